"""`duet serve`: deploy the instances, run the router and its front ends (gRPC, and the
OpenAI-compatible HTTP API beside it on `frontend.http_port`), drain on SIGTERM.

    async with ServingCluster(config) as cluster:   # instances up, router polling, front end bound
        print(cluster.target)                        # HOST:PORT of the client API
        await cluster.wait_for_stop()                # SIGTERM / SIGINT / stop() -> graceful drain

Draining (SIGTERM, `ray job stop`, Ctrl-C): health reports NOT_SERVING (gRPC) and 503 (HTTP /health)
and new requests get UNAVAILABLE (HTTP: 503); requests in flight finish, or end with UNAVAILABLE once `drain_timeout_s` has passed;
then the front end, the router and the instance actors stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from cluster.deploy.config import ClusterConfig
from cluster.deploy.launch import Deployment, DeploymentError, roles_summary
from cluster.deploy.preflight import StartupError, StartupProblem
from cluster.router.driver import Router
from cluster.shutdown import STOP_TIMEOUT_S, StopTimeout, bounded

logger = logging.getLogger(__name__)


def load_tokenizer(model: str | None):
    """The served model's tokenizer, for text prompts at the front end (no torch)."""
    if model is None:
        from worker.tokenizer import ByteTokenizer

        return ByteTokenizer()
    from worker.tokenizer import HfTokenizer

    return HfTokenizer.from_directory(Path(model))


def served_model_name(model: str | None, configured: str | None) -> str:
    """What the HTTP API's `model` field must say: the configured name, else the checkpoint
    directory's name, else duet-default (the built-in model)."""
    if configured is not None:
        return configured
    if model is None:
        from cluster.frontend.http import DEFAULT_SERVED_MODEL_NAME

        return DEFAULT_SERVED_MODEL_NAME
    return Path(model).resolve().name


class ServingCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.deployment = Deployment(config)
        self.router: Router | None = None
        self.frontend = None
        self.http = None
        self.http_url = ""
        self.target = ""
        self.metrics = None
        self.metrics_port: int | None = None
        self.model_info = None
        self.timeline_log = None
        self._stop = asyncio.Event()

    async def __aenter__(self) -> ServingCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.shutdown()

    async def start(self) -> None:
        from cluster.frontend.service import FrontendServer

        config = self.config
        logger.info("deploying %s", roles_summary(config))
        self.deployment.connect()
        clients = await asyncio.to_thread(self.deployment.start)
        infos = [await client.get_info() for client in clients]
        fingerprints = {info.layout.model_fingerprint for info in infos}
        if len(fingerprints) != 1:
            await self.shutdown()
            raise DeploymentError(f"instances serve different models (fingerprints {sorted(fingerprints)})", "instances")
        first = infos[0]
        from cluster.router.observe import ModelInfo, RouterMetrics, TimelineLog

        self.model_info = ModelInfo(
            model=config.model or "built-in",
            architecture=first.architecture or "unknown",
            dtype=first.layout.dtype,
            max_model_len=min(info.max_seq_len for info in infos),
            kv_capacity_tokens=min(info.num_blocks for info in infos) * first.layout.tokens_per_block,
        )
        # Once, at startup: `dtype: auto` resolves on the instances, and this is where it is said.
        logger.info("serving model %s", self.model_info.describe())
        self.metrics = RouterMetrics()
        self.metrics.set_model(self.model_info)
        if config.frontend.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(config.frontend.host, config.frontend.metrics_port)
            except OSError as error:
                # Serving goes on without /metrics rather than not at all; say so loudly.
                logger.error("cannot serve metrics on %s:%s: %s", config.frontend.host, config.frontend.metrics_port, error)
        if config.frontend.timeline_log:
            self.timeline_log = TimelineLog(config.frontend.timeline_log)
        tokenizer = load_tokenizer(config.model)
        self.router = Router(
            config.router,
            tokenizer,
            vocab_size=first.vocab_size,
            max_seq_len=min(info.max_seq_len for info in infos),
            tokens_per_block=first.layout.tokens_per_block,
            seed=config.seed,
            metrics=self.metrics,
            timeline_log=self.timeline_log,
            model_info=self.model_info,
        )
        await self.router.start()
        for client in clients:
            await self.router.add_instance(client)
        tls = None
        frontend_config = config.frontend
        if frontend_config.tls_cert is not None:
            from worker.kv_transfer.tls import TlsConfig

            certificate = Path(frontend_config.tls_cert).read_bytes()
            client_ca = frontend_config.tls_client_ca
            # Server TLS; with a client CA, mutual TLS (clients must present certificates it signed).
            tls = TlsConfig(
                certificate_chain_pem=certificate,
                private_key_pem=Path(frontend_config.tls_key).read_bytes(),
                root_certificates_pem=Path(client_ca).read_bytes() if client_ca else certificate,
                require_client_auth=client_ca is not None,
            )
        template = None
        if frontend_config.chat_template is not None:
            try:
                template = Path(frontend_config.chat_template).read_text(encoding="utf-8")
            except OSError as error:
                raise DeploymentError(f"frontend.chat_template: cannot read it: {error}") from None
        from worker.tokenizer import chat_prompt_ids

        def chat(messages, add_generation_prompt: bool) -> list[int]:
            return chat_prompt_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt, template=template)

        self.frontend = FrontendServer(
            self.router,
            host=frontend_config.host,
            port=frontend_config.port,
            tokens=frontend_config.tokens,
            tls=tls,
            chat=chat,
        )
        port = await self.frontend.start()
        self.target = f"{frontend_config.host}:{port}"
        # `serve` announces "serving on" itself (once, on stdout), after its signal handlers are in.
        logger.debug("front end up on %s", self.target)
        if frontend_config.http_port:
            await self._start_http(tokenizer, template)

    async def _start_http(self, tokenizer, template: str | None) -> None:
        from cluster.frontend.http import HttpTls, OpenAIServer
        from cluster.frontend.service import FrontendError

        frontend_config = self.config.frontend
        tls = None
        if frontend_config.tls_cert is not None:
            tls = HttpTls(frontend_config.tls_cert, frontend_config.tls_key, frontend_config.tls_client_ca)
        server = OpenAIServer(
            self.router,
            tokenizer,
            served_model_name=served_model_name(self.config.model, frontend_config.served_model_name),
            host=frontend_config.host,
            port=frontend_config.http_port,
            tokens=frontend_config.tokens,
            tls=tls,
            registry=self.metrics.registry if self.metrics is not None else None,
            chat_template=template,
        )
        try:
            await server.start()
        except FrontendError as error:
            # As the metrics server: gRPC clients are still served; say so loudly.
            logger.error("%s; serving gRPC only", error)
            return
        self.http = server
        self.http_url = server.url

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def shutdown(self) -> None:
        """Drain, then stop everything (idempotent). Every step is bounded (cluster/shutdown.py): a
        step that hangs is logged and the others still run (the instances' actors stop even if the
        front end hung), then StopTimeout names what hung."""
        hung: list[str] = []

        async def step(awaitable, what: str, timeout_s: float = STOP_TIMEOUT_S):
            try:
                return await bounded(awaitable, what, timeout_s)
            except StopTimeout as error:
                logger.error("shutdown: %s", error)
                hung.append(str(error))
                return None

        if self.frontend is not None:
            await step(self.frontend.set_serving(False), "the front end's health switch")
        if self.http is not None:
            self.http.set_serving(False)
        if self.router is not None:
            drain_s = self.config.drain_timeout_s
            left = await step(self.router.drain(drain_s), f"the drain (drain_timeout_s {drain_s:g} s)", drain_s + STOP_TIMEOUT_S)
            if left:
                logger.warning("drain: %d requests ended with UNAVAILABLE", left)
        if self.frontend is not None:
            await step(self.frontend.stop(2.0), "the gRPC front end", 2.0 + 2 * STOP_TIMEOUT_S)
            self.frontend = None
        if self.http is not None:
            await step(self.http.stop(2.0), "the OpenAI HTTP front end", 2.0 + 3 * STOP_TIMEOUT_S)
            self.http = None
        if self.router is not None:
            try:
                await self.router.stop()
            except StopTimeout as error:
                logger.error("shutdown: %s", error)
                hung.append(str(error))
            self.router = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.timeline_log is not None:
            self.timeline_log.close()
            self.timeline_log = None
        await step(asyncio.to_thread(self.deployment.stop), "stopping the instances' actors (and the embedded Ray)")
        if hung:
            raise StopTimeout("; ".join(hung))


async def serve(config: ClusterConfig, *, announce=print) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status. A deployment that fails raises
    StartupError (after stopping what it started), for the CLI to word as one line."""
    from cluster.frontend.service import FrontendError

    cluster = ServingCluster(config)
    try:
        await cluster.start()
    except (DeploymentError, FrontendError) as error:
        await cluster.shutdown()
        where = error.where if isinstance(error, DeploymentError) else f"{config.frontend.host}:{config.frontend.port}, frontend.port"
        kind = StartupProblem.DEPLOYMENT if isinstance(error, DeploymentError) else StartupProblem.PORT
        raise StartupError(kind, str(error).splitlines()[0], where) from None
    cluster.install_signal_handlers()
    announce(f"serving on {cluster.target}")
    if cluster.http_url:
        announce(f"OpenAI API on {cluster.http_url}")
    try:
        await cluster.wait_for_stop()
        logger.info("stopping: draining in-flight requests")
    finally:
        try:
            await cluster.shutdown()
        except StopTimeout as error:
            logger.error("stopped, but not cleanly: %s", error)
            return 1
    return 0

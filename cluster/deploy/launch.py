"""Deployment on Ray: connect (or start an embedded cluster), check resources, start instance actors.

Ray appears here, in cluster/router/instance_client.py (the actor calls) and where the chaos harness
kills actors (cluster/loadgen). The instance actor class (worker.instance.Instance) is imported
inside `start`, where actors are spawned, so importing this module never imports torch.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from cluster.deploy.config import ClusterConfig, InstanceGroup
from cluster.router.instance_client import RayInstanceClient
from worker.config import load_config
from worker.engine_types import EngineConfig
from worker.kv_transfer import shm
from worker.kv_transfer.config import KvTransferConfig
from worker.protocol import Encoder, InstanceRole, Ping

if TYPE_CHECKING:
    from worker.kv_transfer.certificates import DeploymentCa
    from worker.kv_transfer.tls import TlsConfig

logger = logging.getLogger(__name__)

ACTOR_MAX_CONCURRENCY = 16


class DeploymentError(RuntimeError):
    """The deployment cannot be satisfied or did not come up in time (the message says why;
    `where` names the instance or the Ray cluster)."""

    def __init__(self, message: str, where: str = "the Ray cluster") -> None:
        super().__init__(message)
        self.where = where


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def root_cause(error: BaseException) -> str:
    """The line of a Ray error that says what went wrong: Ray's text is the remote traceback with
    terminal colours, and its last exception line ("CheckpointError: ...") is the cause."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and not type(cause).__module__.startswith("ray"):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b:?", line):
            return line
    return lines[-1] if lines else type(error).__name__


@dataclass(frozen=True)
class PlannedInstance:
    instance_id: str
    group: InstanceGroup
    num_gpus: float


def connect_ray(config: ClusterConfig) -> bool:
    """Join the cluster at ray.address / RAY_ADDRESS, or start an embedded local one pinned to
    127.0.0.1 with the dashboard (and its job API) off or on loopback. Returns True if this call
    started Ray (and so should shut it down)."""
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if not address:
        keep_ray_on_loopback()
    import ray

    if ray.is_initialized():
        return False
    if address:
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, namespace=config.ray.namespace, log_to_driver=True)
        return True
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logger.info("starting an embedded Ray cluster on 127.0.0.1")
    ray.init(
        address="local",
        num_cpus=config.ray.num_cpus,
        include_dashboard=config.ray.include_dashboard,
        dashboard_host=config.ray.dashboard_host,
        namespace=config.ray.namespace,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    return True


# Ray's switch for clusters on Windows and macOS. At "0" Ray takes 127.0.0.1 as the node's
# address instead of the machine's routable one, so that its own listeners (GCS, raylet, object
# manager, workers' gRPC servers, the dashboard agent and its metrics and job ports, the runtime
# env agent) bind loopback, and no other node can join. Read when Ray is imported.
RAY_SINGLE_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> bool:
    """Before an embedded Ray starts: tell Ray (and the processes it spawns, through the
    environment) to keep every listener on 127.0.0.1. True if it will; False if Ray was imported
    before this could take effect, or the environment asks otherwise (then Ray's own listeners
    follow the machine's address, which README's security section says how to firewall)."""
    if sys.modules.get("ray") is None:
        os.environ.setdefault(RAY_SINGLE_HOST_ENV, "0")
    on_loopback = os.environ.get(RAY_SINGLE_HOST_ENV) == "0"
    if on_loopback and sys.modules.get("ray") is not None:
        from ray._private import ray_constants  # the constant Ray computed when it was imported

        on_loopback = not getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    if not on_loopback:
        logger.warning(
            "Ray's own listeners will bind this machine's address, not 127.0.0.1 (set %s=0 before Ray is imported)",
            RAY_SINGLE_HOST_ENV,
        )
    return on_loopback


def transfer_bind_host(config: ClusterConfig, nodes: list[dict[str, Any]]) -> str:
    """The InstanceSpec.transfer_host of every instance (`nodes`: ray.nodes()).

    `kv_transfer.bind_host` when set. Else 127.0.0.1 for the embedded cluster (no address to join,
    and every alive node on one host): Ray reports the machine's routable address there too (it
    replaces a node address of 127.0.0.1), and one host needs no more than loopback. Else "auto",
    each actor's own node address, which the other nodes reach."""
    bind_host = config.kv_transfer.get("bind_host")
    if bind_host:
        return str(bind_host)
    hosts = {node.get("NodeManagerAddress") for node in nodes if node.get("Alive", True)}
    return "127.0.0.1" if not _joined(config) and len(hosts) <= 1 else "auto"


def transfer_tls_wanted(config: ClusterConfig, nodes: list[dict[str, Any]]) -> bool:
    """Whether every KV transfer of the deployment is mutual TLS (`kv_transfer.tls`, `nodes`:
    ray.nodes()). auto: yes when certificates are configured, or a transfer can go from one Ray
    node to another, that is when more than one node is alive or the cluster was joined by address
    (nodes may join later); no on a lone embedded node, where a transfer never leaves the process's
    host. on: always. off: never."""
    section = load_config(KvTransferConfig, config.kv_transfer)
    if section.tls == "off":
        return False
    return section.tls == "on" or section.tls_files is not None or _spans_nodes(config, nodes)


def _joined(config: ClusterConfig) -> bool:
    return bool(config.ray.address or os.environ.get("RAY_ADDRESS"))


def _spans_nodes(config: ClusterConfig, nodes: list[dict[str, Any]]) -> bool:
    return _joined(config) or sum(1 for node in nodes if node.get("Alive", True)) > 1


def _demand(planned: PlannedInstance) -> dict[str, float]:
    demand = {"CPU": planned.group.num_cpus, **dict(planned.group.resources)}
    if planned.num_gpus:
        demand["GPU"] = planned.num_gpus
    return {name: amount for name, amount in demand.items() if amount > 0}


def instance_engine(config: ClusterConfig, planned: PlannedInstance) -> EngineConfig:
    """One planned instance's engine settings. An instance given a fraction of a GPU sizes its KV pool
    to that fraction of engine.gpu_memory_utilization: instances sharing a device start together,
    and each would otherwise take the whole share for itself."""
    engine = config.engine_config(planned.group)
    if 0 < planned.num_gpus < 1:
        engine = msgspec.structs.replace(engine, gpu_memory_utilization=engine.gpu_memory_utilization * planned.num_gpus)
    return engine


def plan_instances(config: ClusterConfig, cluster_resources: dict[str, float]) -> list[PlannedInstance]:
    has_gpus = cluster_resources.get("GPU", 0) > 0
    planned = []
    for group in config.instances:
        gpus = group.num_gpus if group.num_gpus is not None else (1.0 if has_gpus else 0.0)
        prefix = group.role.value.lower()
        taken = sum(1 for p in planned if p.group.role is group.role)
        for index in range(group.count):
            planned.append(PlannedInstance(f"{prefix}-{taken + index}", group, gpus))
    return planned


def check_resources(planned: list[PlannedInstance], nodes: list[dict[str, Any]], totals: dict[str, float]) -> None:
    """Fail fast, naming the missing resource, when the cluster cannot hold the deployment."""
    capacities = [dict(node.get("Resources", {})) for node in nodes if node.get("Alive", True)]
    for item in planned:
        demand = _demand(item)
        if not any(all(capacity.get(name, 0.0) >= amount for name, amount in demand.items()) for capacity in capacities):
            missing = [
                f"{name}={amount:g} (largest node offers {max((c.get(name, 0.0) for c in capacities), default=0.0):g})"
                for name, amount in demand.items()
                if not any(c.get(name, 0.0) >= amount for c in capacities)
            ] or [f"{demand} together on one node"]
            raise DeploymentError(
                f"instance {item.instance_id} ({item.group.role.name}) needs {', '.join(missing)}: no node can host it",
                item.instance_id,
            )
    needed: dict[str, float] = {}
    for item in planned:
        for name, amount in _demand(item).items():
            needed[name] = needed.get(name, 0.0) + amount
    for name, amount in needed.items():
        if amount > totals.get(name, 0.0) + 1e-9:
            raise DeploymentError(
                f"the deployment needs {name}={amount:g} in total, the Ray cluster has {totals.get(name, 0.0):g}"
            )


# How long stop() waits for killed instances that own shared-memory segments to exit.
SHM_SWEEP_WAIT_S = 10.0


class Deployment:
    """The instance actors of one cluster configuration."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.cluster_token = config.cluster_token or secrets.token_urlsafe(32)
        self.actors: dict[str, Any] = {}
        self.deployment_id = secrets.token_hex(3)  # in actor names, so deployments never clash
        self.clients: dict[str, RayInstanceClient] = {}
        self._started_ray = False
        # The public certificate of the KV transfer CA when transfers are mTLS.
        self.transfer_ca_pem: bytes | None = None
        # The generated CA, kept (in this process's memory only: its key is never serialised) for
        # the deployment's life, so that a restarted instance gets a fresh certificate from it.
        self._transfer_ca: DeploymentCa | None = None

    def connect(self) -> None:
        """Connect to (or start) Ray. Call it from the main thread: Ray installs signal handlers."""
        if connect_ray(self.config):
            self._started_ray = True

    def start(self) -> list[RayInstanceClient]:
        """Create every actor and wait (bounded) until each reports ready."""
        import ray

        from worker.instance import Instance, InstanceSpec

        self.connect()
        planned = plan_instances(self.config, ray.cluster_resources())
        check_resources(planned, ray.nodes(), ray.cluster_resources())
        remote_class = ray.remote(Instance)
        strategy = "SPREAD" if self.config.placement_strategy == "spread" else "DEFAULT"
        nodes = ray.nodes()
        transfer_host = transfer_bind_host(self.config, nodes)
        transfer_certificate = self._transfer_certificates(nodes)
        pending = {}
        for item in planned:
            spec = InstanceSpec(
                instance_id=item.instance_id,
                engine=instance_engine(self.config, item),
                model=self.config.model,
                dtype=self.config.dtype,
                device=self.config.device,
                transfer_host=transfer_host,
                cluster_token=self.cluster_token,
                transfer_tls=transfer_certificate(item.instance_id) if transfer_certificate is not None else None,
                torch_threads=item.group.torch_threads,
                faults=self.config.faults,
                sender=self._kv_section("sender"),
                receiver=self._kv_section("receiver"),
                shm_tag=self.deployment_id,
                step_log=None if self.config.step_log_dir is None else str(Path(self.config.step_log_dir) / f"{item.instance_id}.jsonl"),
            )
            actor = remote_class.options(
                name=f"duet-{self.deployment_id}-{item.instance_id}",
                num_cpus=item.group.num_cpus,
                num_gpus=item.num_gpus,
                resources=dict(item.group.resources) or None,
                max_concurrency=ACTOR_MAX_CONCURRENCY,
                max_restarts=self.config.max_restarts,
                max_task_retries=0,
                scheduling_strategy=strategy,
            ).remote(spec.to_bytes())
            self.actors[item.instance_id] = actor
            pending[item.instance_id] = actor.handle.remote(Encoder().encode(Ping()))
        try:
            ready, not_ready = ray.wait(list(pending.values()), num_returns=len(pending), timeout=self.config.actor_start_timeout_s)
            if not_ready:
                late = [iid for iid, ref in pending.items() if ref in not_ready]
                raise DeploymentError(
                    f"instances did not start within {self.config.actor_start_timeout_s:g}s "
                    f"(waiting for resources? available: {ray.available_resources()})",
                    ", ".join(late),
                )
            for instance_id, ref in pending.items():
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as error:
                    raise DeploymentError(f"instance failed to start: {root_cause(error)}", instance_id) from None
        except BaseException:
            self.stop()
            raise
        reissue = self._transfer_ca.issue if self._transfer_ca is not None else None
        self.clients = {iid: RayInstanceClient(iid, actor, issue_certificate=reissue) for iid, actor in self.actors.items()}
        logger.info("started %d instances: %s", len(self.actors), ", ".join(self.actors))
        return list(self.clients.values())

    def _kv_section(self, side: str) -> dict[str, Any] | None:
        """`kv_transfer.<side>` with `kv_transfer.data_plane` applied (it sets both sides)."""
        section = self.config.kv_transfer.get(side)
        data_plane = self.config.kv_transfer.get("data_plane")
        if data_plane is None:
            return section
        return {**(section or {}), "data_plane": data_plane}

    def _transfer_certificates(self, nodes: list[dict[str, Any]]) -> Callable[[str], TlsConfig] | None:
        """What gives each instance its KV transfer certificate when transfers are mTLS, else None:
        the configured files (the same for every instance), or a CA made for this deployment, which
        stays in this process (certificates are issued here, at deploy time and on restarts)."""
        section = load_config(KvTransferConfig, self.config.kv_transfer)
        self.transfer_ca_pem = None
        self._transfer_ca = None
        if not transfer_tls_wanted(self.config, nodes):
            if _spans_nodes(self.config, nodes):
                logger.warning(
                    "kv_transfer.tls is off: KV cache moves between Ray nodes in plain TCP "
                    "(readable and alterable by anyone on the network path; the cluster token still authenticates)"
                )
            return None
        from worker.kv_transfer.tls import TlsConfig, TlsConfigError

        if section.tls_files is not None:
            try:
                configured = TlsConfig.from_files(*section.tls_files, server_name_override=section.tls_server_name)
            except (OSError, TlsConfigError) as error:
                raise DeploymentError(f"kv_transfer: the configured TLS certificates cannot be used: {error}") from None
            self.transfer_ca_pem = configured.root_certificates_pem
            logger.info("KV transfers are mutual TLS with the configured certificates")
            return lambda _instance_id: configured
        from worker.kv_transfer.certificates import DeploymentCa

        ca = DeploymentCa(self.deployment_id, validity_days=section.tls_validity_days)
        self._transfer_ca = ca
        self.transfer_ca_pem = ca.root_pem
        logger.info(
            "KV transfers are mutual TLS: a deployment CA issued each instance a certificate (%d days)", section.tls_validity_days
        )
        return ca.issue

    def stop(self) -> None:
        import ray

        for instance_id, actor in list(self.actors.items()):
            try:
                ray.kill(actor, no_restart=True)
            except Exception as error:  # noqa: BLE001 - best effort on the way out
                logger.debug("killing %s: %s", instance_id, error)
        self.actors.clear()
        self._transfer_ca = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
        self.sweep_shared_memory()

    def sweep_shared_memory(self, wait_s: float = SHM_SWEEP_WAIT_S) -> list[str]:
        """Remove this deployment's shared-memory segments on this host. Actors are killed, never
        closed, so their senders' segments stay behind; their owners' exits are awaited (bounded:
        ray.kill returns before the process is gone) so that none creates one after the sweep.
        Other hosts' segments go when a restarted instance's pool sweeps its dead predecessors'."""
        removed = shm.sweep_when_owners_exit(self.deployment_id, wait_s)
        if removed:
            logger.info("removed %d shared-memory segment(s) of deployment %s", len(removed), self.deployment_id)
        return removed


def roles_summary(config: ClusterConfig) -> str:
    counts: dict[InstanceRole, int] = {}
    for group in config.instances:
        counts[group.role] = counts.get(group.role, 0) + group.count
    return ", ".join(f"{count} {role.name}" for role, count in counts.items() if count)

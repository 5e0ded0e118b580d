"""Router observability: its counters, Prometheus metrics and the per-request timeline log.

`RouterObserver` is the one owner of all three: the driver reports what happened to it (a request
ended, a transfer started, a recovery action, an instance's load) and it keeps the counters that
`ClusterStatus` shows, updates the metrics when they are served, and writes the timeline log.

Metrics live in their own CollectorRegistry, served over HTTP by the front end process
(`frontend.metrics_port`) at /metrics only (any other path is 404). Latencies are measured at the
router, from admission. Names follow Prometheus' conventions (a unit suffix, `_total` counters,
`_ratio` for fractions); no `*_created` series, which only double the series count:

- duet_model_info{model,architecture,dtype,max_model_len,kv_capacity_tokens}   1, the served model
- duet_requests_total{outcome,status}            requests ended, by outcome and gRPC status
- duet_prompt_tokens_total, duet_generation_tokens_total   tokens of ended requests
- duet_ttft_seconds / duet_tpot_seconds / duet_itl_seconds / duet_e2e_seconds   histograms
- duet_state_seconds{state}                       time spent in each global state
- duet_transfers_total{result}                    KV transfers started / committed / failed
- duet_transfer_failures_total{reason}            by FailureReason
- duet_transfer_bytes_total, duet_transfer_seconds   pushed bytes and push durations
- duet_recovery_actions_total{action}             retry_transfer, recompute_local, ...
- duet_instance_kv_utilization_ratio{instance,role}   used / total blocks, per instance
- duet_instance_queued_requests / _running_requests / _healthy{instance,role}
- duet_router_in_flight, duet_router_queue_depth  requests in the router (0 when idle)

The timeline log writes, for every request that ends, one JSON line: ids, outcome, finish reason,
error, usage, instances used and the state timeline (wall-clock seconds), for offline analysis.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections import Counter as Tally
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from cluster.router.actions import NoteInconsistent, TransferNote
from cluster.router.api import FinalEvent, InstanceHealthView, ModelInfo
from cluster.router.config import RecoveryAction
from worker.json_lines import JsonLinesFile

if TYPE_CHECKING:
    from cluster.router.fleet import Member
    from cluster.router.flow import RequestFlow
    from worker.protocol import PushResult

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # prometheus_client's switch is process-wide; every registry of this process wants it off.
        disable_created_metrics()
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.model_info = Gauge(
            "duet_model_info", "The served model (value 1)",
            ["model", "architecture", "dtype", "max_model_len", "kv_capacity_tokens"], registry=r,
        )
        self.requests = Counter("duet_requests", "Requests ended, by outcome and status", ["outcome", "status"], registry=r)
        self.prompt_tokens = Counter("duet_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("duet_generation_tokens", "Generated tokens of ended requests", registry=r)
        self.ttft = Histogram("duet_ttft_seconds", "Admission to first token", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("duet_tpot_seconds", "Mean time per output token after the first", buckets=_TOKEN_BUCKETS_S, registry=r)
        self.itl = Histogram(
            "duet_itl_seconds", "Time between consecutive output tokens (a batch of n tokens counts n gaps of 1/n)",
            buckets=_TOKEN_BUCKETS_S, registry=r,
        )
        self.e2e = Histogram("duet_e2e_seconds", "Admission to the end of the request", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.state_seconds = Histogram(
            "duet_state_seconds", "Time spent in each global state", ["state"], buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.transfers = Counter("duet_transfers", "KV transfers by result", ["result"], registry=r)
        self.transfer_failures = Counter("duet_transfer_failures", "KV transfer failures by reason", ["reason"], registry=r)
        self.transfer_bytes = Counter("duet_transfer_bytes", "KV bytes pushed", registry=r)
        self.transfer_seconds = Histogram("duet_transfer_seconds", "KV push durations", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.recovery = Counter("duet_recovery_actions", "Recovery actions taken", ["action"], registry=r)
        labels = ["instance", "role"]
        self.kv_utilization = Gauge("duet_instance_kv_utilization_ratio", "Used / total KV blocks", labels, registry=r)
        self.queued = Gauge("duet_instance_queued_requests", "Requests queued in the instance", labels, registry=r)
        self.running = Gauge("duet_instance_running_requests", "Requests running in the instance", labels, registry=r)
        self.healthy = Gauge("duet_instance_healthy", "1 if the router considers the instance healthy", labels, registry=r)
        self.in_flight = Gauge("duet_router_in_flight", "Requests in the router", registry=r)
        self.queue_depth = Gauge("duet_router_queue_depth", "Requests waiting for placement", registry=r)
        self._server = None

    def set_model(self, info: ModelInfo) -> None:
        self.model_info.labels(
            info.model, info.architecture, info.dtype, str(info.max_model_len), str(info.kv_capacity_tokens)
        ).set(1)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP in a daemon thread; returns the bound port (0 picks a free one)."""
        server = _MetricsServer((host, port), _MetricsHandler)
        server.registry = self.registry
        threading.Thread(target=server.serve_forever, name="duet-metrics", daemon=True).start()
        self._server = server
        bound = server.server_address[1]
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics, nothing else: prometheus_client's own server answers every path, so a client
    that mistook this port for an API got a metrics page or a 405 instead of a plain 404."""

    server: _MetricsServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] != "/metrics":
            self._plain(404, "not found: metrics are at /metrics\n")
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802
        self._plain(404 if self.path.split("?", 1)[0] != "/metrics" else 405, "")

    def _other(self) -> None:
        if self.path.split("?", 1)[0] == "/metrics":
            self._plain(405, "method not allowed: GET /metrics\n", allow="GET")
        else:
            self._plain(404, "not found: metrics are at /metrics\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other  # noqa: N815

    def _plain(self, status: int, text: str, allow: str | None = None) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - scrapes are not news
        logger.debug("metrics: " + format, *args)


class TimelineLog:
    """Appends one JSON line per ended request (thread-safe, line-buffered)."""

    def __init__(self, path: str | Path) -> None:
        self._lines = JsonLinesFile(path)
        self.path = self._lines.path

    def write(self, request_id: str, client_request_id: str | None, final: FinalEvent) -> None:
        record = {
            "request_id": request_id,
            "client_request_id": client_request_id,
            "outcome": final.outcome.value,
            "finish_reason": final.finish_reason,
            "stop_reason": final.stop_reason,
            "error": None if final.error_kind is None else {"status": final.error_kind.value, "message": final.error_message},
            "usage": {
                "prompt_tokens": final.usage.prompt_tokens,
                "completion_tokens": final.usage.completion_tokens,
                "cached_tokens": final.usage.cached_tokens,
            },
            "instances": [
                {"instance_id": u.instance_id, "role": u.role.value, "phase": u.phase, "attempt": u.attempt} for u in final.instances
            ],
            "timeline": [
                {"state": e.state, "time_s": e.time_s, "instance_id": e.instance_id, "detail": e.detail} for e in final.timeline
            ],
        }
        self._lines.write(record)

    def close(self) -> None:
        self._lines.close()


class RouterObserver:
    """Counters (always), metrics and the timeline log (when configured) of one router."""

    def __init__(self, metrics: RouterMetrics | None = None, timeline_log: TimelineLog | None = None) -> None:
        self.metrics = metrics
        self.timeline_log = timeline_log
        self.outcomes: Tally = Tally()
        self.recovery_actions: Tally = Tally()
        self.transfers: Tally = Tally()
        self.inconsistent_reports = 0  # local states that contradicted the global view (must stay 0)
        self.illegal_transitions = 0  # refused by the transition table (a router bug; must stay 0)
        # The refused transitions themselves, each with the stack that attempted it (the last few),
        # so that a test or an operator sees what happened, not only that it did.
        self.illegal_transition_reports: collections.deque[str] = collections.deque(maxlen=16)

    # --- requests -----------------------------------------------------------------------------------
    def request_ended(self, flow: RequestFlow, final: FinalEvent, now_s: float) -> None:
        key = final.outcome.value if final.error_kind is None else f"{final.outcome.value}:{final.error_kind.value}"
        self.outcomes[key] += 1
        if self.timeline_log is not None:
            try:
                self.timeline_log.write(flow.request_id, flow.client_request_id, final)
            except OSError as error:
                logger.warning("timeline log: %s", error)
        metrics = self.metrics
        if metrics is None:
            return
        metrics.requests.labels(final.outcome.value, final.error_kind.value if final.error_kind else "OK").inc()
        metrics.prompt_tokens.inc(final.usage.prompt_tokens)
        metrics.generation_tokens.inc(final.usage.completion_tokens)
        metrics.e2e.observe(now_s - flow.admitted_s)
        produced = len(flow.outputs)
        if flow.first_token_s is not None and produced > 1:
            metrics.tpot.observe((now_s - flow.first_token_s) / (produced - 1))
        entries = flow.timeline.entries
        for entry, following in zip(entries, entries[1:], strict=False):
            metrics.state_seconds.labels(entry.state.name).observe(following.timestamp_s - entry.timestamp_s)

    def first_token(self, ttft_s: float) -> None:
        if self.metrics is not None:
            self.metrics.ttft.observe(ttft_s)

    def tokens_after(self, gap_s: float, count: int) -> None:
        """`count` tokens of a request came `gap_s` after its previous ones: `count` inter-token
        latencies of gap_s / count each. The first tokens only start the clock (their wait is
        TTFT); gaps inside one batch are not seen by the router."""
        if self.metrics is None or count <= 0:
            return
        for _ in range(count):
            self.metrics.itl.observe(gap_s / count)

    def requests_in_router(self, in_flight: int, queued: int) -> None:
        if self.metrics is not None:
            self.metrics.in_flight.set(in_flight)
            self.metrics.queue_depth.set(queued)

    # --- recovery and transfers ---------------------------------------------------------------------
    def recovery(self, request_id: str, action: RecoveryAction, reason: str) -> None:
        self.recovery_actions[action] += 1
        if self.metrics is not None:
            self.metrics.recovery.labels(action.value).inc()
        logger.warning("request %s: %s -> %s", request_id, reason, action.value)

    def transfer(self, note: TransferNote) -> None:
        self.transfers[note.value] += 1
        if self.metrics is not None:
            self.metrics.transfers.labels(note.value).inc()

    def push_result(self, push: PushResult) -> None:
        if push.ok:
            self.transfers["pushed"] += 1
        else:
            self.transfers[f"failed_{push.reason}"] += 1
        metrics = self.metrics
        if metrics is not None:
            metrics.transfer_bytes.inc(push.bytes_sent)
            metrics.transfer_seconds.observe(push.elapsed_s)
            if not push.ok:
                metrics.transfers.labels("failed").inc()
                metrics.transfer_failures.labels(push.reason or "UNKNOWN").inc()

    # --- bugs -----------------------------------------------------------------------------------------
    def inconsistent(self, note: NoteInconsistent) -> None:
        self.inconsistent_reports += 1
        logger.warning(
            "request %s: %s reports %s while the router has it in %s",
            note.request_id, note.instance_id, note.local_state, note.global_state,
        )

    def illegal(self, report: str) -> None:
        self.illegal_transitions += 1
        self.illegal_transition_reports.append(report)

    # --- instances ------------------------------------------------------------------------------------
    def instance(self, member: Member) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        labels = (member.instance_id, member.info.role.value)
        metrics.healthy.labels(*labels).set(1.0 if member.health is InstanceHealthView.HEALTHY else 0.0)
        load = member.load
        if load is not None and load.total_blocks:
            metrics.kv_utilization.labels(*labels).set(1.0 - load.free_blocks / load.total_blocks)
            metrics.queued.labels(*labels).set(load.queued_requests)
            metrics.running.labels(*labels).set(load.running_requests)

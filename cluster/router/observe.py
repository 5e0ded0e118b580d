"""Router observability: Prometheus metrics and the per-request timeline log.

Metrics live in their own CollectorRegistry (no process globals), served over HTTP by the front end
process (`frontend.metrics_port`). Latencies are measured at the router, from admission:

- duet_requests_total{outcome,status}            requests ended, by outcome and gRPC status
- duet_ttft_seconds / duet_tpot_seconds / duet_e2e_seconds   histograms
- duet_state_seconds{state}                       time spent in each global state
- duet_transfers_total{result}                    KV transfers started / committed / failed
- duet_transfer_failures_total{reason}            by FailureReason
- duet_transfer_bytes_total, duet_transfer_seconds   pushed bytes and push durations
- duet_recovery_actions_total{action}             retry_transfer, recompute_local, ...
- duet_instance_kv_utilization{instance,role}     used / total blocks, per instance
- duet_instance_queued_requests / _running_requests / _healthy{instance,role}
- duet_router_in_flight, duet_router_queue_depth  requests in the router

The timeline log writes, for every request that ends, one JSON line: ids, outcome, finish reason,
error, usage, instances used and the state timeline (wall-clock seconds), for offline analysis.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TextIO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from cluster.router.api import FinalEvent

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("duet_requests", "Requests ended, by outcome and status", ["outcome", "status"], registry=r)
        self.ttft = Histogram("duet_ttft_seconds", "Admission to first token", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("duet_tpot_seconds", "Mean time per output token after the first", buckets=_TOKEN_BUCKETS_S, registry=r)
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
        self.kv_utilization = Gauge("duet_instance_kv_utilization", "Used / total KV blocks", labels, registry=r)
        self.queued = Gauge("duet_instance_queued_requests", "Requests queued in the instance", labels, registry=r)
        self.running = Gauge("duet_instance_running_requests", "Requests running in the instance", labels, registry=r)
        self.healthy = Gauge("duet_instance_healthy", "1 if the router considers the instance healthy", labels, registry=r)
        self.in_flight = Gauge("duet_router_in_flight", "Requests in the router", registry=r)
        self.queue_depth = Gauge("duet_router_queue_depth", "Requests waiting for placement", registry=r)
        self._server = None

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP; returns the bound port (0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        bound = server.server_address[1]
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class TimelineLog:
    """Appends one JSON line per ended request (thread-safe, line-buffered)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

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
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

"""bench/handover_latency.py --quick (one case, every instance in the bench's process) ends with the
JSON summary line, and its breakdown of the first-to-second-token path is there for both clusters
and in causal order. It asserts no speed (the figures are the bench's to report); the order checks
that the instances' report times and the client's stamps share one clock."""

from __future__ import annotations

import pytest
from bench_summary import run_bench

CASE = "default_p512_c512_grpc_at_context_start"
PHASES = ("hand_over", "commit_to_step", "decode_report", "router_to_client", "first_token_report")


@pytest.mark.timeout(180)
def test_quick_handover_bench_reports_where_the_gap_goes() -> None:
    summary, _ = run_bench("handover_latency.py", "--quick")
    assert summary["bench"] == "handover_latency"
    figures = summary["figures"]
    assert figures[f"{CASE}_kv_bytes"] > 0 and figures[f"{CASE}_disagg_ttft_ms"] > 0
    phases = {
        cluster: {phase: figures[f"{CASE}_{cluster}_phase_{phase}_ms"] for phase in PHASES}
        for cluster in ("disaggregated", "mixed")
    }
    # MIXED: no hand-over, no commit (its decode step follows its context's).
    assert phases["mixed"]["hand_over"] == 0 and phases["mixed"]["commit_to_step"] == 0
    # Each step of the path after the one before it: the generation instance commits after the
    # prefill's context is done, decodes after the commit, the router hears of it after that, and
    # the client after the router; the client's first token after the context was done.
    for cluster, measured in phases.items():
        assert all(value >= 0 for value in measured.values()), (cluster, measured)
        assert measured["decode_report"] > 0 and measured["first_token_report"] > 0, (cluster, measured)
    assert phases["disaggregated"]["hand_over"] > 0, phases

"""Router values -> wire messages (cluster.convert) and wire messages -> client values
(cluster.client), checked end to end on the edge cases that the fake router does not produce."""

from __future__ import annotations

import pytest

from cluster.client import TokenLogprob, TopLogprob, delta_from_proto, result_from_proto
from cluster.frontend.convert import (
    ModelLimits,
    check_request_id,
    final_event_to_result,
    request_ref_from_proto,
    timestamp,
    token_event_to_proto,
)
from cluster.frontend.convert import RequestValidationError as Invalid
from cluster.router.api import ErrorKind, FinalEvent, Outcome, TokenEvent, Usage
from duet_wire.v1 import client_pb2 as pb
from worker.sampler_types import SampleLogprobs
from worker.sampler_types import TokenLogprob as WorkerLogprob


def _final(**overrides: object) -> FinalEvent:
    values: dict[str, object] = {
        "outcome": Outcome.COMPLETE,
        "finish_reason": "stop",
        "stop_reason": None,
        "usage": Usage(3, 2, 0),
        "timeline": (),
        "instances": (),
    }
    values.update(overrides)
    return FinalEvent(**values)  # type: ignore[arg-type]


def test_logprobs_travel_from_the_router_to_the_client() -> None:
    entry = SampleLogprobs(
        sampled=WorkerLogprob(5, -0.25), rank=2, top=(WorkerLogprob(9, -0.125), WorkerLogprob(5, -0.25))
    )
    message = token_event_to_proto("req-1", TokenEvent(token_ids=(5,), text="x", logprobs=(entry,)))
    delta = delta_from_proto(message.request_id, message.delta)
    assert delta.token_ids == (5,) and delta.text == "x" and delta.request_id == "req-1"
    assert delta.logprobs == (TokenLogprob(5, -0.25, (TopLogprob(9, -0.125), TopLogprob(5, -0.25))),)
    plain = token_event_to_proto("req-1", TokenEvent(token_ids=(5, 6), text="xy"))
    assert list(plain.delta.logprobs) == []


@pytest.mark.parametrize(
    ("finish", "stop", "expected_finish", "expected_stop"),
    [
        ("stop", "END", "stop", "END"),
        ("stop", 2, "stop", 2),
        ("stop", 0, "stop", 0),  # token id 0 is a real id, not "unset"
        ("stop", None, "stop", None),  # EOS, as vLLM reports it
        ("length", None, "length", None),
        ("abort", None, "abort", None),
        (None, None, None, None),
        ("error", None, None, None),  # not a client-API finish reason
    ],
)
def test_finish_and_stop_reasons_round_trip(finish, stop, expected_finish, expected_stop) -> None:
    result = result_from_proto("r", final_event_to_result(_final(finish_reason=finish, stop_reason=stop)))
    assert (result.finish_reason, result.stop_reason) == (expected_finish, expected_stop)


def test_a_bool_stop_reason_is_not_taken_for_a_token_id() -> None:
    assert final_event_to_result(_final(stop_reason=True)).WhichOneof("stop_reason") is None


def test_error_details_stay_out_of_the_result_message() -> None:
    result = final_event_to_result(_final(outcome=Outcome.ERROR, finish_reason=None, error_kind=ErrorKind.INTERNAL, error_message="boom"))
    assert result.finish_reason == pb.FINISH_REASON_UNSPECIFIED and "boom" not in str(result)


@pytest.mark.parametrize("time_s", [0.0, 1.5, 1_700_000_000.25, 1_700_000_000.999999999])
def test_timestamps_keep_sub_second_precision(time_s: float) -> None:
    stamp = timestamp(time_s)
    assert 0 <= stamp.nanos < 1_000_000_000
    assert abs(stamp.seconds + stamp.nanos / 1e9 - time_s) < 1e-6


def test_request_refs_and_ids() -> None:
    assert request_ref_from_proto(pb.RequestRef(request_id="req-1")) == ("req-1", None)
    assert request_ref_from_proto(pb.RequestRef(client_request_id="mine")) == (None, "mine")
    with pytest.raises(Invalid, match="request: exactly one"):
        request_ref_from_proto(pb.RequestRef())
    with pytest.raises(Invalid, match="request.request_id: must not be empty"):
        request_ref_from_proto(pb.RequestRef(request_id=""))
    assert check_request_id("A-z_0.9:~", "f") == "A-z_0.9:~"


@pytest.mark.parametrize(("vocab", "seq"), [(0, 10), (10, 1), (True, 10), (10, 2.5)])
def test_model_limits_are_validated(vocab, seq) -> None:
    with pytest.raises(ValueError):
        ModelLimits(vocab_size=vocab, max_seq_len=seq)


def test_merged_token_events_keep_one_logprob_entry_per_token() -> None:
    from cluster.frontend.service import merge_token_events

    entry = SampleLogprobs(sampled=WorkerLogprob(5, -0.5), rank=1, top=())
    merged = merge_token_events(
        [TokenEvent((1, 2), "ab"), TokenEvent((5,), "c", (entry,)), TokenEvent((7,), "")]
    )
    assert merged.token_ids == (1, 2, 5, 7) and merged.text == "abc"
    assert merged.logprobs == (None, None, entry, None)
    wire = token_event_to_proto("r", merged).delta
    assert [e.token_id for e in wire.logprobs] == [1, 2, 5, 7] and wire.logprobs[2].logprob == -0.5
    plain = merge_token_events([TokenEvent((1,), "a"), TokenEvent((2,), "b")])
    assert plain == TokenEvent((1, 2), "ab")


def test_the_reader_stops_reading_ahead_of_a_stalled_writer() -> None:
    """A client that stops reading must back up into the router's queue (which then aborts the
    request), not into an unbounded buffer in the front end."""
    import asyncio

    from cluster.frontend.service import MAX_QUEUED_EVENTS, _CoalescingReader

    produced = 0

    async def events():
        nonlocal produced
        for i in range(10 * MAX_QUEUED_EVENTS):
            produced += 1
            yield TokenEvent((i % 100,), "t")

    async def run() -> tuple[int, int]:
        reader = _CoalescingReader(events())
        for _ in range(50):
            await asyncio.sleep(0)
        stalled_at = produced
        first = await reader.next()  # the writer takes what is queued, and the reader moves on
        for _ in range(50):
            await asyncio.sleep(0)
        reader.close()
        assert first is not None and len(first.token_ids) == MAX_QUEUED_EVENTS
        return stalled_at, produced

    stalled_at, later = asyncio.run(run())
    assert stalled_at <= MAX_QUEUED_EVENTS + 1
    assert MAX_QUEUED_EVENTS < later <= 2 * MAX_QUEUED_EVENTS + 2

"""Reporting a request's tokens in groups (engine.stream_interval_ms): which outputs wait, how they
merge, when they are due; and an instance with an interval giving the same tokens in fewer, larger
events, its first token still alone and at once."""

from __future__ import annotations

import asyncio

import pytest

from worker.protocol import ErrorCode, InstanceRole, RequestError, RequestOutput
from worker.stopping import FinishReason
from worker.stream_merge import StreamMerger, merged


def out(rid: str, *tokens: int, **fields) -> RequestOutput:
    return RequestOutput(rid, tokens, "".join(chr(96 + t) for t in tokens), tuple(None for _ in tokens), num_output_tokens=tokens[-1] if tokens else 0, **fields)


def test_without_an_interval_everything_goes_out_as_it_comes() -> None:
    merger = StreamMerger(0.0)
    outputs = [out("a", 1), out("a", 2), out("a", 3, finished=True, finish_reason=FinishReason.LENGTH)]
    assert merger.add(outputs, [], 0.0) == outputs and merger.num_held == 0


def test_plain_tokens_after_the_first_wait_for_the_interval_and_merge() -> None:
    merger = StreamMerger(0.05)
    assert merger.add([out("a", 1)], [], 10.0) == [out("a", 1)]  # the first token: at once
    assert merger.add([out("a", 2)], [], 10.01) == []
    assert merger.add([out("a", 3), out("b", 7)], [], 10.03) == [out("b", 7)]  # b's first: at once
    assert merger.take_due(10.059) == [] and merger.next_due_s() == pytest.approx(10.06)
    [due] = merger.take_due(10.06)
    assert due == merged([out("a", 2), out("a", 3)])
    assert (due.new_token_ids, due.text_delta, due.logprobs, due.num_output_tokens) == ((2, 3), "bc", (None, None), 3)
    assert merger.num_held == 0 and merger.next_due_s() is None


@pytest.mark.parametrize(
    "last",
    [
        out("a", 4, finished=True, finish_reason=FinishReason.STOP),
        out("a", 4, context_done=True),
        out("a", finished=True, handed_over=True),
        out("a", finished=True, error=RequestError(ErrorCode.ABORTED, "gone")),
    ],
    ids=["finished", "context-done", "handed-over", "error"],
)
def test_an_output_that_must_go_at_once_takes_the_held_tokens_before_it(last) -> None:
    merger = StreamMerger(1.0)
    merger.add([out("a", 1)], [], 0.0)
    merger.add([out("a", 2), out("a", 3)], [], 0.1)
    assert merger.add([last], [], 0.2) == [merged([out("a", 2), out("a", 3)]), last]
    assert merger.num_held == 0


def test_a_state_event_takes_its_requests_held_tokens_out_and_a_finished_request_starts_over() -> None:
    merger = StreamMerger(1.0)
    merger.add([out("a", 1)], [], 0.0)
    merger.add([out("a", 2)], [], 0.1)
    assert merger.add([], ["b"], 0.2) == [] and merger.num_held == 1
    assert merger.add([], ["a"], 0.3) == [out("a", 2)]
    merger.add([out("a", 3, finished=True)], [], 0.4)
    # The same id again (a recovered hop on this instance): its first output goes at once.
    assert merger.add([out("a", 9)], [], 0.5) == [out("a", 9)]


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        StreamMerger(-1.0)


def test_an_instance_with_an_interval_reports_the_same_tokens_in_fewer_events() -> None:
    from cluster.router.api import ClientRequest, FinalEvent, Outcome, TokenEvent
    from cluster.router.config import RouterConfig
    from cluster.router.driver import Router
    from cluster.router.instance_client import LocalInstanceClient
    from worker.engine_types import EngineConfig
    from worker.instance import Instance, InstanceSpec
    from worker.sampling import SamplingParams
    from worker.tokenizer import ByteTokenizer

    async def run(interval_ms: float) -> list[tuple[int, ...]]:
        engine = EngineConfig(role=InstanceRole.MIXED, num_blocks=64, tokens_per_block=16, stream_interval_ms=interval_ms)
        instance = Instance(InstanceSpec("m0", engine, dtype="float32", device="cpu", cluster_token="t" * 32, torch_threads=1))
        config = RouterConfig.from_dict({"placement": {"disaggregation": "never"}})
        router = Router(config, ByteTokenizer(), vocab_size=264, max_seq_len=4096, tokens_per_block=16, seed=1)
        await router.start()
        try:
            await router.add_instance(LocalInstanceClient(instance))
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            handle = await router.submit(ClientRequest(None, tuple(range(5, 45)), params))
            events = []
            async for event in handle.events():
                if isinstance(event, TokenEvent):
                    events.append(event.token_ids)
                else:
                    assert isinstance(event, FinalEvent) and event.outcome is Outcome.COMPLETE, event
            return events
        finally:
            await router.stop()
            instance.shutdown()

    every_step = asyncio.run(run(0.0))
    grouped = asyncio.run(run(30.0))
    assert [t for e in grouped for t in e] == [t for e in every_step for t in e] and len(every_step) == 40
    assert len(grouped[0]) == 1, "the first token waits for nothing"
    assert len(grouped) < len(every_step) and max(len(e) for e in grouped) > 1, grouped

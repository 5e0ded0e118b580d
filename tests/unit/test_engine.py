"""The engine step loop: exact tokens against a dense reference, pause/recompute, hand-over, abort."""

from __future__ import annotations

import pytest
import torch

from scheduler.config import CapacitySchedulerPolicy, ContextChunkingPolicy
from scheduler.state import LlmRequestState
from worker.default_model import MARGIN_CORPUS_SEED, build_default_model, greedy_margins, margin_corpus
from worker.dense import DenseGenerator
from worker.engine import Engine, EngineError
from worker.engine_types import EngineConfig
from worker.kv_layout import KvLayout
from worker.kv_transfer.failures import FailureReason, TransferFailure, TransferRejected
from worker.protocol import EngineInputError, ErrorCode, InstanceRole, RequestType, SubmitRequest
from worker.sampling import InvalidSamplingParams, SamplingParams

S = LlmRequestState
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def default_model():
    torch.set_num_threads(1)
    return build_default_model(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def corpus():
    return margin_corpus(MARGIN_CORPUS_SEED, 16)


@pytest.fixture(scope="module")
def dense_greedy(default_model, corpus):
    model = default_model[0]
    results = []
    for prompt in corpus:
        generator = DenseGenerator(model, 1, len(prompt) + NEW_TOKENS)
        logits = generator.prefill([prompt])
        tokens = []
        for _ in range(NEW_TOKENS):
            token = logits.argmax(dim=-1)
            tokens.append(int(token))
            logits = generator.decode_step(token)
        results.append(tokens)
    return results


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_engine(default_model, clock=None, **options) -> Engine:
    model, tokenizer, generation = default_model
    config = EngineConfig(**{"num_blocks": 512, "tokens_per_block": 16, **options})
    return Engine(model, tokenizer, config, generation_config=generation, clock=clock or FakeClock())


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert not engine.has_work(), "engine did not finish"
    return outputs


def tokens_of(outputs: list) -> list[int]:
    assert sum(o.finished for o in outputs) == 1 and outputs[-1].finished, "a request must end exactly once"
    return [t for o in outputs for t in o.new_token_ids]


def assert_no_leak(engine: Engine) -> None:
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def submit_corpus(engine: Engine, corpus, params, request_type=RequestType.CONTEXT_AND_GENERATION) -> None:
    for index, prompt in enumerate(corpus):
        engine.add_request(SubmitRequest(f"r{index}", tuple(prompt), params, request_type))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"chunk_unit_tokens": 16, "max_num_tokens": 64},
        {"chunk_unit_tokens": 32, "max_num_tokens": 48, "chunking_policy": ContextChunkingPolicy.EQUAL_PROGRESS},
        {"chunking_policy": None, "max_num_tokens": 4096},
        {"enable_prefix_reuse": False, "chunk_unit_tokens": 16, "max_num_tokens": 40},
        {"capacity_policy": CapacitySchedulerPolicy.MAX_UTILIZATION, "num_blocks": 12, "max_num_tokens": 64, "chunk_unit_tokens": 16},
        {"capacity_policy": CapacitySchedulerPolicy.STATIC_BATCH, "max_batch_size": 5},
    ],
    ids=["default", "chunk16", "equal-progress", "unchunked", "no-reuse", "max-util-small-pool", "static-batch"],
)
def test_paged_engine_greedy_equals_dense_reference(default_model, corpus, dense_greedy, options) -> None:
    engine = make_engine(default_model, **options)
    submit_corpus(engine, corpus, greedy())
    outputs = run_all(engine)
    for index in range(len(corpus)):
        assert tokens_of(outputs[f"r{index}"]) == dense_greedy[index], f"request r{index}"
    if options.get("num_blocks") == 12:
        assert engine.num_pauses > 0, "the small pool must force MAX_UTILIZATION to pause"
    assert_no_leak(engine)


def test_prefix_reuse_reads_cached_blocks_and_matches_dense(default_model) -> None:
    model = default_model[0]
    shared = margin_corpus(11, 1, min_len=70, max_len=70)[0]
    prompts = [shared + tail for tail in ([1, 2, 3], [9, 8], [200, 100, 50, 25])]
    margins = greedy_margins(model, prompts, 12)
    assert min(margins) > 1e-3  # guard: no near-tie in this corpus
    engine = make_engine(default_model)
    engine.add_request(SubmitRequest("first", tuple(prompts[0]), greedy(12)))
    first = run_all(engine)
    # Same engine: its cache now holds the shared prefix blocks.
    for index, prompt in enumerate(prompts[1:], start=1):
        engine.add_request(SubmitRequest(f"p{index}", tuple(prompt), greedy(12)))
    later = run_all(engine)
    for index, prompt in enumerate(prompts):
        generator = DenseGenerator(model, 1, len(prompt) + 12)
        logits = generator.prefill([prompt])
        expected = []
        for _ in range(12):
            token = logits.argmax(dim=-1)
            expected.append(int(token))
            logits = generator.decode_step(token)
        got = first["first"] if index == 0 else later[f"p{index}"]
        assert tokens_of(got) == expected
        if index:
            assert got[-1].num_cached_tokens == 64  # 4 full blocks of 16 shared tokens reused
    assert_no_leak(engine)


def test_seeded_sampling_is_reproducible_and_independent_of_batching(default_model, corpus) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    together = make_engine(default_model)
    submit_corpus(together, corpus[:6], params)
    batched = {rid: tokens_of(outs) for rid, outs in run_all(together).items()}
    for index in range(6):
        alone = make_engine(default_model, chunk_unit_tokens=16, max_num_tokens=32)
        alone.add_request(SubmitRequest(f"r{index}", tuple(corpus[index]), params))
        assert tokens_of(run_all(alone)[f"r{index}"]) == batched[f"r{index}"]


def _handover(prefill: Engine, generation: Engine, request_ids: list[str], firsts: dict) -> None:
    """Drive the in-process hand-over of every request until both sides are idle."""
    pending = set(request_ids)
    for _ in range(100):
        generation.step()
        for request_id in list(pending):
            reservation = generation.reservation(request_id)
            if reservation is None:
                continue
            layout, data = prefill.export_kv(request_id)
            generation.import_kv(reservation.transfer_id, request_id, layout, data)
            prefill.finish_handover(request_id, None)
            pending.discard(request_id)
        if not pending:
            return
    raise AssertionError(f"hand-over never reserved: {pending}")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_prefill_to_generation_handover_equals_mixed(default_model, corpus, sampled) -> None:
    params = (
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=99, ignore_eos=True) if sampled else greedy()
    )
    mixed = make_engine(default_model)
    submit_corpus(mixed, corpus, params)
    expected = {rid: tokens_of(outs) for rid, outs in run_all(mixed).items()}

    prefill = make_engine(default_model, role=InstanceRole.PREFILL)
    generation = make_engine(default_model, role=InstanceRole.GENERATION)
    submit_corpus(prefill, corpus, params, RequestType.CONTEXT_ONLY)
    first_tokens: dict[str, list[int]] = {}
    prefill_outputs: dict[str, list] = {}
    for _ in range(200):
        for output in prefill.step():
            prefill_outputs.setdefault(output.request_id, []).append(output)
            if output.context_done:
                first_tokens[output.request_id] = list(output.new_token_ids)
        if len(first_tokens) == len(corpus):
            break
    for request_id in first_tokens:
        assert prefill.state_of(request_id) is S.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        index = int(request_id[1:])
        generation.add_request(
            SubmitRequest(request_id, tuple(corpus[index]), params, RequestType.GENERATION_ONLY, tuple(first_tokens[request_id]))
        )
    _handover(prefill, generation, sorted(first_tokens), first_tokens)
    for output in prefill.step():
        prefill_outputs.setdefault(output.request_id, []).append(output)
    generated = run_all(generation)
    for request_id in first_tokens:
        assert prefill_outputs[request_id][-1].handed_over
        assert first_tokens[request_id] + tokens_of(generated[request_id]) == expected[request_id]
    assert_no_leak(prefill)
    assert_no_leak(generation)


def test_incompatible_engines_refuse_the_handover(default_model, corpus) -> None:
    generation = make_engine(default_model, role=InstanceRole.GENERATION)
    generation.add_request(SubmitRequest("x", tuple(corpus[0]), greedy(), RequestType.GENERATION_ONLY, (5,)))
    generation.step()
    reservation = generation.reservation("x")
    assert reservation is not None and generation.state_of("x") is S.DISAGG_GENERATION_TRANS_IN_PROGRESS
    good = generation.layout
    for field, value in (("tokens_per_block", 32), ("dtype", "bfloat16"), ("model_fingerprint", "other-model")):
        bad = KvLayout(**{**good.__dict__, field: value})
        with pytest.raises(TransferRejected) as error:
            generation.import_kv(reservation.transfer_id, "x", bad, b"")
        assert error.value.code is FailureReason.INCOMPATIBLE
    with pytest.raises(TransferRejected) as error:
        generation.open_transfer("forged-id", "x", good)
    assert error.value.code is FailureReason.UNKNOWN_TRANSFER
    assert generation.abort("x")
    run_all(generation)
    assert_no_leak(generation)


def test_reservation_expires_and_frees_blocks(default_model, corpus) -> None:
    clock = FakeClock()
    generation = make_engine(default_model, clock=clock, role=InstanceRole.GENERATION, reservation_timeout_s=5.0)
    generation.add_request(SubmitRequest("x", tuple(corpus[1]), greedy(), RequestType.GENERATION_ONLY, (7,)))
    generation.step()
    transfer_id = generation.reservation("x").transfer_id
    assert generation.blocks.num_free_blocks < generation.blocks.num_blocks
    clock.now += 5.0
    outputs = generation.step()
    assert [o.error.code for o in outputs if o.finished] == [ErrorCode.RESERVATION_EXPIRED]
    assert outputs[-1].error.transfer_reason == "RESERVATION_EXPIRED"
    with pytest.raises(TransferRejected):
        generation.open_transfer(transfer_id, "x", generation.layout)
    assert_no_leak(generation)


def test_sender_lease_expires_and_frees_blocks(default_model, corpus) -> None:
    clock = FakeClock()
    prefill = make_engine(default_model, clock=clock, role=InstanceRole.PREFILL, sender_lease_s=3.0)
    prefill.add_request(SubmitRequest("y", tuple(corpus[2]), greedy(), RequestType.CONTEXT_ONLY))
    outputs = run_steps_until(prefill, lambda outs: any(o.context_done for o in outs))
    assert prefill.state_of("y") is S.DISAGG_CONTEXT_TRANS_IN_PROGRESS
    clock.now += 2.9
    assert not any(o.finished for o in prefill.step())
    clock.now += 0.2
    outputs = prefill.step()
    assert [o.error.code for o in outputs if o.finished] == [ErrorCode.LEASE_EXPIRED]
    assert_no_leak(prefill)


def test_failed_handover_frees_blocks_on_both_sides(default_model, corpus) -> None:
    prefill = make_engine(default_model, role=InstanceRole.PREFILL)
    generation = make_engine(default_model, role=InstanceRole.GENERATION)
    prefill.add_request(SubmitRequest("z", tuple(corpus[3]), greedy(), RequestType.CONTEXT_ONLY))
    outputs = run_steps_until(prefill, lambda outs: any(o.context_done for o in outs))
    first = next(o for o in outputs if o.context_done).new_token_ids
    generation.add_request(SubmitRequest("z", tuple(corpus[3]), greedy(), RequestType.GENERATION_ONLY, first))
    generation.step()
    reservation = generation.reservation("z")
    target = generation.open_transfer(reservation.transfer_id, "z", prefill.layout)
    failure = TransferFailure(FailureReason.CHECKSUM_MISMATCH, "chunk 3")
    target.fail(failure)
    prefill.begin_push("z")
    prefill.report_push("z", failure)
    gen_out = generation.step()
    # A failed push keeps the sender's blocks (the router may retry) until it is released.
    assert not [o for o in prefill.step() if o.finished]
    assert prefill.state_of("z") is S.DISAGG_CONTEXT_TRANS_IN_PROGRESS
    assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks
    assert prefill.release("z", failure)
    pre_out = prefill.step()
    for outs in (gen_out, pre_out):
        final = [o for o in outs if o.finished]
        assert len(final) == 1 and final[0].error.code is ErrorCode.TRANSFER_FAILED
        assert final[0].error.transfer_reason == "CHECKSUM_MISMATCH"
    assert_no_leak(prefill)
    assert_no_leak(generation)


def run_steps_until(engine: Engine, predicate, max_steps: int = 200) -> list:
    seen = []
    for _ in range(max_steps):
        outputs = engine.step()
        seen.extend(outputs)
        if predicate(outputs):
            return seen
    raise AssertionError("condition never reached")


@pytest.mark.parametrize("state", ["queued", "prefilling", "generating", "reserved", "handing-over"])
def test_abort_in_any_state_frees_every_block(default_model, corpus, state) -> None:
    role = {"reserved": InstanceRole.GENERATION, "handing-over": InstanceRole.PREFILL}.get(state, InstanceRole.MIXED)
    engine = make_engine(default_model, role=role, chunk_unit_tokens=16, max_num_tokens=16)
    request_type = {"reserved": RequestType.GENERATION_ONLY, "handing-over": RequestType.CONTEXT_ONLY}.get(
        state, RequestType.CONTEXT_AND_GENERATION
    )
    first = (3,) if request_type is RequestType.GENERATION_ONLY else ()
    prompt = tuple(corpus[5]) * 2
    engine.add_request(SubmitRequest("a", prompt, greedy(), request_type, first))
    expected_state = {
        "queued": S.CONTEXT_INIT,
        "prefilling": S.CONTEXT_INIT,
        "generating": S.GENERATION_IN_PROGRESS,
        "reserved": S.DISAGG_GENERATION_TRANS_IN_PROGRESS,
        "handing-over": S.DISAGG_CONTEXT_TRANS_IN_PROGRESS,
    }[state]
    if state != "queued":
        engine.step()
    for _ in range(50):
        if engine.state_of("a") is expected_state:
            break
        engine.step()
    assert engine.state_of("a") is expected_state
    if state == "prefilling":
        assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    assert engine.abort("a")
    assert not engine.abort("a")
    outputs = run_all(engine)
    final = outputs["a"][-1]
    assert final.finished and final.error.code is ErrorCode.ABORTED
    assert_no_leak(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt_token_ids": (1, 2, 99999)}, "prompt_token_ids"),
        ({"prompt_token_ids": (-1,)}, "prompt_token_ids"),
        ({"prompt_token_ids": tuple(range(100)) * 41}, "prompt_token_ids"),
        ({"request_type": RequestType.GENERATION_ONLY, "output_token_ids": (1,)}, "request_type"),
    ],
)
def test_bad_requests_are_refused_before_the_model(default_model, kwargs, field) -> None:
    engine = make_engine(default_model, role=InstanceRole.PREFILL) if "request_type" in kwargs else make_engine(default_model)
    if field == "request_type":
        kwargs = {**kwargs}
    base = {"request_id": "bad", "prompt_token_ids": (1, 2, 3), "sampling_params": greedy()}
    with pytest.raises(EngineInputError) as error:
        engine.add_request(SubmitRequest(**{**base, **kwargs}))
    assert error.value.field == field
    assert engine.num_requests == 0 and engine.num_forward_tokens == 0


def test_invalid_sampling_params_and_stop_ids_are_refused(default_model) -> None:
    engine = make_engine(default_model)
    with pytest.raises(InvalidSamplingParams) as error:
        SamplingParams(temperature=-1.0)
    assert error.value.field == "temperature"
    with pytest.raises(InvalidSamplingParams) as error:
        engine.add_request(SubmitRequest("s", (1, 2), SamplingParams(stop_token_ids=[100000])))
    assert error.value.field == "stop_token_ids"
    with pytest.raises(EngineInputError):
        SubmitRequest("", (1,), greedy())
    assert engine.num_forward_tokens == 0


def test_stop_strings_and_eos_end_requests(default_model, corpus) -> None:
    engine = make_engine(default_model)
    engine.add_request(SubmitRequest("free", tuple(corpus[0]), SamplingParams(max_tokens=200, temperature=0.0)))
    run = run_all(engine)["free"]
    text = "".join(o.text_delta for o in run)
    tokens = tokens_of(run)
    assert run[-1].finish_reason is not None
    # Stop at the text of the third token: the output must end right before it.
    stop_text = engine.tokenizer.decode(tokens[2:3])
    if stop_text and "\ufffd" not in stop_text:
        engine.add_request(SubmitRequest("stop", tuple(corpus[0]), SamplingParams(max_tokens=200, temperature=0.0, stop=[stop_text])))
        stopped = run_all(engine)["stop"]
        assert stopped[-1].stop_reason == stop_text
        assert "".join(o.text_delta for o in stopped) == text[: text.index(stop_text)]
    engine.add_request(SubmitRequest("ids", tuple(corpus[0]), SamplingParams(max_tokens=200, temperature=0.0, stop_token_ids=[tokens[4]])))
    by_id = run_all(engine)["ids"]
    assert tokens_of(by_id) == tokens[: tokens.index(tokens[4]) + 1]
    assert by_id[-1].stop_reason == tokens[4]


def test_engine_api_misuse_is_an_error(default_model, corpus) -> None:
    engine = make_engine(default_model)
    with pytest.raises(EngineError):
        engine.export_kv("nothing")
    engine.add_request(SubmitRequest("dup", tuple(corpus[0]), greedy()))
    with pytest.raises(EngineInputError) as error:
        engine.add_request(SubmitRequest("dup", tuple(corpus[0]), greedy()))
    assert error.value.field == "request_id"
    run_all(engine)
    assert_no_leak(engine)


def test_abort_during_a_push_frees_blocks_only_when_the_push_returns(default_model, corpus) -> None:
    prefill = make_engine(default_model, role=InstanceRole.PREFILL)
    prefill.add_request(SubmitRequest("pinned", tuple(corpus[6]), greedy(), RequestType.CONTEXT_ONLY))
    run_steps_until(prefill, lambda outs: any(o.context_done for o in outs))
    source = prefill.begin_push("pinned")
    before = bytes(source.read(0, prefill.layout.num_layers, 0, source.num_blocks))
    assert prefill.abort("pinned", "client went away")
    assert not [o for o in prefill.step() if o.finished]  # deferred: a push is reading the blocks
    assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks
    assert bytes(source.read(0, prefill.layout.num_layers, 0, source.num_blocks)) == before
    prefill.report_push("pinned", None)
    final = [o for o in prefill.step() if o.finished]
    assert len(final) == 1 and final[0].error.code is ErrorCode.ABORTED
    assert_no_leak(prefill)


def test_a_push_that_succeeds_while_an_earlier_one_is_in_flight_frees_blocks_only_when_both_returned(default_model, corpus) -> None:
    """A retried transfer (the router gave up on a stalled push and pushes to another receiver) runs
    beside the stalled push, which still reads the blocks: the retry's success ends the request,
    but its blocks stay until the stalled push returns, as for an abort during a push."""
    prefill = make_engine(default_model, role=InstanceRole.PREFILL)
    prefill.add_request(SubmitRequest("retried", tuple(corpus[6]), greedy(), RequestType.CONTEXT_ONLY))
    run_steps_until(prefill, lambda outs: any(o.context_done for o in outs))
    stalled = prefill.begin_push("retried")
    before = bytes(stalled.read(0, prefill.layout.num_layers, 0, stalled.num_blocks))
    prefill.begin_push("retried")  # the retry
    prefill.report_push("retried", None)  # the retry committed
    assert not [o for o in prefill.step() if o.finished]  # deferred: the stalled push reads the blocks
    assert prefill.blocks.num_free_blocks < prefill.blocks.num_blocks
    prefill.add_request(SubmitRequest("next", tuple(corpus[5]), greedy(), RequestType.CONTEXT_ONLY))
    run_steps_until(prefill, lambda outs: any(o.context_done for o in outs))  # a new prompt takes free blocks only
    assert bytes(stalled.read(0, prefill.layout.num_layers, 0, stalled.num_blocks)) == before
    prefill.report_push("retried", TransferFailure(FailureReason.DEADLINE_EXCEEDED, "stalled"))  # it returns at its deadline
    final = [o for o in prefill.step() if o.finished and o.request_id == "retried"]
    assert len(final) == 1 and final[0].handed_over and final[0].error is None
    prefill.abort("next")
    run_all(prefill)
    assert_no_leak(prefill)


def test_a_prefill_hop_reserves_for_its_prompt_and_first_token_only(default_model) -> None:
    """A CONTEXT_ONLY hop samples one token (the generation instance makes the rest), so a prefill
    instance's pool needs to hold the prompt and that token, whatever max_tokens says (as
    TensorRT-LLM's disaggregated server sends context requests with max_tokens 1)."""
    engine = make_engine(default_model, num_blocks=8, role=InstanceRole.PREFILL)
    # 127 prompt tokens + the first token fill the 8 blocks of 16: accepted with max_tokens 1000.
    engine.add_request(SubmitRequest("long-output", tuple(range(1, 128)), greedy(1000), RequestType.CONTEXT_ONLY))
    assert engine.num_requests == 1
    # 128 prompt tokens + the first token need a ninth block: refused, naming the pool.
    with pytest.raises(EngineInputError) as error:
        engine.add_request(SubmitRequest("too-long", tuple(range(1, 129)), greedy(1), RequestType.CONTEXT_ONLY))
    assert "needs 9 KV blocks" in error.value.message and "holds 8 blocks (128 tokens)" in error.value.message


@pytest.mark.parametrize("role", [InstanceRole.MIXED, InstanceRole.GENERATION])
def test_a_request_the_kv_pool_can_never_hold_is_refused_at_submission(default_model, role) -> None:
    # 8 blocks of 16 tokens: a 100-token prompt with 40 new tokens needs 9 blocks at its longest.
    engine = make_engine(default_model, num_blocks=8, role=role)
    request_type = RequestType.CONTEXT_AND_GENERATION
    with pytest.raises(EngineInputError) as error:
        engine.add_request(SubmitRequest("big", tuple(range(1, 101)), greedy(40), request_type))
    assert error.value.field == "sampling_params.max_tokens"
    assert "needs 9 KV blocks" in error.value.message and "holds 8 blocks (128 tokens)" in error.value.message
    assert engine.num_requests == 0
    # 28 new tokens fill the 8 blocks exactly: accepted (and, colocated, run to completion).
    engine.add_request(SubmitRequest("fits", tuple(range(1, 101)), greedy(28), request_type))
    assert engine.num_requests == 1
    if role is InstanceRole.MIXED:
        outputs = run_all(engine)
        assert outputs["fits"][-1].finished and outputs["fits"][-1].error is None
        assert_no_leak(engine)


def test_a_handed_over_prompt_is_published_after_its_first_token_and_step_not_before(default_model, corpus) -> None:
    """Publishing a prompt to the prefix cache hashes every block: the generation side publishes a
    received prompt after the step that decodes its next token, never between the two tokens."""
    from scheduler.block_hash import PrefixEventKind

    def stored(engine: Engine) -> int:
        return sum(1 for event in engine.load().prefix_events if event.kind is PrefixEventKind.STORED)

    options = {"record_prefix_events": True}
    prefill = make_engine(default_model, role=InstanceRole.PREFILL, **options)
    generation = make_engine(default_model, role=InstanceRole.GENERATION, **options)
    prompt = tuple(corpus[0])
    prefill.add_request(SubmitRequest("h", prompt, greedy(), RequestType.CONTEXT_ONLY))
    first: list[int] = []
    for _ in range(50):
        first += [t for output in prefill.step() if output.context_done for t in output.new_token_ids]
        if first:
            break
    # The prefill side publishes in the step that makes the first token (its push thread reads the
    # blocks right after: publishing then would hold the GIL against it).
    assert stored(prefill) == (len(prompt) - 1) // prefill.config.tokens_per_block
    assert not prefill.publish_prefixes()
    generation.add_request(SubmitRequest("h", prompt, greedy(), RequestType.GENERATION_ONLY, tuple(first)))
    while generation.reservation("h") is None:
        generation.step()
    # As the KV receiver's thread does: write and commit through the target (the commit reaches the
    # engine through its inbox, taken in by its next step).
    layout, data = prefill.export_kv("h")
    target = generation.open_transfer(generation.reservation("h").transfer_id, "h", layout)
    target.write(0, layout.num_layers, 0, target.num_blocks, memoryview(data))
    target.commit(tuple(first))
    prefill.finish_handover("h", None)
    assert stored(generation) == 0
    outputs = generation.step()  # takes the commit in, decodes the next token
    assert [t for output in outputs for t in output.new_token_ids] and stored(generation) == 0
    generation.step()  # the next step starts by publishing it
    assert stored(generation) == (len(prompt) - 1) // generation.config.tokens_per_block


"""Replay TensorRT-LLM's scheduler peer cases on our own scheduler and block manager.

    python -m scheduler.replay [FILE ...]      (default: the repo's copy of the cases)

Implements each harness of the case format (the `harness_descriptions` of
scheduler/cases/scheduler_cases.json) and
nothing more. Prints `PASS name` or `FAIL name: what differed` per case, then `N passed, M failed`.
Exit status: 0 if all pass, 1 if any fail, 2 for an unreadable file or an unknown harness.
Needs nothing but the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.block_manager import BlockManager, BlockManagerConfig
from scheduler.capacity import make_capacity_scheduler
from scheduler.chunking import chunk_contexts
from scheduler.config import CapacitySchedulerPolicy, ChunkingConfig, ContextChunkingPolicy
from scheduler.microbatch import MicroBatchScheduler
from scheduler.ordering import insert_by_priority
from scheduler.peft import PeftBudget
from scheduler.request import DEFAULT_PRIORITY, LlmRequest
from scheduler.state import LlmRequestState, parse_state

S = LlmRequestState
DEFAULT_CASES = Path(__file__).resolve().parent / "cases" / "scheduler_cases.json"
MAX_ITERATIONS = 100_000
HARNESS_TOKEN = 0  # the value of every token the harnesses append (values matter only for reuse)


class CaseFailure(Exception):
    """An expectation of a case did not hold."""


class UnknownHarness(Exception):
    pass


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CaseFailure(message)


# --- shared helpers -----------------------------------------------------------------------------
def _new_request(spec: dict[str, Any], *, default_max_new_tokens: int | None = None) -> LlmRequest:
    prompt_len = spec["prompt_len"]
    tokens = spec.get("input_tokens")
    if tokens is None:
        tokens = [HARNESS_TOKEN] * prompt_len
    max_new = spec.get("max_new_tokens", default_max_new_tokens)
    state = parse_state(spec.get("state", "CONTEXT_INIT"))
    encoder_len = spec.get("encoder_input_len")
    request = LlmRequest(
        spec["id"],
        tokens,
        max_new,
        beam_width=spec.get("beam_width", 1),
        lora_task_id=spec.get("lora_task_id"),
        priority=spec.get("priority", DEFAULT_PRIORITY),
        num_draft_tokens=spec.get("num_draft_tokens", 0),
        encoder_input_len=encoder_len,
        state=state,
    )
    if "initial_context_chunk_size" in spec:
        request.set_context_chunk_size(spec["initial_context_chunk_size"])
    return request


def _insert(active: list[LlmRequest], request: LlmRequest, mode: str) -> None:
    if mode == "append":
        active.append(request)
    elif mode == "insert_by_priority":
        insert_by_priority(active, request)
    else:
        raise CaseFailure(f"unknown insertion mode {mode!r}")


def _num_generated(request: LlmRequest) -> int:
    return request.max_num_generated_tokens


def _make_gen_in_progress(request: LlmRequest) -> None:
    """A generation request as the micro-batch harnesses build it: prompt done, one token out."""
    request.context_current_position = request.prompt_len
    request.context_chunk_size = 0
    request.add_new_token(HARNESS_TOKEN)


def _ids(requests: list[LlmRequest]) -> list:
    return [request.request_id for request in requests]


# --- capacity_runTest ---------------------------------------------------------------------------
def _kv_manager(config: dict[str, Any], *, reuse: bool, cross: bool) -> BlockManager:
    tpb = config["kv_tokens_per_block"]
    return BlockManager(
        BlockManagerConfig(
            tokens_per_block=tpb,
            num_blocks=math.ceil(config["kv_max_num_tokens"] / tpb),
            max_attention_window=config["max_attention_window_and_max_seq_len"],
            sink_token_len=config.get("sink_token_len", 0),
            enable_block_reuse=reuse,
            two_steps_lookahead=config.get("two_steps_lookahead", False),
            is_cross_attention=cross,
        )
    )


def run_capacity(case: dict[str, Any]) -> None:
    config = case["config"]
    expected = case["expected"]
    derived = case.get("derived_from_reference_model")
    tpb = config["kv_tokens_per_block"]
    kv = _kv_manager(config, reuse=config["enable_block_reuse"], cross=False)
    cross = _kv_manager(config["cross_kv"], reuse=False, cross=True) if config.get("cross_kv") else None
    peft_mock = config["peft_mock"]
    peft = PeftBudget(peft_mock["max_device_pages"], peft_mock["pages_per_new_task"])
    scheduler = make_capacity_scheduler(
        CapacitySchedulerPolicy.parse(case["policy"]),
        config["max_num_requests"],
        kv,
        cross_kv=cross,
        peft=peft,
    )
    max_input_len = config["max_input_len_for_pause"]
    has_disagg = case.get("harness_flags", {}).get("has_disagg_gen_init", False)

    active: list[LlmRequest] = []
    for spec in case["requests"]:
        _insert(active, _new_request(spec), case["initial_insertion"])
    additions: dict[int, list[dict[str, Any]]] = {}
    for entry in case.get("add_requests", []):
        additions.setdefault(entry["at_iteration"], []).append(entry)
    ranges = expected.get("ranges", [])

    scheduled_by_it: list[tuple[set, set]] = []
    paused_by_it: dict[int, list] = {}
    iteration = 0
    while active:
        if iteration >= MAX_ITERATIONS:
            raise CaseFailure(f"still running after {MAX_ITERATIONS} iterations")
        for entry in additions.get(iteration, []):  # step 1
            for spec in entry["requests"]:
                _insert(active, _new_request(spec), entry["mode"])
        for request in active:  # step 2
            if request.state is S.ENCODER_INIT and request.encoder_input_len is not None:
                request.set_state(S.CONTEXT_INIT)
        output = scheduler.schedule(active)  # step 3
        fitting, disagg, paused = output.fitting, output.disagg_generation_init, output.paused
        scheduled_by_it.append((set(_ids(fitting)), set(_ids(disagg))))
        if paused:
            paused_by_it[iteration] = _ids(paused)

        for index, rng in enumerate(ranges):  # step 4
            if not rng["it_begin"] <= iteration < rng["it_end"]:
                continue
            where = f"iteration {iteration}"
            _expect(
                _ids(active) == rng["active_ids"],
                f"{where}: active ids {_ids(active)} != expected {rng['active_ids']}",
            )
            want = sorted(entry["id"] for entry in rng["scheduled"])
            _expect(
                sorted(_ids(fitting)) == want,
                f"{where}: scheduled {sorted(_ids(fitting))} != expected {want}",
            )
            want_disagg = rng.get("scheduled_disagg_gen_init_count", 0)
            _expect(
                len(disagg) == want_disagg,
                f"{where}: {len(disagg)} disagg-init requests scheduled, expected {want_disagg}",
            )
            if iteration == rng["it_begin"]:
                previous = {e["id"] for e in ranges[index - 1]["scheduled"]} if index > 0 else set()
                by_id = {request.request_id: request for request in active}
                for entry in rng["scheduled"]:
                    request = by_id[entry["id"]]
                    for name, value in (
                        ("max_new_tokens", request.max_new_tokens),
                        ("prompt_len", request.prompt_len),
                        ("num_generated", _num_generated(request)),
                        ("context_position", request.context_current_position),
                    ):
                        _expect(
                            value == entry[name],
                            f"{where}: request {entry['id']} {name} {value} != expected {entry[name]}",
                        )
                    if not has_disagg:
                        if entry["id"] not in previous:
                            _expect(
                                request.state is S.CONTEXT_INIT,
                                f"{where}: request {entry['id']} is {request.state.name}, expected CONTEXT_INIT",
                            )
                        elif request.context_remaining_length == 0:
                            _expect(
                                request.state is S.GENERATION_IN_PROGRESS,
                                f"{where}: request {entry['id']} is {request.state.name}, "
                                "expected GENERATION_IN_PROGRESS",
                            )

        for request in paused:  # step 5
            kv.remove_sequence(request.request_id)
            if cross is not None:
                cross.remove_sequence(request.request_id)
            request.pause(max_input_len)
            _expect(request.state is S.CONTEXT_INIT, f"paused request {request.request_id} is {request.state.name}")

        for request in disagg:  # step 6
            kv.add_sequence(request)
            request.set_state(S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
            request.set_state(S.DISAGG_GENERATION_TRANS_COMPLETE)
            request.set_state(S.GENERATION_IN_PROGRESS)
            request.context_current_position = request.prompt_len
            request.decoding_iter = 1
            request.add_new_token(HARNESS_TOKEN)

        for request in sorted(fitting, key=lambda r: r.request_id):  # step 7
            if request.state is S.CONTEXT_INIT:
                if not request.is_last_context_chunk():
                    _expect(
                        request.context_chunk_size % tpb == 0,
                        f"iteration {iteration}: request {request.request_id} non-last chunk "
                        f"{request.context_chunk_size} is not a multiple of {tpb}",
                    )
                if request.is_first_context_chunk():
                    kv.add_sequence(request)
                    if cross is not None:
                        cross.add_sequence(request, num_tokens=request.encoder_input_len)
                chunk = request.context_chunk_size
                request.move_to_next_context_chunk()
                request.set_context_chunk_size(chunk)
                if request.context_remaining_length == 0:
                    kv.store_context_blocks(request)
                    request.add_new_token(HARNESS_TOKEN)
                    request.set_state(S.GENERATION_IN_PROGRESS)
            else:
                kv.add_token(request.request_id)
                request.add_new_token(HARNESS_TOKEN)
            if request.num_tokens(0) == request.prompt_len + request.max_new_tokens:
                request.set_state(S.GENERATION_COMPLETE)
                kv.remove_sequence(request.request_id)
                if cross is not None:
                    cross.remove_sequence(request.request_id)

        active = [request for request in active if request.state is not S.GENERATION_COMPLETE]  # step 8
        iteration += 1

    _expect(
        iteration == expected["num_iterations"],
        f"ran {iteration} iterations, expected {expected['num_iterations']}",
    )
    _check_reused(expected.get("num_reused_blocks"), kv.num_reused_blocks, "num_reused_blocks")
    kv.check_integrity()
    _expect(kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks leaked")

    if derived is not None:
        covered = 0
        for run in derived["scheduled_runs"]:
            for it in range(run["it_from"], run["it_to_inclusive"] + 1):
                _expect(it < len(scheduled_by_it), f"derived run covers iteration {it} beyond the run")
                got_fit, got_disagg = scheduled_by_it[it]
                _expect(
                    got_fit == set(run["scheduled_ids"]),
                    f"derived: iteration {it} scheduled {sorted(got_fit)} != {run['scheduled_ids']}",
                )
                _expect(
                    got_disagg == set(run["disagg_gen_init_ids"]),
                    f"derived: iteration {it} disagg-init {sorted(got_disagg)} != {run['disagg_gen_init_ids']}",
                )
                covered += 1
        _expect(covered == iteration, f"derived runs cover {covered} iterations, the run had {iteration}")
        want_pauses = {event["it"]: event["paused_ids_in_order"] for event in derived["pause_events"]}
        _expect(
            paused_by_it == want_pauses,
            f"derived: pause events {paused_by_it} != expected {want_pauses}",
        )
        _check_reused(derived.get("num_reused_blocks"), kv.num_reused_blocks, "derived num_reused_blocks")


def _check_reused(want: Any, got: int, name: str) -> None:
    if want is None:
        return
    if isinstance(want, dict):
        if want.get("op") != ">":
            raise CaseFailure(f"{name}: unknown comparison {want!r}")
        _expect(got > want["value"], f"{name} {got} is not > {want['value']}")
    else:
        _expect(got == want, f"{name} {got} != expected {want}")


# --- micro-batch harnesses ----------------------------------------------------------------------
def _microbatch(config: dict[str, Any]) -> MicroBatchScheduler:
    chunking = config.get("chunking")
    return MicroBatchScheduler(
        chunking=None
        if chunking is None
        else ChunkingConfig(ContextChunkingPolicy.parse(chunking["policy"]), chunking["unit"]),
        max_context_length=config.get("max_context_length"),
    )


def run_microbatch_forward(case: dict[str, Any]) -> None:
    config = case["config"]
    scheduler = _microbatch(config)
    active = []
    for spec in case["requests"]:
        request = _new_request(spec)
        if request.state is S.GENERATION_IN_PROGRESS:
            _make_gen_in_progress(request)
        active.append(request)
    inflight: set = set()
    slots: list[set] = [set() for _ in range(config["num_micro_batch_contexts"])]
    slot = 0
    mutations: dict[int, list] = {}
    for mutation in case.get("mutations", []):
        mutations.setdefault(mutation["after_iteration"], []).extend(mutation["set"])
    for iteration in range(case["num_iterations_run"]):
        inflight -= slots[slot]
        batch = scheduler.schedule(active, inflight, config["max_batch_size"], config["max_num_tokens"])
        returned = batch.context + batch.generation
        inflight.update(_ids(returned))
        for request in batch.context:
            request.move_to_next_context_chunk()
            if request.context_remaining_length == 0:
                request.set_state(S.GENERATION_IN_PROGRESS)
                request.add_new_token(HARNESS_TOKEN)
            if request.num_tokens(0) == request.prompt_len + request.max_new_tokens:
                request.set_state(S.GENERATION_COMPLETE)
        for request in batch.generation:
            request.add_new_token(HARNESS_TOKEN)
            if request.num_tokens(0) == request.prompt_len + request.max_new_tokens:
                request.set_state(S.GENERATION_COMPLETE)
        active = [request for request in active if request.state is not S.GENERATION_COMPLETE]
        slots[slot] = set(_ids(returned))
        slot = (slot + 1) % len(slots)

        for entry in case["expected"]:
            if not entry["it_from"] <= iteration <= entry["it_to_inclusive"]:
                continue
            where = f"iteration {iteration}"
            got_ids = sorted(_ids(returned))
            if "scheduled_ids" in entry:
                _expect(got_ids == sorted(entry["scheduled_ids"]), f"{where}: scheduled {got_ids} != {entry['scheduled_ids']}")
            if "num_scheduled" in entry:
                _expect(len(returned) == entry["num_scheduled"], f"{where}: {len(returned)} scheduled != {entry['num_scheduled']}")
            by_id = {request.request_id: request for request in returned}
            for after in entry.get("after_iteration", []):
                request = by_id.get(after["id"])
                _expect(request is not None, f"{where}: request {after['id']} was not scheduled")
                for name, value in (
                    ("num_generated", _num_generated(request)),
                    ("context_position", request.context_current_position),
                    ("num_draft_tokens", request.num_draft_tokens),
                ):
                    if name in after:
                        _expect(value == after[name], f"{where}: request {after['id']} {name} {value} != {after[name]}")
        for change in mutations.get(iteration, []):
            for request in active:
                if request.request_id == change["id"]:
                    request.set_num_draft_tokens(change["num_draft_tokens"])


def run_microbatch_single_call(case: dict[str, Any]) -> None:
    config = case["config"]
    scheduler = _microbatch(config)
    requests = []
    for spec in case["requests"]:
        request = _new_request(spec)
        if request.state is S.GENERATION_IN_PROGRESS:
            _make_gen_in_progress(request)
        request.estimated_reusable_tokens = spec.get("estimated_reusable_tokens", 0)
        requests.append(request)
    batch = scheduler.schedule(
        requests, set(case.get("inflight_ids", [])), config["max_batch_size"], config["max_num_tokens"]
    )
    expected = case["expected"]
    if "context_ids" in expected:
        got = sorted(_ids(batch.context))
        _expect(got == sorted(expected["context_ids"]), f"context ids {got} != {expected['context_ids']}")
    if "generation_ids" in expected:
        got = _ids(batch.generation)
        _expect(got == expected["generation_ids"], f"generation ids {got} != {expected['generation_ids']}")
    if "num_context" in expected:
        _expect(len(batch.context) == expected["num_context"], f"{len(batch.context)} contexts != {expected['num_context']}")
    by_id = {request.request_id: request for request in requests}
    for entry in expected.get("chunk_sizes", []):
        got = by_id[entry["id"]].context_chunk_size
        _expect(got == entry["chunk_size"], f"request {entry['id']} chunk size {got} != {entry['chunk_size']}")


def run_chunking_static(case: dict[str, Any]) -> None:
    config = case["config"]
    for policy_name in config["policies"]:
        policy = ContextChunkingPolicy.parse(policy_name)
        want = case["expected"][policy_name]
        requests = [_new_request(spec, default_max_new_tokens=1) for spec in case["requests"]]

        def step(targets: list[LlmRequest], policy: ContextChunkingPolicy = policy) -> None:
            chunk_contexts(
                targets, policy, config["ctx_tokens_capacity"], config["chunk_unit_size"], config["max_context_length"]
            )

        if "chunk_sizes_single_call" in want:
            step(requests)
            got = [request.context_chunk_size for request in requests]
            _expect(got == want["chunk_sizes_single_call"], f"{policy_name}: chunk sizes {got} != {want['chunk_sizes_single_call']}")
        if "positions_after_each_iteration" in want:
            for iteration, positions in enumerate(want["positions_after_each_iteration"]):
                pending = [request for request in requests if request.context_remaining_length > 0]
                step(pending)
                for request in pending:
                    request.move_to_next_context_chunk()
                got = [request.context_current_position for request in requests]
                _expect(got == positions, f"{policy_name}: iteration {iteration} positions {got} != {positions}")
            if "final_num_draft_tokens" in want:
                got = [request.num_draft_tokens for request in requests]
                _expect(got == want["final_num_draft_tokens"], f"{policy_name}: draft tokens {got} != {want['final_num_draft_tokens']}")


def run_priority_insertion(case: dict[str, Any]) -> None:
    active: list[LlmRequest] = []
    for spec in case["requests"]:
        insert_by_priority(active, _new_request({"prompt_len": 1, "max_new_tokens": 1, **spec}))
    got = _ids(active)
    _expect(got == case["expected"]["order"], f"order {got} != {case['expected']['order']}")


HARNESSES: dict[str, Callable[[dict[str, Any]], None]] = {
    "capacity_runTest": run_capacity,
    "microbatch_forward": run_microbatch_forward,
    "microbatch_single_call": run_microbatch_single_call,
    "context_chunking_static": run_chunking_static,
    "force_chunk_static": run_chunking_static,
    "priority_insertion": run_priority_insertion,
}


def run_case(case: dict[str, Any]) -> str | None:
    """None if the case passes, else what differed. Raises UnknownHarness."""
    harness = HARNESSES.get(case.get("harness"))
    if harness is None:
        raise UnknownHarness(f"case {case.get('name')!r}: unknown harness {case.get('harness')!r}")
    try:
        harness(case)
    except CaseFailure as failure:
        return str(failure)
    except Exception as error:  # noqa: BLE001 - a scheduler error is a failed case, reported with its type
        return f"{type(error).__name__}: {error}"
    return None


def load_cases(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise ValueError(f"{path}: not a case file (no 'cases' list)")
    return data["cases"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help=f"case files (default: {DEFAULT_CASES})")
    args = parser.parse_args(argv)
    files = args.files or [DEFAULT_CASES]
    all_cases: list[dict[str, Any]] = []
    for path in files:
        try:
            all_cases.extend(load_cases(path))
        except (OSError, ValueError) as error:
            print(f"error: cannot read {path}: {error}", file=sys.stderr)
            return 2
    passed = failed = 0
    for case in all_cases:
        try:
            failure = run_case(case)
        except UnknownHarness as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if failure is None:
            passed += 1
            print(f"PASS {case['name']}")
        else:
            failed += 1
            print(f"FAIL {case['name']}: {failure}")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

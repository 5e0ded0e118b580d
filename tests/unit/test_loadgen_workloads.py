"""Seeded workload generators: lengths, sharing structure, conversation links, ShareGPT parsing."""

from __future__ import annotations

import json
import statistics

import pytest

from cluster.loadgen.workloads import (
    BenchRequest,
    SharegptPair,
    WorkloadConfig,
    WorkloadError,
    WorkloadKind,
    build_workload,
    load_sharegpt,
    lognormal_length,
    parse_sharegpt,
)


def test_fixed_lengths_range_and_seed() -> None:
    config = WorkloadConfig(kind=WorkloadKind.FIXED, num_requests=10, input_len=37, output_len=5, token_range=(40, 50))
    requests = build_workload(config, seed=3)
    assert [r.index for r in requests] == list(range(10))
    assert all(len(r.prompt) == 37 and r.max_tokens == 5 for r in requests)
    assert all(40 <= t < 50 for r in requests for t in r.prompt)
    assert build_workload(config, seed=3) == requests
    assert build_workload(config, seed=4) != requests
    assert len({r.prompt for r in requests}) == 10


def test_lognormal_mean_and_clamps() -> None:
    config = WorkloadConfig(kind=WorkloadKind.LOGNORMAL, num_requests=3000, input_len=100, output_len=20,
                            lognormal_sigma=0.5, max_input_len=400, max_output_len=60)
    requests = build_workload(config, seed=1)
    inputs = [len(r.prompt) for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert 1 <= min(inputs) and max(inputs) <= 400 and max(outputs) <= 60
    # Mean stays at the configured length (mu = ln(mean) - sigma^2/2); clamping trims a little.
    assert statistics.mean(inputs) == pytest.approx(100, rel=0.05)
    assert statistics.mean(outputs) == pytest.approx(20, rel=0.06)
    assert len(set(inputs)) > 50  # really spread, not fixed


def test_lognormal_length_clamps_to_one() -> None:
    import random

    rng = random.Random(0)
    assert all(1 <= lognormal_length(rng, 1, 3.0, 5) <= 5 for _ in range(500))


def test_shared_prefix_groups_share_exactly_their_prefix() -> None:
    config = WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, num_prefixes=3, suffixes_per_prefix=5, prefix_len=32, input_len=8)
    requests = build_workload(config, seed=0)
    assert config.total_requests == 15 and len(requests) == 15
    groups: dict[int, list[BenchRequest]] = {}
    for r in requests:
        assert len(r.prompt) == 40
        groups.setdefault(r.group, []).append(r)
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 5 for g in groups.values())
    prefixes = {g: {r.prompt[:32] for r in members} for g, members in groups.items()}
    assert all(len(p) == 1 for p in prefixes.values())
    assert len({next(iter(p)) for p in prefixes.values()}) == 3
    assert all(len({r.prompt[32:] for r in members}) == 5 for members in groups.values())
    # Shuffled: not grouped, not in strict rotation.
    order = [r.group for r in requests]
    assert order != sorted(order) and order != [i % 3 for i in range(15)]


def test_multi_turn_links_each_turn_to_the_previous_one() -> None:
    config = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, num_requests=10, turns=3, input_len=6, output_len=4)
    requests = build_workload(config, seed=0)
    assert len(requests) == 10
    by_index = {r.index: r for r in requests}
    per_conversation: dict[int, list[BenchRequest]] = {}
    for r in requests:
        per_conversation.setdefault(r.conversation, []).append(r)
        if r.turn == 0:
            assert r.after is None
        else:
            previous = by_index[r.after]
            assert previous.conversation == r.conversation and previous.turn == r.turn - 1
            assert previous.index < r.index
    # ceil(10 / 3) = 4 conversations; the last one is cut to 1 turn so that exactly 10 are sent.
    assert sorted(len(turns) for turns in per_conversation.values()) == [1, 3, 3, 3]
    # Turn-major order: all first turns come before any second turn.
    assert [r.turn for r in requests] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_multi_turn_shuffles_conversations_within_each_turn() -> None:
    # A fixed rotation would let round robin over 2 instances keep every conversation in place.
    config = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, num_requests=32, turns=4, input_len=4, output_len=2)
    requests = build_workload(config, seed=0)
    waves = [[r.conversation for r in requests if r.turn == turn] for turn in range(4)]
    assert all(sorted(wave) == list(range(8)) for wave in waves)
    assert len({tuple(wave) for wave in waves}) > 1
    assert waves[0] != list(range(8))


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "What is a KV cache, in short?"},
                                   {"from": "gpt", "value": "The keys and values of past tokens, kept for reuse." * 2}]},
    {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there, friend"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "Explain paged attention to me please."},
                                   {"from": "gpt", "value": "Blocks of KV indexed by a table." * 3}, {"from": "human", "value": "more"}]},
]


def test_parse_sharegpt_takes_the_first_two_turns() -> None:
    pairs = parse_sharegpt(SHAREGPT)
    assert len(pairs) == 3  # "b" has a single turn
    assert pairs[0] == SharegptPair(SHAREGPT[0]["conversations"][0]["value"], SHAREGPT[0]["conversations"][1]["value"])


def test_sharegpt_filters_and_estimates_lengths(tmp_path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    dataset = load_sharegpt(path)
    config = WorkloadConfig(kind=WorkloadKind.SHAREGPT, dataset_path=str(path), num_requests=2, sharegpt_bytes_per_token=1.0)
    requests = build_workload(config, seed=0, dataset=dataset)
    # "c" ("hi", 2 bytes) is below the 4-token minimum; the other two remain.
    prompts = {r.prompt for r in requests}
    assert prompts == {SHAREGPT[0]["conversations"][0]["value"], SHAREGPT[3]["conversations"][0]["value"]}
    for r in requests:
        reply = next(p.completion for p in dataset if p.prompt == r.prompt)
        assert r.max_tokens == len(reply.encode())
        assert r.new_prompt_tokens is None  # text: the server tokenizes it


def test_sharegpt_reuses_entries_when_asked_for_more(caplog) -> None:
    config = WorkloadConfig(kind=WorkloadKind.SHAREGPT, dataset_path="x", num_requests=5, sharegpt_bytes_per_token=1.0)
    requests = build_workload(config, seed=0, dataset=parse_sharegpt(SHAREGPT))
    assert len(requests) == 5 and len({r.prompt for r in requests}) == 2
    assert "more than once" in caplog.text


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"not": "a list"}, "dataset"),
        ([{"conversations": "nope"}], "dataset[0]"),
        ([{"conversations": [{"from": "human", "value": 3}, {"value": "x"}]}], "dataset[0].conversations[0]"),
    ],
)
def test_bad_sharegpt_names_the_offending_entry(data, field) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_sharegpt(data)
    assert info.value.field == field


def test_unreadable_dataset_is_a_workload_error(tmp_path) -> None:
    with pytest.raises(WorkloadError, match="cannot read"):
        load_sharegpt(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(WorkloadError, match="not JSON"):
        load_sharegpt(bad)


def test_sharegpt_needs_a_dataset() -> None:
    with pytest.raises(WorkloadError) as info:
        WorkloadConfig(kind=WorkloadKind.SHAREGPT)
    assert info.value.field == "dataset_path"
    config = WorkloadConfig(kind=WorkloadKind.SHAREGPT, dataset_path="x")
    with pytest.raises(WorkloadError):
        build_workload(config, seed=0)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"input_len": 0}, "input_len"),
        ({"num_requests": True}, "num_requests"),
        ({"lognormal_sigma": float("nan")}, "lognormal_sigma"),
        ({"token_range": (5, 5)}, "token_range"),
        ({"turns": -1}, "turns"),
    ],
)
def test_config_validation_names_the_field(overrides, field) -> None:
    with pytest.raises(WorkloadError) as info:
        WorkloadConfig(**overrides)
    assert info.value.field == field

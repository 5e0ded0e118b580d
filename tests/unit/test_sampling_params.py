"""SamplingParams: vLLM defaults, every validation rule, transport."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import msgpack
import pytest

from worker.sampling import MAX_STOP_STRINGS, InvalidSamplingParams, SamplingParams


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert p.top_k == -1
    assert p.top_p == 1.0
    assert p.min_p == 0.0
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.seed is None
    assert p.stop == ()
    assert p.stop_token_ids == ()
    assert p.ignore_eos is False
    assert p.include_stop_str_in_output is False
    assert p.logprobs is None
    assert p.min_tokens == 0
    assert p.skip_special_tokens is True
    assert not p.greedy
    assert not p.has_penalties
    assert p.effective_top_k is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", "3"),
        ("max_tokens", None),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", True),
        ("temperature", "1"),
        ("top_k", -2),
        ("top_k", 1.0),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", float("nan")),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.01),
        ("presence_penalty", False),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", float("-inf")),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("seed", True),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", ""]),
        ("stop", [1]),
        ("stop", 5),
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
        ("stop", ["x" * 10_000]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 5),
        ("stop_token_ids", "abc"),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("include_stop_str_in_output", 0),
        ("skip_special_tokens", None),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("logprobs", True),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("min_tokens", True),
    ],
)
def test_invalid_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 0},
        {"temperature": 100.0},
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"min_tokens": 16},
        {"max_tokens": 1, "min_tokens": 1},
        {"stop": ["x"] * MAX_STOP_STRINGS},
    ],
)
def test_boundary_values_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_numbers_normalised_to_float() -> None:
    p = SamplingParams(temperature=2, top_p=1, presence_penalty=1)
    assert type(p.temperature) is float and p.temperature == 2.0
    assert type(p.top_p) is float
    assert type(p.presence_penalty) is float


def test_tiny_temperature_raised_like_vllm(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.sampling"):
        p = SamplingParams(temperature=1e-4)
    assert p.temperature == 1e-2
    assert "temperature" in caplog.text


def test_stop_normalised_to_tuples() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()  # type: ignore[arg-type]
    # Hashable and comparable once normalised.
    assert SamplingParams(stop=["a"]) == SamplingParams(stop=("a",))
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop="a"))


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_derived_properties() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(top_k=0).effective_top_k is None
    assert SamplingParams(top_k=5).effective_top_k == 5
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


def test_validate_against_vocab() -> None:
    p = SamplingParams(stop_token_ids=[2, 4])
    p.validate_against(5)
    with pytest.raises(InvalidSamplingParams) as info:
        p.validate_against(4)
    assert info.value.field == "stop_token_ids"
    with pytest.raises(ValueError):
        p.validate_against(0)


def test_with_seed_returns_validated_copy() -> None:
    p = SamplingParams(temperature=0.7, stop="x")
    q = p.with_seed(42)
    assert q.seed == 42 and p.seed is None
    assert dataclasses.replace(q, seed=None) == p
    with pytest.raises(InvalidSamplingParams) as info:
        p.with_seed(-5)
    assert info.value.field == "seed"


def test_dict_round_trip_through_msgpack() -> None:
    p = SamplingParams(
        max_tokens=64,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=2**63 - 1,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 9],
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=5,
        min_tokens=3,
        skip_special_tokens=False,
    )
    d = p.to_dict()
    assert all(not isinstance(v, tuple) for v in d.values())
    assert SamplingParams.from_dict(d) == p
    wire = msgpack.packb(d)
    assert SamplingParams.from_dict(msgpack.unpackb(wire)) == p
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_rejects_unknown_and_bad() -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    assert info.value.field == "best_of"
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams.from_dict({"top_p": 2.0})
    assert info.value.field == "top_p"
    with pytest.raises(InvalidSamplingParams):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]


def test_module_does_not_import_torch() -> None:
    code = "import sys, worker.sampling; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr

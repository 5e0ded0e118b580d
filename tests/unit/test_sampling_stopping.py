"""StopChecker: EOS, stop ids, stop strings across tokens, min/max tokens, withheld streaming text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.sampling import SamplingParams
from worker.stopping import FinishReason, StopChecker, StopCheckerError, StopStep

EOS = 2


def feed(checker: StopChecker, steps: list[tuple[int, str]]) -> tuple[str, list[StopStep]]:
    streamed = ""
    results = []
    for token_id, delta in steps:
        step = checker.append(token_id, delta)
        streamed += step.text_delta
        results.append(step)
        if step.finished:
            break
    return streamed, results


def test_eos_stops_and_its_text_is_dropped() -> None:
    checker = StopChecker(SamplingParams(max_tokens=10), eos_token_ids=(EOS,))
    streamed, steps = feed(checker, [(10, "Hi"), (11, " there"), (EOS, "</s>"), (12, "never")])
    assert len(steps) == 3
    assert steps[-1].finish_reason is FinishReason.STOP
    assert steps[-1].stop_reason is None  # vLLM reports EOS without a stop_reason
    assert checker.text == streamed == "Hi there"


def test_eos_text_kept_with_include_stop_str() -> None:
    checker = StopChecker(SamplingParams(include_stop_str_in_output=True), eos_token_ids=(EOS,))
    streamed, _ = feed(checker, [(10, "Hi"), (EOS, "</s>")])
    assert streamed == checker.text == "Hi</s>"


def test_ignore_eos_runs_to_length() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=(EOS,))
    streamed, steps = feed(checker, [(EOS, ""), (EOS, ""), (EOS, "")])
    assert [s.finish_reason for s in steps] == [None, None, FinishReason.LENGTH]
    assert checker.num_output_tokens == 3


def test_stop_token_id_reports_the_id() -> None:
    checker = StopChecker(SamplingParams(stop_token_ids=[7, 8]), eos_token_ids=(EOS,))
    streamed, steps = feed(checker, [(10, "a"), (8, "<stop>")])
    assert steps[-1].finish_reason is FinishReason.STOP
    assert steps[-1].stop_reason == 8
    assert checker.stop_reason == 8 and checker.finish_reason is FinishReason.STOP
    assert streamed == "a"


def test_stop_string_spanning_tokens() -> None:
    checker = StopChecker(SamplingParams(stop=["STOP"]))
    streamed, steps = feed(checker, [(1, "Hel"), (2, "lo ST"), (3, "OP now"), (4, "more")])
    assert len(steps) == 3
    assert steps[-1].finish_reason is FinishReason.STOP
    assert steps[-1].stop_reason == "STOP"
    assert checker.text == streamed == "Hello "


def test_stop_string_included_when_asked() -> None:
    checker = StopChecker(SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    streamed, _ = feed(checker, [(1, "Hel"), (2, "lo ST"), (3, "OP now")])
    assert checker.text == streamed == "Hello STOP"


def test_earliest_stop_string_wins() -> None:
    checker = StopChecker(SamplingParams(stop=["zz", "b"]))
    streamed, steps = feed(checker, [(1, "a"), (2, "zzb")])
    # Both complete in the same step; "zz" comes first in the text.
    assert steps[-1].stop_reason == "zz"
    assert streamed == "a"
    checker = StopChecker(SamplingParams(stop=["abcd", "c"]))
    streamed, steps = feed(checker, [(1, "abc"), (2, "d")])
    # "c" completes first, although "abcd" starts earlier.
    assert steps[-1].stop_reason == "c" and streamed == "ab"


def test_stop_string_not_searched_in_old_text() -> None:
    # The stop string only appears during min_tokens; later steps do not rediscover it.
    checker = StopChecker(SamplingParams(stop=["X"], min_tokens=1, max_tokens=5))
    streamed, steps = feed(checker, [(1, "aXb"), (2, "cd"), (3, "e")])
    assert all(not s.finished for s in steps)
    assert checker.text == "aXbcde"


def test_min_tokens_defers_every_stop() -> None:
    params = SamplingParams(stop=["!"], stop_token_ids=[9], min_tokens=3, max_tokens=10)
    checker = StopChecker(params, eos_token_ids=(EOS,))
    streamed, steps = feed(checker, [(EOS, ""), (9, "x"), (5, "!"), (EOS, "")])
    assert [s.finished for s in steps] == [False, False, False, True]
    assert steps[-1].finish_reason is FinishReason.STOP
    assert checker.text == streamed == "x!"


def test_max_tokens_length_and_stop_precedence() -> None:
    checker = StopChecker(SamplingParams(max_tokens=2), eos_token_ids=(EOS,))
    streamed, steps = feed(checker, [(5, "a"), (6, "b")])
    assert steps[-1].finish_reason is FinishReason.LENGTH and steps[-1].stop_reason is None
    assert streamed == "ab"
    checker = StopChecker(SamplingParams(max_tokens=2), eos_token_ids=(EOS,))
    _, steps = feed(checker, [(5, "a"), (EOS, "")])
    assert steps[-1].finish_reason is FinishReason.STOP  # a stop on the last token is a stop
    checker = StopChecker(SamplingParams(max_tokens=2, stop=["b"]), eos_token_ids=(EOS,))
    _, steps = feed(checker, [(5, "a"), (6, "b")])
    assert steps[-1].finish_reason is FinishReason.STOP and steps[-1].stop_reason == "b"


def test_max_model_len_is_length() -> None:
    checker = StopChecker(SamplingParams(max_tokens=100), prompt_len=6, max_model_len=8)
    _, steps = feed(checker, [(5, "a"), (6, "b"), (7, "c")])
    assert len(steps) == 2 and steps[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError):
        StopChecker(SamplingParams(), prompt_len=8, max_model_len=8)


def test_withheld_text_could_become_a_stop_string() -> None:
    checker = StopChecker(SamplingParams(stop=["STOP", "no"], max_tokens=10))
    step = checker.append(1, "abcdef")
    assert step.text_delta == "abc"  # last len("STOP")-1 = 3 chars withheld
    assert checker.withheld_text == "def"
    step = checker.append(2, "S")
    assert step.text_delta == "d" and checker.withheld_text == "efS"
    step = checker.append(3, "T")
    assert step.text_delta == "e" and checker.withheld_text == "fST"
    step = checker.append(4, "x")  # "STx" is no stop: everything up to the last 3 goes out
    assert step.text_delta == "f" and checker.withheld_text == "STx"
    step = checker.append(5, "y")
    assert step.text_delta == "S"


def test_withheld_text_released_on_length() -> None:
    checker = StopChecker(SamplingParams(stop=["STOP"], max_tokens=2))
    assert checker.append(1, "abcdef").text_delta == "abc"
    step = checker.append(2, "ST")
    assert step.finish_reason is FinishReason.LENGTH
    assert step.text_delta == "defST" and checker.withheld_text == ""


def test_nothing_withheld_without_stop_strings_or_when_included() -> None:
    assert StopChecker(SamplingParams()).append(1, "abcdef").text_delta == "abcdef"
    included = SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    assert StopChecker(included).append(1, "abcdef").text_delta == "abcdef"


def test_misuse_is_loud() -> None:
    checker = StopChecker(SamplingParams(max_tokens=1))
    with pytest.raises(StopCheckerError):
        checker.flush("x")
    checker.append(1, "a")
    with pytest.raises(StopCheckerError):
        checker.append(2, "b")


def test_flush_after_finish() -> None:
    checker = StopChecker(SamplingParams(max_tokens=1))
    checker.append(1, "a")
    assert checker.flush("\ufffd") == "\ufffd"
    assert checker.text == "a\ufffd"
    stopped = StopChecker(SamplingParams(stop=["b"]))
    stopped.append(1, "abc")
    assert stopped.flush("\ufffd") == "" and stopped.text == "a"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="abcXY!", max_size=40),
    cuts=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=40),
    stops=st.lists(st.text(alphabet="abXY!", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streamed_text_is_final_text_and_never_contains_a_stop(
    text: str, cuts: list[int], stops: list[str], include: bool
) -> None:
    chunks = []
    rest = text
    for n in cuts:
        if not rest:
            break
        chunks.append(rest[:n])
        rest = rest[n:]
    if rest:
        chunks.append(rest)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=max(1, len(chunks)))
    checker = StopChecker(params)
    streamed, steps = feed(checker, [(100 + i, c) for i, c in enumerate(chunks)])
    assert streamed == checker.text
    if not chunks:
        return
    last = steps[-1]
    assert last.finished
    if last.finish_reason is FinishReason.STOP:
        stop = last.stop_reason
        assert isinstance(stop, str) and stop in stops
        if include:
            assert checker.text.endswith(stop)
            assert text.startswith(checker.text)
            body = checker.text[: -len(stop)]
        else:
            assert text.startswith(checker.text + stop)
            body = checker.text
        assert not any(s in body for s in stops)
    else:
        assert last.finish_reason is FinishReason.LENGTH
        assert checker.text == text
        assert not any(s in text for s in stops)

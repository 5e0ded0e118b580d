"""IncrementalDetokenizer: never a broken UTF-8 character; deltas concatenate to decode()."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.detokenizer import DetokenizerError, DetokenizeStrategy, IncrementalDetokenizer

REPLACEMENT = "\ufffd"
STRATEGIES = [DetokenizeStrategy.BYTES, DetokenizeStrategy.OFFSETS]


class ByteTok:
    """256 byte tokens, then <bos> and <eos>. Decodes as Hugging Face's byte-level decoders do:
    skipped specials vanish before the bytes are joined; kept ones join as their text's bytes."""

    BOS = 256
    EOS = 257
    SPECIAL_TEXT = {BOS: "<bos>", EOS: "<eos>"}
    vocab_size = 258
    eos_token_ids = (EOS,)
    bos_token_id = BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i in self.SPECIAL_TEXT:
                if not skip_special_tokens:
                    out += self.SPECIAL_TEXT[i].encode()
            else:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def id_to_bytes(self, token_id: int) -> bytes | None:
        return None if token_id in self.SPECIAL_TEXT else bytes([token_id])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "中文字符测试，中国人民，中文中文世界上下",
    "日本語のテキストです。こんにちは世界",
    "emoji 😀😃😄 🎉🎉 party 👍🏽 ok",
    "café naïve résumé über straße",
] * 20


class BpeTok:
    """A real `tokenizers` byte-level BPE trained here on a tiny corpus: merges form tokens that
    hold parts of CJK characters and emoji (e.g. 'ĠðŁ' = space + two of an emoji's four bytes)."""

    def __init__(self) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=420,
            special_tokens=["<bos>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(CORPUS, trainer)
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.bos_token_id = tok.token_to_id("<bos>")
        self.eos_token_ids = (tok.token_to_id("<eos>"),)
        self._special = {self.bos_token_id, *self.eos_token_ids}
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self._bytes = {
            i: bytes(byte_of[c] for c in tok.id_to_token(i)) for i in range(self.vocab_size) if i not in self._special
        }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_bytes(self, token_id: int) -> bytes | None:
        return self._bytes.get(token_id)


class NoBytesTok:
    """A duck-typed tokenizer without id_to_bytes: AUTO must fall back to OFFSETS."""

    def __init__(self, inner: BpeTok) -> None:
        self._inner = inner

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._inner.decode(ids, skip_special_tokens)


@lru_cache(maxsize=1)
def bpe() -> BpeTok:
    return BpeTok()


def run(tok, ids: Sequence[int], strategy=DetokenizeStrategy.AUTO, prompt=(), skip=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, strategy=strategy)
    deltas = [detok.append(i) for i in ids]
    tail = detok.finish()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


TEXTS = ["中文世界 😀 café", "龍🦄 and 👍🏽!", "日本語のテキスト", "plain ascii", "é", ""]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_byte_tokens_never_split_a_character(text: str, strategy: DetokenizeStrategy) -> None:
    tok = ByteTok()
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = run(tok, ids, strategy)
    assert "".join(deltas) == text and tail == ""
    assert all(REPLACEMENT not in d for d in deltas)
    if strategy is DetokenizeStrategy.BYTES:
        # Each character appears exactly when its last byte arrives.
        expected = []
        for ch in text:
            n = len(ch.encode())
            expected += [""] * (n - 1) + [ch]
        assert deltas == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bpe_tokens_never_split_a_character(text: str, strategy: DetokenizeStrategy) -> None:
    tok = bpe()
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = run(tok, ids, strategy)
    assert "".join(deltas) == tok.decode(ids) == text and tail == ""
    assert all(REPLACEMENT not in d for d in deltas)


def test_bpe_really_splits_characters_across_tokens() -> None:
    tok = bpe()
    ids = tok.encode("中文世界 😀", add_special_tokens=False)
    pieces = [tok.id_to_bytes(i) for i in ids]
    assert any(p is not None and _incomplete(p) for p in pieces)
    deltas, _ = run(tok, ids, DetokenizeStrategy.BYTES)
    assert "" in deltas  # some token completed no character


def _incomplete(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prompt_context(strategy: DetokenizeStrategy) -> None:
    tok = bpe()
    prompt = tok.encode("the quick brown fox", add_special_tokens=False)
    ids = tok.encode(" jumps 中文 😀", add_special_tokens=False)
    deltas, tail = run(tok, ids, strategy, prompt=prompt)
    assert "".join(deltas) + tail == " jumps 中文 😀"


@pytest.mark.parametrize("tok", [ByteTok(), bpe()], ids=["bytes", "bpe"])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_special_token_inside_a_character_matches_decode(tok, skip: bool, strategy: DetokenizeStrategy) -> None:
    raw = "中".encode()
    eos = tok.eos_token_ids[0]
    if isinstance(tok, ByteTok):
        ids = [raw[0], eos, raw[1], raw[2], ord("a")]
    else:
        by_bytes = {tok.id_to_bytes(i): i for i in range(tok.vocab_size)}
        ids = [by_bytes[raw[:1]], eos, by_bytes[raw[1:2]], by_bytes[raw[2:]], by_bytes[b"a"]]
    deltas, tail = run(tok, ids, strategy, skip=skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert ("中a" if skip else f"{REPLACEMENT}<eos>{REPLACEMENT}{REPLACEMENT}a") == tok.decode(ids, skip)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_finish_flushes_incomplete_bytes_like_decode(strategy: DetokenizeStrategy) -> None:
    tok = ByteTok()
    ids = list("ok😀".encode())[:-1]
    detok = IncrementalDetokenizer(tok, (), strategy=strategy)
    assert "".join(detok.append(i) for i in ids) == "ok"
    assert detok.finish() == tok.decode(ids)[2:] == REPLACEMENT
    assert detok.finish() == ""
    with pytest.raises(DetokenizerError):
        detok.append(65)


def test_auto_strategy() -> None:
    assert IncrementalDetokenizer(ByteTok()).strategy is DetokenizeStrategy.BYTES
    no_bytes = NoBytesTok(bpe())
    detok = IncrementalDetokenizer(no_bytes)
    assert detok.strategy is DetokenizeStrategy.OFFSETS
    ids = bpe().encode("中文 😀", add_special_tokens=False)
    assert "".join(detok.append(i) for i in ids) + detok.finish() == "中文 😀"


TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40) | st.text(
    alphabet="中文世界日本語😀🦄👍🏽éa ", max_size=30
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=TEXT, strategy=st.sampled_from(STRATEGIES), use_bpe=st.booleans())
def test_property_random_text(text: str, strategy: DetokenizeStrategy, use_bpe: bool) -> None:
    tok = bpe() if use_bpe else ByteTok()
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = run(tok, ids, strategy)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    if REPLACEMENT not in text:
        assert all(REPLACEMENT not in d for d in deltas + [tail])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data(), skip=st.booleans(), strategy=st.sampled_from(STRATEGIES), use_bpe=st.booleans())
def test_property_random_ids_match_decode(data, skip: bool, strategy: DetokenizeStrategy, use_bpe: bool) -> None:
    # Arbitrary ids, invalid UTF-8 and specials included: the same text as decode, replacement
    # characters and all.
    tok = bpe() if use_bpe else ByteTok()
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=tok.vocab_size - 1), max_size=25))
    deltas, tail = run(tok, ids, strategy, skip=skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_with_stop_checker_as_the_engine_uses_them() -> None:
    from worker.sampling import SamplingParams
    from worker.stopping import FinishReason, StopChecker

    tok = ByteTok()
    # A stop string made of multi-byte characters, arriving one byte per token.
    ids = list("日本 😀終わり rest".encode())
    detok = IncrementalDetokenizer(tok)
    checker = StopChecker(SamplingParams(stop=["終わ"], max_tokens=100), tok.eos_token_ids)
    streamed = ""
    for token_id in ids:
        step = checker.append(token_id, detok.append(token_id))
        streamed += step.text_delta
        if step.finished:
            streamed += checker.flush(detok.finish())
            break
    assert checker.finish_reason is FinishReason.STOP and checker.stop_reason == "終わ"
    assert streamed == checker.text == "日本 😀"

    # EOS right after half a character: the dangling bytes flush as U+FFFD, as decode renders them.
    ids = [*b"ok", *"😀".encode()[:2], ByteTok.EOS]
    detok = IncrementalDetokenizer(tok)
    checker = StopChecker(SamplingParams(), tok.eos_token_ids)
    streamed = ""
    for token_id in ids:
        step = checker.append(token_id, detok.append(token_id))
        streamed += step.text_delta
    assert step.finish_reason is FinishReason.STOP
    streamed += checker.flush(detok.finish())
    assert streamed == tok.decode(ids) == "ok" + REPLACEMENT

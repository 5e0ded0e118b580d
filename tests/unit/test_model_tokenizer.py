"""HfTokenizer over tokenizer.json files built in code (byte-level BPE, SentencePiece-style byte
fallback), chat templates, and load_model's tokenizer wiring."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from worker.default_model import build_random_model, default_model_config
from worker.loader import CheckpointError, load_model
from worker.tokenizer import ChatTemplateError, HfTokenizer, TokenizerError
from worker.tokenizer import Tokenizer as TokenizerProtocol

CORPUS = ["hello world", "the quick brown fox jumps", "héllo wörld ünïcode", "你好世界", "emoji 🙂 ok"] * 20
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def byte_level_dir(directory: Path, *, template: str | None = LLAMA3_STYLE_TEMPLATE) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|bos|>", "<|eos|>", "<|start|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens(["<think>"])  # an added, non-special token
    bos = tokenizer.token_to_id("<|bos|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": {"content": "<|end|>"}}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def sentencepiece_dir(directory: Path) -> Path:
    """A Llama-2-style tokenizer: ▁ for spaces, <0xNN> byte-fallback pieces, Strip of the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "he", "ll", "\u2581he", "llo", "\u2581hello"]:
        vocab[piece] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("\u2581", "he"), ("ll", "o"), ("\u2581he", "llo")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (directory / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    return directory


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return HfTokenizer.from_directory(byte_level_dir(tmp_path_factory.mktemp("bl")), extra_eos_token_ids=(1,))


def test_protocol_conformance(byte_level):
    assert isinstance(byte_level, TokenizerProtocol)
    assert byte_level.exact_token_bytes


def test_special_ids_and_encoding(byte_level):
    bos = byte_level.bos_token_id
    assert bos == 0
    assert byte_level.eos_token_ids == (3, 1)  # tokenizer_config's eos first, then generation's
    ids = byte_level.encode("hello world")
    assert ids[0] == bos
    assert byte_level.encode("hello world", add_special_tokens=False) == ids[1:]
    assert byte_level.decode(ids) == "hello world"
    assert byte_level.decode(ids, skip_special_tokens=False) == "<|bos|>hello world"


@settings(max_examples=60)
@given(st.text(max_size=40))
def test_byte_level_bytes_concatenate_to_the_text(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assert byte_level.decode(ids) == text
    assert b"".join(byte_level.id_to_bytes(i) for i in ids) == text.encode("utf-8")


def test_byte_level_id_to_bytes_details(byte_level):
    assert byte_level.id_to_bytes(byte_level.bos_token_id) is None
    think = byte_level.encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and byte_level.id_to_bytes(think[0]) == b"<think>"
    emoji = byte_level.encode("🙂", add_special_tokens=False)
    assert b"".join(byte_level.id_to_bytes(i) for i in emoji) == "🙂".encode()
    with pytest.raises(TokenizerError):
        byte_level.id_to_bytes(byte_level.vocab_size)
    with pytest.raises(TokenizerError):
        byte_level.decode([-1])


def test_chat_template_renders_in_a_sandbox(byte_level):
    text = byte_level.apply_chat_template([{"role": "user", "content": " hi "}])
    assert text == "<|bos|><|start|>user\nhi<|end|>\n<|start|>assistant\n"
    assert not byte_level.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "assistant\n"
    )
    with pytest.raises(ChatTemplateError):
        byte_level.apply_chat_template([{"role": "user", "content": 3}])


def test_hostile_template_is_refused(tmp_path):
    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = HfTokenizer.from_directory(byte_level_dir(tmp_path, template=hostile))
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_raise_exception_becomes_typed(tmp_path):
    template = "{{ raise_exception('roles must alternate') }}"
    tokenizer = HfTokenizer.from_directory(byte_level_dir(tmp_path, template=template))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_a_typed_error(tmp_path):
    tokenizer = HfTokenizer.from_directory(byte_level_dir(tmp_path, template=None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_sentencepiece_style_byte_fallback(tmp_path):
    tokenizer = HfTokenizer.from_directory(sentencepiece_dir(tmp_path))
    assert not tokenizer.exact_token_bytes  # decode strips the leading space
    ids = tokenizer.encode("hello 你", add_special_tokens=False)
    assert ids[0] == tokenizer.encode("hello", add_special_tokens=False)[0]  # "▁hello" is one piece
    assert tokenizer.decode(ids) == "hello 你"
    joined = b"".join(tokenizer.id_to_bytes(i) for i in ids)
    assert joined == " hello 你".encode()  # the piece bytes keep SentencePiece's leading space
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"  # chat_template.jinja


def test_missing_or_broken_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        HfTokenizer.from_directory(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        HfTokenizer.from_directory(tmp_path)


def test_unknown_special_token_in_config(tmp_path):
    directory = byte_level_dir(tmp_path)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match="eos_token"):
        HfTokenizer.from_directory(directory)


def test_load_model_wires_tokenizer_and_generation_config(tmp_path):
    directory = byte_level_dir(tmp_path)
    config = replace(default_model_config(), vocab_size=400)
    model = build_random_model(config, 0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_hf_config()))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    with torch.inference_mode():
        loaded, tokenizer, generation = load_model(directory, "float32", "cpu")
    assert generation.eos_token_ids == (1, 2)
    assert set(tokenizer.eos_token_ids) == {3, 1, 2, *config.eos_token_ids}
    assert loaded.fingerprint() == model.fingerprint()


def test_load_model_rejects_a_tokenizer_larger_than_the_model(tmp_path):
    directory = byte_level_dir(tmp_path)
    config = default_model_config()
    small = replace(config, vocab_size=300, bos_token_id=None, eos_token_ids=())
    model = build_random_model(small, 0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(small.to_hf_config()))
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_model(directory, "float32", "cpu")

"""Tokenizers: the protocol the engine and the detokenizer use, the embedded byte tokenizer, and a
wrapper around Hugging Face's tokenizer.json (`tokenizers` library).

Chat templates of HF checkpoints are Jinja templates; they are rendered in jinja2's immutable
sandbox (never a plain Environment: a checkpoint's template is untrusted input). Text produced by a
chat template usually already starts with the BOS token, so encode it with add_special_tokens=False.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

ChatMessages = Sequence[Mapping[str, Any]]


class TokenizerError(ValueError):
    """A tokenizer could not be built or used (bad files, unknown ids, ...)."""


class ChatTemplateError(TokenizerError):
    """The tokenizer has no chat template, or the template failed to render."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # True when decode(ids) is exactly the UTF-8 decoding of the concatenated id_to_bytes of the
    # non-special ids (byte tokenizer, byte-level BPE); False when decoding also rewrites text
    # (SentencePiece's leading-space strip) or bytes are unknown. Incremental detokenizers use it to
    # choose between byte-wise and offset-based strategies.
    exact_token_bytes: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_bytes(self, token_id: int) -> bytes | None:
        """Raw bytes of a token when known (None for special tokens or unknown encodings)."""
        ...

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> str: ...


def _validate_messages(messages: ChatMessages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a sequence of mappings, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ChatTemplateError(f"messages[{index}].{key} must be a string, got {message.get(key)!r}")


class ByteTokenizer:
    """The embedded tokenizer: ids 0..255 are bytes, then BOS, EOS, PAD and reserved specials.

    The vocabulary is padded with reserved specials to a multiple of 8 so that the model's vocab and
    the tokenizer's agree (a model can emit every id it has; each must decode to something).
    Specials are never produced by `encode` from text: user text cannot inject an EOS.
    """

    NUM_BYTES = 256
    BOS_ID = 256
    EOS_ID = 257
    PAD_ID = 258
    VOCAB_SIZE = 264

    def __init__(self) -> None:
        self.vocab_size = self.VOCAB_SIZE
        self.exact_token_bytes = True
        self.eos_token_ids = (self.EOS_ID,)
        self.bos_token_id: int | None = self.BOS_ID
        self.pad_token_id = self.PAD_ID
        names = {self.BOS_ID: "<|bos|>", self.EOS_ID: "<|eos|>", self.PAD_ID: "<|pad|>"}
        for offset, token_id in enumerate(range(self.PAD_ID + 1, self.VOCAB_SIZE)):
            names[token_id] = f"<|reserved_{offset}|>"
        self._special_names = names

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self._special_names)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token_id in ids:
            self._check_id(token_id)
            if token_id < self.NUM_BYTES:
                pending.append(token_id)
                continue
            if skip_special_tokens:
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(self._special_names[token_id])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def id_to_bytes(self, token_id: int) -> bytes | None:
        self._check_id(token_id)
        return bytes([token_id]) if token_id < self.NUM_BYTES else None

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> str:
        """A minimal plain-text template ("role: content" lines) so the embedded model can chat."""
        _validate_messages(messages)
        text = "".join(f"{message['role']}: {message['content']}\n" for message in messages)
        return text + "assistant: " if add_generation_prompt else text

    def _check_id(self, token_id: int) -> None:
        if not isinstance(token_id, int) or not 0 <= token_id < self.VOCAB_SIZE:
            raise TokenizerError(f"token id {token_id!r} outside [0, {self.VOCAB_SIZE})")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HfTokenizer:
    """A Hugging Face tokenizer.json (plus tokenizer_config.json and chat template files when present)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        decoder_kind: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._bos_token = bos_token
        self.bos_token_id: int | None = self._token_id("bos_token", bos_token) if bos_token else None
        eos_ids = [self._token_id("eos_token", token) for token in eos_tokens]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_ids, *extra_eos_token_ids]))
        self._eos_token = eos_tokens[0] if eos_tokens else None
        self._chat_template = chat_template
        added_tokens = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(token_id for token_id, added in added_tokens.items() if added.special)
        # Added non-special tokens are stored as plain text, not in the model's byte encoding.
        self._added_text = {
            token_id: added.content for token_id, added in added_tokens.items() if not added.special
        }
        self._decoder_kind = decoder_kind
        self.exact_token_bytes = decoder_kind == "byte_level"
        self._byte_decoder = {char: byte for byte, char in _bytes_to_unicode().items()}

    @classmethod
    def from_directory(cls, path: str | Path, extra_eos_token_ids: Sequence[int] = ()) -> HfTokenizer:
        """Read tokenizer.json (required), tokenizer_config.json, chat_template.jinja/.json (optional)."""
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file} not found")
        try:
            text = tokenizer_file.read_text(encoding="utf-8")
            raw = json.loads(text)
            tokenizer = RustTokenizer.from_str(text)
        except Exception as error:  # the Rust side raises a bare Exception; re-raised typed, not swallowed
            raise TokenizerError(f"{tokenizer_file}: cannot load: {error}") from error
        config: Mapping[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = _read_json(config_file)
        eos = _token_text(config.get("eos_token"))
        return cls(
            tokenizer,
            bos_token=_token_text(config.get("bos_token")),
            eos_tokens=[eos] if eos else [],
            extra_eos_token_ids=extra_eos_token_ids,
            chat_template=_find_chat_template(directory, config),
            decoder_kind=_decoder_kind(raw.get("decoder")),
        )

    def _token_id(self, field: str, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{field} {token!r} is not in the vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        for token_id in ids:
            self._check_id(token_id)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_bytes(self, token_id: int) -> bytes | None:
        """Raw bytes for byte-level BPE and SentencePiece-style (▁ + <0xNN> byte fallback) vocabularies.

        SentencePiece pieces keep their leading space ("▁" -> b" "); the decoder's strip of the very
        first space is not applied here. None for special tokens and unknown decoder kinds.
        """
        self._check_id(token_id)
        if token_id in self._special_ids or self._decoder_kind is None:
            return None
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return None
        if self._decoder_kind == "byte_level":
            try:
                return bytes(self._byte_decoder[char] for char in piece)
            except KeyError:
                return None  # not a byte-level piece: unknown bytes
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True) -> str:
        if self._chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        _validate_messages(messages)
        return render_chat_template(
            self._chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token or "",
            eos_token=self._eos_token or "",
        )

    def _check_id(self, token_id: int) -> None:
        if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id!r} outside [0, {self.vocab_size})")


def _read_json(path: Path) -> Mapping[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerError(f"{path}: cannot read JSON: {error}") from error
    if not isinstance(value, Mapping):
        raise TokenizerError(f"{path}: expected a JSON object")
    return value


def _find_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template (a string, or a list of named ones: take "default"),
    else chat_template.jinja / chat_template.json as newer transformers save them."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        value = _read_json(json_file).get("chat_template")
        if isinstance(value, str):
            return value
    return None


def _decoder_kind(decoder: object) -> str | None:
    """How token strings map to bytes: "byte_level", "sentencepiece", or None (unknown)."""
    if not isinstance(decoder, Mapping):
        return None
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "byte_level"
    if kind == "Metaspace":
        return "sentencepiece"
    if kind == "Sequence":
        parts = [part.get("type") for part in decoder.get("decoders", []) if isinstance(part, Mapping)]
        if "ByteLevel" in parts:
            return "byte_level"
        if "ByteFallback" in parts or "Metaspace" in parts:
            return "sentencepiece"
    return None


def render_chat_template(
    template: str,
    messages: ChatMessages,
    *,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
) -> str:
    """Render an HF chat template as transformers does (sandboxed jinja2, trim/lstrip blocks)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ChatTemplateError("rendering a chat template needs jinja2, which is not installed") from error

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template raised: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        compiled = env.from_string(template)
        return compiled.render(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template failed to render: {error}") from error


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: ChatMessages,
    *,
    add_generation_prompt: bool = True,
    template: str | None = None,
) -> list[int]:
    """A conversation's prompt token ids: rendered with `template` when given (it overrides the
    tokenizer's own), else with the tokenizer's chat template (ChatTemplateError when it has none).

    Templates usually write the BOS token themselves, so the text is encoded without special tokens
    and the BOS is put first only when it is missing. Every front end and the offline API use this,
    so that one conversation is one prompt everywhere."""
    if template is not None:
        _validate_messages(messages)
        bos_id = tokenizer.bos_token_id
        eos_ids = tokenizer.eos_token_ids
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.decode([bos_id], skip_special_tokens=False) if bos_id is not None else "",
            eos_token=tokenizer.decode([eos_ids[0]], skip_special_tokens=False) if eos_ids else "",
        )
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids

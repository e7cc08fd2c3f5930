"""Tokenizer: tokenizer.json through `tokenizers`, chat templates, and streaming detokenization."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from .errors import UserError

# A newline between two non-space characters: GPT-2's and Llama 3's byte-level regexes both end a
# pre-token right after it (whitespace before it could join it into one pre-token, e.g. " \n").
_NEWLINE_THEN_TEXT = re.compile(r"(?<=\S)\n(?=\S)")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback vocabulary's single byte


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: the printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, ...) for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1)]
    printable += range(ord("\xae"), ord("\xff") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise UserError(f"no tokenizer.json in {model_dir}")
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise UserError(f"could not read {path}: {e}") from None
        config = read_tokenizer_config(model_dir)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template: str | None = read_chat_template(model_dir, config)
        spec = json.loads(self.backend.to_str())
        # Splitting a long text is exact only when pre-tokens never span a newline and nothing
        # is prepended to each piece: byte-level pre-tokenization with no normalizer, no prefix
        # space, and no added token that swallows the whitespace before it (lstrip).
        pre_tokenizer = json.dumps(spec.get("pre_tokenizer"))
        self._splittable = (
            spec.get("normalizer") is None
            and "ByteLevel" in pre_tokenizer
            and '"add_prefix_space": true' not in pre_tokenizer
            and not any(t.get("lstrip") for t in spec.get("added_tokens") or [])
        )

        decoder = json.dumps(spec.get("decoder"))
        self._byte_level, self._byte_fallback = '"ByteLevel"' in decoder, '"ByteFallback"' in decoder
        self._added = set(self.backend.get_added_tokens_decoder())

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, which need not be UTF-8 by themselves (a character's
        bytes may span tokens): a byte-level vocabulary spells each byte as one character, a
        byte-fallback one a lone byte as <0xNN>; other tokens (added ones, whole pieces of other
        vocabularies) are their decoded text."""
        piece = self.backend.id_to_token(token)
        if piece is not None and token not in self._added:
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            if self._byte_fallback and (byte := _BYTE_PIECE.fullmatch(piece)):
                return bytes([int(byte[1], 16)])
        return self.decode([token]).encode()

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """BOS (and anything else) is added exactly as the tokenizer's post-processor says."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_long(
        self, text: str, add_special_tokens: bool = True, piece_chars: int = 1 << 20
    ) -> list[int]:
        """Encode a long text (a 512k-token file) in pieces with the batch encoder, which runs in
        parallel threads. Pieces end after a newline between two non-space characters, where
        byte-level pre-tokenizers always end a pre-token, so the pieces' ids concatenate to the
        whole text's ids; special tokens (BOS, and EOS where a template appends it) are then
        added once, by the tokenizer's post-processor."""
        if len(text) <= piece_chars or not self._splittable:
            return self.encode(text, add_special_tokens)
        pieces, begin = [], 0
        while begin < len(text):
            cut = _NEWLINE_THEN_TEXT.search(text, begin + piece_chars)
            end = cut.end() if cut else len(text)
            pieces.append(text[begin:end])
            begin = end
        encodings = self.backend.encode_batch(pieces, add_special_tokens=False)
        if not add_special_tokens:
            return [i for enc in encodings for i in enc.ids]
        merged = Encoding.merge(encodings, growing_offsets=True)
        return self.backend.post_process(merged, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the checkpoint's chat template, ending with the assistant prompt."""
        if not self.chat_template:
            raise UserError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise UserError("messages must be a list of {'role': ..., 'content': ...} dicts")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise UserError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=True,
            )
        except jinja2.TemplateError as e:
            raise UserError(f"chat template failed to render: {e}") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template writes BOS itself: encoding it without special tokens avoids a double BOS
        # (what transformers' apply_chat_template does too).
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, never emitting a broken UTF-8 character.

    It decodes a short window of recent tokens twice (with and without the newest ones) and
    emits the difference once that text no longer ends in U+FFFD (an incomplete byte sequence);
    the window keeps tokenizers that strip a leading space from seeing a "first" token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens up to here have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        emitted = decode(self.ids[self.prefix_offset : self.read_offset])
        text = decode(self.ids[self.prefix_offset :])
        if len(text) > len(emitted) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(emitted) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (e.g. an incomplete character)."""
        emitted = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(emitted) :]


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when absent)."""
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object, not a {type(config).__name__}")
    return config


def read_chat_template(model_dir: Path, config: dict[str, Any] | None = None) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config.json's (the default one of a
    list of named templates); None when the checkpoint has none."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = (read_tokenizer_config(model_dir) if config is None else config).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # AddedToken serialised as a dict
        return token.get("content")
    return token


class ByteTokenizer:
    """Stand-in tokenizer for synthetic (random-weight) models, which ship no tokenizer: text
    maps to its UTF-8 bytes (ids 0-255), other ids decode as `<id>`. Honest, not pretty."""

    bos_token = eos_token = chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def token_id(self, text: str | None) -> int | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    encode_long = encode

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else f"<{token}>".encode()

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(f"<{i}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        raise UserError("synthetic models have no chat template")

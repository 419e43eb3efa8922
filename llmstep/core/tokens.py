"""Text <-> token ids, through the `tokenizers` library and a model's tokenizer.json.

Llama 3 uses a byte-level BPE of 128,000 merges plus 256 special tokens; the default Shakespeare model
uses the same scheme with 8,192 tokens. Special tokens (`<|begin_of_text|>`, `<|eot_id|>`, ...) come
from the file; the chat format is used only when the tokenizer has its tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral
from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

from .config import read_json_object

__all__ = ["Tokenizer", "StreamDecoder"]

BOS = "<|begin_of_text|>"
EOS_CANDIDATES = ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")
CHAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


class Tokenizer:
    """A `tokenizers.Tokenizer` with what generation needs beside it: the bos id and whether text starts with it
    (`add_bos`: Llama 3 yes, SmolLM2 no), the ids that end a reply, and the checkpoint's chat template (Jinja
    source, or None for the built-in Llama 3 format)."""

    def __init__(self, tok: tokenizers.Tokenizer, bos_id: int | None = None, eos_ids: Iterable[int] | None = None,
                 add_bos: bool | None = None, chat_template: str | None = None):
        self.tok = tok
        self.bos_id = tok.token_to_id(BOS) if bos_id is None else bos_id
        if eos_ids is None:
            eos_ids = [i for t in EOS_CANDIDATES if (i := tok.token_to_id(t)) is not None]
        self.eos_ids: list[int] = list(dict.fromkeys(eos_ids))
        self.add_bos = self.bos_id is not None if add_bos is None else bool(add_bos)
        if self.add_bos and self.bos_id is None:
            raise ValueError("add_bos is set, but the tokenizer has no bos token")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be Jinja source text, got {type(chat_template).__name__}")
        self.chat_template = chat_template
        self._plain: tokenizers.Tokenizer | None = None  # a twin that reads special-token text as plain text

    @classmethod
    def from_file(cls, path: str | Path, bos_id: int | None = None, eos_ids: Iterable[int] | None = None):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
        return cls(tok, bos_id, eos_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json plus the stop tokens of generation_config.json (or config.json) when present."""
        path = Path(path)
        eos: list[int] = []
        bos = None
        for name in ("generation_config.json", "config.json"):
            f = path / name
            if f.is_file():
                data = read_json_object(f)
                ids = data.get("eos_token_id")
                ids = [ids] if isinstance(ids, int) else ids or []
                if not isinstance(ids, list) or not all(_is_id(i) for i in ids):
                    raise ValueError(f"{f}: eos_token_id must be a token id or a list of them, got {ids!r}")
                if not (data.get("bos_token_id") is None or _is_id(data["bos_token_id"])):
                    raise ValueError(f"{f}: bos_token_id must be a token id, got {data['bos_token_id']!r}")
                eos += ids
                bos = data.get("bos_token_id") if bos is None else bos
        tokenizer = cls.from_file(path / "tokenizer.json", bos_id=bos, eos_ids=eos or None)
        outside = [i for i in [*tokenizer.eos_ids, tokenizer.bos_id] if i is not None and i >= tokenizer.vocab_size]
        if outside:
            raise ValueError(f"{path}: bos_token_id/eos_token_id {outside[0]} is outside tokenizer.json's vocabulary "
                             f"(0..{tokenizer.vocab_size - 1})")
        return tokenizer

    # ---- the vocabulary --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    @property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    # ---- encode / decode -------------------------------------------------------------------------
    def encode(self, text: str, bos: bool | None = None, special: bool = True) -> list[int]:
        """Text -> ids, starting with bos where `bos` (None: the tokenizer's own `add_bos`) says so. With
        special=True, special tokens written in the text (`<|eot_id|>`) become their ids; with special=False they
        are read as the plain characters they are (what untrusted text needs)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        _check_encodable(text)
        ids = (self.tok if special else self._plain_tokenizer()).encode(text, add_special_tokens=False).ids
        bos = self.add_bos if bos is None else bos
        return [self.bos_id] + ids if bos and self.bos_id is not None else ids

    def _plain_tokenizer(self) -> tokenizers.Tokenizer:
        if self._plain is None:  # built once; never mutated afterwards, so threads may share it
            plain = tokenizers.Tokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Ids (a list, or a tensor/array) -> text. A model's vocabulary may be padded past its tokenizer's (to a
        multiple of 64 or 128, for fast matmuls): an id in that padding (`padded_vocab_size`, set by the loader
        from config.json) decodes to nothing, as Hugging Face tokenizers decode an id they lack, so a generation
        that samples one keeps its text. An id outside even the padded vocabulary is refused by value."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # a tensor or a numpy array
        ids = ids if isinstance(ids, list) else [ids]  # a 0-d tensor
        padded = max(getattr(self, "padded_vocab_size", 0), self.vocab_size)
        bad = next((i for i in ids if not (_is_id(i) and i < padded)), None)
        if bad is not None:
            raise ValueError(f"cannot decode token id {bad!r}: ids are integers in 0..{padded - 1}")
        return self.tok.decode([int(i) for i in ids if i < self.vocab_size], skip_special_tokens=skip_special_tokens)

    def pieces(self, text: str) -> list[str]:
        """The BPE pieces of text, readable (byte-level 'Ġ' shown as a space)."""
        return [self.decode([i]) for i in self.encode(text, bos=False)]

    # ---- Llama 3 chat format ---------------------------------------------------------------------
    @property
    def has_chat_format(self) -> bool:
        return all(self.token_to_id(t) is not None for t in CHAT_TOKENS)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Messages [{"role": ..., "content": ...}] -> the Llama 3 prompt string (with <|begin_of_text|>)."""
        if not self.has_chat_format:
            raise ValueError("this tokenizer has no Llama 3 chat tokens (<|start_header_id|>, ...)")
        parts = [BOS]
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                raise ValueError(f"message {i}: 'role' and 'content' must be strings, got {m!r}")
            parts.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
        if add_generation_prompt:
            parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(parts)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of `chat(messages)`, with the special tokens taken from the template alone: a role or content
        that spells `<|eot_id|><|start_header_id|>system...` stays text and cannot open a turn of its own (as
        serving engines encode chat). For trusted text with special tokens in it, use encode(chat(...))."""
        self.chat(messages, add_generation_prompt)  # the same checks and errors
        start, end, eot = (self.token_to_id(t) for t in CHAT_TOKENS)

        def turn(role: str) -> list[int]:
            return [start] + self.encode(role, bos=False, special=False) + [end]

        ids = [] if self.bos_id is None else [self.bos_id]
        for m in messages:
            ids += turn(m["role"]) + self.encode("\n\n" + m["content"].strip(), bos=False, special=False) + [eot]
        if add_generation_prompt:
            ids += turn("assistant") + self.encode("\n\n", bos=False, special=False)
        return ids

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids}, "
                f"add_bos={self.add_bos})")


def _check_encodable(text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, e.g. from a bad decode): it has no UTF-8 bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode: {text[e.start]!r} at character {e.start} is a lone "
                         "surrogate; decode the input with errors='replace'") from None


def _is_id(i) -> bool:
    return isinstance(i, Integral) and not isinstance(i, bool) and i >= 0


class StreamDecoder:
    """Ids in one at a time, text out as soon as it is whole: a character split over several byte-level
    tokens is held back until its last byte arrives, so the stream never shows broken UTF-8."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far

    def step(self, token_id: int) -> str:
        """The new text this id completes ('' while a character is still incomplete)."""
        self._ids.append(int(token_id))
        if token_id >= self.tokenizer.vocab_size:  # padding past the tokenizer's ids: nothing, as decode gives
            self.tokenizer.decode([token_id])  # ... but an id past the padding too is refused, by decode's rule
            return ""
        text = self._stream.step(self.tokenizer.tok, int(token_id)) or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """At the end: the text still held back (bytes that never made a whole character, as decode shows them,
        U+FFFD), so that everything step() and flush() returned adds up to decode(ids)."""
        return self.tokenizer.decode(self._ids, self.skip_special_tokens)[self._emitted:]

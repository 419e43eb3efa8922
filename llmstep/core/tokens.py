"""Text <-> token ids, through the `tokenizers` library and a model's tokenizer.json.

Llama 3 uses a byte-level BPE of 128,000 merges plus 256 special tokens; the default Shakespeare model
uses the same scheme with 8,192 tokens. Special tokens (`<|begin_of_text|>`, `<|eot_id|>`, ...) come
from the file. A chat is formatted by the checkpoint's own template (llmstep.core.chat) or, where it has none,
in Llama 3's format when the tokenizer has its tokens."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path

import tokenizers

from .chat import check_messages, read_tokenizer_config, render, template_literals
from .checks import is_int
from .config import read_json_object
from .files import atomic_write, atomic_write_text
from .stream_decode import StreamDecoder

__all__ = ["Tokenizer", "StreamDecoder"]

BOS = "<|begin_of_text|>"
EOS_CANDIDATES = ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")
CHAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# encode_chat stands one character of Supplementary Private Use Area-B in for each character a message holds.
HIDDEN_FIRST, HIDDEN_LAST = 0x100000, 0x10FFFD
HIDDEN = re.compile("[\U00100000-\U0010fffd]")
MARKS = ("\U000f0000", "\U000f0001")  # around a control token a message spells, where HIDDEN cannot serve


class Tokenizer:
    """A `tokenizers.Tokenizer` with what generation needs beside it: the bos id and whether text starts with it
    (`add_bos`: Llama 3 yes, SmolLM2 no), the ids that end a reply, and the checkpoint's chat template (Jinja
    source, or None for the built-in Llama 3 format) with the special-token strings it sees by name
    (`named_tokens`, {"bos_token": "<|begin_of_text|>", ...}; by default the bos and first eos tokens), the added
    tokens only it may write where tokenizer_config.json names them (`chat_control_tokens`, see control_tokens), the
    ids that decode to nothing (`unused_ids`: a GGUF file's unused tokens, as llama.cpp decodes them), and those that
    decode to their own text (`literal_ids`: a GGUF file's user-defined tokens, which llama.cpp writes out as they
    are; a byte-level decoder would read é in "café" as one of its byte symbols); save_dir keeps both."""

    def __init__(self, tok: tokenizers.Tokenizer, bos_id: int | None = None, eos_ids: Iterable[int] | None = None,
                 add_bos: bool | None = None, chat_template: str | None = None,
                 named_tokens: Mapping[str, str] | None = None, chat_control_tokens: Iterable[str] | None = None,
                 unused_ids: Iterable[int] = (), literal_ids: Iterable[int] = ()):
        if not isinstance(tok, tokenizers.Tokenizer):  # Tokenizer("tokenizer.json") is the easy mistake
            raise TypeError(f"tok must be a tokenizers.Tokenizer (for a path: from_file), got {type(tok).__name__}")
        self.tok = tok
        self.bos_id = tok.token_to_id(BOS) if bos_id is None else bos_id
        eos_ids = [i for t in EOS_CANDIDATES if (i := tok.token_to_id(t)) is not None] if eos_ids is None else eos_ids
        self.eos_ids: list[int] = list(dict.fromkeys(eos_ids))
        self.add_bos = self.bos_id is not None if add_bos is None else bool(add_bos)
        if self.add_bos and self.bos_id is None:
            raise ValueError("add_bos is set, but the tokenizer has no bos token")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be Jinja source text, got {type(chat_template).__name__}")
        self.chat_template = chat_template
        if named_tokens is None:
            first_eos = self.eos_ids[0] if self.eos_ids else None
            named_tokens = {"bos_token": tok.id_to_token(self.bos_id) if self.bos_id is not None else None,
                            "eos_token": tok.id_to_token(first_eos) if first_eos is not None else None}
        if not isinstance(named_tokens, Mapping) or not all(isinstance(v, str | None) for v in named_tokens.values()):
            raise ValueError(f"named_tokens must map names to token text, got {named_tokens!r}")
        self.named_tokens: dict[str, str] = {k: v for k, v in named_tokens.items() if v is not None}
        controls = None if chat_control_tokens is None else tuple(chat_control_tokens)
        if isinstance(chat_control_tokens, str) or not all(isinstance(t, str) for t in controls or ()):
            raise ValueError(f"chat_control_tokens must be a list of token texts, got {chat_control_tokens!r}")
        self.chat_control_tokens: tuple[str, ...] | None = controls
        self.unused_ids, self.literal_ids = frozenset(unused_ids), frozenset(literal_ids)
        self._plain: tokenizers.Tokenizer | None = None  # a twin that reads special-token text as plain text
        self._controls: tuple = ((), None, ())  # (the template and names read, control tokens' pattern, their text)

    @classmethod
    def from_file(cls, path: str | Path, bos_id: int | None = None, eos_ids: Iterable[int] | None = None,
                  **options) -> Tokenizer:
        """A tokenizer.json (or the folder holding one); `options` as the constructor takes them."""
        path = Path(path)
        if path.is_dir() and path.name != "tokenizer.json":  # the folder holding one
            path = path / "tokenizer.json"
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory, not a tokenizer.json file")
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
        return cls(tok, bos_id, eos_ids, **options)

    @classmethod
    def from_dir(cls, path: str | Path, parsed: Mapping[str, dict] | None = None) -> Tokenizer:
        """tokenizer.json plus the stop tokens of generation_config.json (or config.json) when present, and
        tokenizer_config.json's chat template, add_bos_token and special-token names (chat_template.jinja, where
        there is one, is the template: transformers reads it before tokenizer_config.json's). Without add_bos_token,
        text starts with bos where tokenizer.json's post-processor puts it there (Llama 3's template does, SmolLM2's
        byte-level one not), as transformers' tokenizer of the folder encodes it.

        `parsed`: generation_config.json and config.json as already read (file name -> object, a file absent
        when the folder has none), so that a loader reads each file once."""
        path = Path(path)
        eos: list[int] = []
        bos = None
        for name in ("generation_config.json", "config.json"):
            f = path / name
            data = (read_json_object(f) if f.is_file() else None) if parsed is None else parsed.get(name)
            if data is not None:
                ids = data.get("eos_token_id")
                ids = [ids] if isinstance(ids, int) else ids or []
                if not isinstance(ids, list) or not all(_is_id(i) for i in ids):
                    raise ValueError(f"{f}: eos_token_id must be a token id or a list of them, got {ids!r}")
                if not (data.get("bos_token_id") is None or _is_id(data["bos_token_id"])):
                    raise ValueError(f"{f}: bos_token_id must be a token id, got {data['bos_token_id']!r}")
                eos += ids
                bos = data.get("bos_token_id") if bos is None else bos
        options = read_tokenizer_config(path)
        tokenizer = cls.from_file(path / "tokenizer.json", bos_id=bos, eos_ids=eos or None, **options)
        if "add_bos" not in options:  # as transformers reads the folder: bos where tokenizer.json's template puts it
            first = [tokenizer.tok.encode("a", add_special_tokens=s).ids[:1] for s in (True, False)]
            tokenizer.add_bos = tokenizer.bos_id is not None and first[0] == [tokenizer.bos_id] != first[1]
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
    def encode(self, text: str, bos: bool | None = None, special: bool = True, max_tokens: int | None = None
               ) -> list[int]:
        """Text -> ids, starting with bos where `bos` (None: the tokenizer's own `add_bos`) says so. With
        special=True, special tokens written in the text (`<|eot_id|>`) become their ids; with special=False they
        are read as the plain characters they are (what untrusted text needs). With `max_tokens`, text that must
        make more tokens than that (more bytes than max_tokens of the longest token hold) is refused unread."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        _check_encodable(text)
        if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 1):  # 0 leaves room for no text
            raise ValueError(f"max_tokens must be a whole number of at least 1, got {max_tokens!r}")
        if max_tokens is not None and len(text) > max_tokens:  # fewer characters never make more tokens
            self.check_room(len(text.encode()), max_tokens, "the text is")
        try:
            ids = (self.tok if special else self._plain_tokenizer()).encode(text, add_special_tokens=False).ids
        except BaseException as e:  # the tokenizers library panics (a BaseException) where its regex gives up
            if type(e).__name__ != "PanicException":
                raise
            raise ValueError(f"the tokenizer cannot split this text: {str(e).splitlines()[0]} (its split rule "
                             "backtracks too much on it; tokenizer.json's pre_tokenizer is at fault)") from None
        bos = self.add_bos if bos is None else bos
        return [self.bos_id] + ids if bos and self.bos_id is not None else ids

    def check_room(self, n_bytes: int, max_tokens: int, what: str) -> None:
        """Refuse, unread, text of n_bytes UTF-8 bytes that must make more than max_tokens tokens: more bytes than
        max_tokens of the longest token hold. `what` ("the text is") begins the message."""
        if n_bytes > max_tokens and n_bytes > max_tokens * self.longest:  # `longest` read only when it may matter
            raise ValueError(f"{what} {n_bytes:,} bytes, at least {n_bytes // self.longest:,} tokens: more than the "
                             f"{max_tokens:,} there is room for")

    @cached_property
    def longest(self) -> int:
        """Bytes in the longest token (its text decoded alone: never fewer than its bytes), so a text of n bytes
        makes at least n / longest tokens."""
        texts = self.tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(1, *(len(t.encode()) for t in texts))

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
        that samples one keeps its text; so does an unused id (`unused_ids`). An id outside even the padded
        vocabulary is refused by value."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # a tensor or a numpy array
        ids = ids if isinstance(ids, list) else [ids]  # a 0-d tensor
        self._check_ids(ids)
        size, unused = self.vocab_size, self.unused_ids  # read once: each read asks the tokenizer (~1-4 us)
        ids = [int(i) for i in ids if i < size and i not in unused]
        if not self.literal_ids or self.literal_ids.isdisjoint(ids):
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        cuts = [-1, *(n for n, i in enumerate(ids) if i in self.literal_ids), len(ids)]  # each literal id alone
        return "".join(self.tok.decode(ids[a + 1:b], skip_special_tokens=skip_special_tokens) +
                       (self.tok.id_to_token(ids[b]) if b < len(ids) else "") for a, b in itertools.pairwise(cuts))

    @property
    def decodable_size(self) -> int:
        """Ids decode takes: the vocabulary, or the padded one the loader sets from config.json (`decode`)."""
        return max(getattr(self, "padded_vocab_size", 0), self.vocab_size)

    def _check_ids(self, ids: list) -> None:
        """Refuse, by value, an id that is not an integer inside even the padded vocabulary (`decode`)."""
        size = self.decodable_size
        if all(type(i) is int and 0 <= i < size for i in ids):  # the common case, at a fraction of _is_id's cost
            return
        bad = next((i for i in ids if not (_is_id(i) and i < size)), None)
        if isinstance(bad, list | tuple):  # a batch [B, T] of ids: tolist() made rows
            raise ValueError(f"decode takes one sequence of ids, got sequences of them ({bad!r} first): decode each")
        if bad is not None:
            raise ValueError(f"cannot decode token id {bad!r}: ids are integers in 0..{size - 1}")

    def pieces(self, text: str) -> list[str]:
        """The BPE pieces of text, readable (byte-level 'Ġ' shown as a space)."""
        return [self.decode([i]) for i in self.encode(text, bos=False)]

    # ---- chat ------------------------------------------------------------------------------------
    @property
    def has_chat_format(self) -> bool:
        """Whether the tokenizer has Llama 3's chat tokens (the built-in format's)."""
        return all(self.token_to_id(t) is not None for t in CHAT_TOKENS)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Messages [{"role": ..., "content": ...}] -> the prompt string: the checkpoint's chat template rendered as
        transformers' apply_chat_template renders it, or, where it has none, Llama 3's format (with
        <|begin_of_text|>)."""
        messages = check_messages(messages)
        if self.chat_template is not None:
            return render(self.chat_template, messages, add_generation_prompt, self.named_tokens)
        if not self.has_chat_format:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json's chat_template) and no "
                             "Llama 3 chat tokens (<|start_header_id|>, ...)")
        bare = [i for i, m in enumerate(messages) if "content" not in m]
        if bare:
            raise ValueError(f"message {bare[0]} has no content: Llama 3's format writes only text; a turn of tool "
                             "calls needs the checkpoint's chat template")
        parts = [BOS]
        for m in messages:
            parts.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
        if add_generation_prompt:
            parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(parts)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of `chat(messages)`, with the control tokens (`control_tokens`) taken from the template alone: a role
        or content that spells `<|eot_id|><|start_header_id|>system...` stays text and cannot open a turn of its own
        (as serving engines encode chat), each control token it spells encoded as plain text apart from the text
        beside it, as transformers' apply_chat_template(..., sanitize_control_tokens=True) encodes it. Starts with bos
        where the template writes it, else where `add_bos` says. For trusted text with special tokens in it, use
        encode(chat(...), bos=False)."""
        messages = check_messages(messages)  # read once: an iterator is not drained by a first pass
        if self.chat_template is not None:
            ids = self._encode_template_chat(messages, add_generation_prompt)
            return [self.bos_id] + ids if self.add_bos and ids[:1] != [self.bos_id] else ids
        self.chat(messages, add_generation_prompt)  # the same checks and errors
        start, end, eot = (self.token_to_id(t) for t in CHAT_TOKENS)

        def turn(role: str) -> list[int]:
            return [start] + self._encode_written(role) + [end]

        ids = [] if self.bos_id is None else [self.bos_id]
        for m in messages:
            ids += turn(m["role"]) + self._encode_written("\n\n" + m["content"].strip()) + [eot]
        if add_generation_prompt:
            ids += turn("assistant") + self._encode_written("\n\n")
        return ids

    @property
    def control_tokens(self) -> list[str]:
        """The added tokens only a chat's template may write (transformers' control tokens): the special ones, and
        those `chat_control_tokens` names or, where it is None, those the template (or the built-in format) writes as
        text, but whitespace (Gemma's "\\n", which templates write as text)."""
        named = self.chat_control_tokens
        literals = "\0".join((BOS, *CHAT_TOKENS)) if self.chat_template is None else \
            template_literals(self.chat_template)
        return [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special or (
            t.content in named if named is not None else t.content in literals and not t.content.isspace())]

    def _encode_template_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """A template's render -> ids, the control tokens written by the template only.

        The conversation is rendered a second time with every character of the messages' text (each value but the
        roles, which templates compare: `message['role'] == 'system'`) other than whitespace replaced by its own
        private-use character (HIDDEN), so `| trim` still works and nothing a message holds can spell, join into
        or be turned into a control token (a template's `lower`, `replace('[', '<')` or its own text right after a
        message's `<|im`); in roles and keys only the characters where a control token begins (or may, the template's
        text completing it) are replaced. Putting the characters back must give the real render; the control tokens
        of that render are then the template's own, and the text between them is encoded as a message's
        (`_encode_written`). Where it does not (the template reads or rewrites the text: a reasoning model's
        `content.split('</think>')`), `_encode_marked_chat` encodes it."""
        text = self.chat(messages, add_generation_prompt)
        controls = self._control_pattern()
        if HIDDEN.search(json.dumps(messages, ensure_ascii=False)):
            raise ValueError("a message holds a character of Supplementary Private Use Area-B (U+100000..), which "
                             "encode_chat uses to keep the messages' text plain: remove it")
        hidden: dict[str, str] = {}  # original character -> its stand-in
        tokens = self._controls[2]  # as read by _control_pattern

        def stand_in(c: str) -> str:
            return hidden.setdefault(c, chr(HIDDEN_FIRST + len(hidden)))

        def hide(value, key=None):
            if isinstance(value, str) and key == "role":  # compared by templates: only where a token could begin
                return "".join(stand_in(c) if any(value[i:].startswith(t) or t.startswith(value[i:]) for t in tokens)
                               else c for i, c in enumerate(value))
            if isinstance(value, str):
                return "".join(c if c.isspace() else stand_in(c) for c in value)
            if isinstance(value, list | tuple):  # a tuple too (check_messages keeps them): its text hidden as well
                return type(value)(hide(v) for v in value)
            if isinstance(value, dict):
                return {hide(k, "role"): hide(v, k) for k, v in value.items()}
            return value

        masked = hide(messages)
        if HIDDEN_FIRST + len(hidden) > HIDDEN_LAST:
            raise ValueError("the messages use more distinct characters than encode_chat can keep plain (65,534)")
        marked = render(self.chat_template, masked, add_generation_prompt, self.named_tokens)
        shown = {v: k for k, v in hidden.items()}

        def put_back(s: str) -> str:
            return HIDDEN.sub(lambda m: shown.get(m.group(), m.group()), s)

        if put_back(marked) != text:
            own = [m.group() for m in controls.finditer(marked)]  # the template's own: no message can spell one
            return self._encode_marked_chat(messages, add_generation_prompt, own)
        return self._encode_between_specials(marked, put_back)

    def _encode_between_specials(self, text: str, plain=lambda s: s) -> list[int]:
        """The control tokens of `text` as their ids, the text between them (through `plain`) as a message's."""
        ids, at = [], 0
        for m in self._control_pattern().finditer(text):
            ids += self._encode_written(plain(text[at:m.start()])) + [self.token_to_id(m.group())]
            at = m.end()
        return ids + self._encode_written(plain(text[at:]))

    def _encode_written(self, text: str) -> list[int]:
        """Text a message wrote, as transformers' sanitizer encodes it: each control token it spells as plain text, no
        added token matched in it (refused where even that makes the token), apart from the text on either side,
        which is encoded with special=False (an added token that is no control token read as itself)."""
        ids, at, tok = [], 0, self.tok
        for m in self._control_pattern().finditer(text):  # as transformers' _encode_without_added_tokens
            token = tok.normalizer.normalize_str(m.group()) if tok.normalizer else m.group()
            words = tok.pre_tokenizer.pre_tokenize_str(token) if tok.pre_tokenizer else [(token, None)]
            bare = [t.id for w, _ in words for t in tok.model.tokenize(w)]
            if self.token_to_id(m.group()) in bare:
                raise ValueError(f"{m.group()!r} in a message cannot be kept as text: the tokenizer makes that token "
                                 "of its plain text")
            ids += self.encode(text[at:m.start()], bos=False, special=False) + bare
            at = m.end()
        return ids + self.encode(text[at:], bos=False, special=False)

    def _encode_marked_chat(self, messages: list[dict], add_generation_prompt: bool, own: list[str]) -> list[int]:
        """For a template that reads or rewrites the messages' text, as transformers' apply_chat_template(...,
        sanitize_control_tokens=True) encodes it: each control token a message's value spells is wrapped in two
        private-use markers (MARKS; any already there dropped), the conversation rendered, and a marked token
        encoded as plain text; a lone marker (a template's split cut through a marked token) is dropped but still
        parts the text on either side. The control tokens left must be `own`, in order, those of the render where no
        message could spell one: else refused, as a template that makes one out of a message's text (its `lower`,
        its `replace`) adds one. (A template that both branches on the text and rewrites it could swap one of its
        own for one made so, in its place: a contrived template; tuples stay tuples, as the render shows them.)"""
        start, end = MARKS
        controls = self._control_pattern()

        def mark(value):
            if isinstance(value, str):
                value = value.replace(start, "").replace(end, "")
                return controls.sub(lambda m: start + m.group() + end, value)
            if isinstance(value, list | tuple):
                return type(value)(mark(v) for v in value)
            if isinstance(value, dict):
                return {k: mark(v) for k, v in value.items()}
            return value

        rendered = render(self.chat_template, mark(messages), add_generation_prompt, self.named_tokens)
        pieces = re.split(f"{start}({controls.pattern}){end}|[{start}{end}]", rendered)  # text, token, text, ...
        if [m.group() for text in pieces[::2] for m in controls.finditer(text)] != own:
            raise ValueError("the chat template changes the messages' text (beyond trimming it) or writes special "
                             "tokens by what it says, so special tokens in it could not be kept as text; use "
                             "encode(chat(...), bos=False) for trusted text")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:  # None: a lone marker's place
                ids += self._encode_written(piece) if i % 2 else self._encode_between_specials(piece)
        return ids

    def _control_pattern(self) -> re.Pattern:
        """control_tokens' text, longest first (a token wins over a shorter one inside it), but whitespace alone."""
        key = (self.chat_template, self.chat_control_tokens)
        if self._controls[0] != key:  # read again where the template (an attribute) has changed
            texts = sorted((t for t in self.control_tokens if t and not t.isspace()), key=len, reverse=True)
            self._controls = (key, re.compile("|".join(map(re.escape, texts)) or "(?!)"), texts)  # (?!): no match
        return self._controls[1]

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """tokenizer.json, written whole or not at all."""
        try:
            with atomic_write(path) as tmp:
                self.tok.save(str(tmp))
        except Exception as e:
            if type(e) is not Exception:  # tokenizers reports a failed write (ENOSPC) as a bare Exception
                raise
            raise OSError(f"cannot write {path}: {e}") from None

    def save_dir(self, folder: str | Path) -> None:
        """tokenizer.json and tokenizer_config.json (the chat template, add_bos_token, the special-token names,
        chat_control_tokens, unused_ids and literal_ids) into `folder` (made if missing), as from_dir reads them
        back; each file written whole or not at all."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.save(folder / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos, **self.named_tokens}
        if self.chat_control_tokens is not None:
            config["chat_control_tokens"] = list(self.chat_control_tokens)
        config |= {f"llmstep_{k}": sorted(ids) for k, ids in (("unused_ids", self.unused_ids),
                                                              ("literal_ids", self.literal_ids)) if ids}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids})"


def _check_encodable(text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, e.g. from a bad decode): it has no UTF-8 bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode: {text[e.start]!r} at character {e.start} is a lone "
                         "surrogate; decode the input with errors='replace'") from None


def _is_id(i) -> bool:
    return is_int(i) and i >= 0

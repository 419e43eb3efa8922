"""Token ids in one at a time, text out as soon as it is final: what `llmstep.stream` and the server show.

A token is not always whole text. In a byte-level BPE (Llama 3's, SmolLM2's) a character of several UTF-8 bytes may
be split over tokens: until its last byte arrives, its text is U+FFFD and must be held back. In a byte-fallback
tokenizer (Llama 2's, Mistral's: Metaspace pieces and `<0xNN>` byte tokens) a run of byte tokens decodes as a whole,
and a run that is not valid UTF-8 turns every byte of it into U+FFFD, even bytes that were a whole character alone:
"A" as `<0x41>`, then a stray lead byte, decodes as two U+FFFD, not "A" and one. So the text of a run of byte tokens
is held back until a token that is not one ends the run.

The text is found as vLLM's and tokenizers' incremental decoders find it: decode a window of the last tokens with
some already shown before them (their context: a Metaspace decoder drops the first token's leading space), and
return what the window adds past the context's text. The window moves on only where its text is final, so every
piece is text that decode(ids) holds at that place, and the pieces add up to decode(ids) once flush() returns the
rest.
"""

from __future__ import annotations

import re

__all__ = ["StreamDecoder"]

BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # a byte-fallback token's text


class StreamDecoder:
    """Ids in one at a time (step), text out as soon as it is final; flush() at the end gives what is still held
    back, so that everything returned adds up to tokenizer.decode(ids). `tokenizer`: a llmstep Tokenizer (not
    imported here: tokens.py imports this module, for Tokenizer.stream)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        decoder = tokenizer.tok.decoder
        self._byte_fallback = decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
        added = tokenizer.tok.get_added_tokens_decoder() if self._byte_fallback and skip_special_tokens else {}
        self._skipped = {i for i, t in added.items() if t.special}  # gone before the decoder runs: ends no run
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read]: the window's context, shown; ids[read:]: not yet shown
        self._emitted = 0  # characters returned so far

    def step(self, token_id: int) -> str:
        """The new text this id makes final ('' while a character or a run of byte tokens is unfinished). An id that
        is not one of the vocabulary's is refused before it is kept, so the stream stays usable (flush() included)."""
        token_id = token_id.tolist() if hasattr(token_id, "tolist") else token_id  # a 0-d tensor or numpy int
        self.tokenizer._check_ids([token_id])
        self._ids.append(int(token_id))
        if self._byte_fallback and self._in_run(int(token_id)):
            return ""  # a run of byte tokens decodes as a whole: its text waits for the run's end
        decode = self.tokenizer.decode
        shown = decode(self._ids[self._prefix:self._read], self.skip_special_tokens)
        text = decode(self._ids[self._prefix:], self.skip_special_tokens)
        if len(text) <= len(shown) or text.endswith("\ufffd") or not text.startswith(shown):
            return ""  # nothing new, a character's bytes still arriving, or (never seen) a context that changed
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted += len(text) - len(shown)
        return text[len(shown):]

    def _in_run(self, token_id: int) -> bool:
        """Whether this id leaves a run of byte tokens open: a byte token, or an id decode drops before its decoder
        runs (a skipped special, an unused or padding id), so that the bytes either side of it are one run."""
        t = self.tokenizer
        if token_id in self._skipped or token_id >= t.vocab_size or token_id in t.unused_ids:
            return True
        return BYTE_TOKEN.fullmatch(t.id_to_token(token_id) or "") is not None

    def flush(self) -> str:
        """At the end: the text still held back (bytes that never made a whole character, as decode shows them,
        U+FFFD), so that everything step() and flush() returned adds up to decode(ids)."""
        return self.tokenizer.decode(self._ids, self.skip_special_tokens)[self._emitted:]

"""The generation loop: prefill the prompt once, then decode one token at a time through the KV cache.

`stream` yields each token as it is made, with its text and how long it took; `generate` runs it to
the end and returns the whole `Generation`. Each run allocates its own KV cache, so many threads may generate with one
model at once (the fast loops, which own one cache each, refuse that: llmstep.engines.decoding.exclusive).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..core.device import synchronize
from ..core.model import Llama
from ..core.sampling import check_params, sample
from ..core.tokens import Tokenizer
from .decoding import (
    DecodeResult,
    budget,
    cache_len,
    check_finite,
    check_max_new_tokens,
    check_seed,
    encode_prompt,
    end_reason,
    make_generator,
    step_bytes_by_context,
    stop_id_set,
)

__all__ = ["TokenEvent", "Generation", "Stream", "stream", "generate"]


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str  # the text this token completes; '' while a character is unfinished, or for a stop token. The
    # last event also carries the bytes still held back (as U+FFFD), so the texts add up to decode(tokens).
    index: int  # 0 for the first new token
    seconds: float  # the prefill for index 0, one decode step after that
    stop: bool = False  # an end-of-sequence / stop token (its id is kept, its text is not)


@dataclass
class Generation(DecodeResult):
    """A `DecodeResult` with its text and the time of every decode step."""

    text: str = ""
    step_seconds: list[float] = field(default_factory=list)  # one per decode step

    @property
    def decode_steps(self) -> int:
        return len(self.step_seconds)

    @property
    def decode_seconds(self) -> float:
        return sum(self.step_seconds)

    def __str__(self) -> str:
        return self.text


class Stream:
    """Iterate to get `TokenEvent`s; afterwards `.result` holds the whole `Generation`."""

    def __init__(self, events: Iterator[TokenEvent], result: Generation):
        self._events, self.result = events, result

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events


def stream(model: Llama, tokenizer: Tokenizer, prompt, max_new_tokens: int = 128, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           stop_ids: Iterable[int] | None = None) -> Stream:
    """Start generating; see `generate` for the arguments. Errors in the arguments are raised here; a forward
    that produces NaN or Inf logits raises `decoding.NonFiniteLogitsError` naming its step."""
    check_params(temperature, top_k, top_p)
    check_max_new_tokens(max_new_tokens)
    check_seed(seed)
    ids = encode_prompt(tokenizer, prompt, model.config.max_seq_len)
    stops = stop_id_set(tokenizer.eos_ids if stop_ids is None else stop_ids, model.config.vocab_size)
    result = Generation(prompt_ids=ids)
    events = _run(model, tokenizer, ids, max_new_tokens, temperature, top_k, top_p, seed, stops, result)
    return Stream(events, result)


@torch.inference_mode()
def _run(model, tokenizer, ids, max_new_tokens, temperature, top_k, top_p, seed, stops, result) -> Iterator[TokenEvent]:
    device = model.device
    n_ctx = cache_len(len(ids), max_new_tokens, model.config.max_seq_len)
    plan = budget(len(ids), max_new_tokens, n_ctx)
    cache = model.new_cache(batch_size=1, max_len=n_ctx)
    step_bytes = step_bytes_by_context(model, context=len(ids))  # the weights counted once
    generator = make_generator(device, seed)
    detok = tokenizer.stream(skip_special_tokens=True)
    x = torch.tensor([ids], device=device)  # [1, T]: the whole prompt, then one token at a time
    position = 0  # where x's first token goes in the cache
    # Until the last token is made the run is unfinished: a stream broken off early says so.
    result.stop_reason = "interrupted" if plan.tokens else plan.stop_reason
    for index in range(plan.tokens):
        synchronize(device)
        start = time.perf_counter()
        logits = model(x, cache=cache, last_only=True)[:, -1]  # [1, vocab]
        check_finite(logits, index)  # NaN logits would sample token 0 forever, in silence
        token = sample(logits, temperature, top_k, top_p, generator)  # [1]
        token_id = int(token)  # waits for the device
        seconds = time.perf_counter() - start
        if index == 0:
            result.prefill_seconds = seconds
        else:
            result.step_seconds.append(seconds)
            result.decode_bytes += step_bytes(position)
        position += x.shape[1]
        result.tokens.append(token_id)
        reason = end_reason(result.tokens, stops, plan)
        is_stop = reason == "stop"
        text = "" if is_stop else detok.step(token_id)
        if reason:  # the last token: nothing held back
            text += detok.flush()
            result.stop_reason = reason
        result.text += text
        yield TokenEvent(token_id, text, index, seconds, is_stop)
        if reason:
            break
        x = token[:, None]  # [1, 1]


def generate(model: Llama, tokenizer: Tokenizer, prompt, max_new_tokens: int = 128, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             stop_ids: Iterable[int] | None = None) -> Generation:
    """Continue `prompt` (text, token ids, or chat messages) by up to max_new_tokens tokens.

    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. A seed makes the run
    reproducible. Stops at the tokenizer's end-of-sequence tokens, or at `stop_ids` when given.
    """
    s = stream(model, tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_ids)
    for _ in s:
        pass
    return s.result

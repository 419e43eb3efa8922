"""The generation loop: prefill the prompt once, then decode one token at a time through the KV cache.

`stream` yields each token as it is made, with its text and how long it took; `generate` runs it to
the end and returns the whole `Generation`. Each run allocates its own KV cache, so many threads may generate with one
model at once (the fast loops, which own one cache each, refuse that: llmstep.engines.engine.Engine.running).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..core.device import synchronize
from ..core.model import LAST, Llama
from ..core.sampling import sample
from ..core.tokens import Tokenizer
from .decoding import Budget, DecodeResult, budget, cache_len, check_finite, end_reason, step_bytes_by_context
from .request import Checked, Request, as_request, check_request

__all__ = ["TokenEvent", "Generation", "Stream", "stream", "generate"]


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str  # the text this token completes; '' while a character (or a run of byte-fallback tokens) is
    # unfinished, or for a stop token. The last event also carries the bytes still held back (as U+FFFD), so the
    # texts add up to decode(tokens).
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


def stream(model: Llama, tokenizer: Tokenizer, prompt: str | list | torch.Tensor | Request,
           max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
           top_p: float | None = None, seed: int | None = None, stop_ids=None) -> Stream:
    """Start generating; see `generate` for the arguments. Errors in the arguments are raised here; a forward
    that produces NaN or Inf logits raises `decoding.NonFiniteLogitsError` naming its step."""
    if tokenizer is None:  # check_request lets the engines that take ids alone have none; the text needs one
        raise TypeError("tokenizer must be a llmstep Tokenizer (llmstep.load returns (model, tokenizer)), got None")
    request = as_request(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, stop_ids=stop_ids)
    r = check_request(request, model, tokenizer=tokenizer)
    result = Generation(prompt_ids=r.ids, stop_reason="interrupted")  # not yet run: unfinished (`_run` decides)
    return Stream(_run(model, tokenizer, r, result), result)


@torch.inference_mode()
def _run(model, tokenizer, r: Checked, result: Generation) -> Iterator[TokenEvent]:
    device, ids, stops = model.device, r.ids, r.stops
    n_ctx = cache_len(len(ids), r.max_new_tokens, model.config.max_seq_len)
    plan = budget(len(ids), r.max_new_tokens, n_ctx)
    cache = model.new_cache(batch_size=1, max_len=n_ctx)
    step_bytes = step_bytes_by_context(model, context=len(ids))  # the weights counted once
    generator = r.generator(device)
    detok = tokenizer.stream(skip_special_tokens=True)
    x = torch.tensor([ids], device=device)  # [1, T]: the whole prompt, then one token at a time
    position = 0  # where x's first token goes in the cache
    # Until the last token is made the run is unfinished: a stream broken off early says so.
    result.stop_reason = "interrupted" if plan.tokens else plan.stop_reason
    for index in range(plan.tokens):
        synchronize(device)
        start = time.perf_counter()
        logits = model(x, cache=cache, keep=LAST)[:, -1].float()  # [1, vocab], float32 as every engine picks from
        check_finite(logits, index)  # NaN logits would sample token 0 forever, in silence
        token = sample(logits, *r.sampling, generator)  # [1]
        token_id = int(token)  # waits for the device
        seconds = time.perf_counter() - start
        if index == 0:
            result.prefill_seconds = seconds
        else:
            result.decode_bytes += step_bytes(position)
        position += x.shape[1]
        event = emit(result, detok, token_id, seconds, stops, plan)
        yield event
        if event.stop:  # else the budget ends the loop
            break
        x = token[:, None]  # [1, 1]


def emit(result: Generation, detok, token_id: int, seconds: float, stops: set[int], plan: Budget) -> TokenEvent:
    """A new token, made in `seconds` (the prefill's for the first), added to `result` with its text (none for a
    stop token; the last also flushes what the detokenizer held back) -> its event."""
    index = len(result.tokens)
    result.tokens.append(token_id)
    if index:
        result.step_seconds.append(seconds)
    reason = end_reason(result.tokens, stops, plan)
    text = "" if reason == "stop" else detok.step(token_id)
    if reason:  # the last token: nothing held back
        text += detok.flush()
        result.stop_reason = reason
    result.text += text
    return TokenEvent(token_id, text, index, seconds, reason == "stop")


def generate(model: Llama, tokenizer: Tokenizer, prompt: str | list | torch.Tensor | Request,
             max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_ids=None) -> Generation:
    """Serve a `Request` (llmstep.engines.request), or continue `prompt` (text, token ids, or chat messages) with
    the request's other fields as keywords (None keeps the request's value: the defaults every engine shares).
    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. A seed makes the run reproducible.
    Stops at `stop_ids` (None: the model's end tokens; (): never early).
    """
    s = stream(model, tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_ids)
    for _ in s:
        pass
    return s.result

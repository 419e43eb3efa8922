"""The generation loop: prefill the prompt once, then decode one token at a time through the KV cache.

`stream` yields each token as it is made, with its text and how long it took; `generate` runs it to
the end and returns the whole `Generation`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from numbers import Integral

import torch

from ..core.cost import model_step_cost
from ..core.device import synchronize
from ..core.model import Llama
from ..core.sampling import check_params, sample
from ..core.tokens import Tokenizer

__all__ = ["TokenEvent", "Generation", "Stream", "stream", "generate", "encode_prompt", "check_prompt_ids",
           "make_generator", "stop_id_set"]


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str  # the text this token completes; '' while a character is unfinished, or for a stop token. The
    # last event also carries the bytes still held back (as U+FFFD), so the texts add up to decode(tokens).
    index: int  # 0 for the first new token
    seconds: float  # the prefill for index 0, one decode step after that
    stop: bool = False  # an end-of-sequence / stop token (its id is kept, its text is not)


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, a final stop token included
    text: str = ""
    prefill_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # one per decode step
    stop_reason: str = ""  # "stop" (an EOS/stop token), "length" (max_new_tokens) or "context" (full)
    decode_bytes: float = 0.0  # weights + KV cache read by the decode steps (from llmstep.cost)

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else float("nan")

    @property
    def decode_seconds(self) -> float:
        return sum(self.step_seconds)

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.step_seconds) / self.decode_seconds if self.step_seconds else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.decode_bytes / len(self.step_seconds) if self.step_seconds else float("nan")

    @property
    def bandwidth_gb_per_second(self) -> float:
        """Bytes the decode steps had to read over the time they took: the memory bandwidth achieved."""
        return self.decode_bytes / self.decode_seconds / 1e9 if self.step_seconds else float("nan")

    def summary(self) -> str:
        return (f"prompt {len(self.prompt_ids)} tokens, prefill {self.prefill_seconds * 1e3:.1f} ms "
                f"({self.prefill_tokens_per_second:,.0f} tok/s) | decode {len(self.step_seconds)} tokens at "
                f"{self.decode_tokens_per_second:,.1f} tok/s | {self.bytes_per_token / 1e6:,.2f} MB read per token, "
                f"{self.bandwidth_gb_per_second:,.2f} GB/s achieved | stop: {self.stop_reason}")

    def __str__(self) -> str:
        return self.text


def check_max_new_tokens(max_new_tokens) -> None:
    if not isinstance(max_new_tokens, Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")


def check_prompt_ids(ids, vocab_size: int, max_len: int, room: str = "the model's context") -> list[int]:
    """Token ids (a list, or a tensor [T] or [1, T]) as a list of ints: not empty, inside the vocabulary,
    and leaving room for one new token."""
    if torch.is_tensor(ids) or hasattr(ids, "__array__"):  # a tensor or a numpy array
        ids = torch.as_tensor(ids)
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(f"a prompt tensor must hold one sequence, [T] or [1, T]; got shape {list(ids.shape)}")
        ids = ids.flatten().tolist()
    ids = list(ids)
    odd = [i for i in ids if not isinstance(i, Integral) or isinstance(i, bool)]
    if odd:
        raise ValueError(f"prompt token ids must be integers, got {odd[0]!r}")
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    if len(ids) >= max_len:
        raise ValueError(f"the prompt is {len(ids)} tokens, but {room} is {max_len}: "
                         "no room for a new token; shorten the prompt")
    return ids


def stop_id_set(stop_ids) -> set[int]:
    """Stop token ids (a list, a set, a tensor, ...) as a set of ints; anything else is refused by name."""
    if torch.is_tensor(stop_ids):
        stop_ids = stop_ids.flatten().tolist()
    if isinstance(stop_ids, str | bytes) or not isinstance(stop_ids, Iterable):
        raise ValueError(f"stop_ids must be a collection of token ids, got {stop_ids!r}")
    ids = [i.item() if torch.is_tensor(i) and i.numel() == 1 else i for i in stop_ids]
    odd = [i for i in ids if not isinstance(i, Integral) or isinstance(i, bool)]
    if odd:
        raise ValueError(f"stop_ids must hold integer token ids, got {odd[0]!r}")
    return {int(i) for i in ids}


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int] | torch.Tensor | list[dict],
                  max_seq_len: int) -> list[int]:
    """A prompt as text (BOS added), as token ids (a list or a tensor, used as given) or as chat messages -> ids,
    checked."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: give at least one character")
        ids = tokenizer.encode(prompt, bos=True)
    elif isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = tokenizer.encode_chat(list(prompt))
    else:  # token ids, a list or a tensor
        ids = prompt
    return check_prompt_ids(ids, tokenizer.vocab_size, max_seq_len)


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator on the model's device: seeded runs reproduce exactly, None draws a fresh seed."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


class Stream:
    """Iterate to get `TokenEvent`s; afterwards `.result` holds the whole `Generation`."""

    def __init__(self, events: Iterator[TokenEvent], result: Generation):
        self._events, self.result = events, result

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events


def stream(model: Llama, tokenizer: Tokenizer, prompt, max_new_tokens: int = 128, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           stop_ids: Iterable[int] | None = None) -> Stream:
    """Start generating; see `generate` for the arguments. Errors in the arguments are raised here."""
    check_params(temperature, top_k, top_p)
    check_max_new_tokens(max_new_tokens)
    ids = encode_prompt(tokenizer, prompt, model.config.max_seq_len)
    stops = stop_id_set(tokenizer.eos_ids if stop_ids is None else stop_ids)
    result = Generation(prompt_ids=ids)
    events = _run(model, tokenizer, ids, max_new_tokens, temperature, top_k, top_p, seed, stops, result)
    return Stream(events, result)


@torch.inference_mode()
def _run(model, tokenizer, ids, max_new_tokens, temperature, top_k, top_p, seed, stops, result) -> Iterator[TokenEvent]:
    config, device = model.config, model.device
    n_ctx = min(config.max_seq_len, len(ids) + max_new_tokens)
    cache = model.new_cache(batch_size=1, max_len=n_ctx)
    generator = make_generator(device, seed)
    detok = tokenizer.stream(skip_special_tokens=True)
    x = torch.tensor([ids], device=device)  # [1, T]: the whole prompt, then one token at a time
    position = 0  # where x's first token goes in the cache
    result.stop_reason = "length"
    for index in range(max_new_tokens):
        if position + x.shape[1] > n_ctx:  # the context is full: nowhere to write the last token
            result.stop_reason = "context"
            break
        synchronize(device)
        start = time.perf_counter()
        logits = model(x, cache=cache, last_only=True)[:, -1]  # [1, vocab]
        token = sample(logits, temperature, top_k, top_p, generator)  # [1]
        token_id = int(token)  # waits for the device
        seconds = time.perf_counter() - start
        if index == 0:
            result.prefill_seconds = seconds
        else:
            result.step_seconds.append(seconds)
            result.decode_bytes += model_step_cost(model, context=position).bytes
        position += x.shape[1]
        result.tokens.append(token_id)
        is_stop = token_id in stops
        text = "" if is_stop else detok.step(token_id)
        if is_stop or index == max_new_tokens - 1 or position + 1 > n_ctx:  # the last token: nothing held back
            text += detok.flush()
        result.text += text
        yield TokenEvent(token_id, text, index, seconds, is_stop)
        if is_stop:
            result.stop_reason = "stop"
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

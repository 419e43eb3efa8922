"""The rules every decode loop shares, in one place: the prompt, the budget, the stop, the result.

generate, FastDecoder, the speculative loops and the batchers all ask the same questions, and each asks them here:
is the input usable (the checks a request's one check asks, llmstep/engines/request.py); how big a cache does a run
need (`cache_len`, the one sizing rule; `cache_bucket` for an engine that keeps its cache) and how many new tokens
fit in it (`budget`: the last token sampled is never written, so max_len slots hold a prompt of T tokens and
max_len - T + 1 new ones); has the sequence ended (`end_reason`: a stop token, kept as its last token, else the
budget); are the logits finite (`check_finite` every step in the teaching loops, `NonFiniteLogits` on the device in
the others: no per-token sync); what does a decode read (`step_bytes_by_context`, `round_bytes`); and what does a
run report (`DecodeResult`, which every loop's result extends).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, field

import torch

from ..core.checks import SEED_LIMIT, check_int, check_max_len, check_seed, is_int
from ..core.cost import step_bytes_by_context
from ..core.tokens import Tokenizer

__all__ = ["SEED_LIMIT", "check_int", "check_seed", "check_max_len", "check_prompt_ids",
           "NonFiniteLogitsError", "check_finite", "NonFiniteLogits", "ConcurrentUseError", "stop_id_set",
           "encode_prompt", "room", "CACHE_ROUNDING", "cache_len", "cache_bucket", "Budget", "budget",
           "end_reason", "cut_at_stop", "step_bytes_by_context", "round_bytes", "DecodeResult"]


# ---- The input ---------------------------------------------------------------------------------------------


def check_prompt_ids(ids, vocab_size: int, max_len: int, room: str = "the model's context") -> list[int]:
    """Token ids (a list, or a tensor [T] or [1, T]) as a list of ints: not empty, inside the vocabulary,
    and leaving room for one new token."""
    if torch.is_tensor(ids) or hasattr(ids, "__array__"):  # a tensor or a numpy array
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):  # numpy strings or objects: no tensor of them
            raise ValueError(f"a prompt array must hold integer token ids, got one of dtype "
                             f"{getattr(ids, 'dtype', type(ids).__name__)}") from None
        if ids.dim() == 0 or ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(f"a prompt tensor must hold one sequence, [T] or [1, T]; got shape {list(ids.shape)}")
        check_prompt_len(ids.numel(), max_len, room)  # before the ids are read
        ids = ids.flatten().tolist()
    # Text and chat messages reach here only from an engine without a tokenizer (`encode_prompt` encodes them).
    read = max_len + 1 if is_int(max_len) else None  # the most ids worth reading: one more is refused (inf: all)
    messages = isinstance(ids, list | tuple) and any(isinstance(m, dict) for m in ids[:read])
    if isinstance(ids, str) or messages:
        what, how = ("chat messages", "tokenizer.encode_chat(messages)") if messages else ("text", "tokenizer.encode")
        raise ValueError(f"this takes token ids (an engine without a tokenizer, a lab helper), not {what}: encode "
                         f"the prompt with the model's tokenizer first ({how})")
    if isinstance(ids, str | bytes | bytearray) or not isinstance(ids, Iterable):
        raise ValueError(f"a prompt must be text, token ids or chat messages, got {type(ids).__name__}")
    if isinstance(ids, Sized):
        check_prompt_len(len(ids), max_len, room)  # before the ids are read (a one-shot iterator: once read)
    ids = list(itertools.islice(ids, read))  # an iterator far too long is not read past the context
    check_prompt_len(len(ids), max_len, room)
    odd = [i for i in ids if not is_int(i)]
    if odd:
        raise ValueError(f"prompt token ids must be integers, got {odd[0]!r}")
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    return ids


def check_prompt_len(n_ids: int, max_len: int, room: str) -> None:
    """A prompt of n_ids tokens must leave room for one new token in max_len positions (`room` names them)."""
    if n_ids > max_len:  # a prompt that fills it still gets its one new token (never written)
        raise ValueError(f"the prompt is {n_ids} tokens, but {room} is {max_len}: "
                         "no room for a new token; shorten the prompt")


def stop_id_set(stop_ids, vocab_size: int | None = None) -> set[int]:
    """Stop token ids (a list, a set, a tensor, ...) as a set of ints; anything else is refused by name, and so is
    an id outside the vocabulary (0..vocab_size-1, when given): a stop token the model can never make."""
    if torch.is_tensor(stop_ids):
        if vocab_size is not None:
            check_stop_count(stop_ids.numel(), vocab_size)  # before the ids are read
        stop_ids = stop_ids.flatten().tolist()
    if isinstance(stop_ids, str | bytes) or not isinstance(stop_ids, Iterable):
        raise ValueError(f"stop_ids must be a collection of token ids, got {stop_ids!r}")
    if vocab_size is not None:  # more ids than the vocabulary has: refused before they are read (range(10**8))
        if isinstance(stop_ids, Sized):
            check_stop_count(len(stop_ids), vocab_size)
        stop_ids = list(itertools.islice(stop_ids, vocab_size + 1))
        check_stop_count(len(stop_ids), vocab_size)
    ids = [i.item() if torch.is_tensor(i) and i.numel() == 1 else i for i in stop_ids]
    odd = [i for i in ids if not is_int(i)]
    if odd:
        raise ValueError(f"stop_ids must hold integer token ids, got {odd[0]!r}")
    outside = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if outside:
        span = "ids are >= 0" if vocab_size is None else f"0..{vocab_size - 1}"
        raise ValueError(f"stop id {outside[0]} is outside the vocabulary ({span}): it could never stop")
    return {int(i) for i in ids}


def check_stop_count(n_ids: int, vocab_size: int) -> None:
    if n_ids > vocab_size:
        raise ValueError(f"stop_ids holds {n_ids:,} ids, more than the vocabulary's {vocab_size:,} tokens: give each "
                         "stop token once")


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int] | torch.Tensor | list[dict],
                  max_seq_len: int, vocab_size: int | None = None) -> list[int]:
    """A prompt as text (bos added where the tokenizer adds it), as token ids (a list or a tensor, used as given)
    or as chat messages -> ids, checked against vocab_size: the model's, whose embedding reads them, as every engine
    checks them without a tokenizer (None: the tokenizer's)."""
    if isinstance(prompt, bytes | bytearray):  # iterating bytes would give integers: read as token ids
        raise ValueError("the prompt is bytes: give text (decode it first, e.g. prompt.decode('utf-8')) or token ids")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: give at least one character")
        ids = tokenizer.encode(prompt, max_tokens=max_seq_len)  # a text far too long is refused before it is read
    elif isinstance(prompt, list | tuple) and any(isinstance(m, dict) for m in prompt[:max_seq_len + 1]):  # chat
        check_chat_size(tokenizer, prompt, max_seq_len)  # messages far too long are refused before they are rendered
        ids = tokenizer.encode_chat(list(prompt))  # names a message that is not one
        if not ids:  # not the caller's empty prompt: the template's
            raise ValueError("the chat template rendered these messages to no tokens: the checkpoint's template "
                             "(its chat_template) formats nothing for them")
    else:  # token ids, a list or a tensor
        ids = prompt
    return check_prompt_ids(ids, tokenizer.vocab_size if vocab_size is None else vocab_size, max_seq_len)


def check_chat_size(tokenizer: Tokenizer, messages: list | tuple, max_tokens: int) -> None:
    """Refuse chat messages whose contents alone must make more than max_tokens tokens, before the template renders
    them: the rule `Tokenizer.encode` applies to text (`Tokenizer.check_room`), applied to the contents as a template
    writes them (stripped); what the template adds only makes more."""
    contents = [m.get("content") for m in messages if isinstance(m, dict)]
    n_bytes = sum(len(c.strip().encode("utf-8", "surrogatepass")) for c in contents if isinstance(c, str))
    tokenizer.check_room(n_bytes, max_tokens, "the chat messages' contents are")


# ---- Non-finite numbers, and one run at a time -------------------------------------------------------------


class NonFiniteLogitsError(ValueError):
    """A forward produced NaN or Inf logits: a bad weight, scale or config; sampling them would give token 0."""


def check_finite(logits: torch.Tensor, step: int, what: str = "the model") -> None:
    """Raise NonFiniteLogitsError naming the step (0: the prompt's forward) if logits hold a NaN or an Inf."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogitsError(f"{what} produced non-finite logits (NaN or Inf) at step {step} "
                                   "(0 = the prompt's forward): check its weights and config")


class NonFiniteLogits:
    """A flag on the device: `update(logits)` every step (no host sync), `check()` once at the end. requests: None,
    one flag for the run; n, one per request (the batcher: `update(logits [B, V], ids [B])`)."""

    def __init__(self, device: torch.device, requests: int | None = None):
        self.per_request = requests is not None
        self.seen = torch.zeros(() if requests is None else (requests,), dtype=torch.bool, device=device)

    def update(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        if ids is None:
            self.record(torch.isfinite(logits).all())
        else:
            self.seen[ids] |= ~torch.isfinite(logits).flatten(1).all(-1)  # on the device: no sync

    def record(self, finite: torch.Tensor) -> None:
        """finite: a bool tensor [] computed elsewhere (inside a compiled step)."""
        self.seen |= ~finite

    def check(self, where: str = "") -> None:
        if not bool(self.seen.any()):
            return
        if self.per_request:
            ids = self.seen.nonzero()[:, 0].tolist()
            listed = ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
            raise NonFiniteLogitsError(f"the model produced non-finite logits (NaN or Inf) for request(s) {listed}"
                                       f"{where}: their tokens are meaningless; check the model's weights and config")
        raise NonFiniteLogitsError(f"the model produced non-finite logits (NaN or Inf){where}: "
                                   "its tokens are meaningless; check its weights and config")


class ConcurrentUseError(RuntimeError):
    """An engine that owns one cache was called while it was already running (`Engine.running`)."""


@contextlib.contextmanager
def held(lock: threading.Lock, why: str) -> Iterator[None]:
    """`lock` held inside; taken by another thread already, ConcurrentUseError(why) at once: one caller at a time."""
    if not lock.acquire(blocking=False):
        raise ConcurrentUseError(why)
    try:
        yield
    finally:
        lock.release()


# ---- The budget: how many new tokens fit, and why a run ends -----------------------------------------------


def room(prefix_len: int, max_len: int) -> int:
    """New tokens a cache of max_len slots allows after prefix_len tokens: prefix_len - 1 + n slots are written
    (the last token sampled is never fed back), so n = max_len - prefix_len + 1 (0 when nothing fits)."""
    return max(0, max_len - prefix_len + 1)


CACHE_ROUNDING = 256  # slots: an engine's cache sized per request is rounded up to this, so nearby lengths share one


def cache_len(prompt_len: int, max_new_tokens: int, max_seq_len: int, reserve: int = 0, rounding: int = 1) -> int:
    """The slots a run needs, the one sizing rule: the prompt, its new tokens and `reserve` more (a speculative
    round's k slots written past the last token it keeps), at least one past the prompt, rounded up to `rounding`,
    at most the model's context: never the whole context unless a run needs it (17 GB for Llama 3.1 8B)."""
    need = max(prompt_len + max_new_tokens + reserve, prompt_len + 1)
    return min(max_seq_len, -(-need // rounding) * rounding)


def cache_bucket(slots: int, max_seq_len: int) -> int:
    """The slots an engine that keeps its cache across runs grows it to when a run needs `slots`: the next power of
    two, at least CACHE_ROUNDING, at most the context. A new size is a new compiled step, so a session whose context
    grows to n tokens compiles about log2(n / CACHE_ROUNDING) times; the cache holds at most twice what it needs."""
    return min(max_seq_len, max(CACHE_ROUNDING, 1 << (slots - 1).bit_length()))


@dataclass(frozen=True)
class Budget:
    """What a run may make: `tokens` new tokens, and the stop_reason if no stop token ends it first."""

    tokens: int
    stop_reason: str  # "length" (max_new_tokens) or "context" (the cache is full first)


def budget(prompt_len: int, max_new_tokens: int, max_len: int) -> Budget:
    """The budget of a run of a prompt_len-token prompt for max_new_tokens in a cache of max_len slots."""
    n = min(max_new_tokens, room(prompt_len, max_len))
    return Budget(n, "length" if n == max_new_tokens else "context")


def end_reason(tokens: list[int], stops: set[int], plan: Budget) -> str | None:
    """Why a sequence that has made `tokens` ends now, or None: "stop" when its last token is a stop token
    (kept as the last token), the budget's reason once it has made plan.tokens."""
    if tokens and tokens[-1] in stops:
        return "stop"
    return plan.stop_reason if len(tokens) >= plan.tokens else None


def cut_at_stop(tokens: list[int], stops: set[int]) -> tuple[list[int], bool]:
    """Tokens made ahead (a round of speculation, steps run between host syncs) up to and including the first
    stop token; and whether there was one."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], True
    return tokens, False


def round_bytes(target_bytes: Callable[[int], float], draft_bytes: Callable[[int], float], L: int, k: int) -> float:
    """What one speculative round reads (both speculative loops count it so), its pending token at position L - 1:
    the target's verifying forward over a cache of L - 1 tokens (its weights once for all k + 1 tokens), and k
    draft steps over L - 1, L, ..., L + k - 2. target_bytes, draft_bytes: `step_bytes_by_context` of each."""
    return target_bytes(L - 1) + sum(draft_bytes(L - 1 + i) for i in range(k))


# ---- The result every loop returns -------------------------------------------------------------------------


@dataclass
class DecodeResult:
    """A prompt, the tokens made after it, why they ended, and how long it took. Every loop's result extends it and
    gives `decode_steps` (the forwards after the prefill) and `decode_seconds` (their time)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, a final stop token included
    stop_reason: str = ""  # "stop" (a stop token), "length" (max_new_tokens), "context" (the cache is full), or
    #                        "interrupted" (a stream broken off, or not yet run, before its end)
    prefill_seconds: float = 0.0  # the prompt's forward, which makes the first token
    decode_bytes: float = 0.0  # weights + KV cache the decode steps read (llmstep.core.cost); 0: not counted

    @property
    def decode_steps(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must say how many decode steps it ran")

    @property
    def decode_seconds(self) -> float:
        raise NotImplementedError(f"{type(self).__name__} must say how long its decode steps took")

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else math.nan

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_steps and self.decode_seconds else math.nan

    @property
    def bytes_per_token(self) -> float:
        return self.decode_bytes / self.decode_steps if self.decode_steps and self.decode_bytes else math.nan

    @property
    def bandwidth_gb_per_second(self) -> float:
        """Bytes the decode steps had to read over the time they took: the memory bandwidth achieved."""
        if not (self.decode_steps and self.decode_bytes and self.decode_seconds):
            return math.nan
        return self.decode_bytes / self.decode_seconds / 1e9

    def summary(self) -> str:
        """One line: the prefill, the decode rate and bandwidth, why it stopped; a part with nothing timed is left out
        (max_new_tokens=0 runs no forward; one new token runs no decode step; a paged batch's prompt chunks, shared
        with other requests' work, are not timed per request), never printed as nan."""
        parts = [f"prompt {len(self.prompt_ids)} tokens"]
        if self.tokens and self.prefill_seconds:
            parts[0] += (f", prefill {self.prefill_seconds * 1e3:.1f} ms "
                         f"({self.prefill_tokens_per_second:,.0f} tok/s)")
        if self.decode_steps:
            kept = max(len(self.tokens) - 1, 0)  # a loop that checks its stop every few steps may run past it
            ran = (f"{self.decode_steps} tokens" if kept >= self.decode_steps else
                   f"{self.decode_steps} steps ({kept} kept: the rest came after the stop)")
            parts.append(f"decode {ran} at {self.decode_tokens_per_second:,.1f} tok/s")
            if self.decode_bytes:
                parts.append(f"{self.bytes_per_token / 1e6:,.2f} MB read per token, "
                             f"{self.bandwidth_gb_per_second:,.2f} GB/s achieved")
        else:
            parts.append(f"{len(self.tokens)} new token{'s' * (len(self.tokens) != 1)}, no decode step")
        return " | ".join(parts + [f"stop: {self.stop_reason}"])

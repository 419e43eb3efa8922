"""The decode loop without the overhead: a static KV cache, the step compiled whole, sampling on the device.

`llmstep.generate`, the teaching loop, waits for every token, turns it into text and counts its bytes before the
next step starts. At batch 1 a step of a small model is mostly that overhead (on a GPU, also the hundreds of kernel
launches per step). This loop keeps only the model: the KV cache is allocated once and written at explicit
positions, so every decode step has the same shapes (token [1, 1] at position [1, 1]); the step is the model's one
forward and the sampling, on the device (`llmstep.sampling`'s exponential race: no torch.multinomial sync), compiled
whole (llmstep/engines/compile.py: a CUDA graph on CUDA, the weights frozen in on a CPU). Tokens reach the host once
at the end, or every `sync_every` steps when stop tokens are watched; NaN or Inf logits are flagged on the device
and reported at the end (`decoding.NonFiniteLogitsError`).

With compile=False it is the plain eager model in the same loop, and it gives the tokens `llmstep.generate`
gives: greedy, and seeded sampling (the same generator, the same draws in the same order, on any device).
Compiled or fused, the draws are the same and the logits equal up to rounding (tests/engines/test_fast.py).
`FastSpeculator` runs speculative decoding the same way, with the rule of llmstep/engines/speculative.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from ..core.checks import check_flag
from ..core.device import synchronize
from ..core.fuse import fused, fuses_by_default
from ..core.model import LAST, Llama
from ..core.sampling import check_params, greedy, picker, probs, race, sample
from . import speculative
from .compile import Step
from .decoding import (
    DecodeResult,
    NonFiniteLogits,
    budget,
    check_int,
    cut_at_stop,
    end_reason,
    round_bytes,
    step_bytes_by_context,
)
from .engine import Engine
from .request import Checked, Request, as_request, sampling_key
from .speculative import Rounds

__all__ = ["FastResult", "FastDecoder", "FastSpeculativeResult", "FastSpeculator"]


@dataclass
class FastResult(DecodeResult):
    """A `DecodeResult` timed with one timer for all the decode steps (synchronised at the end)."""

    decode_seconds: float = 0.0  # all decode steps together
    decode_steps: int = 0  # forwards after the prefill: len(tokens) - 1 when nothing stopped early


class FastDecoder(Engine):
    """One model, one static cache, one (optionally compiled) decode step; call `generate` many times.

    max_len: the cache's slots; None sizes it for each request, growing it (`Engine.grow`). compile, mode: the
    step's (llmstep.engines.compile.Step; None compiles on CUDA only). fuse: run a twin of the model with q|k|v and
    gate|up as one matmul each (llmstep.core.fuse: the same function; None: `fuse.fuses_by_default`).

    The decode step (`_advance`) makes a whole token in place in fixed buffers (history, position): on CUDA one
    graph replay makes one token. A seeded draw needs Exp(1) noise from the run's torch.Generator, which no
    compiled graph can take (dynamo refuses a Generator; inductor's RNG draws other numbers): the loop refills a
    fixed noise buffer from it before each sampled step (one launch, no sync), the draw `llmstep.generate` makes.
    """

    def __init__(self, model: Llama, max_len: int | None = None, compile: bool | None = None, mode: str | None = None,
                 fuse: bool | None = None):
        check_flag(fuse, "fuse")
        first_len = self._own(model, max_len, compile=compile, mode=mode)
        self.fused = fuses_by_default(model, self.compiled) if fuse is None else fuse
        self.net = fused(model) if self.fused else model  # what the steps run: the same function
        self._allocate(first_len)

    def _allocate(self, max_len: int) -> None:  # the cache first: if memory refuses it, nothing here has changed
        cache = self.net.new_cache(batch_size=1, max_len=max_len)  # per layer k, v: [1, n_kv, max_len, hd]
        self.max_len, self.cache, device = max_len, cache, self.device
        # The run's state on the device, at fixed addresses: a CUDA graph reads and writes them in place.
        self._history = torch.zeros(max_len + 1, dtype=torch.long, device=device)  # [max_len+1]: token at position p
        self._position = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]: the pending token's position
        self._noise = torch.ones(1, self.model.config.vocab_size, dtype=torch.float32,  # [1, V]: Exp(1) draws
                                 device=device)  # float32 whatever the default dtype: `draw`'s noise is p's
        self._finite = torch.ones((), dtype=torch.bool, device=device)  # []: every logit of the run was finite
        self._state = (*self.cache.buffers, self._history, self._position, self._finite)  # written by the step
        self._advances: dict[tuple, Step] = {}  # one compiled step per sampling setting (its constants)
        self._step = None  # the public logits step, made when first asked for

    def _decode_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """token [1, 1], position [1, 1] -> logits [1, vocab] (float32): one token through the model."""
        return self.net(token, position, self.cache, keep=LAST, static=self.static)[:, -1].float()

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """`_decode_step`, maybe compiled (with CUDA graphs, use or clone the logits before the next call); refused
        while the engine runs in another thread (it writes the cache)."""
        self.cache.check_static(position)
        with self.running():
            if self._step is None:
                self._step = self._step_of(self._decode_step, self.cache.buffers, self.net)
            return self._step(token, position)

    def _advance(self, temperature: float, top_k: int, top_p: float) -> None:
        """One whole decode step on the run's state, in place: the pending token history[position] through the
        model, the next token (greedy, or raced against the noise buffer) written at history[position + 1], the
        position advanced, the finite flag updated. Returns nothing: nothing leaves the device."""
        position = self._position  # [1, 1]
        logits = self._decode_step(self._history.gather(0, position.view(1)).view(1, 1), position)  # [1, V]
        self._finite &= torch.isfinite(logits).all()
        token = greedy(logits) if temperature == 0 else race(probs(logits, temperature, top_k, top_p), self._noise)
        position += 1
        self._history.index_copy_(0, position.view(1), token)

    def _advance_step(self, sampling: tuple) -> Step:
        if sampling not in self._advances:
            self._advances[sampling] = self._step_of(partial(self._advance, *sampling), self._state, self.net,
                                                     refilled=(self._noise,))
        return self._advances[sampling]

    def _reset(self) -> None:
        self.cache.reset()
        self._history.zero_()
        self._position.zero_()
        self._finite.fill_(True)

    def warmup(self, steps: int = 3, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> float:
        """`Engine.warm_once` for this sampling setting's decode step, from position 0 and with a clean cache, under
        inference mode as the runs (Dynamo guards the mode: a step compiled under another would compile again).
        Refused while the engine runs in another thread: it resets the cache and the run's state."""
        with self.running():
            return self._warmup(steps, temperature, top_k, top_p)

    @torch.inference_mode()
    def _warmup(self, steps: int, temperature: float, top_k: int, top_p: float) -> float:
        check_params(temperature, top_k, top_p)
        sampling = sampling_key(temperature, top_k, top_p)  # the key `generate` asks for: one greedy step
        if self.is_warm(sampling):
            return 0.0
        advance = self._advance_step(sampling)

        def at_zero():  # every warm-up step from position 0: a cache of 2 slots holds 3 steps' keys too
            self._position.zero_()
            advance()

        self._reset()
        seconds = self.warm_once(sampling, at_zero, steps=steps)
        self._reset()
        return seconds

    def generate(self, prompt_ids: list[int] | torch.Tensor | Request, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, stop_ids=None, sync_every: int = 32) -> FastResult:
        """Serve a `Request` (or prompt_ids and the request's other fields as keywords), as llmstep.generate does.
        Stop ids are checked every sync_every steps; the tokens after a stop are dropped."""
        request = as_request(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, stop_ids=stop_ids)
        r = self.check(request)
        check_int(sync_every, "sync_every", low=1)
        with self.running(r):
            return self._generate(r, sync_every)

    @torch.inference_mode()  # the cache was grown (`running`) outside it: its tensors stay normal ones
    def _generate(self, r: Checked, sync_every: int) -> FastResult:
        ids, sampling, stops = r.ids, r.sampling, r.stops
        plan = budget(len(ids), r.max_new_tokens, self.max_len)
        result = FastResult(prompt_ids=ids, stop_reason=plan.stop_reason)
        n = plan.tokens
        if n == 0:
            return result
        if n > 1:  # a decode step will run: compiled (and warm) before anything is timed; one token needs none
            self._warmup(3, *sampling)
        device, first = self.device, len(ids)
        generator = r.generator(device)  # the generator llmstep.generate uses: the same draws
        stop_tensor = torch.tensor(sorted(stops), device=device, dtype=torch.long)

        self._reset()
        prompt = torch.tensor([ids], device=device)  # [1, T]
        synchronize(device)
        start = time.perf_counter()
        logits = self.net(prompt, torch.arange(first, device=device), self.cache, keep=LAST)[:, -1]
        nonfinite = NonFiniteLogits(device)  # a flag on the device, read once at the end
        nonfinite.update(logits)
        token = sample(logits.float(), *sampling, generator)  # [1]
        self._history[first: first + 1] = token  # the pending token, at its position
        self._position.fill_(first)
        synchronize(device)
        result.prefill_seconds = time.perf_counter() - start

        advance = self._advance_step(sampling).unguarded()  # compiled: its guards evaluated here, once per run
        steps = 0
        start = time.perf_counter()
        for i in range(1, n):  # per token: one call (one graph replay on CUDA), plus the noise draw when sampling
            if stops and i % sync_every == 0 and bool(torch.isin(self._history[first: first + i], stop_tensor).any()):
                break  # the one host sync every sync_every steps, and only when stop tokens are watched
            if not r.greedy:
                self._noise.exponential_(1.0, generator=generator)  # what `sample` would draw at this step
            advance()
            steps += 1
        tokens = self._history[first: first + steps + 1].tolist()  # waits for the device: the end of the timing
        result.decode_seconds = time.perf_counter() - start
        nonfinite.record(self._finite)
        nonfinite.check(f" in a run of {steps + 1} tokens")
        result.decode_steps = steps
        step_bytes = step_bytes_by_context(self.model, context=len(ids))
        result.decode_bytes = sum(step_bytes(len(ids) + i) for i in range(steps))
        result.tokens, stopped = cut_at_stop(tokens, stops)
        if stopped:
            result.stop_reason = "stop"
        return result


# ---- Speculative decoding, the fast way: static caches, compiled draft steps and verification --------------


@dataclass
class FastSpeculativeResult(FastResult, Rounds):
    """A `FastResult` plus the rounds. decode_steps counts the tokens after the first (as plain decoding
    does, one per forward), so decode_tokens_per_second compares directly with FastDecoder's."""


class FastSpeculator(Engine):
    """Speculative decoding the way `FastDecoder` decodes: static KV caches, fixed shapes, compiled steps.

    Each round the draft first reads two tokens, the one before the pending token and the pending one (new to its
    cache when the last round accepted all k proposals, else rewriting a slot with the token already there), so
    every round has the same shapes. At temperature 0 the whole round (k draft steps, the target's (k+1)-token
    forward, the greedy rule) is one compiled call and one host sync; with sampling the draft steps and the
    verification are separate calls, since each draw comes from the host's generator.

    The rule is `speculative_generate`'s (`verify`, `verify_greedy`), its random numbers drawn in the same order;
    k is fixed (one compilation per k): where the budget has fewer than k + 1 tokens left, `speculative_generate`
    proposes fewer and this one proposes k and keeps what the budget takes, so with sampling the last round's
    tokens may differ (each drawn from the target's distribution all the same). Where the next round would write
    past either cache, the target goes on alone, one token a step, as `speculative_generate` does. max_len: the
    target's cache slots (the draft's as many, at most its context); None: sized for each request with k slots
    reserved, as FastDecoder's. fuse: as FastDecoder's, for both models.
    """

    room = "the target's context"

    def __init__(self, target: Llama, draft: Llama, k: int = 4, max_len: int | None = None,
                 compile: bool | None = None, mode: str | None = None, fuse: bool | None = None):
        speculative.check_k(k)
        speculative.check_pair(target, draft)
        check_flag(fuse, "fuse")
        context = target.config.max_seq_len  # a shorter max_len: refused by check_max_len, its range k+2..context
        if k + 2 > context:  # a round: a prompt token at least, the pending token, k proposals
            raise ValueError(f"k {k} never fits: a round writes the pending token and k proposals after at least one "
                             f"token, k + 2 = {k + 2} positions, and the target's context is {context}; choose k at "
                             f"most {context - 2}")
        first_len = self._own(target, max_len, reserve=k, low=k + 2, compile=compile, mode=mode)
        self.k = k
        self.fused = (fuses_by_default(target, self.compiled) or fuses_by_default(draft, self.compiled)
                      if fuse is None else fuse)  # as FastDecoder's
        self.target, self.draft = (fused(target), fused(draft)) if self.fused else (target, draft)
        self._allocate(first_len)

    def _allocate(self, max_len: int) -> None:  # the caches first: if memory refuses one, nothing has changed
        caches = [m.new_cache(batch_size=1, max_len=min(max_len, m.config.max_seq_len))  # a draft: at most its context
                  for m in (self.target, self.draft)]
        self.max_len, (self.target_cache, self.draft_cache) = max_len, caches  # per layer k, v: [1, n_kv, slots, hd]
        d, t = self.draft_cache.buffers, self.target_cache.buffers
        self._draft_step = self._step_of(self._draft, d, self.draft)
        self._verify_step = self._step_of(self._verify, t, self.target)
        self._target_step = self._step_of(self._target_next, t, self.target)
        self._greedy_step = self._step_of(self._greedy_round, d + t, self.draft, self.target)

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [1, T] at positions [1, T] -> the draft's logits after the last one [1, V] (float32)."""
        return self.draft(tokens, positions, self.draft_cache, keep=LAST, static=self.static)[:, -1].float()

    def _verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [1, k+1] at positions [1, k+1] -> the target's logits [1, k+1, V] (float32)."""
        return self.target(tokens, positions, self.target_cache, static=self.static).float()

    def _target_next(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """token [1, 1] at position [1, 1] -> the target's logits after it [1, V] (float32): a step without a draft."""
        return self.target(token, position, self.target_cache, keep=LAST, static=self.static)[:, -1].float()

    def _greedy_round(self, pair: torch.Tensor, position: torch.Tensor):
        """pair [1, 2] at positions position-1, position ([1, 1]) -> (drafted [1, k], n [1], next token [1],
        whether every logit of the round, the draft's and the target's, was finite [])."""
        logits = self._draft(pair, position + torch.arange(-1, 1, device=pair.device))  # [1, V]
        finite = torch.isfinite(logits).all()
        x = greedy(logits)[:, None]
        proposed = [x]  # [1, 1] each
        for i in range(1, self.k):
            logits = self._draft(x, position + i)
            finite &= torch.isfinite(logits).all()
            x = greedy(logits)[:, None]
            proposed.append(x)
        drafted = torch.cat(proposed, dim=1)  # [1, k]
        tokens = torch.cat([pair[:, 1:], drafted], dim=1)  # [1, k+1]: the pending token and the proposals
        logits = self._verify(tokens, position + torch.arange(self.k + 1, device=pair.device))  # [1, k+1, V]
        n, token = speculative.verify_greedy(logits, drafted)
        return drafted, n, token, finite & torch.isfinite(logits).all()

    def warmup(self, greedy: bool = True, steps: int = 3, alone: bool = False, rounds: bool = True) -> float:
        """`Engine.warm_once` for a greedy or a sampling round's steps (rounds False: none, for a run where the draft
        never proposes; its slots past the caches' would not fit) and, alone: the target's step alone. Refused
        while the engine runs in another thread: its steps write both caches."""
        with self.running():
            return self._warmup(greedy, steps, alone, rounds)

    @torch.inference_mode()  # as the runs: see FastDecoder.warmup
    def _warmup(self, greedy: bool, steps: int, alone: bool, rounds: bool) -> float:
        def ids(n: int) -> torch.Tensor:  # [1, n] of zeros: the shapes and layouts `generate` passes
            return torch.zeros(1, n, dtype=torch.long, device=self.device)

        def arange(n: int) -> torch.Tensor:  # [1, n]: positions 0 .. n-1
            return torch.arange(n, device=self.device)[None]

        if greedy:
            calls = [lambda: self._greedy_step(ids(2), ids(1) + 1)]
        else:
            calls = [lambda: self._draft_step(ids(2), arange(2)), lambda: self._draft_step(ids(1), ids(1)),
                     lambda: self._verify_step(ids(self.k + 1), arange(self.k + 1))]
        seconds = self.warm_once("greedy" if greedy else "sampling", *calls, steps=steps) if rounds else 0.0
        if alone:
            seconds += self.warm_once("alone", lambda: self._target_step(ids(1), ids(1)), steps=steps)
        return seconds

    def generate(self, prompt_ids: list[int] | torch.Tensor | Request, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, stop_ids=None) -> FastSpeculativeResult:
        """Serve a `Request` (or prompt_ids and its fields) as FastDecoder.generate does, with the target's tokens."""
        request = as_request(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, stop_ids=stop_ids)
        r = self.check(request)
        with self.running(r):
            return self._generate(r)

    @torch.inference_mode()  # as FastDecoder._generate
    def _generate(self, r: Checked) -> FastSpeculativeResult:
        ids, stops, sampling, greedy = r.ids, r.stops, r.sampling, r.greedy
        k, device = self.k, self.device
        plan = budget(len(ids), r.max_new_tokens, self.max_len)  # every engine's budget
        # A round with its pending token at position L - 1 writes the target's slots L-1 .. L+k-1 and the draft's
        # L-2 .. L+k-2; a draft whose context cannot hold the prompt never proposes.
        draft_slots = self.draft_cache.max_len if len(ids) <= self.draft_cache.max_len else 0
        last_round = min(self.max_len, draft_slots + 1) - k  # the last L a round fits at
        self._warmup(greedy, 3, alone=plan.tokens > 1 and len(ids) + plan.tokens - 1 > last_round,
                     rounds=plan.tokens > 1 and len(ids) + 1 <= last_round)  # the first round's L: len(ids) + 1
        result = FastSpeculativeResult(prompt_ids=ids, k=k, stop_reason=plan.stop_reason)
        if plan.tokens == 0:
            return result
        generator = r.generator(device)
        pick = picker(sampling, generator)
        for cache in (self.target_cache, self.draft_cache):
            cache.reset()

        synchronize(device)
        start = time.perf_counter()
        prompt, positions = torch.tensor([ids], device=device), torch.arange(len(ids), device=device)  # [1, T], [T]
        logits = self.target(prompt, positions, self.target_cache, keep=LAST)[:, -1].float()  # [1, V]
        nonfinite = NonFiniteLogits(device)  # a flag on the device, read once at the end
        nonfinite.update(logits)
        token, _ = pick(logits)  # [1]
        if draft_slots:
            self.draft(prompt, positions, self.draft_cache, keep=LAST)  # only its cache is wanted
        seq = ids + [int(token)]
        result.tokens = seq[len(ids):]
        result.prefill_seconds = time.perf_counter() - start

        target_bytes, draft_bytes = step_bytes_by_context(self.target), step_bytes_by_context(self.draft)
        start = time.perf_counter()
        while (reason := end_reason(result.tokens, stops, plan)) is None:
            L = len(seq)  # the pending token seq[-1] sits at position L - 1, in neither cache yet
            k = 0 if L > last_round else self.k  # 0: the target alone, as speculative_generate's rounds of k = 0
            pair = torch.tensor([seq[-2:]], device=device) if k else None  # [1, 2] at positions L-2, L-1
            if not k:
                logits = self._target_step(torch.tensor([seq[-1:]], device=device),
                                           torch.full((1, 1), L - 1, device=device))  # [1, V]
                nonfinite.update(logits)
                drafted, n, token = torch.zeros(1, 0, dtype=torch.long), 0, pick(logits)[0]  # drafted [1, 0]
            elif greedy:
                drafted, n, token, finite = self._greedy_step(pair, torch.full((1, 1), L - 1, device=device))
                nonfinite.record(finite)
            else:
                x, pos, proposed, q = pair, torch.arange(L - 2, L, device=device)[None], [], []
                for i in range(k):
                    draft_logits = self._draft_step(x, pos)  # [1, V]
                    nonfinite.update(draft_logits)
                    t, q_i = pick(draft_logits)
                    x, pos = t.view(1, 1), torch.full((1, 1), L + i, device=device)
                    proposed.append(x)
                    q.append(q_i)
                drafted = torch.cat(proposed, dim=1)  # [1, k]
                logits = self._verify_step(torch.cat([pair[:, 1:], drafted], dim=1),
                                           torch.arange(L - 1, L + k, device=device)[None])  # [1, k+1, V]
                p = probs(logits, *sampling)
                n, token = speculative.verify(p, torch.stack(q, dim=1), drafted, generator)
                nonfinite.update(logits)
            n = int(n)  # the one host sync of the round
            # Nothing to roll back: slots past the accepted tokens are rewritten before a query can see them.
            new = (drafted[0, :n].tolist() + [int(token)])[: plan.tokens - len(result.tokens)]
            new, _ = cut_at_stop(new, stops)
            result.record(k, n, len(new))
            result.decode_bytes += round_bytes(target_bytes, draft_bytes, L, k)
            seq += new
            result.tokens += new
        synchronize(device)
        result.decode_seconds = time.perf_counter() - start
        nonfinite.check(f" in a run of {len(result.tokens)} tokens")
        result.decode_steps = len(result.tokens) - 1
        result.stop_reason = reason
        return result

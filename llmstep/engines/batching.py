"""Continuous batching: many requests share the model, and one decode step advances all of them.

At batch 1 a decode step streams every weight to make one token. The same pass can serve B sequences:
the weights are read once, and each extra row adds only its own KV cache and a row of arithmetic, so B
requests decoding together make ~B tokens per weight pass, until the math or the KV cache catches up.

*Static* batching takes B requests, runs them until the longest is done, then takes the next B: a slot
whose request finished early sits idle. *Continuous* batching (Orca, Yu et al. 2022; vLLM) admits a
waiting request into a slot the moment one frees. Every engine step:

1. requests that have arrived join the queue;
2. free slots take requests from the queue (static: only when every slot is free); each newcomer's
   prompt is prefilled alone into its own row of the cache (`cache.slot(i)`), which gives its first token
   (a newcomer done at once, stopped by that token, frees its slot for the next in the queue);
3. one decode step for all slots: tokens [S, 1] at positions [S, 1], every row at its own position, the
   model's one forward. A free slot rides along with a dummy token at position 0 (fixed shapes, as CUDA
   graphs need): nothing reads it, and the next prompt in that row overwrites it. Keys that an earlier
   occupant left beyond a row's position are hidden by the causal mask, which compares positions;
4. requests that hit a stop token, their max_new_tokens, or the end of their slot leave.

Each request samples with its own generator, one draw per row, from `llmstep.sampling`: its tokens are
the ones `llmstep.generate` gives it alone with the same seed and the same cache size. Batching changes
when a token is made, not which token (up to the float rounding of a batched matmul; exact in float64).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch

from ..core.device import synchronize
from ..core.model import Llama
from ..core.sampling import check_params, sample
from .fast import compile_step, uses_cuda_graphs
from .generate import check_max_new_tokens, check_prompt_ids, make_generator, stop_id_set

__all__ = ["Request", "Completion", "BatchRun", "ContinuousBatcher", "run_batch", "POLICIES"]

POLICIES = ("continuous", "static")


@dataclass
class Request:
    """One generation request. arrival: the engine step at which it joins the queue."""

    prompt_ids: list[int] | torch.Tensor
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: Iterable[int] = ()  # () never stops early; pass tokenizer.eos_ids to stop at the end of a text
    arrival: int = 0


@dataclass
class Completion:
    """What became of a request: its tokens, and when (in engine steps and in seconds) things happened."""

    id: int  # the request's index in the order it was submitted
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, a final stop token included
    stop_reason: str = ""  # "stop", "length" or "context", as in llmstep.generate
    slot: int = -1
    arrival: int = 0  # engine step it arrived at
    admitted: int = -1  # engine step its prompt was prefilled in
    finished: int = -1  # engine step its last token was made in
    first_token_seconds: float = float("nan")  # from the start of its arrival step to its first token
    latency_seconds: float = float("nan")  # from the start of its arrival step to its last token

    @property
    def queued_steps(self) -> int:
        return self.admitted - self.arrival

    @property
    def latency_steps(self) -> int:
        """Engine steps from arrival to the last token, both counted."""
        return self.finished - self.arrival + 1


@dataclass
class BatchRun:
    """A finished run: every request's completion, and the slots' timeline for plotting.

    timeline[s][i]: the request id slot i decoded for in engine step s, or -1 when the slot was free.
    prefills: (engine step, slot, request id) for every prompt prefilled.
    """

    policy: str
    n_slots: int
    completions: list[Completion]
    timeline: list[list[int]] = field(default_factory=list)
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # per engine step: its prefills and decode step
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.timeline)

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def slot_utilisation(self) -> float:
        """The share of decode-step rows that served a request rather than a free slot."""
        rows = [i for step in self.timeline for i in step]
        return sum(i >= 0 for i in rows) / len(rows) if rows else float("nan")

    def summary(self) -> dict:
        lat = [c.latency_steps for c in self.completions]
        served = [c for c in self.completions if c.tokens]  # a request for 0 tokens has no first token
        return {"policy": self.policy, "slots": self.n_slots, "requests": len(self.completions),
                "tokens": self.tokens, "engine_steps": self.steps, "slot_utilisation": self.slot_utilisation,
                "mean_latency_steps": statistics.fmean(lat) if lat else float("nan"),
                "max_latency_steps": max(lat, default=0),
                "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "mean_first_token_seconds": statistics.fmean(c.first_token_seconds for c in served)
                if served else float("nan"),
                "mean_latency_seconds": statistics.fmean(c.latency_seconds for c in self.completions)
                if self.completions else float("nan")}


@dataclass
class _Running:
    completion: Completion
    request: Request
    stops: set[int]
    generator: torch.Generator
    arrived_at: float  # wall time at the start of its arrival step


class ContinuousBatcher:
    """n_slots rows of KV cache, max_len positions each, and the batched decode step over them.

    compile: compile the decode step (see `llmstep.fast`; on CUDA with CUDA graphs). None compiles on
    CUDA only. Frozen weights on a CPU: change the model's weights and you need a new batcher.
    """

    def __init__(self, model: Llama, n_slots: int = 8, max_len: int | None = None, compile: bool | None = None,
                 mode: str | None = None):
        if not isinstance(n_slots, int) or isinstance(n_slots, bool) or n_slots < 1:
            raise ValueError(f"n_slots must be an integer >= 1, got {n_slots!r}")
        self.model, self.device, self.n_slots = model, model.device, n_slots
        self.max_len = model.config.max_seq_len if max_len is None else max_len
        self.cache = model.new_cache(batch_size=n_slots, max_len=self.max_len)  # k, v: [L, S, n_kv, max_len, hd]
        self.compiled = self.device.type == "cuda" if compile is None else bool(compile)
        self.cuda_graphs = self.compiled and uses_cuda_graphs(self.device, mode)
        self._step = self._decode_step
        if self.compiled:
            self._step = compile_step(self._decode_step, self.device, mode,
                                      static=self.cache.buffers)

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [S, 1], positions [S, 1] -> logits [S, vocab] (float32): one token for every slot."""
        return self.model(tokens, positions, self.cache, last_only=True)[:, -1].float()

    def _check(self, i: int, r: Request) -> tuple[list[int], set[int]]:
        """A request's prompt ids and stop ids, checked (read once: either may be a one-shot iterator)."""
        where = f"request {i}"
        try:
            check_params(r.temperature, r.top_k, r.top_p)
            check_max_new_tokens(r.max_new_tokens)
            if not isinstance(r.arrival, Integral) or isinstance(r.arrival, bool) or r.arrival < 0:
                raise ValueError(f"arrival must be an engine step (an integer >= 0), got {r.arrival!r}")
            stops = stop_id_set(r.stop_ids)
            return check_prompt_ids(r.prompt_ids, self.model.config.vocab_size, self.max_len,
                                    room="a batch slot's length"), stops
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], policy: str = "continuous") -> BatchRun:
        """Serve every request; returns their completions (in submission order) and the timeline."""
        if policy not in POLICIES:
            raise ValueError(f"unknown batching policy {policy!r}: choose one of {', '.join(POLICIES)}")
        checked = [self._check(i, r) for i, r in enumerate(requests)]  # all checked before any work
        device = self.device
        run = BatchRun(policy, self.n_slots, [Completion(i, p, arrival=int(r.arrival))
                                              for i, (r, (p, _)) in enumerate(zip(requests, checked, strict=True))])
        arrivals = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
        queue: deque[_Running] = deque()
        slots: list[_Running | None] = [None] * self.n_slots
        self.cache.reset()
        step, start = 0, time.perf_counter()

        while arrivals or queue or any(slots):
            while not queue and not any(slots) and requests[arrivals[0]].arrival > step:
                run.timeline.append([-1] * self.n_slots)  # nothing to do until the next request arrives
                run.step_seconds.append(0.0)
                step += 1
            synchronize(device)
            step_start = time.perf_counter()
            while arrivals and requests[arrivals[0]].arrival <= step:
                i = arrivals.popleft()
                r = requests[i]
                queue.append(_Running(run.completions[i], r, checked[i][1], make_generator(device, r.seed),
                                      step_start))
            if policy == "static" and not any(slots):  # a static batch takes newcomers only when all of it is done
                for s in range(min(self.n_slots, len(queue))):
                    self._prefill(queue.popleft(), s, slots, run, step)
            while policy == "continuous" and queue and None in slots:  # also a slot freed by a prefill's token
                self._prefill(queue.popleft(), slots.index(None), slots, run, step)
            run.timeline.append([-1 if j is None else j.completion.id for j in slots])  # whom the step serves
            if any(slots):
                self._decode(slots, step)
            synchronize(device)
            run.step_seconds.append(time.perf_counter() - step_start)
            step += 1
        run.seconds = time.perf_counter() - start
        return run

    def _prefill(self, job: _Running, s: int, slots: list, run: BatchRun, step: int) -> None:
        """Admit a request into slot s: its prompt alone through the model into row s of the cache, at
        positions 0..T-1, gives its first token."""
        c, r = job.completion, job.request
        slots[s], c.slot, c.admitted = job, s, step
        run.prefills.append((step, s, c.id))
        if r.max_new_tokens == 0:
            self._finish(job, slots, "length", step)
            return
        prompt = torch.tensor([c.prompt_ids], device=self.device)  # [1, T]
        logits = self.model(prompt, torch.arange(prompt.shape[1], device=self.device), self.cache.slot(s),
                            last_only=True)[:, -1]  # [1, vocab]
        token = sample(logits.float(), r.temperature, r.top_k, r.top_p, job.generator)  # [1]
        self._take(job, int(token), slots, step)  # waits for the device: the scheduler needs the token

    def _decode(self, slots: list, step: int) -> None:
        """One decode step for every slot: each running request's newest token at its own position."""
        tokens = torch.tensor([[0 if j is None else j.completion.tokens[-1]] for j in slots],
                              device=self.device)  # [S, 1]: a free slot feeds token 0 at position 0
        positions = torch.tensor([[0 if j is None else self._position(j)] for j in slots], device=self.device)
        logits = self._step(tokens, positions)  # [S, vocab]
        running = [(s, j) for s, j in enumerate(slots) if j is not None]
        drawn = torch.cat([sample(logits[s:s + 1], j.request.temperature, j.request.top_k, j.request.top_p,
                                  j.generator) for s, j in running])  # [running]: one draw per row, its generator
        for (_, job), token_id in zip(running, drawn.tolist(), strict=True):  # one wait for the device
            self._take(job, token_id, slots, step)

    @staticmethod
    def _position(job: _Running) -> int:
        """Where a running request's newest token goes: after its prompt and the tokens before it."""
        return len(job.completion.prompt_ids) + len(job.completion.tokens) - 1

    def _take(self, job: _Running, token_id: int, slots: list, step: int) -> None:
        """Record a request's new token; free its slot if it is done."""
        c = job.completion
        if not c.tokens:
            c.first_token_seconds = time.perf_counter() - job.arrived_at
        c.tokens.append(token_id)
        if token_id in job.stops:
            self._finish(job, slots, "stop", step)
        elif len(c.tokens) == job.request.max_new_tokens:
            self._finish(job, slots, "length", step)
        elif self._position(job) >= self.max_len:  # the slot is full: nowhere to write this token
            self._finish(job, slots, "context", step)

    @staticmethod
    def _finish(job: _Running, slots: list, reason: str, step: int) -> None:
        c = job.completion
        c.stop_reason, c.finished = reason, step
        c.latency_seconds = time.perf_counter() - job.arrived_at
        slots[c.slot] = None


def run_batch(model: Llama, requests: Sequence[Request], n_slots: int = 8, policy: str = "continuous",
              max_len: int | None = None, compile: bool | None = None) -> BatchRun:
    """One-shot: a ContinuousBatcher with n_slots slots serves `requests`."""
    return ContinuousBatcher(model, n_slots, max_len, compile).run(requests, policy)

"""Continuous batching's scheduler: which request runs at every engine step, and how much of it. Pure Python.

A scheduler owns the queues, the policy and the token budget and touches no tensor (vLLM v1 splits a serving engine
the same way: scheduler, KV-cache manager, model runner). Each engine step, `begin_step` lets arrivals into the
queue; `schedule` gives every running sequence the next of its known tokens (its prompt and what it made) to
compute: one when decoding, up to `prefill_chunk` prompt tokens when prefilling; it admits waiting ones into free
slots while its KV-cache manager (llmstep/engines/kv_manager.py) fits them, and preempts the youngest when the
manager cannot fit an older one's tokens. `update` records what the forward computed and the tokens it gave; a
request leaves when `decoding.end_reason` says so. So every running sequence gets one token a step, a newcomer's
from its prompt's forward. One scheduler serves both caches: a contiguous one is a manager whose every block is a
whole slot (ContinuousBatcher), a paged one hands out small blocks (PagedBatcher). Tests drive it with made-up
tokens (`dry_run`).
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..core.paged_kv import SeqChunk
from .decoding import Budget, DecodeResult, budget, end_reason
from .kv_manager import KVCacheManager
from .request import Checked, check_arrival

__all__ = ["POLICIES", "Completion", "BatchRun", "Job", "Scheduler", "Scheduled", "check_policy"]

POLICIES = ("continuous", "static")


@dataclass(kw_only=True)
class Completion(DecodeResult):
    """What became of a request: its tokens, and when (in engine steps and in seconds) things happened.
    Its decode steps were shared with the batch: decode_seconds is the time from its first token to its last,
    and its bytes are not counted per request."""

    id: int  # the request's index in the order it was submitted
    slot: int = -1
    arrival: int = 0  # engine step it arrived at
    admitted: int = -1  # engine step its prompt was prefilled in
    finished: int = -1  # engine step its last token was made in
    first_token_seconds: float = math.nan  # from the start of its arrival step to its first token
    latency_seconds: float = math.nan  # from the start of its arrival step to its last token

    @property
    def queued_steps(self) -> int:
        return self.admitted - self.arrival

    @property
    def latency_steps(self) -> int:
        """Engine steps from arrival to the last token, both counted."""
        return self.finished - self.arrival + 1

    @property
    def decode_steps(self) -> int:
        return max(0, len(self.tokens) - 1)

    @property
    def decode_seconds(self) -> float:
        return self.latency_seconds - self.first_token_seconds


@dataclass
class BatchRun:
    """A finished run: every request's completion, and the slots' timeline for plotting. timeline[s][i]: the
    request id slot i computed for in engine step s (-1: free); prefills: (engine step, slot, request id) of each
    admission."""

    policy: str
    n_slots: int
    completions: list[Completion]
    timeline: list[list[int]] = field(default_factory=list)
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # per engine step: its forwards and draws
    seconds: float = 0.0
    kv_stats: dict = field(default_factory=dict)  # the cache's use: block_size, blocks_total, peak_blocks_used, ...
    block_tables: list[dict[int, list[int]]] = field(default_factory=list)  # per step, id -> its blocks
    step_tokens: list[int] = field(default_factory=list)  # per step, the tokens its forwards computed
    queued: list[int] = field(default_factory=list)  # per step: requests arrived and waiting once it has admitted

    @property
    def steps(self) -> int:
        return len(self.timeline)

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else math.nan

    def busy_slots(self) -> list[tuple[int, int]]:
        """(slots serving a request, how many steps had that row) for each distinct timeline row: idle steps
        share one row object, so a run with a million idle steps costs a few distinct rows here, not a loop."""
        steps = collections.Counter(map(id, self.timeline))
        rows = dict(zip(map(id, self.timeline), self.timeline, strict=True))
        return [(sum(i >= 0 for i in rows[key]), n) for key, n in steps.items()]

    @property
    def slot_utilisation(self) -> float:
        """The share of decode-step rows that served a request rather than a free slot."""
        rows = len(self.timeline) * self.n_slots
        return sum(busy * n for busy, n in self.busy_slots()) / rows if rows else math.nan

    def summary(self) -> dict:
        lat = [c.latency_steps for c in self.completions]
        served = [c for c in self.completions if c.tokens]  # a request for 0 tokens has no first token
        return {"policy": self.policy, "slots": self.n_slots, "requests": len(self.completions),
                "tokens": self.tokens, "engine_steps": self.steps, "slot_utilisation": self.slot_utilisation,
                "mean_latency_steps": statistics.fmean(lat) if lat else math.nan,
                "max_latency_steps": max(lat, default=0),
                "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "mean_first_token_seconds": statistics.fmean(c.first_token_seconds for c in served)
                if served else math.nan,
                "mean_latency_seconds": statistics.fmean(c.latency_seconds for c in self.completions)
                if self.completions else math.nan} | {f"kv_{k}": v for k, v in self.kv_stats.items()}


@dataclass(eq=False)  # one job is one request: compared by identity, not by its (long) prompt, in every list test
class Job:
    """One request as a scheduler sees it: its record, its budget and its stop tokens (no tensors)."""

    completion: Completion
    plan: Budget  # decoding.budget(prompt length, max_new_tokens, a slot's length)
    stops: set[int]
    arrived_at: float = math.nan  # clock time at the start of its arrival step
    computed: int = 0  # how many of its known tokens the KV cache holds

    @classmethod
    def of(cls, request: Checked, index: int, max_len: int) -> Job:
        """Request `index`, checked, as a job whose sequence may fill max_len positions."""
        return cls(Completion(id=index, prompt_ids=request.ids, arrival=request.arrival),
                   budget(len(request.ids), request.max_new_tokens, max_len), request.stops)

    @property
    def id(self) -> int:
        return self.completion.id

    @property
    def known(self) -> list[int]:
        """Its prompt and the tokens it made: what the cache holds before it samples the next."""
        return self.completion.prompt_ids + self.completion.tokens


@dataclass(eq=False)
class Scheduled:
    """One sequence's share of an engine step: compute `n` of its known tokens (`tokens`) into its blocks."""

    job: Job
    chunk: SeqChunk  # its block table, the first position to compute, how many
    tokens: list[int]  # the tokens at those positions
    samples: bool  # the cache catches up with what it knows: the forward's last logits give its next token


def check_policy(policy) -> None:
    """A batching policy of POLICIES, or a ValueError naming it."""
    if policy not in POLICIES:
        raise ValueError(f"unknown batching policy {policy!r}: choose one of {', '.join(POLICIES)}")


class Scheduler:
    """One run over `jobs` (in submission order): at most n_slots sequences at once, each in a slot (the lowest
    free one) from its admission until it leaves, admitted when the KV-cache manager `kv` fits it (a contiguous
    cache is a manager of n_slots blocks, each a whole slot). policy: "continuous" admits whenever a slot is free,
    "static" only when nothing runs (a batch forms, and runs until all of it is done). prefill_chunk: the most
    prompt tokens a step computes (None: whole prompts). clock: the step's (a test may pass its own)."""

    def __init__(self, jobs: list[Job], n_slots: int, kv: KVCacheManager, prefill_chunk: int | None = None,
                 policy: str = "continuous", clock: Callable[[], float] = time.perf_counter):
        check_policy(policy)
        for job in jobs:  # check_request's rule, for jobs built without it (a simulated workload's)
            try:
                check_arrival(job.completion.arrival)
            except ValueError as e:
                raise ValueError(f"request {job.completion.id}: {e}") from None
        self.kv, self.prefill_chunk, self.policy, self.clock = kv, prefill_chunk, policy, clock
        self.run = BatchRun(policy, n_slots, [j.completion for j in jobs])
        self.arrivals = deque(sorted(jobs, key=lambda j: j.completion.arrival))  # stable: FIFO within a step
        self.queue: deque[Job] = deque()
        self.running: list[Job] = []  # oldest admitted first
        self.slots: list[Job | None] = [None] * n_slots
        self.step, self._step_start = 0, math.nan
        self.stats = {"block_size": kv.block_size, "blocks_total": kv.n_blocks, "peak_blocks_used": 0,
                      "prefix_hit_tokens": 0, "preemptions": 0, "prefill_tokens": 0, "decode_tokens": 0}
        self.run.kv_stats = self.stats

    @property
    def done(self) -> bool:
        return not (self.arrivals or self.queue or self.running)

    def begin_step(self) -> None:
        """Skip the steps in which nothing runs and nobody arrives (recorded idle), then let arrivals in."""
        if not self.queue and not self.running and self.arrivals[0].completion.arrival > self.step:
            self._idle(self.arrivals[0].completion.arrival - self.step)
        self._step_start = self.clock()
        while self.arrivals and self.arrivals[0].completion.arrival <= self.step:
            job = self.arrivals.popleft()
            job.arrived_at = self._step_start
            self.queue.append(job)

    def _idle(self, steps: int) -> None:
        """Record `steps` steps with nothing to do until the next arrival, at once."""
        run = self.run
        run.timeline.extend(itertools.repeat([-1] * run.n_slots, steps))  # one row, shared: read-only
        for record, value in ((run.queued, 0), (run.step_seconds, 0.0), (run.block_tables, {}), (run.step_tokens, 0)):
            record.extend(itertools.repeat(value, steps))
        self.step += steps

    def _grow(self, job: Job, n: int) -> bool:
        """Blocks for n more tokens of a running job. While they cannot fit, the youngest running job is preempted
        (its blocks freed; it waits first in the queue and recomputes what it knows on return): False if that was
        the job itself."""
        while self.kv.allocate(job.id, job.computed + n) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is job:
                return False
        return True

    def preempt(self, job: Job) -> None:
        """A running job gives back its slot and blocks and waits first in the queue; it recomputes what it knows
        on return (its tokens the same: nothing of it is drawn again)."""
        self._leave(job)
        job.computed = 0
        self.queue.appendleft(job)
        self.stats["preemptions"] += 1

    def _admit(self, job: Job, room: float) -> int:
        """Take a waiting job into the lowest free slot if the manager fits it: its cached prefix, then blocks for up
        to `room` tokens. Returns the tokens to compute now (0: not admitted)."""
        known = job.known
        prefix = self.kv.cached_prefix(job.id, known)
        n = int(min(len(known) - prefix.n_tokens, room))
        if n < 1 or self.kv.allocate(job.id, prefix.n_tokens + n, prefix) is None:
            return 0
        job.computed = prefix.n_tokens
        self.stats["prefix_hit_tokens"] += prefix.n_tokens
        self.running.append(job)
        c = job.completion
        c.slot = self.slots.index(None)
        self.slots[c.slot] = job
        if c.admitted < 0:
            c.admitted = self.step
        self.run.prefills.append((self.step, c.slot, c.id))
        return n

    def schedule(self) -> list[Scheduled]:
        """This step's work, oldest running sequence first, then newcomers; recorded in the timeline."""
        room = math.inf if self.prefill_chunk is None else self.prefill_chunk  # prompt tokens left this step
        admits = self.policy == "continuous" or not self.running  # static: a batch forms when nothing runs
        plan: list[tuple[Job, int]] = []
        preempted = self.stats["preemptions"]
        for job in list(self.running):
            if job not in self.running:  # preempted for an older one in this loop
                continue
            left = len(job.known) - job.computed
            decoding = left == 1 and bool(job.completion.tokens)  # its newest token: not the prompt budget's
            n = 1 if decoding else int(min(left, room))
            if n and self._grow(job, n):
                plan.append((job, n))
                room -= 0 if decoding else n
        while admits and self.queue and self.stats["preemptions"] == preempted and None in self.slots:
            job = self.queue[0]
            if job.plan.tokens == 0:  # wants no token: done without a forward
                self.queue.popleft()
                job.completion.admitted = self.step
                self._finish(job, job.plan.stop_reason)
                continue
            n = self._admit(job, room)
            if not n:
                break
            self.queue.popleft()
            plan.append((job, n))
            room -= n
        out, row = [], [-1] * self.run.n_slots
        for job, n in plan:
            start, known = job.computed, job.known
            decode = n == 1 and bool(job.completion.tokens) and start == len(known) - 1
            self.stats["decode_tokens" if decode else "prefill_tokens"] += n
            out.append(Scheduled(job, SeqChunk(self.kv.table(job.id), start, n), known[start:start + n],
                                 start + n == len(known)))
            row[job.completion.slot] = job.id
        self.stats["peak_blocks_used"] = self.kv.pool.peak_used
        self.run.timeline.append(row)
        self.run.block_tables.append({s.job.id: list(s.chunk.table) for s in out})
        self.run.step_tokens.append(sum(n for _, n in plan))
        self.run.queued.append(len(self.queue))
        return out

    def update(self, work: Sequence[Scheduled], tokens: Sequence[int]) -> None:
        """The forward computed `work`: each chunk's tokens are in the cache (the blocks they filled cached, with
        prefix caching); then record `tokens`, one per chunk that samples, in order."""
        for s in work:
            stop = s.chunk.start + s.chunk.n_tokens
            self.kv.cache_blocks(s.job.id, s.job.known, s.chunk.start, stop)
            s.job.computed = stop
        for job, token_id in zip([s.job for s in work if s.samples], tokens, strict=True):
            self.take(job, token_id)

    def take(self, job: Job, token_id: int) -> None:
        """Record a request's new token; it leaves if that ends it."""
        c = job.completion
        if not c.tokens:
            c.first_token_seconds = self.clock() - job.arrived_at
        c.tokens.append(token_id)
        reason = end_reason(c.tokens, job.stops, job.plan)
        if reason:
            self._finish(job, reason)

    def _finish(self, job: Job, reason: str) -> None:
        c = job.completion
        c.stop_reason, c.finished = reason, self.step
        c.latency_seconds = self.clock() - job.arrived_at
        self._leave(job)

    def _leave(self, job: Job) -> None:
        """The job gives back its slot and its blocks (finished, preempted or cancelled)."""
        if job in self.running:
            self.running.remove(job)
            self.slots[job.completion.slot] = None
        self.kv.free(job.id)

    def end_step(self) -> None:
        self.run.step_seconds.append(self.clock() - self._step_start)
        self.step += 1

    def dry_run(self, token_id: int) -> BatchRun:
        """Run the schedule to its end without a model: every forward that samples makes `token_id` (not a stop
        token), so the timeline is the one a model gives requests that run to their budgets."""
        while not self.done:
            self.begin_step()
            work = self.schedule()
            self.update(work, [token_id] * sum(s.samples for s in work))
            self.end_step()
        return self.run

    # ---- requests that arrive while it runs (session.PagedSession, for `llmstep serve`) ----------------------

    def submit(self, job: Job) -> None:
        """A job that arrives now, between engine steps: it joins the queue at the next `begin_step`."""
        job.completion.arrival = self.step
        self.arrivals.append(job)

    def cancel(self, job: Job) -> None:
        """Drop a job wherever it is (arrived, queued or running): its blocks go back to the pool at once;
        its stop_reason is "interrupted". A job already finished is left as it is."""
        if job.completion.stop_reason:
            return
        for waiting in (self.arrivals, self.queue):
            if job in waiting:
                waiting.remove(job)
        self._finish(job, "interrupted")

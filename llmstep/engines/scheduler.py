"""Continuous batching's scheduler: which request runs in which slot at every engine step. Pure Python.

The scheduler owns the queues and the policy and touches no tensor (vLLM v1 splits a serving engine the
same way: scheduler, KV-cache manager, model runner). An engine step, as `ContinuousBatcher.run` drives it
(llmstep/engines/batching.py):

1. `begin_step`: requests that have arrived join the queue (static batching also opens its next batch
   here, but only when every slot is free);
2. `admit`, until it returns None: the next queued request and the slot it gets; the runner prefills
   its prompt into that slot and `take` records the token that gives (a request done at once, stopped by
   that token or wanting none, frees its slot for the next in the queue, in the same step);
3. `running`: whom the step's batched decode serves, one entry per slot (None: a free slot); the runner
   makes one token for each and `take` records them;
4. `end_step`. A request leaves when `decoding.end_reason` says so: a stop token, its max_new_tokens, or
   the end of its slot (`decoding.budget`).

What a slot is stays inside `admit` (`_free_slot`): one row of max_len positions, reserved whole.

`BlockScheduler` is the same loop over a paged KV cache (llmstep.core.paged_kv): admission by free
blocks, not free slots, and no difference between prefill and decode. A sequence has tokens it knows (its
prompt and what it made) and tokens in the cache; each step, `schedule` gives every running sequence the
next of its known tokens to compute (one, when decoding; up to the step's `prefill_chunk` budget of prompt
tokens, when prefilling) and the blocks they need, admits waiting ones while blocks, the budget and
`n_slots` allow (their cached prefix first, with prefix caching), and preempts the youngest running
sequence when the pool runs dry (its blocks freed, its known tokens recomputed when it returns). A sequence
whose cache catches up with what it knows gets its next token. Tests drive it with made-up tokens too.
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.paged_kv import BlockManager, SeqChunk, block_key, blocks_for
from .decoding import Budget, DecodeResult, end_reason

__all__ = ["POLICIES", "Completion", "BatchRun", "Job", "Scheduler", "BlockScheduler", "Scheduled"]

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
    kv_stats: dict = field(default_factory=dict)  # the cache's use: block_size, blocks_total, peak_blocks_used, ...
    block_tables: list[dict[int, list[int]]] = field(default_factory=list)  # paged: per step, id -> its blocks
    step_tokens: list[int] = field(default_factory=list)  # paged: per step, the tokens its one forward computed
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


@dataclass
class Job:
    """One request as the scheduler sees it: its record, its budget and its stop tokens (no tensors)."""

    completion: Completion
    plan: Budget  # decoding.budget(prompt length, max_new_tokens, a slot's length)
    stops: set[int]
    arrived_at: float = math.nan  # clock time at the start of its arrival step

    @property
    def id(self) -> int:
        return self.completion.id

    @property
    def position(self) -> int:
        """Where its newest token goes in its slot: after its prompt and the tokens before it."""
        return len(self.completion.prompt_ids) + len(self.completion.tokens) - 1


class Scheduler:
    """The queue, the slots and the policy for one run over `jobs` (in submission order).

    clock: the wall clock for the per-request seconds (a test may pass its own).
    """

    def __init__(self, jobs: list[Job], n_slots: int, policy: str = "continuous",
                 clock: Callable[[], float] = time.perf_counter):
        if policy not in POLICIES:
            raise ValueError(f"unknown batching policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.jobs, self.policy, self.clock = jobs, policy, clock
        self.run = BatchRun(policy, n_slots, [j.completion for j in jobs])
        self.arrivals = deque(sorted(jobs, key=lambda j: j.completion.arrival))  # stable: FIFO within a step
        self.queue: deque[Job] = deque()
        self.slots: list[Job | None] = [None] * n_slots
        self.step = 0
        self._static_batch: deque[int] = deque()  # the slots a static batch still has to fill this step
        self._step_start = math.nan

    @property
    def done(self) -> bool:
        return not (self.arrivals or self.queue or any(self.slots))

    def begin_step(self) -> None:
        """Skip the steps in which nothing runs and nobody arrives (recorded idle), then let arrivals in."""
        if not self.queue and not any(self.slots) and self.arrivals[0].completion.arrival > self.step:
            idle = self.arrivals[0].completion.arrival - self.step  # steps with nothing to do until the next arrival
            self.run.timeline.extend(itertools.repeat([-1] * len(self.slots), idle))  # one row, shared: read-only
            self.run.queued.extend(itertools.repeat(0, idle))
            self.run.step_seconds.extend(itertools.repeat(0.0, idle))
            self.step += idle
        self._step_start = self.clock()
        while self.arrivals and self.arrivals[0].completion.arrival <= self.step:
            job = self.arrivals.popleft()
            job.arrived_at = self._step_start
            self.queue.append(job)
        if self.policy == "static" and not any(self.slots):  # a static batch forms only when all of it is done
            self._static_batch = deque(range(min(len(self.slots), len(self.queue))))

    def _free_slot(self) -> int | None:
        """The slot the next queued request may take now, or None (the policy's one decision)."""
        if self.policy == "static":
            return self._static_batch.popleft() if self._static_batch else None
        return self.slots.index(None) if None in self.slots else None

    def admit(self) -> Job | None:
        """The next request to prefill, now in its slot; None when the policy admits nobody more this step.
        A request for 0 tokens is admitted and finished here, without a prefill."""
        while self.queue and (slot := self._free_slot()) is not None:
            job = self.queue.popleft()
            c = job.completion
            self.slots[slot], c.slot, c.admitted = job, slot, self.step
            self.run.prefills.append((self.step, slot, c.id))
            if job.plan.tokens == 0:
                self._finish(job, job.plan.stop_reason)
                continue
            return job
        return None

    def running(self) -> list[Job | None]:
        """Whom this step's batched decode serves, one entry per slot (None: free); recorded in the timeline."""
        self.run.timeline.append([-1 if j is None else j.id for j in self.slots])
        self.run.queued.append(len(self.queue))
        return list(self.slots)

    def take(self, job: Job, token_id: int) -> None:
        """Record a request's new token; free its slot if that ends it."""
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
        self.slots[c.slot] = None

    def end_step(self) -> None:
        self.run.step_seconds.append(self.clock() - self._step_start)
        self.step += 1

    def dry_run(self, token_id: int) -> BatchRun:
        """Run the schedule to its end without a model: every prefill and every decode makes `token_id` (not a
        stop token), so the timeline is the one a model gives requests that run to their budgets."""
        while not self.done:
            self.begin_step()
            while (job := self.admit()) is not None:
                self.take(job, token_id)  # the prefill's token
            for job in self.running():
                if job is not None:
                    self.take(job, token_id)  # the decode step's token
            self.end_step()
        return self.run


# ---- the paged cache's scheduler -----------------------------------------------------------------------

@dataclass
class Scheduled:
    """One sequence's share of an engine step: compute `n` of its known tokens (`tokens`) into its blocks."""

    job: Job
    chunk: SeqChunk  # its block table, the first position to compute, how many
    tokens: list[int]  # the tokens at those positions
    samples: bool  # the cache catches up with what it knows: the forward's last logits give its next token


class BlockScheduler(Scheduler):
    """Continuous batching over a pool of KV blocks (`BlockManager`): at most n_slots sequences run at once,
    admitted by free blocks; prefill_chunk: the most prompt tokens one step computes (None: whole prompts)."""

    def __init__(self, jobs: list[Job], n_slots: int, blocks: BlockManager, prefill_chunk: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        super().__init__(jobs, n_slots, "continuous", clock)
        self.blocks, self.prefill_chunk = blocks, prefill_chunk
        self.slots = []  # the running sequences, oldest admission first (a list without free entries)
        self.tables: dict[int, list[int]] = {}  # job id -> its block table
        self.computed: dict[int, int] = {}  # job id -> tokens in the cache
        self.keys: dict[int, list[bytes]] = {}  # job id -> its full blocks' prefix-cache keys, as far as computed
        self.stats = {"block_size": blocks.block_size, "blocks_total": blocks.n_blocks, "peak_blocks_used": 0,
                      "prefix_hit_tokens": 0, "preemptions": 0, "prefill_tokens": 0, "decode_tokens": 0}
        self.run.kv_stats = self.stats

    @staticmethod
    def known(job: Job) -> list[int]:
        return job.completion.prompt_ids + job.completion.tokens

    def _keys(self, job: Job, n_full: int) -> list[bytes]:
        """The prefix-cache keys of the first n_full blocks of the job's known tokens (the chain, extended)."""
        keys, known, bs = self.keys.setdefault(job.id, []), self.known(job), self.blocks.block_size
        while len(keys) < n_full:
            keys.append(block_key(keys[-1] if keys else None, known[len(keys) * bs:(len(keys) + 1) * bs]))
        return keys[:n_full]

    def _grow(self, job: Job, n: int) -> bool:
        """Blocks for n more tokens of a running job, preempting the youngest others while the pool is dry;
        False if the job itself was the youngest left and was preempted."""
        table = self.tables[job.id]
        need = blocks_for(self.computed[job.id] + n, self.blocks.block_size) - len(table)
        while need > self.blocks.n_free:
            victim = self.slots[-1]
            self._preempt(victim)
            if victim is job:
                return False
        table += [self.blocks.allocate() for _ in range(need)]
        return True

    def _preempt(self, job: Job) -> None:
        """Free a running job's blocks; it waits first in the queue and recomputes what it knows on return."""
        self.blocks.release(self.tables.pop(job.id))
        self.computed.pop(job.id)
        self.slots.remove(job)
        self.queue.appendleft(job)
        self.stats["preemptions"] += 1

    def _admit(self, job: Job, room: float) -> int:
        """Take a waiting job if blocks allow: its cached prefix, then blocks for up to `room` tokens. Returns
        the tokens to compute now (0: not admitted)."""
        known, bs = self.known(job), self.blocks.block_size
        hits = self.blocks.cached_prefix(self._keys(job, (len(known) - 1) // bs))  # leave a token to compute
        n = int(min(len(known) - len(hits) * bs, room))
        need = blocks_for(len(hits) * bs + n, bs) - len(hits)
        if n < 1 or need > self.blocks.n_free - sum(b in self.blocks.evictable for b in hits):
            return 0
        self.blocks.hold(hits)
        self.tables[job.id] = hits + [self.blocks.allocate() for _ in range(need)]
        self.computed[job.id] = len(hits) * bs
        self.stats["prefix_hit_tokens"] += len(hits) * bs
        self.slots.append(job)
        c = job.completion
        if c.admitted < 0:
            c.admitted = self.step
        self.run.prefills.append((self.step, -1, c.id))
        return n

    def schedule(self) -> list[Scheduled]:
        """This step's work, oldest running sequence first, then newcomers; recorded in the timeline."""
        room = math.inf if self.prefill_chunk is None else self.prefill_chunk  # prompt tokens left this step
        plan: list[tuple[Job, int]] = []
        preempted = self.stats["preemptions"]
        for job in list(self.slots):
            if job not in self.slots:  # preempted for an older one in this loop
                continue
            left = len(self.known(job)) - self.computed[job.id]
            decoding = left == 1 and bool(job.completion.tokens)  # its newest token: not the prompt budget's
            n = 1 if decoding else int(min(left, room))
            if n and self._grow(job, n):
                plan.append((job, n))
                room -= 0 if decoding else n
        while self.queue and self.stats["preemptions"] == preempted and len(self.slots) < self.run.n_slots:
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
        out = []
        for job, n in plan:
            start, known = self.computed[job.id], self.known(job)
            decode = n == 1 and bool(job.completion.tokens) and start == len(known) - 1
            self.stats["decode_tokens" if decode else "prefill_tokens"] += n
            out.append(Scheduled(job, SeqChunk(self.tables[job.id], start, n), known[start:start + n],
                                 start + n == len(known)))
        self.stats["peak_blocks_used"] = self.blocks.peak_used
        self.run.timeline.append([s.job.id for s in out] + [-1] * (self.run.n_slots - len(out)))
        self.run.block_tables.append({s.job.id: list(self.tables[s.job.id]) for s in out})
        self.run.step_tokens.append(sum(n for _, n in plan))
        self.run.queued.append(len(self.queue))
        return out

    def computed_chunk(self, s: Scheduled) -> None:
        """The forward wrote s's tokens: count them, and cache the blocks they filled (with prefix caching)."""
        job, bs = s.job, self.blocks.block_size
        before, after = self.computed[job.id], self.computed[job.id] + s.chunk.n_tokens
        self.computed[job.id] = after
        for b, key in enumerate(self._keys(job, after // bs)[before // bs:], start=before // bs):
            self.blocks.register(self.tables[job.id][b], key)

    def _finish(self, job: Job, reason: str) -> None:
        c = job.completion
        c.stop_reason, c.finished = reason, self.step
        c.latency_seconds = self.clock() - job.arrived_at
        if job in self.slots:
            self.slots.remove(job)
            self.blocks.release(self.tables.pop(job.id))
            self.computed.pop(job.id)
        self.keys.pop(job.id, None)

    def begin_step(self) -> None:
        if not self.queue and not self.slots and self.arrivals[0].completion.arrival > self.step:
            idle = self.arrivals[0].completion.arrival - self.step  # nothing to do until the next request arrives
            self.run.timeline.extend(itertools.repeat([-1] * self.run.n_slots, idle))  # one row, shared: read-only
            self.run.block_tables.extend(itertools.repeat({}, idle))
            for record, value in ((self.run.step_tokens, 0), (self.run.queued, 0), (self.run.step_seconds, 0.0)):
                record.extend(itertools.repeat(value, idle))
            self.step += idle
        super().begin_step()

    # ---- requests that arrive while it runs (batching.PagedSession, for `llmstep serve`) ---------------

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

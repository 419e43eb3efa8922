"""Continuous batching over the paged KV cache one engine step at a time, for requests that arrive while it runs.

`PagedBatcher.run` serves a workload known in advance. A server does not know what comes next: `PagedSession` is
the same engine step (`batching.engine_step`) driven from outside, one step per call, with requests submitted and
cancelled between steps. A request gets the tokens `PagedBatcher.run` and `llmstep.generate` give it, whenever it
arrives. One thread drives a session: `llmstep serve`'s engine thread (llmstep.serve.engine); another thread's
submit, step or cancel meanwhile is refused (ConcurrentUseError).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from ..core.model import Llama
from ..core.paged_kv import blocks_for
from ..core.sampling import sample
from .batching import PagedRunner, check_paged_options, engine_step
from .decoding import held
from .kv_manager import KVCacheManager, check_fits
from .request import Checked, Request, check_request
from .scheduler import Job, Scheduler

__all__ = ["PagedSession", "TokenOut"]


@dataclass(frozen=True)
class TokenOut:
    """What one engine step made for one request: its new token, and why it ended (None: more to come)."""

    id: int
    token: int  # -1: none (a request that wanted none, or one whose logits broke)
    finish_reason: str | None  # "stop", "length", "context"; "error": its logits held a NaN or an Inf


class PagedSession:
    """`PagedBatcher.run`'s loop one engine step at a time: `submit` a request between steps (it joins at the next;
    its `arrival` is ignored), `step`, read the tokens it made, `cancel` a request to free its blocks at once.

    n_slots, block_size, prefix_caching, prefill_chunk: PagedBatcher's. n_blocks: the pool, fixed (None: n_slots
    sequences of the model's context). No per-step record is kept (a server runs for ever); `stats` counts.
    """

    def __init__(self, model: Llama, n_slots: int = 8, block_size: int = 16, n_blocks: int | None = None,
                 prefix_caching: bool = True, prefill_chunk: int | None = None):
        check_paged_options(n_slots, block_size, prefix_caching, prefill_chunk, n_blocks=n_blocks)
        if n_blocks is None:
            n_blocks = n_slots * blocks_for(model.config.max_seq_len, block_size)
        self.model, self.device, self.n_slots, self.block_size = model, model.device, n_slots, block_size
        self.n_blocks, self.closed = n_blocks, False
        self.runner = PagedRunner(model, n_blocks, block_size)
        self.kv = KVCacheManager(n_blocks, block_size, prefix_caching)
        self.blocks = self.kv.pool  # its counters: n_used, peak_used
        self.scheduler = Scheduler([], n_slots, self.kv, prefill_chunk)
        self.stats = self.scheduler.stats
        self._jobs: dict[int, tuple[Job, Checked, torch.Generator]] = {}  # unfinished: id -> job, request, generator
        self._ids = itertools.count()
        self._broken: set[int] = set()  # this step's requests whose logits held a NaN or an Inf
        self._driver = threading.Lock()  # held by the one thread inside submit, cancel or step

    def _driving(self):
        """One thread drives a session: a call while another thread is inside one is refused, not interleaved."""
        return held(self._driver, "this PagedSession is being driven by another thread: one thread submits, steps "
                                  "and cancels (llmstep serve's engine thread does)")

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (waiting or running)."""
        return len(self._jobs)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def submit(self, request: Request) -> int:
        """Check a request (a ValueError names what is wrong) and queue it; returns its id. A closed session takes
        none (RuntimeError, as `step` raises)."""
        with self._driving():
            return self._submit(request)

    def _submit(self, request: Request) -> int:
        if self.closed:
            raise RuntimeError("this PagedSession is closed")
        checked = check_request(request, self.model)
        job = Job.of(checked, -1, self.model.config.max_seq_len)  # its arrival: set by `submit`
        check_fits(len(checked.ids), job.plan.tokens, self.n_blocks, self.block_size)
        job.completion.id = next(self._ids)  # a refused request takes no id
        self._jobs[job.id] = (job, checked, checked.generator(self.device))
        self.scheduler.submit(job)
        return job.id

    def cancel(self, request_id: int) -> None:
        """Drop a request (waiting or running): its blocks go back now. Unknown or finished ids are ignored."""
        with self._driving():
            entry = self._jobs.pop(request_id, None)
            if entry is not None:
                self.scheduler.cancel(entry[0])

    def step(self) -> list[TokenOut]:
        """One engine step (nothing when no request is pending): the tokens it made, one per request that got one.
        A request whose logits held a NaN or an Inf ends here with finish_reason "error" and no token (its draw is
        meaningless, so not shown), its blocks freed; the others go on (a model may overflow on one input alone).
        The paged cache keeps one sequence's non-finite keys and values from the others of its forward (it stores
        them as 0 and marks the rows that read them NaN: `PagedKVCache`); as a second guard, after a step that broke
        a request, those in the middle of their prompt start it again (preempted) and the prefix cache is emptied,
        so no later request finds a block that step registered."""
        with self._driving():
            return self._step()

    @torch.inference_mode()
    def _step(self) -> list[TokenOut]:
        if self.closed:
            raise RuntimeError("this PagedSession is closed")
        out = []
        if self.scheduler.done:
            return out
        self._broken = set()
        made = engine_step(self.scheduler, lambda work: self.runner.compute(work, self._draw), self.device)
        if self._broken:
            # a request that computed part of its prompt in this forward drew nothing to check, and may hold NaN
            # keys from a broken neighbour: it starts over (preempted), so nothing of it is cached or read again
            for job in [j for j in self.scheduler.running if j.id not in self._broken and
                        j.computed < len(j.known) - bool(j.completion.tokens)]:
                self.scheduler.preempt(job)
            self.kv.pool.forget_cached()
        for job in made:
            if job.id in self._broken:
                self.scheduler.cancel(job)  # its blocks back now (a no-op where its meaningless token ended it)
                del self._jobs[job.id]
                out.append(TokenOut(job.id, -1, "error"))
                continue
            reason = job.completion.stop_reason or None
            if reason:
                del self._jobs[job.id]
            out.append(TokenOut(job.id, job.completion.tokens[-1], reason))
        for job in [j for j, _, _ in self._jobs.values() if j.completion.stop_reason]:  # wanted 0 tokens
            del self._jobs[job.id]
            out.append(TokenOut(job.id, -1, job.completion.stop_reason))
        run = self.scheduler.run  # a server's session has no end: keep no per-step record
        for record in (run.timeline, run.block_tables, run.step_tokens, run.queued, run.step_seconds, run.prefills):
            record.clear()
        return out

    def _draw(self, logits: torch.Tensor, ids: list[int]) -> list[int]:
        """logits [K, vocab], row k of request ids[k] -> one token each, drawn with its request's own generator; the
        requests whose rows are not all finite noted in `_broken` (`step` ends them). One wait for the device."""
        tokens = torch.cat([sample(logits[k:k + 1], *r.sampling, g) for k, (_, r, g) in
                            enumerate(self._jobs[i] for i in ids)])  # [K]
        finite = torch.isfinite(logits).all(-1)  # [K]
        tokens, finite = torch.stack([tokens, finite.long()]).tolist()
        self._broken.update(i for i, ok in zip(ids, finite, strict=True) if not ok)
        return tokens

    def close(self) -> None:
        """Cancel what is left; the session takes no more steps."""
        if not self.closed:
            for i in list(self._jobs):
                self.cancel(i)
            self.closed = True

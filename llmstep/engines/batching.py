"""Continuous batching: many requests share the model, and one decode step advances all of them.

At batch 1 a decode step streams every weight to make one token. The same pass can serve B sequences: the weights
are read once, and each extra row adds only its own KV cache and a row of arithmetic, so B requests decoding
together make ~B tokens per weight pass, until the math or the KV cache catches up.

*Static* batching takes B requests, runs them until the longest is done, then takes the next B: a slot whose
request finished early sits idle. *Continuous* batching (Orca, Yu et al. 2022; vLLM) admits a waiting request into
a slot the moment one frees. One scheduler (scheduler.py) decides both, every engine step: arrivals join the queue;
free slots take requests from it (static: only when no slot is busy); every running request gets one token, a
newcomer's from its prompt's forward. Over a contiguous cache (`ContinuousBatcher`) the step is one decode for
every slot, tokens [S, 1] at positions [S, 1], each row at its own position, then each newcomer's prompt prefilled
alone into its own row of the cache (`cache.slot(i)`). A slot with no token to decode rides along with a dummy
token at position 0 (fixed shapes, as CUDA graphs need): nothing reads it (a newcomer's prefill overwrites it), and
keys an earlier occupant left past a row's position are hidden by the causal mask. The runner (`BatchRunner`) owns
the cache and does the forwards; `ContinuousBatcher`, a runner that drives the scheduler, samples each row with its
request's own generator, so a request gets the tokens `llmstep.generate` gives it alone (up to the float rounding
of a batched matmul; exact in float64).

Over a paged KV cache (`PagedBatcher`; llmstep.core.paged_kv) a sequence's keys live in blocks, not in a row of the
cache (its slot is only its place in the batch), and there is no separate prefill: each engine step is one eager
forward over a flattened row [1, N] holding every running sequence's next token and up to `prefill_chunk` prompt
tokens of newcomers (chunked prefill, Agrawal et al. 2023, "Sarathi"), each token at its own position, in its own
block slot, attending to its own sequence's keys (as vLLM lays a step out). When the pool runs dry the youngest
sequence is preempted and recomputes what it knew when it returns (its generator keeps its place); with prefix
caching a newcomer starts after the longest prefix of full blocks anyone computed. Every request is checked before
any work (a bad one is refused with its index).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from ..core.config import LlamaConfig
from ..core.cost import check_fits as check_memory
from ..core.cost import dtype_bytes, kv_cache_bytes
from ..core.device import synchronize
from ..core.model import LAST, Llama
from ..core.paged_kv import PagedKVCache, blocks_for, check_pool
from .decoding import CACHE_ROUNDING, cache_len, check_int
from .engine import Engine, Rows
from .kv_manager import KVCacheManager, check_fits
from .request import MAX_ARRIVAL_STEP, Checked, Request, check_request
from .scheduler import POLICIES, BatchRun, Completion, Job, Scheduled, Scheduler, check_policy

__all__ = ["Request", "Completion", "BatchRun", "BatchRunner", "ContinuousBatcher", "PagedRunner", "PagedBatcher",
           "engine_step", "run_steps", "make_batcher", "pool_blocks", "run_batch", "POLICIES", "KV_LAYOUTS",
           "MAX_ARRIVAL_STEP", "cache_config"]


def cache_config(model: Llama) -> LlamaConfig:
    """The config a KV cache for this model is built from (its head counts): a tensor-parallel rank's own
    (`rank_config`, as its `new_cache` uses), else the model's."""
    return getattr(model, "rank_config", model.config)


def step_buffer_bytes(model: Llama, rows: int) -> float:
    """About what one decode step over `rows` rows allocates besides the cache, roughly: its logits in the model's
    dtype and their float32 copy, and a layer's activations (the residual, q/k/v/o, and the MLP's three widths)."""
    c, size = model.config, dtype_bytes(model.dtype)
    return rows * (c.vocab_size * (size + 4) + (6 * c.dim + 3 * c.hidden_dim) * size)


class BatchRunner(Engine):
    """The model runner: n_slots rows of KV cache, max_len positions each, and the forwards over them.

    `prefill` puts one prompt into one row; `step` advances every row by one token. max_len None: the rows grow to
    what is asked of them (`Engine.grow`, keeping what they hold). compile, mode: the step's (`compile.Step`).
    """

    def __init__(self, model: Llama, n_slots: int = 8, max_len: int | None = None, compile: bool | None = None,
                 mode: str | None = None):
        check_int(n_slots, "n_slots", low=1)
        self.n_slots, self.cache = n_slots, None
        first = self._own(model, max_len, low=1, compile=compile, mode=mode)  # 1: a step at position 0
        cache = kv_cache_bytes(cache_config(model), n_slots, first, model.dtype)
        check_memory(cache + step_buffer_bytes(model, n_slots), model.device,
                     f"n_slots {n_slots:,}: a KV cache of {n_slots:,} x {first:,} positions and one decode step's "
                     f"logits ({n_slots:,} x {model.config.vocab_size:,}, float32) and activations")
        self._allocate(first)

    def _allocate(self, max_len: int) -> None:
        """A cache of max_len positions per row holding what the old one held, and its step."""
        cache = self.model.new_cache(batch_size=self.n_slots, max_len=max_len)  # per layer k, v: [S, n_kv, max_len, hd]
        if self.cache is not None:
            for old, new in zip(self.cache.k + self.cache.v, cache.k + cache.v, strict=True):
                new[:, :, :old.shape[2]].copy_(old)  # [S, n_kv, old max_len, hd]
            cache.lengths.copy_(self.cache.lengths)
        self.max_len, self.cache = max_len, cache
        self._step = self._step_of(self._decode_step, self.cache.buffers)

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [S, 1], positions [S, 1] -> logits [S, vocab] (float32): what `step` runs, maybe compiled."""
        return self.model(tokens, positions, self.cache, keep=LAST, static=self.static)[:, -1].float()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`_decode_step`, maybe compiled (with CUDA graphs, use the logits before the next call); refused while the
        runner runs in another thread (it writes the cache)."""
        with self.running():
            return self._step_call(tokens, positions)

    @torch.inference_mode()
    def _step_call(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`step` under inference mode on inference tensors, as the runs and the warm-up call it: Dynamo guards the
        mode and the inputs' dispatch keys, so a caller outside the mode (its tensors copied: S ints each) runs the
        same compiled step."""
        self.cache.check_static(positions)
        tokens, positions = (t if t.is_inference() else t.clone() for t in (tokens, positions))
        return self._step(tokens, positions)

    def warmup(self, steps: int = 3) -> float:
        """`Engine.warm_once` for the batched step, under inference mode as the runs (Dynamo guards the mode: a step
        compiled under no_grad would compile again in the run); the cache reset afterwards, so refused while the
        engine runs in another thread."""
        with self.running():
            return self._warmup(steps)

    @torch.inference_mode()
    def _warmup(self, steps: int) -> float:
        # tokens and positions [S, 1], two tensors as `decode` passes them (one tensor twice would compile a variant)
        tokens, positions = (torch.zeros(self.n_slots, 1, dtype=torch.long, device=self.device) for _ in range(2))
        seconds = self.warm_once("step", lambda: self._step_call(tokens, positions), steps=steps)
        self.cache.reset()
        return seconds

    def prefill(self, slot: int, prompt_ids: list[int]) -> torch.Tensor:
        """One prompt alone through the model into row `slot`, at positions 0..T-1 -> its last logits [1, vocab];
        refused while the runner runs in another thread."""
        with self.running():
            return self._prefill(slot, prompt_ids)

    def decode(self, rows: list[tuple[int, int] | None]) -> torch.Tensor:
        """rows[s]: (token, position) of slot s, or None for a free slot (token 0 at position 0) -> logits [S, V];
        refused while the runner runs in another thread."""
        with self.running():
            return self._decode(rows)

    def _prefill(self, slot: int, prompt_ids: list[int]) -> torch.Tensor:
        if self.sized_per_request:
            self.grow(len(prompt_ids))
        prompt = torch.tensor([prompt_ids], device=self.device)  # [1, T]
        positions = torch.arange(prompt.shape[1], device=self.device)
        return self.model(prompt, positions, self.cache.slot(slot), keep=LAST)[:, -1].float()

    def _decode(self, rows: list[tuple[int, int] | None]) -> torch.Tensor:
        if self.sized_per_request:
            self.grow(1 + max((r[1] for r in rows if r is not None), default=0))
        tokens = torch.tensor([[0 if r is None else r[0]] for r in rows], device=self.device)  # [S, 1]
        positions = torch.tensor([[0 if r is None else r[1]] for r in rows], device=self.device)  # [S, 1]
        return self._step_call(tokens, positions)


class ContinuousBatcher(BatchRunner):
    """A runner that also schedules: serves requests in n_slots slots of max_len positions each (None: sized for
    the requests of each run, grown only when a run needs more).
    """

    fixed_room = "a batch slot's length"  # sized per request, its slots hold the model's context (Engine.room)

    def run(self, requests: Sequence[Request], policy: str = "continuous") -> BatchRun:
        """Serve every request; returns their completions (in submission order) and the timeline."""
        checked = [self.check(r, i) for i, r in enumerate(request_list(requests))]  # all checked before any work
        slot_len = max(self.max_len, self.slots_needed(checked)) if self.sized_per_request else self.max_len
        jobs = [Job.of(r, i, slot_len) for i, r in enumerate(checked)]
        kv = KVCacheManager(self.n_slots, slot_len)  # a slot is one block: it always holds its request
        scheduler = Scheduler(jobs, self.n_slots, kv, policy=policy)  # refuses an unknown policy
        with self.running(*checked):
            return self._run(checked, scheduler)

    @torch.inference_mode()
    def _run(self, requests: Sequence[Checked], scheduler: Scheduler) -> BatchRun:
        self._warmup(3)
        self.cache.reset()
        rows = Rows(requests, self.device)
        return run_steps(scheduler, lambda work: self.compute(work, rows), rows)

    def compute(self, work: Sequence[Scheduled], rows: Rows) -> list[int]:
        """An engine step's forwards over the slots (each sequence in its own, the scheduler's `slot`): one decode
        for every slot, then each newcomer's whole prompt alone -> a token for each, in `work`'s order."""
        decode = {s.job.completion.slot: s for s in work if s.chunk.start}  # one token after what its slot holds
        drawn = {}
        if decode:
            logits = self._decode([(s.tokens[0], s.chunk.start) if (s := decode.get(i)) else None
                                  for i in range(self.n_slots)])  # [S, vocab]
            ids, slots = [s.job.id for s in decode.values()], torch.tensor(list(decode), device=self.device)
            drawn = dict(zip(ids, rows.draw(logits[slots], ids), strict=True))
        for s in work:
            if not s.chunk.start:  # a newcomer's prompt, into its slot (over the decode's dummy): its first token
                prefill_start = time.perf_counter()
                logits = self._prefill(s.job.completion.slot, s.tokens)  # [1, vocab]
                drawn[s.job.id] = rows.draw(logits, [s.job.id])[0]  # waits for the device
                s.job.completion.prefill_seconds = time.perf_counter() - prefill_start
        return [drawn[s.job.id] for s in work]


class PagedRunner:
    """The model runner over a paged KV cache: one forward per engine step, every scheduled token of every
    sequence in one flattened row [1, N] (llmstep.core.paged_kv). Eager: its shapes change every step."""

    def __init__(self, model: Llama, n_blocks: int, block_size: int):
        self.model, self.device = model, model.device
        self.cache = PagedKVCache(cache_config(model), n_blocks, block_size, device=model.device, dtype=model.dtype)

    def forward(self, work: Sequence[Scheduled]) -> torch.Tensor:
        """The step's chunks -> logits [K, vocab] (float32) after the last token of each of the K that sample."""
        positions = self.cache.plan([s.chunk for s in work])  # [1, N]
        tokens = torch.tensor([[t for s in work for t in s.tokens]], device=self.device)  # [1, N]
        ends = itertools.accumulate(s.chunk.n_tokens for s in work)
        keep = torch.tensor([e - 1 for e, s in zip(ends, work, strict=True) if s.samples],
                            dtype=torch.long, device=self.device)  # [K]
        return self.model(tokens, positions, self.cache, keep=keep)[0].float()

    def compute(self, work: Sequence[Scheduled], draw: Callable[[torch.Tensor, list[int]], list[int]]) -> list[int]:
        """The step's one forward -> a token for each chunk that samples (`draw(logits [K, vocab], their request
        ids)`, one wait for the device); none when every chunk is a prompt's middle."""
        logits = self.forward(work)  # [K, vocab]
        sampled = [s.job.id for s in work if s.samples]
        return draw(logits, sampled) if sampled else []


def engine_step(scheduler: Scheduler, compute: Callable[[list[Scheduled]], list[int]],
                device: torch.device) -> list[Job]:
    """One engine step, every batcher's and `PagedSession.step`'s: the scheduler's work, `compute(work)` (a runner's
    forwards: a token for each chunk that samples, in order), recorded by the scheduler. Returns the jobs that got a
    token: each one's new token is its last."""
    synchronize(device)
    scheduler.begin_step()
    work = scheduler.schedule()
    if not work and scheduler.queue and not scheduler.running:  # each request fits the pool alone
        raise RuntimeError(f"the scheduler admitted nobody into an idle pool at step {scheduler.step}")
    if work:
        scheduler.update(work, compute(work))
    synchronize(device)
    scheduler.end_step()
    return [s.job for s in work if s.samples]


def run_steps(scheduler: Scheduler, compute: Callable[[list[Scheduled]], list[int]], rows: Rows) -> BatchRun:
    """A batcher's run: engine steps until the scheduler is done, timed; any request's non-finite logits raised."""
    start = time.perf_counter()
    while not scheduler.done:
        engine_step(scheduler, compute, rows.device)
    scheduler.run.seconds = time.perf_counter() - start
    rows.nonfinite.check()
    return scheduler.run


# The most slots a paged engine takes beyond its pool's blocks: each running sequence holds a block of its own (the
# block of its last token), so slots past the blocks never run, yet each costs the scheduler a list entry and every
# step's timeline row an int (10**7 slots: ~80 MB a step). A few idle ones are harmless (a pool of 4 blocks with 8
# slots runs, 4 at a time): refused only past both.
SLOTS_PAST_POOL = 1024


def max_slots(n_blocks: int) -> int:
    """The most slots a paged engine over a fixed pool of n_blocks takes: its blocks, or SLOTS_PAST_POOL."""
    return max(n_blocks, SLOTS_PAST_POOL)


def check_slots(n_slots: int, n_blocks: int | None, name: str = "n_slots") -> None:
    """Refuse, by `name`, more slots than `max_slots` of a fixed pool's n_blocks (None: a pool sized per slot):
    slots that could never run, each still a row of the scheduler's bookkeeping."""
    if n_blocks is not None and n_slots > max_slots(n_blocks):
        raise ValueError(f"{name} {n_slots:,}: a pool of {n_blocks:,} blocks runs at most {n_blocks:,} sequences at "
                         f"once (each holds a block of its own), and every slot costs bookkeeping each step: give "
                         f"at most {max_slots(n_blocks):,} slots")


def check_paged_options(n_slots, block_size, prefix_caching, prefill_chunk, **pool) -> None:
    """A paged engine's options, each refused by its name; pool: the pool's size by its name (None: sized later)."""
    check_int(n_slots, "n_slots", low=1)
    check_int(block_size, "block_size", low=1)
    for name, value in (*pool.items(), ("prefill_chunk", prefill_chunk)):
        if value is not None:
            check_int(value, name, low=1)
    for value in pool.values():
        check_slots(n_slots, value)
    if not isinstance(prefix_caching, bool):
        raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}")


class PagedBatcher(Engine):
    """Continuous batching over a paged KV cache: at most n_slots sequences at once, admitted by free blocks.

    kv_blocks: blocks of block_size positions in the pool; None gives the memory a ContinuousBatcher's n_slots
    slots would take for the same requests. prefix_caching: full blocks shared between sequences with the same
    tokens so far, and kept after them (LRU). prefill_chunk: the most prompt tokens a step computes (None: all).
    """

    def __init__(self, model: Llama, n_slots: int = 8, block_size: int = 16, kv_blocks: int | None = None,
                 prefix_caching: bool = False, prefill_chunk: int | None = None):
        check_paged_options(n_slots, block_size, prefix_caching, prefill_chunk, kv_blocks=kv_blocks)
        # Before any request: the block fits the context and a named pool the memory (None: sized per run, below)
        check_pool(cache_config(model), kv_blocks or 1, block_size, model.device, model.dtype)
        self._own(model, None)  # sequences of the model's context: blocks, not slots, bound them
        self.n_slots, self.block_size = n_slots, block_size
        self.kv_blocks, self.prefix_caching, self.prefill_chunk = kv_blocks, prefix_caching, prefill_chunk
        self.runner: PagedRunner | None = None

    def pool_blocks(self, checked: Sequence[Checked]) -> int:
        """kv_blocks, or the blocks of n_slots slots each sized for the longest request (`pool_blocks`)."""
        return pool_blocks([(len(c.ids), c.max_new_tokens) for c in checked], self.n_slots, self.block_size,
                           self.limit, self.kv_blocks)

    def run(self, requests: Sequence[Request], policy: str = "continuous") -> BatchRun:
        """Serve every request; returns their completions (in submission order), the timeline, kv_stats."""
        checked = [self.check(r, i) for i, r in enumerate(request_list(requests))]
        n_blocks = self.pool_blocks(checked)
        jobs = [Job.of(r, i, self.limit) for i, r in enumerate(checked)]
        for i, job in enumerate(jobs):
            check_fits(len(job.completion.prompt_ids), job.plan.tokens, n_blocks, self.block_size, index=i)
        # before bookkeeping
        check_pool(cache_config(self.model), n_blocks, self.block_size, self.device, self.model.dtype)
        kv = KVCacheManager(n_blocks, self.block_size, self.prefix_caching)
        scheduler = Scheduler(jobs, self.n_slots, kv, self.prefill_chunk, policy)  # refuses an unknown policy
        with self.running():
            if self.runner is None or self.runner.cache.n_blocks != n_blocks:
                self.runner = PagedRunner(self.model, n_blocks, self.block_size)
            return self._run(checked, scheduler)

    @torch.inference_mode()
    def _run(self, requests: Sequence[Checked], scheduler: Scheduler) -> BatchRun:
        rows = Rows(requests, self.device)
        run = run_steps(scheduler, lambda work: self.runner.compute(work, rows.draw), rows)
        run.kv_stats["kv_bytes"] = self.runner.cache.nbytes
        return run


KV_LAYOUTS = ("contiguous", "paged")


def pool_blocks(lengths: Iterable[tuple[int, int]], n_slots: int, block_size: int, context: int,
                kv_blocks: int | None = None) -> int:
    """The blocks of a PagedBatcher's pool, the one rule (its run uses it, and `llmstep batch` to check the memory
    before the model loads): kv_blocks, or n_slots sequences each of the slots the longest of these (prompt length,
    max_new_tokens) requests needs (`cache_len`, rounded up to CACHE_ROUNDING, at most the context), in blocks."""
    if kv_blocks is not None:
        return kv_blocks
    longest = max((cache_len(p, n, context, rounding=CACHE_ROUNDING) for p, n in lengths), default=1)
    return n_slots * blocks_for(longest, block_size)


def make_batcher(model: Llama, n_slots: int = 8, max_len: int | None = None, compile: bool | None = None,
                 kv: str = "contiguous", block_size: int = 16, kv_blocks: int | None = None,
                 prefix_caching: bool = False, prefill_chunk: int | None = None) -> ContinuousBatcher | PagedBatcher:
    """A ContinuousBatcher with n_slots slots (kv="contiguous"), or a PagedBatcher running at most n_slots
    sequences over kv_blocks blocks (kv="paged"); each layout's options refused for the other."""
    if kv not in KV_LAYOUTS:
        raise ValueError(f"unknown KV cache layout {kv!r}: choose one of {', '.join(KV_LAYOUTS)}")
    if kv == "contiguous":
        paged_only = {"block_size": block_size != 16, "kv_blocks": kv_blocks is not None,
                      "prefix_caching": prefix_caching is not False, "prefill_chunk": prefill_chunk is not None}
        if any(paged_only.values()):
            raise ValueError(f"{', '.join(k for k, v in paged_only.items() if v)} set the paged KV cache: pass "
                             "kv='paged' (a contiguous cache has none)")
        return ContinuousBatcher(model, n_slots, max_len, compile)
    for name, value, why in (("max_len", max_len, "sets the contiguous cache's slots: the paged cache has blocks "
                              "(kv_blocks)"), ("compile", compile, "is the contiguous cache's option: the paged "
                                              "cache's forward changes shape every step, and runs eager")):
        if value not in (None, False):
            raise ValueError(f"{name} {why}")
    return PagedBatcher(model, n_slots, block_size, kv_blocks, prefix_caching, prefill_chunk)


def request_list(requests) -> list:
    """A batcher's `requests`, a list (or other iterable) of Request; one Request alone, a string or a number is
    refused by name (iterating one would fail far from the call, or not at all). A request whose prompt_ids or
    stop_ids is a one-shot iterator gets them read once, here, into a list / tuple (a request is checked more than
    once, and one listed twice would find its iterator spent the second time): every copy of it sees the same."""
    if isinstance(requests, Request | str | bytes) or not isinstance(requests, Iterable):
        raise ValueError(f"requests must be a list of Request objects, got {type(requests).__name__}"
                         + (" (one request: pass [request])" if isinstance(requests, Request) else ""))
    settled: dict[int, Request] = {}  # id of a request given -> its settled copy
    out = []
    for r in requests:
        if isinstance(r, Request):
            if id(r) not in settled:
                read = {name: (list if name == "prompt_ids" else tuple)(value) for name in ("prompt_ids", "stop_ids")
                        if isinstance(value := getattr(r, name), Iterator)}
                settled[id(r)] = dataclasses.replace(r, **read) if read else r
            r = settled[id(r)]
        out.append(r)
    return out


def run_batch(model: Llama, requests: Sequence[Request], n_slots: int = 8, policy: str = "continuous",
              max_len: int | None = None, compile: bool | None = None, kv: str = "contiguous", block_size: int = 16,
              kv_blocks: int | None = None, prefix_caching: bool = False, prefill_chunk: int | None = None) -> BatchRun:
    """One-shot: `make_batcher`'s batcher serves `requests`. The policy and each request are checked first (against
    the model's context; the batcher checks them again against its own room), before a cache is allocated."""
    check_policy(policy)
    requests = request_list(requests)  # its iterators read once: the batcher checks each request again
    for i, r in enumerate(requests):
        check_request(r, model, index=i)
    return make_batcher(model, n_slots, max_len, compile, kv, block_size, kv_blocks, prefix_caching,
                        prefill_chunk).run(requests, policy)

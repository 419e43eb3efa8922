"""What the engines that own a KV cache share (FastDecoder, FastSpeculator, the batchers and their runner): requests
checked against the positions a sequence may fill, one run at a time, the cache grown before a run that needs more
slots (to a power-of-two bucket: a growing session compiles its steps O(log n) times), their steps made and warmed
up once before anything is timed; and a batcher's `Rows`: each request's own generator and non-finite flag.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from ..core import attention_backend
from ..core.checks import check_max_len
from ..core.cost import MemoryBudgetError
from ..core.sampling import sample
from .compile import Step, compile_options, compiles, gemm_backends, uses_cuda_graphs, warm_up
from .decoding import CACHE_ROUNDING, NonFiniteLogits, cache_bucket, cache_len, held
from .request import Checked, Request, check_request

__all__ = ["Engine", "Rows"]


class Engine:
    """The base of an engine that owns its cache(s). A subclass calls `_own` in its __init__, makes its steps with
    `_step_of`, and gives `_allocate(max_len)` (a new cache of max_len slots per sequence, and its steps) when it
    sizes its cache per request."""

    room = "the model's context"  # what the positions a sequence may fill are, when sized per request
    fixed_room = "the cache it may fill"  # and when the cache is fixed

    def _own(self, model: torch.nn.Module, max_len: int | None, limit: int | None = None, reserve: int = 0,
             low: int = 2, compile: bool | None = False, mode: str | None = None) -> int:
        """Set up the shared state; returns the cache's first size. max_len: the slots per sequence, fixed (checked
        in low .. limit), or None: sized for each request. limit: the context (default the model's). reserve:
        slots a run writes past its last token (a speculative round's k). compile, mode: the steps' (`Step`)."""
        self.model, self.device = model, model.device
        self.limit = model.config.max_seq_len if limit is None else limit
        self.reserve, self.sized_per_request = reserve, max_len is None
        self._lock = threading.Lock()  # one run at a time: the cache is this engine's only one
        self._warm: set = set()  # (step kind, attention backend) run (eager too) before any timing
        self.compile_seconds = 0.0  # spent in the first calls of the compiled steps (warm-up)
        first = (cache_len(1, min(reserve, 1), self.limit, reserve=reserve, rounding=CACHE_ROUNDING)
                 if max_len is None else check_max_len(max_len, self.limit, low=low))
        if mode is not None:
            compile_options(self.device, mode)  # an unknown mode is refused whether or not the steps compile
        self._compile, self._mode, self.compiled = compile, mode, compiles(self.device, compile)
        self.cuda_graphs = self.compiled and uses_cuda_graphs(self.device, mode)
        self.static = self.compiled  # the steps' Llama.forward(static=...): a compiled step needs fixed shapes
        return first

    def _step_of(self, fn: Callable, static: Sequence[torch.Tensor], *models: torch.nn.Module, **options) -> Step:
        """fn as this engine's step (`compile.Step`, compiled as the engine is), writing `static` in place; models:
        those it runs (default the engine's), whose matmuls it tunes as `gemm_backends` says and whose weights name
        it in the compile cache (`compile.weights_digest`)."""
        models = models or (self.model,)
        return Step(fn, self.device, self._compile, self._mode, static=static, gemm_backends=gemm_backends(*models),
                    models=models, **options)

    def check(self, request: Request, index: int | None = None) -> Checked:
        """`request.check_request` against this engine's sequences (the context, or the fixed cache's slots)."""
        if self.sized_per_request:
            return check_request(request, self.model, self.limit, self.room, index=index)
        return check_request(request, self.model, self.max_len, self.fixed_room, index=index)

    def slots_needed(self, checked: Sequence[Checked]) -> int:
        """The slots per sequence the longest of these requests needs (rounded up to CACHE_ROUNDING)."""
        return max([cache_len(len(c.ids), c.max_new_tokens, self.limit, reserve=self.reserve,
                              rounding=CACHE_ROUNDING) for c in checked], default=1)

    @contextlib.contextmanager
    def running(self, *checked: Checked) -> Iterator[None]:
        """One run at a time (a second caller is refused at once), the cache grown first for these requests."""
        with held(self._lock, f"this {type(self).__name__} is already running (in another thread): it owns one KV "
                  "cache, so give each thread its own, or call llmstep.generate, which may be shared"):
            if self.sized_per_request and checked:
                self.grow(self.slots_needed(checked))
            yield

    def is_warm(self, key) -> bool:
        """Whether step kind `key` has run under the attention backend asked for now (a compiled step bakes it in)."""
        return (key, attention_backend.current()) in self._warm

    def grow(self, slots: int) -> None:
        """At least `slots` per sequence: a new cache of the next bucket (`decoding.cache_bucket`), or of just `slots`
        where the device's memory refuses the bucket."""
        if slots <= self.max_len:
            return
        try:
            self._allocate(cache_bucket(slots, self.limit))
        except MemoryBudgetError:
            self._allocate(slots)
        self._warm.clear()  # the new steps have not run

    def warm_once(self, key, *calls: Callable[[], object], steps: int = 3) -> float:
        """Run the calls of step kind `key` once per attention backend before timing anything: `steps` times when
        compiled (on CUDA the graph is recorded too), else once. Returns the seconds spent compiling (0: eager)."""
        if self.is_warm(key):
            return 0.0
        seconds = warm_up(self.device, *calls, steps=steps if self.compiled else 1)
        seconds = seconds if self.compiled else 0.0
        self.compile_seconds += seconds
        self._warm.add((key, attention_backend.current()))
        return seconds


class Rows:
    """A batcher's run, per request: its own generator (made at its first draw, never again: a token recomputed
    after a preemption is not drawn twice) and a non-finite flag on the device, read once at the end."""

    def __init__(self, requests: Sequence[Checked], device: torch.device):
        self.requests, self.device, self.generators = requests, device, {}
        self.nonfinite = NonFiniteLogits(device, requests=len(requests))

    def draw(self, logits: torch.Tensor, ids: Sequence[int]) -> list[int]:
        """logits [B, V], row b of request ids[b] -> one token per row, drawn with its request's own generator (the
        draw it would get alone). One wait for the device."""
        for i in ids:
            if i not in self.generators:
                self.generators[i] = self.requests[i].generator(self.device)
        self.nonfinite.update(logits, torch.tensor(ids, device=self.device))  # on the device: no sync
        return torch.cat([sample(logits[b:b + 1], *self.requests[i].sampling, self.generators[i])
                          for b, i in enumerate(ids)]).tolist()

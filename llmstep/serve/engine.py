"""The engine thread: one `PagedSession` (llmstep.engines.session) stepped in a loop, fed by the web server.

The web server's event loop must never wait for a forward, and the model must never wait for the web server:
so the engine runs in its own thread, as vLLM's engine core runs apart from its API server. Between two
engine steps it takes what arrived (new requests, cancellations) from an inbox; a new request joins the
running batch at the next step. After each step every token made goes to its request's asyncio queue
(`loop.call_soon_threadsafe`), so a streamed token leaves as soon as it is made. With nothing to do the thread
sleeps on a condition, not in a poll.

Backpressure: at most n_slots requests run and max_queue more wait; beyond that `submit` raises `Busy` at
once (HTTP 429), rather than letting a queue, or the memory, grow without end. A request cancelled (its
client gone) leaves the batch at the next step and its KV blocks go back to the pool then.

torch computes in this thread; PyTorch releases the GIL inside its kernels, so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.model import Llama
from ..core.tokens import Tokenizer
from ..engines.batching import Request
from ..engines.decoding import NonFiniteLogitsError
from ..engines.kv_manager import pool_tokens
from ..engines.request import end_ids
from ..engines.session import PagedSession

__all__ = ["Engine", "Ticket", "Busy", "EngineStopped"]


class Busy(RuntimeError):
    """Every slot is running and the queue is full: try again later (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine stopped (the server is shutting down, or the model failed) before the request finished."""


@dataclass(eq=False)
class Ticket:
    """One request's way back: (token, finish_reason) pairs on `queue`, in its event loop; an exception instead
    when it fails. finish_reason is None until its last token."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int | None = None  # the session's id, once the engine thread has taken it
    done: bool = False  # engine thread only

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass


PREFILL_CHUNK = 256  # the server's prompt tokens per engine step, by default (`llmstep serve --prefill-chunk`)


class Engine:
    """A PagedSession served from a thread. Options as PagedSession's; max_queue: requests that may wait for
    a slot."""

    def __init__(self, model: Llama, n_slots: int = 8, block_size: int = 16, kv_blocks: int | None = None,
                 prefix_caching: bool = True, prefill_chunk: int | None = PREFILL_CHUNK, max_queue: int = 64):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue!r}")
        self.session = PagedSession(model, n_slots, block_size, kv_blocks, prefix_caching, prefill_chunk)
        self.options = {"prefix_caching": prefix_caching, "prefill_chunk": prefill_chunk}  # what /health reports
        self.capacity = n_slots + max_queue
        # cancelled: their clients left; stop_strings: ended by a stop string (they count as finished too)
        self.stats = {"requests": 0, "finished": 0, "cancelled": 0, "stop_strings": 0, "refused": 0, "tokens": 0,
                      "steps": 0, "model_errors": 0}  # model_errors: requests ended by NaN or Inf logits
        self._inbox: deque[tuple[str, Ticket]] = deque()
        self._wake = threading.Condition()
        self._in_flight = 0  # submitted and not finished: guarded by _wake
        self._tickets: dict[int, Ticket] = {}  # engine thread only: session id -> ticket
        self._stopping = False
        self.error: BaseException | None = None  # what stopped the engine, if not `stop`
        self.on_error: Callable[[], object] | None = None  # called (from the engine's thread) once it has failed
        self._thread = threading.Thread(target=self._loop, name="llmstep-engine", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the current step, fail what is left with EngineStopped, and end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def end_ids(self, tokenizer: Tokenizer | None) -> list[int]:
        """What a request naming no stop tokens stops at: the model's end tokens, else its tokenizer's
        (engines.request.end_ids: what llmstep.generate stops at; the session has no tokenizer to fall back on)."""
        return end_ids(self.session.model, tokenizer)

    @property
    def context(self) -> int:
        """The most tokens, prompt and new, one request may have: the model's context, or what the whole KV pool
        holds (`pool_tokens`, the rule `check_fits` refuses by), whichever is less."""
        s = self.session
        return min(s.model.config.max_seq_len, pool_tokens(s.n_blocks, s.block_size))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue a request for the next step; raises Busy at once when max_queue requests already wait."""
        ticket = Ticket(request, loop)
        with self._wake:
            if self._stopping or not self._thread.is_alive():
                raise EngineStopped("the engine is not running")
            if self._in_flight >= self.capacity:
                self.stats["refused"] += 1
                raise Busy(f"{self._in_flight} requests are running or waiting, the most this server takes "
                           f"(--slots + --max-queue = {self.capacity}): try again later")
            self._in_flight += 1
            self.stats["requests"] += 1
            self._inbox.append(("submit", ticket))
            self._wake.notify()
        return ticket

    def cancel(self, ticket: Ticket, stop_string: bool = False) -> None:
        """Drop a request (its client is gone; stop_string: its text reached a stop string, counted apart): it
        leaves the batch, and its blocks the pool, before the next step."""
        with self._wake:
            self._inbox.append(("stop" if stop_string else "cancel", ticket))
            self._wake.notify()

    def health(self) -> dict:
        s, config = self.session, self.session.model.config
        return {"status": "ok" if self.alive else "stopped", "running": s.running, "waiting": s.pending - s.running,
                "kv_blocks_total": s.n_blocks, "kv_blocks_used": s.blocks.n_used, "kv_bytes": s.runner.cache.nbytes,
                "block_size": s.block_size, "prefix_hit_tokens": s.stats["prefix_hit_tokens"],
                # the tokens its forwards computed: prompts (a preempted request's again) and, one a step, the decodes
                **{key: s.stats[key] for key in ("prefill_tokens", "decode_tokens", "preemptions")}, "slots": s.n_slots,
                "capacity": self.capacity, "device": str(s.device), "dtype": str(s.model.dtype).removeprefix("torch."),
                "vocab_size": config.vocab_size, "context": config.max_seq_len, "max_model_len": self.context} \
            | self.options | self.stats

    # ---- the engine thread ----------------------------------------------------------------------------

    def _finish(self, ticket: Ticket, item) -> None:
        if ticket.done:
            return
        ticket.done = True
        if ticket.id is not None:
            self._tickets.pop(ticket.id, None)
        with self._wake:
            self._in_flight -= 1
        self.stats["finished"] += 1
        ticket.put(item)

    def _take_inbox(self) -> None:
        with self._wake:
            while not self._inbox and not self.session.pending and not self._stopping:
                self._wake.wait()
            work, self._inbox = list(self._inbox), deque()
        for op, ticket in work:
            if op == "submit":
                try:
                    ticket.id = self.session.submit(ticket.request)
                    self._tickets[ticket.id] = ticket
                except ValueError as e:  # the web layer checks first; this is the session's own word
                    self._finish(ticket, e)
            else:  # cancel, or stop (a stop string)
                self.stats["stop_strings"] += op == "stop"
                if ticket.done:
                    continue
                if ticket.id is not None:
                    self.session.cancel(ticket.id)  # its blocks go back now
                self.stats["cancelled"] += op == "cancel"
                self._finish(ticket, (None, "interrupted"))

    def _loop(self) -> None:
        try:
            while True:
                self._take_inbox()
                if self._stopping:
                    break
                if not self.session.pending:
                    continue
                made = self.session.step()
                self.stats["steps"] += 1
                for out in made:
                    ticket = self._tickets.get(out.id)
                    if ticket is None:
                        continue
                    if out.token >= 0:
                        self.stats["tokens"] += 1
                    if out.finish_reason == "error":  # this request's logits broke; the others go on
                        self.stats["model_errors"] += 1
                        self._finish(ticket, NonFiniteLogitsError(
                            "the model produced non-finite logits (NaN or Inf) for this request: its tokens would "
                            "be meaningless, so it was ended (the server serves the others)"))
                    elif out.finish_reason:
                        self._finish(ticket, (out.token, out.finish_reason))
                    else:
                        ticket.put((out.token, None))
        except BaseException as e:  # a broken model: every waiting request learns it, the server reports it
            self.error = e
        finally:
            with self._wake:
                self._stopping = True
                left = [t for _, t in self._inbox] + list(self._tickets.values())
                self._inbox.clear()
            stopped = EngineStopped("the server is shutting down" if self.error is None else
                                    f"the engine failed: {type(self.error).__name__}: {self.error}")
            for ticket in left:
                self._finish(ticket, stopped)
            try:
                self.session.close()
            finally:
                if self.error is not None and self.on_error is not None:
                    self.on_error()

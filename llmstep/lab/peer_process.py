"""One peer engine in its own process, so that a peer that crashes costs its own rows and nothing else.

llama.cpp is C++ run inside Python: on some Intel virtual machines its AMX kernels die with an illegal instruction
(SIGILL), which no `try` can catch; a segfault or an abort is the same. So `llmstep bench --peers` builds each peer
in a child process (multiprocessing's "spawn": a fresh interpreter, no state copied from the benchmark's own) and
sends it one command per timed run down a pipe:

    parent                                   child (serve)
    PeerProcess(make, spec)  --spec------->  engine = make(spec)       # the peer's own setup: convert, quantise, load
                             <--("ready", info)
    .run(ids, n)             --("run", ...)> engine.run(ids, n)        # timed inside the child
                             <--("ok", (prefill s, decode s, tokens))

The timings are taken in the child, around the peer's own calls, so the pipe costs nothing that is measured. An
exception in the child comes back as ("error", "ValueError: ...") and the child stays alive; a child that dies
leaves the pipe at end-of-file, and its exit code says how it died (a negative code is the signal's number).
Either way the parent raises PeerFailed with the reason in words, and the benchmark records it and goes on.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback

__all__ = ["PeerFailed", "PeerProcess", "describe_exit"]

_STOP_SECONDS = 10  # how long a child may take to exit after "stop" before it is killed
# how long a child may take to answer (start, compile, one run) before it is stopped as hung: far beyond any run
ANSWER_SECONDS = 3600


class PeerFailed(RuntimeError):
    """A peer that raised or died; the message says how (an exception's type and text, or the signal)."""


def describe_exit(exitcode: int | None) -> str:
    """A child's exit code in words: -4 -> "killed by signal SIGILL (Illegal instruction)"."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:
            return f"killed by signal {-exitcode}"
        return f"killed by signal {sig.name} ({signal.strsignal(sig) or 'no description'})"
    return f"exited with status {exitcode}"


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def serve(conn, make, spec) -> None:
    """The child's loop: build the engine with make(spec), answer ("ready", engine.info) (or ("error", why)), then
    run each ("run", ids, n) and answer ("ok", engine.run(ids, n)) or ("error", why), until ("stop",)."""
    try:
        engine = make(spec)
        conn.send(("ready", dict(getattr(engine, "info", {}))))
    except Exception as e:  # the peer's own failure to start: reported, not raised
        conn.send(("error", _short(e), traceback.format_exc(limit=3)))
        return
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        try:
            conn.send(("ok", engine.run(*command[1:])))
        except Exception as e:
            conn.send(("error", _short(e), traceback.format_exc(limit=3)))


class PeerProcess:
    """A peer engine built and run in a child process: .info (what it runs, from the child), .run(ids, n) ->
    (prefill seconds, decode seconds, tokens), .close(). Any failure, at start or in a run, is PeerFailed."""

    def __init__(self, make, spec):
        """`make(spec)` is called in the child; both travel by pickling, so `make` is a module-level function."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child_end, make, spec), daemon=True)
        try:
            self.process.start()  # pickles make and spec: a model's tensors move to shared memory (/dev/shm)
        except Exception as e:
            self.conn.close()
            raise PeerFailed(f"its process could not start: {_short(e)}") from None
        finally:
            child_end.close()  # the child holds its end: when it dies, recv() here sees end-of-file
        self.info = self._answer("starting")

    def _answer(self, doing: str):
        try:
            if not self.conn.poll(ANSWER_SECONDS):  # hung (a deadlock, a wait on input): not forever
                self.process.kill()
                self.process.join(_STOP_SECONDS)
                raise PeerFailed(f"gave no answer in {ANSWER_SECONDS:,} s while {doing}: stopped")
            reply = self.conn.recv()
        except (EOFError, ConnectionError):
            self.process.join(_STOP_SECONDS)
            raise PeerFailed(f"{describe_exit(self.process.exitcode)} while {doing}") from None
        if reply[0] == "error":
            raise PeerFailed(f"{reply[1]} (raised while {doing})")
        return reply[1]

    def run(self, ids: list[int], n: int, doing: str = "running"):
        try:
            self.conn.send(("run", ids, n))
        except (BrokenPipeError, ConnectionError):
            self.process.join(_STOP_SECONDS)
            raise PeerFailed(f"{describe_exit(self.process.exitcode)} before {doing}") from None
        return self._answer(doing)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, ConnectionError):
                pass
            self.process.join(_STOP_SECONDS)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.conn.close()

"""Peers that fail, for tests/lab/test_peer_failures.py: module-level makers, as llmstep.lab.peer_engines.MAKERS
holds, so that a child process (spawned, not forked) can import them by name."""

from __future__ import annotations

import os
import resource
import signal


class _DiesInItsFirstTimedRun:
    """Answers the warm-up, then dies of SIGILL: what llama.cpp's AMX kernels do on some Intel virtual machines."""

    def __init__(self, spec):
        self.info = {"name": "fake peer (SIGILL)", "weights": spec.weights, "source": "none"}
        self.calls = 0

    def run(self, ids, n, doing=""):
        self.calls += 1
        if self.calls == 2:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
            os.kill(os.getpid(), signal.SIGILL)
        return 0.001, 0.001, [0] * n


def dies_of_sigill(spec):
    return _DiesInItsFirstTimedRun(spec)


def raises_at_start(spec):
    raise ValueError(f"fake peer refuses {spec.precision}")


class _RaisesInRuns:
    info = {"name": "fake peer (raises)"}

    def run(self, ids, n, doing=""):
        raise RuntimeError("fake peer's run failed")


def raises_in_runs(spec):
    return _RaisesInRuns()


class _Hangs:
    info = {"name": "fake peer (hangs)"}

    def run(self, ids, n, doing=""):
        import time

        time.sleep(3600)  # a deadlock, as far as the parent can tell


def hangs_in_runs(spec):
    return _Hangs()

"""One engine used from two threads at once, for the tests of its run lock (test_hardening, test_session)."""

from __future__ import annotations

import threading


def run_two_threads(model, first, second):
    """Start `first` in a thread and hold it inside the model's forward; call `second` from another thread
    meanwhile; return what each did (a result or the exception it raised)."""
    inside, tried = threading.Event(), threading.Event()
    outcome: dict = {}

    def hold(module, args):
        if threading.current_thread().name == "first" and not inside.is_set():
            inside.set()
            tried.wait(timeout=30)

    def call(name, fn, before=None):
        if before is not None:
            before.wait(timeout=30)
        try:
            outcome[name] = fn()
        except Exception as e:  # what the test looks at
            outcome[name] = e
        finally:
            if name == "second":
                tried.set()

    handle = model.register_forward_pre_hook(hold)
    try:
        threads = [threading.Thread(target=call, args=("first", first), name="first"),
                   threading.Thread(target=call, args=("second", second, inside), name="second")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        handle.remove()
    return outcome["first"], outcome["second"]

"""Helpers for the serve tests: a real `llmstep serve` on loopback (uvicorn in a thread on a free port, always torn
down), the openai client for it, bounded waits, and the fixtures (imported by the test modules: a conftest.py here
would be the `conftest` that other test directories import by name): each module makes them
with `pytest.fixture(scope="module", name=...)(load_shipped)`."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

TIMEOUT = 120.0  # seconds any one call may take on a loaded 2-core machine: a bound, never a measurement


@contextlib.contextmanager
def running_server(model, tokenizer, name: str = "shipped", **options):
    """(base_url, engine) of a server with PagedSession options; stopped, its thread joined, on the way out."""
    from llmstep.serve.app import bind, create_app, make_server
    from llmstep.serve.engine import Engine

    engine = Engine(model, **options).start()
    sock = bind("127.0.0.1", 0)
    server = make_server(create_app(engine, tokenizer, name, model.config.max_seq_len), graceful_seconds=1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        sock.close()
        engine.stop()
        assert not thread.is_alive(), "the server thread did not stop"


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def wait_for(condition, what: str, timeout: float = TIMEOUT, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def load_shipped():
    """The fixture `shipped`: (model, tokenizer) of the shipped model."""
    import llmstep

    return llmstep.load()


def shared_server(shipped):
    """The fixture `server`: (url, engine) of one server over the shipped model for a module's tests."""
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=16, prefill_chunk=64) as (url, engine):
        yield url, engine

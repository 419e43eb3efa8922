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
    """(base_url, engine) of llmstep.serve.app.background with Engine options; its thread must be gone after."""
    from llmstep.serve.app import background

    before = {t for t in threading.enumerate() if t.name == "llmstep-serve"}
    with background(model, tokenizer, name, start_seconds=TIMEOUT, **options) as (url, engine):
        yield url, engine
    assert {t for t in threading.enumerate() if t.name == "llmstep-serve"} <= before, "the server thread is left"
    assert not engine.alive


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

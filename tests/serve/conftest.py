"""Fixtures for the serve tests: the shipped model, loaded once; a server over it for a module's tests."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from serving import running_server  # noqa: E402


@pytest.fixture(scope="session")
def shipped():
    import llmstep

    return llmstep.load()


@pytest.fixture(scope="module")
def server(shipped):
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=16, prefill_chunk=64) as (url, engine):
        yield url, engine

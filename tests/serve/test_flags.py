"""`llmstep serve`'s and `bench-serve`'s flags reach the engine and the load: chunked prefill can be turned off,
and `--shared-prefix` starts every request with one system prompt (which the prefix cache then finds)."""

from __future__ import annotations

import json

import pytest
from serving import load_shipped, running_server

from llmstep.cli import CommandFailed, main

shipped = pytest.fixture(scope="module", name="shipped")(load_shipped)


@pytest.mark.parametrize("flags, chunk, caching", [([], 256, True), (["--prefill-chunk", "32"], 32, True),
                                                   (["--no-chunked-prefill", "--no-prefix-caching"], None, False)])
def test_serve_passes_prefill_chunk_and_prefix_caching_to_the_engine(flags, chunk, caching, monkeypatch, capsys):
    from llmstep.serve import app

    seen = {}

    def fake_serve(model, tokenizer, name, host, port, n_slots, block_size, kv_blocks, prefix_caching,
                   prefill_chunk, max_queue, ready, sock):
        seen.update(prefix_caching=prefix_caching, prefill_chunk=prefill_chunk)
        ready(host, sock.getsockname()[1], {"kv_blocks_total": 1, "block_size": 16, "kv_bytes": 0})
        sock.close()
        return {"requests": 0, "tokens": 0}

    monkeypatch.setattr(app, "serve", fake_serve)
    main(["serve", "--port", "0", *flags])
    assert seen == {"prefix_caching": caching, "prefill_chunk": chunk}
    said = capsys.readouterr().err
    assert ("chunked prefill off" if chunk is None else f"chunked prefill {chunk} tokens a step") in said, said


@pytest.mark.parametrize("order", [["--prefill-chunk", "64", "--no-chunked-prefill"],
                                   ["--no-chunked-prefill", "--prefill-chunk", "64"]])
def test_serve_refuses_a_prefill_chunk_with_chunked_prefill_off_in_either_order(order, capsys):
    with pytest.raises(CommandFailed):
        main(["serve", "--port", "0", *order])
    assert "--prefill-chunk sets how much of a prompt a step computes: it cannot go with --no-chunked-prefill" in \
        capsys.readouterr().err


def test_bench_serve_shared_prefix_starts_every_request_with_one_system_prompt(shipped, tmp_path):
    model, tokenizer = shipped
    out = tmp_path / "serve.json"
    with running_server(model, tokenizer, n_slots=2, block_size=16) as (url, engine):
        # two runs of one request each, the same seed: the second finds the first's full blocks, the shared 32
        # tokens' 2 (a prompt of 2-4 random tokens alone fills no block, so without the prefix it finds none)
        main(["bench-serve", "--url", url, "--rate", "1000,1000", "--requests", "1", "--prompt-len", "2:4",
              "--new-tokens", "2:2", "--shared-prefix", "32", "--json", str(out)])
        hits = engine.health()["prefix_hit_tokens"]
    record = json.loads(out.read_text())
    assert record["workload"]["shared_prefix"] == 32 and hits == 32
    assert [r["completed"] for r in record["runs"]] == [1, 1]


@pytest.mark.parametrize("flags, named", [(["--port", "70000"], "--port"), (["--port", "-1"], "--port"),
                                          (["--host", "256.1.1.1"], "--host")])
def test_a_port_or_host_no_socket_takes_is_a_flag_error_before_the_model_loads(flags, named, monkeypatch, capsys):
    from llmstep.core import checkpoint

    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and f"argument {named}" in err and flags[1] in err, err


def test_an_address_bind_cannot_take_is_named_in_its_error():
    from llmstep.serve.app import bind

    with pytest.raises(OSError, match="cannot listen on 256.1.1.1 port 0"):
        bind("256.1.1.1", 0)


@pytest.mark.parametrize("url, words", [("ftp://x", "http://HOST:PORT"), ("", "http://HOST:PORT"),
                                        ("http://[::1", "is not a URL"), ("127.0.0.1:8000", "http://HOST:PORT"),
                                        ("http://h:port", "is not a URL")])
def test_bench_serve_refuses_a_url_that_is_not_a_servers_by_its_flag(url, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench-serve", "--url", url])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --url" in err and words in err, err


def test_bench_serve_takes_the_url_serve_prints_and_refuses_what_is_not_a_server_or_too_long(shipped, tmp_path):
    import http.server
    import threading

    from llmstep.cli import CommandFailed

    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=2, block_size=16) as (url, engine):
        record = main(["bench-serve", "--url", f"{url}/v1/", "--rate", "1000", "--requests", "1", "--prompt-len",
                       "2:2", "--new-tokens", "2:2"])  # serve prints .../v1: the base of OpenAI's clients
        assert record["runs"][0]["completed"] == 1
        requests = engine.stats["requests"]
        with pytest.raises(CommandFailed, match="every such request would fail") as failed:
            main(["bench-serve", "--url", url, "--requests", "1", "--prompt-len", f"{engine.context}:{engine.context}",
                  "--new-tokens", "1:1"])
        assert failed.value.code == 2 and engine.stats["requests"] == requests  # refused before any request
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(CommandFailed, match="is not an llmstep server: GET /health gave HTTP 404") as failed:
            main(["bench-serve", "--url", f"http://127.0.0.1:{other.server_address[1]}", "--requests", "1"])
        assert failed.value.code == 2
    finally:
        other.shutdown()
        other.server_close()


def test_a_port_in_use_is_refused_before_the_model_loads(monkeypatch):
    """The CLI binds its socket first: a busy port costs no load of the weights (seconds to minutes)."""
    from llmstep.core import checkpoint
    from llmstep.serve.app import bind

    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    busy = bind("127.0.0.1", 0)
    busy.listen()  # a server's, serving
    try:
        port = busy.getsockname()[1]
        with pytest.raises(CommandFailed, match=f"cannot listen on 127.0.0.1 port {port}: Address already in use"):
            main(["serve", "--port", str(port)])
    finally:
        busy.close()


def test_bench_serve_keeps_the_rates_done_when_the_server_goes_and_fails_when_nothing_completed(monkeypatch,
                                                                                                tmp_path):
    """A server that stops answering mid-run leaves the rates done in --json, and the error says so (not "no
    server"); a run where no request completed ends in an error after its record is written."""
    import httpx

    from llmstep.serve import loadgen

    out = tmp_path / "serve.json"
    run = {"rate_per_second": 1.0, "requests": 2, "completed": 2, "failed": 0, "refused_429": 0, "failures": []}

    def goes_away(url, rates, *args, on_run=None, **kwargs):
        on_run({"server": {"url": url}, "runs": []})
        on_run({"server": {"url": url}, "runs": [run]})
        raise httpx.ConnectError("connection refused")

    monkeypatch.setattr(loadgen, "bench", goes_away)
    with pytest.raises(CommandFailed, match=r"stopped answering during the run \(1 of 3 rate\(s\) recorded\).* the 1 "
                                            r"rate\(s\) done are in"):
        main(["bench-serve", "--url", "http://127.0.0.1:9", "--rate", "1,2,4", "--json", str(out)])
    assert json.loads(out.read_text())["runs"] == [run]

    def nothing_completes(url, rates, *args, on_run=None, **kwargs):
        failed = run | {"completed": 0, "failed": 2, "failures": ["HTTP 500"]}
        return {"server": {"url": url}, "runs": [failed], "server_after": {}}

    monkeypatch.setattr(loadgen, "bench", nothing_completes)
    with pytest.raises(CommandFailed, match="no request completed at any rate .*2 failed: HTTP 500"):
        main(["bench-serve", "--url", "http://127.0.0.1:9", "--rate", "1", "--json", str(out)])
    assert json.loads(out.read_text())["runs"][0]["completed"] == 0  # the record says what failed


def test_bench_serve_names_a_server_that_went_away_and_keeps_the_rate_it_finished(shipped, tmp_path, monkeypatch):
    import contextlib

    from llmstep.serve import loadgen

    model, tokenizer = shipped
    out = tmp_path / "serve.json"
    stack = contextlib.ExitStack()
    url, _ = stack.enter_context(running_server(model, tokenizer, n_slots=2))
    real = loadgen.bench

    def bench(*args, on_run=None, **kwargs):  # the real load; the server stopped once the first rate is recorded
        def after(record):
            on_run(record)
            if len(record["runs"]) == 1:
                stack.close()
        return real(*args, on_run=after, **kwargs)

    monkeypatch.setattr(loadgen, "bench", bench)
    try:
        with pytest.raises(CommandFailed, match=r"stopped answering during the run \(1 of 2 rate\(s\) recorded\)"):
            main(["bench-serve", "--url", url, "--rate", "1000,1000", "--requests", "2", "--prompt-len", "2:2",
                  "--new-tokens", "2:2", "--json", str(out)])
    finally:
        stack.close()
    runs = json.loads(out.read_text())["runs"]
    assert [r["completed"] for r in runs] == [2]

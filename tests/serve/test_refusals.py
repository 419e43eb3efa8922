"""What `llmstep serve` refuses, and how: before anything is queued, as a 400 in OpenAI's shape naming the field
(a seed out of the engine's range, a request longer than the KV pool holds, text that is not Unicode or too long
to read); a refusal the engine makes anyway is a 400 too, or an error event then [DONE] once a stream has begun;
a client that leaves while its request waits frees its place; unknown routes answer in the same shape; a web page
elsewhere is refused."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from serving import TIMEOUT, client, load_shipped, running_server, shared_server, wait_for

from llmstep.serve.protocol import max_body_bytes

openai = pytest.importorskip("openai")
shipped = pytest.fixture(scope="module", name="shipped")(load_shipped)
server = pytest.fixture(scope="module", name="server")(shared_server)


def post(url: str, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, bytes):  # sent as written: JSON no client would make (a lone surrogate)
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def events(url: str, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT) as r:
        return r.status_code, [line.removeprefix("data: ") for line in r.iter_lines() if line]


@pytest.mark.parametrize("stream", [False, True])
def test_a_negative_seed_is_a_400_naming_seed_streamed_or_not(server, stream):
    url, engine = server
    requests = engine.stats["requests"]
    error = error_of(post(url, {"prompt": "ROMEO:", "max_tokens": 3, "seed": -1, "stream": stream}))
    assert error["param"] == "seed" and "2**64 - 1" in error["message"]
    assert engine.stats["requests"] == requests  # refused before it was queued


def test_a_request_the_engine_refuses_is_a_400_or_an_error_event_then_done(server, monkeypatch):
    """The web layer checks first, so this takes a session that refuses everything: what it says reaches the
    client, never a 500 or a stream cut off."""
    url, engine = server

    def refuse(request):
        raise ValueError("max_new_tokens is not what this session takes")

    monkeypatch.setattr(engine.session, "submit", refuse)
    error = error_of(post(url, {"prompt": "ROMEO:", "max_tokens": 3}))
    assert error["type"] == "invalid_request_error" and "max_new_tokens" in error["message"]
    status, lines = events(url, {"prompt": "ROMEO:", "max_tokens": 3})
    assert status == 200 and lines[-1] == "[DONE]"
    assert "max_new_tokens" in json.loads(lines[-2])["error"]["message"]


def test_a_request_whose_logits_break_is_a_500_and_the_server_serves_the_others(shipped):
    """NaN logits on one request's input (a model overflowing on it alone): that request is a 500 model_error (an
    error event, then [DONE], once streaming), its blocks are freed, and the engine goes on serving."""
    model, tokenizer = shipped
    bad = tokenizer.encode("JULIET:")
    with running_server(model, tokenizer, n_slots=2) as (url, engine):
        forward = engine.session.runner.forward

        def breaking(work):  # NaN in the row of any request whose prompt is "JULIET:"
            logits = forward(work)  # [K, vocab]: the chunks that sample, in order
            for k, s in enumerate([s for s in work if s.samples]):
                if list(s.job.known[:len(bad)]) == bad:
                    logits[k, 0] = float("nan")
            return logits

        engine.session.runner.forward = breaking
        error = error_of(post(url, {"prompt": "JULIET:", "max_tokens": 3}), 500)
        assert (error["type"], error["code"]) == ("server_error", "model_error")
        assert "non-finite logits" in error["message"]
        status, lines = events(url, {"prompt": "JULIET:", "max_tokens": 3})
        assert status == 200 and lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["error"]["code"] == "model_error"
        ok = post(url, {"prompt": "ROMEO:", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        health = engine.health()
        assert engine.alive and health["kv_blocks_used"] == 0 and health["model_errors"] == 2


def test_the_engines_context_is_what_its_session_takes(shipped):
    from llmstep.engines.batching import Request
    from llmstep.serve.engine import Engine

    model, _ = shipped
    engine = Engine(model, n_slots=1, block_size=16, kv_blocks=4)  # not started: its session is ours
    try:
        assert engine.context == 4 * 16 + 1 < model.config.max_seq_len
        engine.session.submit(Request(list(range(1, 11)), max_new_tokens=engine.context - 10))
        with pytest.raises(ValueError, match="whole pool"):
            engine.session.submit(Request(list(range(1, 11)), max_new_tokens=engine.context - 9))
    finally:
        engine.session.close()


def test_a_small_kv_pool_refuses_at_once_what_it_cannot_hold_and_serves_what_it_can(shipped):
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=2, block_size=16, kv_blocks=4) as (url, engine):
        context = 4 * 16 + 1
        assert httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"][0]["max_model_len"] == context
        error = error_of(post(url, {"prompt": "ROMEO:", "max_tokens": 100}))
        assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
        assert error_of(post(url, {"prompt": list(range(1, 70)), "max_tokens": 1}))["param"] == "prompt"
        long_chat = {"messages": [{"role": "user", "content": "ab " * 100}], "max_tokens": 1}
        assert error_of(post(url, long_chat, "/v1/chat/completions"))["param"] == "messages"
        # without max_tokens: what fits, a chat's the rest of the pool's room, a completion's 16 cut to it
        chat = client(url).chat.completions.create(model="shipped", messages=[{"role": "user", "content": "Speak."}],
                                                   extra_body={"ignore_eos": True})
        assert chat.usage.total_tokens == context and chat.choices[0].finish_reason == "length"
        r = client(url).completions.create(model="shipped", prompt=list(range(1, 61)), extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == context - 60
        assert engine.stats["requests"] == engine.stats["finished"] == 2 and engine.error is None


@pytest.mark.parametrize("raw", [b'{"prompt": "\\ud800", "max_tokens": 3}', b'{"prompt": ["ab\\udfff"]}'])
def test_a_prompt_that_is_not_unicode_is_a_400_naming_prompt(server, raw):
    error = error_of(post(server[0], raw))
    assert error["param"] == "prompt" and "Unicode" in error["message"]


@pytest.mark.parametrize("raw, status, param", [(b'{"prompt": [1], "model": "\\ud800"}', 404, "model"),
                                                (b'{"prompt": [1], "stream": "\\udfff"}', 400, "stream"),
                                                (b'{"prompt": [1], "\\ud800x": 1}', 400, "\ud800x"),
                                                (b'{"prompt": [1], "stream": true, "stream_options": {"\\udfff": 1}}',
                                                 400, "stream_options.\udfff")])
def test_a_lone_surrogate_in_a_refused_field_or_name_is_still_a_clean_refusal(server, raw, status, param):
    """JSON's "\\ud800" parses to a lone surrogate, no Unicode text: quoted in the error (or naming its field), it
    must not turn the refusal into a 500 when the error is encoded to send."""
    error = error_of(post(server[0], raw), status)
    assert error["param"] == param and "\\ud" in error["message"]


def test_text_too_long_to_fit_is_refused_unread(server, shipped):
    url, _ = server
    _, tokenizer = shipped
    too_long = "a" * (512 * tokenizer.longest + 1)  # more bytes than 512 of the longest token hold
    error = error_of(post(url, {"prompt": too_long, "max_tokens": 1}))
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")  # as messages' below
    assert "bytes" in error["message"]  # counted, not tokenised
    chat = {"messages": [{"role": "user", "content": too_long}], "max_tokens": 1}
    error = error_of(post(url, chat, "/v1/chat/completions"))
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert "bytes" in error["message"]
    wide = "語" * (512 * tokenizer.longest // 3 + 1)  # fewer characters than the bound, more bytes
    error = error_of(post(url, {"prompt": wide, "max_tokens": 1}))
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")


def test_a_client_that_leaves_while_its_request_waits_frees_its_place(shipped, monkeypatch):
    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=1, max_queue=1) as (url, engine):
        step = engine.session.step
        monkeypatch.setattr(engine.session, "step", lambda: time.sleep(0.02) or step())  # 480 tokens: ~10 s
        long = {"model": "shipped", "prompt": "ROMEO:", "max_tokens": 480, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=TIMEOUT) as running:
            lines = running.iter_lines()  # kept: a generator dropped would close the connection
            next(lines)  # it holds the one slot
            with pytest.raises(httpx.ReadTimeout):  # waits behind it, gives up after 1 s: the connection closes
                httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=httpx.Timeout(TIMEOUT, read=1.0))
            wait_for(lambda: engine.health()["waiting"] == 0, "the abandoned request to leave the queue", timeout=30)
            assert engine.health()["running"] == 1 and engine.stats["cancelled"] == 1  # the long one still runs
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the place is free: a new request waits in it
                fresh = pool.submit(client(url).completions.create, model="shipped", prompt="hi", max_tokens=2)
                wait_for(lambda: engine.health()["waiting"] == 1 or fresh.done(), "the new request to queue")
                running.close()
                assert fresh.result(TIMEOUT).usage.completion_tokens == 2
        assert engine.stats["refused"] == 0


@pytest.mark.parametrize(("method", "path", "status", "code"), [("GET", "/v2/nothing", 404, "not_found"),
                                                                ("GET", "/v1/completions", 405, "method_not_allowed")])
def test_an_unknown_route_or_method_answers_in_openais_error_shape(server, method, path, status, code):
    error = error_of(httpx.request(method, f"{server[0]}{path}", timeout=TIMEOUT), status)
    assert error["code"] == code and error["message"]


def test_a_request_ended_by_a_stop_string_is_not_counted_as_cancelled(server):
    url, engine = server
    greedy = client(url).completions.create(model="shipped", prompt="ROMEO:", max_tokens=10, temperature=0)
    before = dict(engine.stats)
    r = client(url).completions.create(model="shipped", prompt="ROMEO:", max_tokens=10, temperature=0,
                                       stop=greedy.choices[0].text[2:5])
    assert r.choices[0].finish_reason == "stop"
    wait_for(lambda: engine.stats["stop_strings"] == before["stop_strings"] + 1, "the stop string to be counted",
             timeout=30)
    assert engine.stats["cancelled"] == before["cancelled"]


def test_a_body_larger_than_any_request_the_server_holds_is_a_413_before_it_is_read(server, shipped):
    url, engine = server
    limit = max_body_bytes(engine.context, shipped[1].longest)
    requests = engine.stats["requests"]
    body = b'{"prompt": "' + b"a" * limit + b'", "max_tokens": 1}'
    error = error_of(post(url, body), status=413)
    assert error["code"] == "request_too_large" and f"{limit:,} bytes" in error["message"]
    assert engine.stats["requests"] == requests
    text = "ROMEO: " + "x" * (limit - 2**20 - 100)  # just under the limit: read, then refused as too long by tokens
    assert error_of(post(url, {"prompt": text, "max_tokens": 1}))["param"] == "prompt"


def test_odd_model_stream_options_and_max_completion_tokens_are_named_as_sent(server, shipped):
    url, engine = server
    error = error_of(post(url, {"prompt": "hi", "max_tokens": 2, "model": 5}))
    assert error["param"] == "model" and error["code"] == "invalid_type"
    error = error_of(post(url, {"prompt": "hi", "max_tokens": 2, "model": "x" * 10_000}), 404)
    assert len(error["message"]) < 200  # the name shortened, not echoed whole
    for options in ([], False, 0, ""):
        assert error_of(post(url, {"prompt": "hi", "stream": True, "stream_options": options}))["param"] == \
            "stream_options"
    error = error_of(post(url, {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}))
    assert error["param"] == "stream_options" and "stream" in error["message"]
    for options in ({}, {"include_usage": False}, None):  # asking for nothing is no question (vLLM takes it too)
        assert post(url, {"prompt": "hi", "max_tokens": 2, "stream_options": options}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": engine.context + 1}
    error = error_of(post(url, chat, "/v1/chat/completions"))
    assert error["param"] == "max_completion_tokens" and "max_completion_tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_a_field_the_endpoint_does_not_take_is_refused_by_name(server):
    """A mistyped or foreign field would otherwise be dropped and the answer made without it: refused, as OpenAI
    refuses it, before any work; fields that change no answer pass."""
    url, engine = server
    requests = engine.stats["requests"]
    for body, path, name in (({"prompt": "hi", "max_new_tokens": 2}, "/v1/completions", "max_new_tokens"),
                             ({"prompt": "hi", "repeat_penalty": 1.1}, "/v1/completions", "repeat_penalty"),
                             ({"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"},
                              "/v1/chat/completions", "prompt"),
                             ({"prompt": "hi", "messages": []}, "/v1/completions", "messages"),
                             ({"prompt": "hi", "max_completion_tokens": 2}, "/v1/completions",
                              "max_completion_tokens")):
        error = error_of(post(url, body, path))
        assert error["param"] == name and error["code"] == "unrecognized_argument", error
        assert name in error["message"] and path in error["message"]
    assert "did you mean max_tokens" in error_of(post(url, {"prompt": "hi", "max_token": 2}))["message"]
    assert engine.stats["requests"] == requests
    fine = {"prompt": "hi", "max_tokens": 1, "user": "u1", "metadata": {"a": "b"}, "store": False,
            "service_tier": "auto"}
    assert post(url, fine).status_code == 200


def test_a_web_page_elsewhere_cannot_drive_a_server_on_loopback(server):
    """A page the user opens may POST text/plain cross-origin (no preflight), or rebind its own name to 127.0.0.1:
    either is a 403 before anything is queued; curl's form content type, from no page, is served."""
    url, engine = server
    port, body, requests = url.rsplit(":", 1)[1], b'{"prompt": "ROMEO:", "max_tokens": 1}', engine.stats["requests"]
    for headers in ({"Content-Type": "text/plain;charset=UTF-8", "Origin": "http://evil.example"},
                    {"Content-Type": "application/json", "Host": f"rebind.evil.example:{port}"}):
        r = httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=TIMEOUT)
        assert error_of(r, 403)["code"] == "forbidden"
    assert engine.stats["requests"] == requests
    curl = {"Content-Type": "application/x-www-form-urlencoded", "Host": f"localhost:{port}"}
    assert httpx.post(f"{url}/v1/completions", content=body, headers=curl, timeout=TIMEOUT).status_code == 200


def test_head_asks_what_get_answers(server):
    for path in ("/health", "/v1/models"):
        r = httpx.head(f"{server[0]}{path}", timeout=TIMEOUT)
        assert r.status_code == 200 and r.content == b""


def test_a_failed_engine_stops_the_server_and_a_busy_port_leaves_no_engine(shipped):
    """A server whose engine has failed answers nothing: it stops (serve() then raises the error) rather than
    answering 503 for ever; and a port that cannot be bound is refused before an engine (its KV pool) exists."""
    import threading

    from llmstep.serve.app import background

    model, tokenizer = shipped
    with running_server(model, tokenizer, n_slots=2) as (url, engine):
        def broken():
            raise RuntimeError("no viable attention kernel")

        engine.session.step = broken
        error = error_of(post(url, {"prompt": "ROMEO:", "max_tokens": 3}), 503)
        assert "no viable attention kernel" in error["message"]
        def gone() -> bool:
            try:
                httpx.get(f"{url}/health", timeout=5)
            except httpx.TransportError:
                return True
            return False

        wait_for(gone, "the server to stop")
        assert isinstance(engine.error, RuntimeError)
    engines = sum(t.name == "llmstep-engine" for t in threading.enumerate())
    with running_server(model, tokenizer, n_slots=2) as (busy, _):
        port = int(busy.rsplit(":", 1)[1])
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1 port {port}"):
            with background(model, tokenizer, port=port):
                pass
        assert sum(t.name == "llmstep-engine" for t in threading.enumerate()) == engines + 1  # the running one's


def _events(r: httpx.Response) -> list[dict]:
    """A server-sent-events body's JSON events, [DONE] last (checked)."""
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def test_the_bodies_on_the_wire_are_openais(server):
    """The openai client reads whatever fields come: the bodies themselves, field by field, as OpenAI's reference
    gives them (object kinds, ids, the served model's name, the assistant's role, usage adding up)."""
    url, _ = server
    common = {"model": "shipped", "max_tokens": 4, "temperature": 0}
    one = post(url, common | {"prompt": "ROMEO:"}).json()
    assert set(one) == {"id", "object", "created", "model", "choices", "usage"}
    assert one["object"] == "text_completion" and one["id"].startswith("cmpl-") and one["model"] == "shipped"
    assert type(one["created"]) is int and abs(one["created"] - time.time()) < 600
    assert [set(c) for c in one["choices"]] == [{"index", "text", "logprobs", "finish_reason"}]
    assert one["choices"][0]["index"] == 0 and one["choices"][0]["logprobs"] is None
    use = one["usage"]
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"] and use["completion_tokens"] == 4
    chat = post(url, common | {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions").json()
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-") and chat["model"] == "shipped"
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["choices"][0]["index"] == 0
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    for path, body, kind in (("/v1/completions", {"prompt": "ROMEO:"}, "text_completion"),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                              "chat.completion.chunk")):
        events = _events(post(url, common | body | {"stream": True, "stream_options": {"include_usage": True}},
                              path))
        assert {e["object"] for e in events} == {kind} and len({e["id"] for e in events}) == 1
        assert all(e["model"] == "shipped" and type(e["created"]) is int for e in events)
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4  # the usage chunk, last
        assert all(len(e["choices"]) == 1 and e["choices"][0]["index"] == 0 for e in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
        if kind == "chat.completion.chunk":
            assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"  # the first delta names the role

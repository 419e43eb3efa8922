"""`llmstep serve`'s app driven as uvicorn drives it (ASGI messages, no socket, no model): a client gone, or a
server stopping, before a request's body is all read is answered, never an exception uvicorn logs as the
server's; and a server bound to a loopback address answers no request for another host name (DNS rebinding) or
from a web page elsewhere."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from llmstep.serve.app import create_app, foreign, is_loopback  # noqa: E402

BODY = b'{"prompt": "ROMEO:", "max_tokens": 3}'


def app_bound_to(host: str = "127.0.0.1"):
    """The app as serve() makes it for a server bound to `host`, over an engine and tokenizer it never reaches."""
    engine = SimpleNamespace(context=64, end_ids=lambda tokenizer: [2])
    return create_app(engine, SimpleNamespace(longest=16, vocab_size=10), "m", host)


def scope(method: str, path: str, headers: dict[str, str]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8000), "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}


def call(app, method: str, path: str, headers: dict[str, str], body: list[bytes], then: str = "end",
         cancel: bool = False) -> tuple[int, bytes]:
    """(status, body) of one request whose body comes in `body`'s pieces, then: "end" (all sent), "gone" (the
    client closes first) or "wait" (it sends no more). cancel: the request is cancelled while it waits for more,
    as uvicorn cancels what is still open once a stopping server's grace is over. An exception the app raises
    (what uvicorn logs as "Exception in ASGI application") is raised here."""
    pieces = [{"type": "http.request", "body": b, "more_body": then != "end" or i < len(body) - 1}
              for i, b in enumerate(body)] or [{"type": "http.request", "body": b"", "more_body": then != "end"}]
    sent, waiting = [], asyncio.Event()

    async def receive():
        if pieces:
            return pieces.pop(0)
        if then == "gone":
            return {"type": "http.disconnect"}
        waiting.set()
        await asyncio.Event().wait()  # nothing more comes

    async def send(message):
        sent.append(message)

    async def run():
        task = asyncio.ensure_future(app(scope(method, path, headers), receive, send))
        if cancel:
            await asyncio.wait_for(waiting.wait(), 10)
            task.cancel()
        await asyncio.wait_for(task, 10)

    asyncio.run(run())
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


LOCAL = {"Host": "127.0.0.1:8000", "Content-Type": "application/json"}


def test_a_client_gone_before_its_body_is_all_sent_is_answered_not_raised():
    status, _ = call(app_bound_to(), "POST", "/v1/completions", LOCAL | {"Content-Length": "100"}, [BODY[:14]],
                     then="gone")
    assert status == 499  # nobody reads it; uvicorn logs no traceback for an app that returned


def test_a_body_still_coming_when_the_server_stops_is_a_503_not_a_cancelled_task():
    status, body = call(app_bound_to(), "POST", "/v1/completions", LOCAL | {"Content-Length": "100"}, [BODY[:14]],
                        then="wait", cancel=True)
    error = json.loads(body)["error"]
    assert status == 503 and (error["type"], error["code"]) == ("server_error", "engine_stopped")


@pytest.mark.parametrize("name, loopback", [("127.0.0.1", True), ("localhost", True), ("LocalHost", True),
                                            ("::1", True), ("127.0.0.2", True), ("localhost.", True),
                                            ("LOCALHOST.", True), ("::ffff:127.0.0.1", True), ("localhost..", False),
                                            ("::ffff:10.0.0.1", False), ("0.0.0.0", False), ("::", False),
                                            ("192.168.1.5", False), ("localhost.evil.example", False), ("", False)])
def test_loopback_names(name, loopback):
    assert is_loopback(name) is loopback


@pytest.mark.parametrize("headers", [{"Host": "evil.example:8000"}, {"Host": "rebind.evil.example"},
                                     {"Host": "127.0.0.1.evil.example:8000"}, {"Host": "evil@127.0.0.1"},
                                     {"Host": "127.0.0.1:8000:8000"}, {"Host": ""},
                                     {"Host": "127.0.0.1:8000", "Origin": "http://evil.example"},
                                     {"Host": "localhost:8000", "Origin": "null"},
                                     {"Host": "localhost:8000", "Origin": "http://localhost.evil.example:8000"}],
                         ids=lambda h: " ".join(f"{k}={v}" for k, v in h.items()))
def test_a_loopback_server_refuses_another_hosts_name_and_a_page_elsewhere_unread(headers):
    """A page the user opens may POST text/plain cross-origin (no preflight) or rebind its own name to 127.0.0.1:
    either is a 403 in OpenAI's shape naming the header, before the body is read."""
    for method, path, body in (("POST", "/v1/completions", [BODY]), ("GET", "/v1/models", [])):
        status, out = call(app_bound_to(), method, path, headers | {"Content-Type": "text/plain;charset=UTF-8"}, body,
                           then="wait")  # a body read would wait for ever
        error = json.loads(out)["error"]
        assert status == 403 and error["code"] == "forbidden" and set(error) == {"message", "type", "param", "code"}
        assert ("Origin" if "Origin" in headers else "Host") in error["message"]
    assert foreign([(b"host", b"x" * 10_000)]).count("x") < 100  # the header quoted short


@pytest.mark.parametrize("headers", [{"Host": "127.0.0.1:8000"}, {"Host": "localhost"}, {"Host": "[::1]:8000"},
                                     {"Host": "LOCALHOST:1", "Origin": "http://localhost:3000"},
                                     {"Host": "127.0.0.1:8000", "Origin": "http://[::1]:8000"},
                                     {"Host": "localhost:8000", "Origin": "https://127.0.0.1"},
                                     {"Host": "localhost.:8000", "Origin": "http://localhost.:3000"},
                                     {"Host": "[::ffff:127.0.0.1]:80"}, {}],
                         ids=lambda h: " ".join(f"{k}={v}" for k, v in h.items()) or "no Host")
def test_a_loopback_server_answers_its_own_names_and_pages(headers):
    assert call(app_bound_to(), "GET", "/v1/models", headers, [])[0] == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5"])
def test_a_server_bound_to_be_reachable_answers_any_host_and_origin(host):
    headers = {"Host": "evil.example:8000", "Origin": "http://evil.example"}
    assert call(app_bound_to(host), "GET", "/v1/models", headers, [])[0] == 200


def test_curls_form_content_type_is_read_as_json():
    """`curl -d` sends application/x-www-form-urlencoded: no JSON content type is required (the body is read as
    JSON whatever it says), so a refusal here is the body's own, past the host checks."""
    status, out = call(app_bound_to(), "POST", "/v1/completions",
                       {"Host": "localhost:8000", "Content-Type": "application/x-www-form-urlencoded"},
                       [b'{"prompt": "hi", "max_token": 2}'])
    assert status == 400 and json.loads(out)["error"]["param"] == "max_token"

"""`llmstep serve`'s HTTP side: the OpenAI routes, server-sent events, errors; and the uvicorn server around them.

Why FastAPI on uvicorn: it is the stack vLLM's and SGLang's OpenAI servers run on, so a learner who reads this
file can read theirs. uvicorn is an asyncio ASGI server that handles SIGINT/SIGTERM with a graceful shutdown;
Starlette (under FastAPI) streams a response from an async generator and cancels it when the client goes,
which is how a disconnect reaches the engine; FastAPI adds the routing and the error handlers. The checking of
request bodies is ours (llmstep.serve.protocol), not FastAPI's pydantic models, so that every refusal is HTTP
400 with OpenAI's error body naming the field (FastAPI's own would be a 422 in its own shape).

Routes: GET (and HEAD) /health, GET (and HEAD) /v1/models and /v1/models/{id}, POST /v1/completions, POST
/v1/chat/completions (the checkpoint's chat template, `Tokenizer.encode_chat`), each streamed (`"stream": true`: `data:
{json}` events, then `data: [DONE]`) or not. Text is decoded incrementally (`Tokenizer.stream`, special tokens
skipped), as `llmstep.generate` does, and cut before a `stop` string (the engine then drops the request). The model's
end-of-sequence tokens (else its tokenizer's, as `llmstep.generate`) end a request with finish_reason "stop"; its
max_tokens, or the end of the context, with "length". A request is checked whole before it is queued, its length
against what the server holds (`Engine.context`: the model's context or the KV pool, whichever is less), so the engine
never refuses one; if it still does, that is a 400 (an error event, then [DONE], once a stream has begun; a server
stopping under an open stream sends a server_error event, then [DONE]). A request on which the model's logits break
(NaN or Inf) is a 500 "model_error" (or that event), and the engine serves the others. Every chunk of a response
carries the one `created` time. A client that goes away, mid-stream, or while its request waits for a slot or runs for
a whole answer, has its request dropped at once, and one gone before its body is all sent is no error of the server's.
Text is tokenised off the event loop, and a text too long to fit is refused unread.

Bound to a loopback address (the default), the server answers only requests for localhost or a loopback address
(127.x.x.x, [::1]; any port), and none from a web page elsewhere: a Host naming another host (DNS rebinding) or an
Origin of another is a 403 (`foreign`), so no page the user opens can drive it. Bound to 0.0.0.0 or a LAN
address, it is reachable by choice: neither is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..core.tokens import Tokenizer
from ..engines.batching import Request as EngineRequest
from ..engines.decoding import NonFiniteLogitsError
from . import protocol
from .engine import PREFILL_CHUNK, Busy, Engine, EngineStopped
from .protocol import RequestError, Sampling

__all__ = ["create_app", "make_server", "bind", "serve", "background"]


class ErrorResponse(JSONResponse):
    """An error's JSON in ASCII (every other character escaped): a field name or value the client sent that is no
    Unicode text (a lone surrogate, which JSON's "\\ud800" parses to) cannot make the error itself fail to send."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def is_loopback(name: str) -> bool:
    """`name`, an address to bind or the host a Host or Origin header names (no brackets, no port), is this
    machine alone: localhost, 127.0.0.0/8 or ::1 (and ::ffff:127.x.x.x)."""
    if name.lower().removesuffix(".") == "localhost":  # "localhost." is the same name, fully qualified
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    return ip.is_loopback or getattr(ip, "ipv4_mapped", None) is not None and ip.ipv4_mapped.is_loopback


def _host(value: str) -> str:
    """The host of a Host header's host[:port] ("[::1]:8000": "::1"); "" where it is no such thing."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::\d*)?|([^:\[\]]*)(?::\d*)?", value)
    return "" if m is None else m.group(1) or m.group(2)


def foreign(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a server on a loopback address refuses a request with these headers, or None: a Host that names no
    loopback address (a page whose name was rebound to 127.0.0.1), or an Origin whose host is none (a web page
    elsewhere: a browser sends its "simple" cross-origin POST, text/plain, with no preflight; "null" too)."""
    for key, raw in headers:
        value = raw.decode("latin-1")
        if key == b"host" and not is_loopback(_host(value)):
            return (f"the Host header {protocol.shorten(value)} names no loopback address: this server, bound to "
                    "one, answers requests for localhost or a loopback address only")
        if key == b"origin" and not is_loopback(_host(value.partition("://")[2])):
            return (f"a request from the web page of Origin {protocol.shorten(value)} is refused: this server, "
                    "bound to a loopback address, answers pages of localhost or a loopback address only")
    return None


class LoopbackOnly:
    """ASGI middleware: a request `foreign` refuses is answered 403 unread, before any route."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        why = foreign(scope["headers"]) if scope["type"] == "http" else None
        app = self.app if why is None else ErrorResponse(protocol.error_body(why, code="forbidden"), status_code=403)
        await app(scope, receive, send)


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, host: str = "127.0.0.1") -> FastAPI:
    """The app over a started engine. model_name: what /v1/models lists and requests may name. host: the address
    the server is bound to; a loopback one (the default) refuses what `foreign` names (0.0.0.0: nothing)."""
    app = FastAPI(title="llmstep serve", docs_url=None, redoc_url=None, openapi_url=None)
    if is_loopback(host):
        app.add_middleware(LoopbackOnly)
    # a name from argv may hold undecodable bytes (lone surrogates): escaped once, so every response can be sent
    model_name = protocol.sendable(model_name)
    # the most tokens, prompt and new, one request may have; the end tokens it stops at (as llmstep.generate's)
    context, ends = engine.context, engine.end_ids(tokenizer)

    @app.exception_handler(RequestError)
    async def bad_request(_, e: RequestError):
        headers = {"Retry-After": "1"} if e.status == 429 else None  # a full queue drains in about a second
        return ErrorResponse(protocol.error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                            headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def gone(_, e: ClientDisconnect):  # it left before its body was all sent: an answer nobody reads
        return Response(status_code=499)  # as `answer` gives a client gone, and not logged as a server's error

    @app.exception_handler(HTTPException)
    async def no_route(_, e: HTTPException):  # 404, 405: in OpenAI's shape too, not FastAPI's {"detail": ...}
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ErrorResponse(protocol.error_body(str(e.detail), "invalid_request_error", None, code),
                            status_code=e.status_code, headers=e.headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        body = engine.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "llmstep", "max_model_len": context}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != model_name:
            raise RequestError(f"the model {protocol.shorten(model_id)} does not exist: this server serves "
                               f"{protocol.quote(model_name)}", "model", "model_not_found", status=404)
        return model_card

    limit = protocol.max_body_bytes(context, tokenizer.longest)

    async def read_body(request: Request) -> dict:
        raw = bytearray()
        try:
            async for chunk in request.stream():  # read up to the limit, not whatever was sent
                raw += chunk
                if len(raw) > limit:
                    raise RequestError(f"the request body is over {limit:,} bytes: more than a request of {context} "
                                       "tokens can hold", None, "request_too_large", status=413)
        except asyncio.CancelledError:  # uvicorn cancels what is open when a stopping server's grace is over: a
            # body still coming is answered, not logged as the server's error
            raise RequestError("the server is shutting down", None, "engine_stopped", status=503,
                               type="server_error") from None
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RequestError(f"the request body is not valid JSON: {e.msg.removesuffix(' at')} at line {e.lineno} "
                               f"column {e.colno}", None, "invalid_json") from None
        except UnicodeDecodeError as e:
            raise RequestError(f"the request body is not UTF-8 text: byte {e.start} cannot be read", None,
                               "invalid_json") from None
        except RecursionError:  # JSON nested about a thousand deep: valid, too deep to read
            raise RequestError("the request body nests its JSON too deeply to be read", None, "invalid_json") from None
        except ValueError as e:  # what else the parser refuses: an integer of more than 4,300 digits
            raise RequestError(f"the request body cannot be read as JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", None, "invalid_body")
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise RequestError(f"model must be a string, got {protocol.shorten(body['model'])}", "model",
                               "invalid_type")
        if body.get("model") not in (None, model_name):
            raise RequestError(f"the model {protocol.shorten(body['model'])} does not exist: this server serves "
                               f"{protocol.quote(model_name)}", "model", "model_not_found", status=404)
        return body

    def generate(ids: list[int], sampling: Sampling, prompt_param: str) -> tuple[asyncio.Queue, object]:
        max_new = protocol.check_length(len(ids), sampling, context, prompt_param)
        request = EngineRequest(ids, max_new_tokens=max_new, temperature=sampling.temperature, top_k=sampling.top_k,
                                top_p=sampling.top_p, seed=sampling.seed, stop_ids=() if sampling.ignore_eos else ends)
        try:
            return engine.submit(request, asyncio.get_running_loop())
        except Busy as e:
            raise RequestError(str(e), None, "queue_full", status=429, type="rate_limit_error") from None
        except EngineStopped as e:
            raise RequestError(str(e), None, "engine_stopped", status=503, type="server_error") from None

    async def pieces(ticket, sampling: Sampling) -> AsyncIterator[tuple[str, str | None, int]]:
        """(text, finish_reason, tokens so far) as tokens arrive; the request is cancelled if this stops early."""
        detok, stop_text = tokenizer.stream(skip_special_tokens=True), protocol.StopText(sampling.stop)
        n, reason = 0, None
        try:
            while reason is None:
                item = await ticket.queue.get()
                if isinstance(item, BaseException):  # EngineStopped, a ValueError (refused), NonFiniteLogitsError
                    raise item
                token, reason = item
                if token is not None and token >= 0:
                    n += 1
                    text = "" if reason == "stop" else detok.step(token)  # a stop token's text is not shown
                    text = stop_text.feed(text + (detok.flush() if reason else ""))
                    if stop_text.stopped:
                        reason = "stop"
                        engine.cancel(ticket, stop_string=True)  # it may still be running: free its slot now
                    elif reason:
                        text += stop_text.flush()
                    yield text, (None if reason is None else "length" if reason == "context" else reason), n
                if reason == "interrupted":
                    raise EngineStopped("the request was dropped")
        finally:
            if reason is None:  # the client went away (or the server stops): the engine drops it
                engine.cancel(ticket)

    def sse(body: dict | str) -> str:
        return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"

    async def whole(ticket, sampling: Sampling) -> tuple[str, str, int]:
        """(text, finish_reason, tokens) of a whole answer; cancelled, it cancels the request in the engine."""
        text, reason, n = "", "length", 0
        made_so_far = pieces(ticket, sampling)
        try:
            async for piece, finish, made in made_so_far:
                text, reason, n = text + piece, finish, made
        except EngineStopped as e:
            raise RequestError(str(e), None, "engine_stopped", status=503, type="server_error") from None
        except NonFiniteLogitsError as e:  # the model broke on this request (the server serves the others)
            raise RequestError(str(e), None, "model_error", status=500, type="server_error") from None
        except ValueError as e:  # the session's own check refused it (the web layer's checks should have)
            raise RequestError(str(e), None, "invalid_value") from None
        finally:
            await made_so_far.aclose()  # cancels the request in the engine if it has not finished
        return text, reason, n

    async def answer(http: Request, ids: list[int], sampling: Sampling, chat: bool):
        rid, created = protocol.new_id("chatcmpl" if chat else "cmpl"), int(time.time())  # one time for its chunks
        ticket = generate(ids, sampling, "messages" if chat else "prompt")
        if not sampling.stream:
            done = await unless_gone(http, whole(ticket, sampling))
            if done is None:  # nobody waits for the answer: the request is dropped already
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            text, reason, n = done
            use = protocol.usage(len(ids), n)
            body = protocol.chat_body if chat else protocol.completion_body
            return body(rid, created, model_name, text, reason, use)

        async def events() -> AsyncIterator[str]:
            n = 0
            if chat:
                yield sse(protocol.chat_chunk(rid, created, model_name, {"role": "assistant", "content": ""},
                                              None))
            try:
                async for piece, reason, made in pieces(ticket, sampling):
                    n = made
                    if chat:
                        delta = {"content": piece} if piece else {}
                        yield sse(protocol.chat_chunk(rid, created, model_name, delta, reason))
                    else:
                        yield sse(protocol.completion_chunk(rid, created, model_name, piece, reason))
            except EngineStopped as e:  # after the 200 went out: the error as an event, the stream ended as any
                yield sse(protocol.error_body(str(e), "server_error", None, "engine_stopped"))
                yield sse("[DONE]")
                return
            except NonFiniteLogitsError as e:  # likewise: the model broke on this request alone
                yield sse(protocol.error_body(str(e), "server_error", None, "model_error"))
                yield sse("[DONE]")
                return
            except ValueError as e:  # refused by the session after the 200 went out: likewise
                yield sse(protocol.error_body(str(e), "invalid_request_error", None, "invalid_value"))
                yield sse("[DONE]")
                return
            if sampling.include_usage:
                use = protocol.usage(len(ids), n)
                chunk = protocol.chat_chunk if chat else protocol.completion_chunk
                yield sse(chunk(rid, created, model_name, "", None, use))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def encode(text: str) -> list[int]:
        protocol.check_prompt_size(text, context, tokenizer.longest)  # a text far too long is refused unread
        return tokenizer.encode(text, max_tokens=context)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        # tokenising is CPU work: in a worker thread, so the event loop goes on streaming the others' tokens
        ids, sampling = await asyncio.to_thread(protocol.parse_completion, body, encode, tokenizer.vocab_size)
        return await answer(request, ids, sampling, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        messages, sampling = protocol.parse_chat(body)
        protocol.check_chat_size(messages, context, tokenizer.longest)
        try:
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages)
        except ValueError as e:
            raise RequestError(f"messages: {e}", "messages", "invalid_value") from None
        return await answer(request, ids, sampling, chat=True)

    return app


async def until_gone(http: Request) -> None:
    """Returns once the client has closed the connection: its body read, the next message can only say that."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(http: Request, work):
    """What awaitable `work` returns, or None if the client goes first: `work` is then cancelled (a request
    waiting for a slot, or running, leaves the engine at once rather than at its next token)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(until_gone(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # nothing, if it is done
        await asyncio.gather(task, gone, return_exceptions=True)  # its clean-up (the engine's cancel) has run
    return None if task.cancelled() else task.result()


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A TCP socket bound to (host, port) (port 0: any free port; read it back with sock.getsockname()[1]); a port
    another socket listens on is refused here. It listens once the server runs (asyncio's create_server): until
    then, while the engine is built or the weights load, a client is refused at once rather than left waiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, engine: Engine | None = None, graceful_seconds: float = 2.0):
    """A uvicorn server for `app` (run it with `.run(sockets=[bind(...)])`). SIGINT/SIGTERM stop it: the engine
    stops at once (its open streams end with an error event and close), anything still open after
    graceful_seconds is cut; the process then returns normally (exit status 0) rather than dying of the signal
    again, as uvicorn does by default. An engine that fails (an attention kernel this machine lacks, a model that
    raises) stops it too, after the requests it held are told: a server that can answer nothing does not stay up. A
    request on which the model's logits break (NaN or Inf) is answered 500 model_error and counted in /health's
    model_errors; the server goes on (an overflow may come from one input alone), even for a model broken on all."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
                yield
                return
            before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if engine is not None:  # not from the signal handler itself: stopping waits for the current step
                threading.Thread(target=engine.stop, name="llmstep-engine-stop", daemon=True).start()

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_seconds, lifespan="off",
                            access_log=False)
    server = Server(config)
    if engine is not None:  # an engine that fails stops the server: serve() then raises its error
        engine.on_error = lambda: setattr(server, "should_exit", True)
    return server


def serve(model, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000, n_slots: int = 8,
          block_size: int = 16, kv_blocks: int | None = None, prefix_caching: bool = True,
          prefill_chunk: int | None = PREFILL_CHUNK, max_queue: int = 64, ready=None,
          sock: socket.socket | None = None) -> dict:
    """Serve (model, tokenizer) until SIGINT/SIGTERM; returns the engine's counters. ready(host, port, health) is
    called once the socket listens (port 0 picks a free one), with what /health says. The socket is bound before
    the engine (its KV pool) exists, so a port in use is refused at once; sock: one bound already (`bind`: the CLI
    binds it before it loads the weights), served and closed here; host: the address to bind (the address
    bound decides: a loopback one refuses `foreign` requests)."""
    sock = bind(host, port) if sock is None else sock
    try:
        engine = Engine(model, n_slots, block_size, kv_blocks, prefix_caching, prefill_chunk, max_queue).start()
    except BaseException:
        sock.close()
        raise
    try:
        # the address bound, not the name asked for: a host name that resolves to 127.0.1.1 is loopback too
        server = make_server(create_app(engine, tokenizer, model_name, sock.getsockname()[0]), engine)
        try:
            sock.listen(128)  # ready: a client told the address now waits in the backlog for the first accept
            if ready is not None:
                ready(host, sock.getsockname()[1], engine.health())
            server.run(sockets=[sock])
        finally:
            sock.close()
    finally:
        engine.stop()
    if engine.error is not None:
        raise engine.error
    return engine.health()


@contextlib.contextmanager
def background(model, tokenizer, model_name: str = "llmstep", host: str = "127.0.0.1", port: int = 0,
               start_seconds: float = 120.0, **options):
    """A server in a thread of this process (a notebook's, a test's), on a free port by default: yields
    (base_url, engine); stopped, its thread joined and its port closed on the way out. options: Engine's."""
    sock = bind(host, port)  # a port in use is refused before an engine (and its KV pool) exists
    engine = server = thread = None
    try:
        engine = Engine(model, **options).start()
        app = create_app(engine, tokenizer, model_name, sock.getsockname()[0])  # the address bound: a name's too
        server = make_server(app, engine, graceful_seconds=1.0)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="llmstep-serve", daemon=True)
        thread.start()
        deadline = time.monotonic() + start_seconds
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {start_seconds:g} s")
            time.sleep(0.02)
        where = f"[{host}]" if ":" in host else host
        yield f"http://{where}:{sock.getsockname()[1]}", engine
    finally:
        if thread is not None:  # as a signal does: the engine stops now, its open streams end with an error event
            server.should_exit = True
            threading.Thread(target=engine.stop, name="llmstep-engine-stop", daemon=True).start()
            thread.join(start_seconds)
        sock.close()
        if engine is not None:
            engine.stop()

"""The OpenAI API's side of `llmstep serve`: request bodies checked field by field, the response bodies, errors.

Pure Python, no web framework: a request body (parsed JSON) goes in, a `Sampling` and a prompt come out, or a
`RequestError` naming the field (HTTP 400 with OpenAI's error body, `{"error": {"message", "type", "param",
"code"}}`, which the `openai` client raises as `BadRequestError`). The fields are those of OpenAI's
`/v1/completions` and `/v1/chat/completions`, plus `top_k` (as vLLM accepts it); a field llmstep does not do
(several choices, logprobs, penalties, ...) is refused by name rather than ignored, so a client never gets an
answer to a question it did not ask; `ignore_eos` (vLLM's too) lets a benchmark fix every request's length.
Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 for a completion and the rest of the context
for a chat.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..core.checks import is_int, is_number

__all__ = ["RequestError", "Sampling", "parse_completion", "parse_chat", "error_body", "StopText",
           "completion_body", "completion_chunk", "chat_body", "chat_chunk", "usage", "MAX_STOP_STRINGS"]

MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# Fields whose only value llmstep serves is their default (OpenAI's): anything else is refused by name.
ONLY_DEFAULT = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
                "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None,
                "response_format": None}


class RequestError(ValueError):
    """A bad request: HTTP `status` with OpenAI's error body; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Sampling:
    """What a request asks of the engine, besides its prompt."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    ignore_eos: bool = False  # vLLM's extension, for benchmarks: run to max_tokens past end-of-sequence tokens


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value) or not (low < value if low_open else low <= value) \
            or value > high:
        span = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"{name} must be a number in {span}, got {value!r}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise RequestError(f"{name} must be an integer {span}, got {value!r}", name, "invalid_value")
    return int(value)


def _sampling(body: dict, default_max_tokens: int | None) -> Sampling:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_body")
    for name, default in ONLY_DEFAULT.items():
        if name in body and body[name] is not None and body[name] != default:
            raise RequestError(f"{name}={body[name]!r} is not supported by llmstep serve (only {default!r})", name,
                               "unsupported_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options",
                           "invalid_type")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, got "
                           f"{body.get('stop')!r}", "stop", "invalid_value")
    max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None and "max_completion_tokens" in body:
        max_tokens = _integer(body, "max_completion_tokens", 1)
    top_k = _integer(body, "top_k", -1)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos", "invalid_type")
    return Sampling(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's range
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    top_k=0 if top_k in (None, -1) else top_k,  # -1: off, as vLLM has it
                    seed=_integer(body, "seed", -(2**63), 2**64 - 1), stop=stop, stream=stream,
                    include_usage=bool(options.get("include_usage", False)), ignore_eos=ignore_eos)


def parse_completion(body: dict, encode, vocab_size: int) -> tuple[list[int], Sampling]:
    """/v1/completions: `prompt` as text, or as token ids -> (prompt ids, Sampling). encode: text -> ids."""
    sampling = _sampling(body, COMPLETION_MAX_TOKENS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return encode(prompt), sampling
    if isinstance(prompt, list) and prompt and all(is_int(i) for i in prompt):
        bad = [i for i in prompt if not 0 <= i < vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt",
                               "invalid_value")
        return [int(i) for i in prompt], sampling
    raise RequestError("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request), "
                       f"got {_short(prompt)}", "prompt", "invalid_value")


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: dict) -> tuple[list[dict], Sampling]:
    """/v1/chat/completions: `messages` -> (messages with text content, Sampling); max_tokens None: the rest of
    the context. A content given as parts (`[{"type": "text", "text": ...}]`) is joined; other parts refused."""
    sampling = _sampling(body, None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, got {_short(messages)}", "messages",
                           "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where} must be an object with a role in {', '.join(ROLES)}, got {_short(m)}",
                               f"{where}.role", "invalid_value")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"{where}.content: llmstep serve reads text parts only", f"{where}.content",
                                   "unsupported_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string, got {_short(content)}", f"{where}.content",
                               "invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for the system turn
        out.append({"role": role, "content": content})
    return out, sampling


def check_length(prompt_len: int, sampling: Sampling, context: int) -> int:
    """The new tokens a request may make: max_tokens, or the rest of the context; refused if they do not fit."""
    if prompt_len >= context:
        raise RequestError(f"the prompt is {prompt_len} tokens; this model's context is {context} tokens, with "
                           "room for at least one new token", "messages" if sampling.max_tokens is None else "prompt",
                           "context_length_exceeded")
    if sampling.max_tokens is None:
        return context - prompt_len
    if prompt_len + sampling.max_tokens > context:
        raise RequestError(f"this model's context is {context} tokens; the prompt ({prompt_len}) and max_tokens "
                           f"({sampling.max_tokens}) need {prompt_len + sampling.max_tokens}", "max_tokens",
                           "context_length_exceeded")
    return sampling.max_tokens


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class StopText:
    """Text arriving in pieces, cut before the first stop string: `feed` returns what may leave now (the end that
    could still begin a stop string is held back) and sets `stopped` when one is found; `flush` the rest."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.held += text
        cuts = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            out, self.held = self.held[:min(cuts)], ""
            return out
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


# ---- response bodies ------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None, use: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [] if use else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chat_body(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None, use: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [] if use else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}

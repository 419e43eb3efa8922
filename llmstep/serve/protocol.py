"""The OpenAI API's side of `llmstep serve`: request bodies checked field by field, the response bodies, errors.

Pure Python, no web framework: a request body (parsed JSON) goes in, a `Sampling` and a prompt come out, or a
`RequestError` naming the field (HTTP 400 with OpenAI's error body, `{"error": {"message", "type", "param",
"code"}}`, which the `openai` client raises as `BadRequestError`). The fields are those of OpenAI's
`/v1/completions` and `/v1/chat/completions`, plus `top_k` (as vLLM accepts it); a field llmstep does not do
(several choices, logprobs, penalties, min_p, tools, ...: `ONLY_DEFAULT`) is refused by name unless it holds its
default, and a field that is not the endpoint's at all (`max_new_tokens`, `repeat_penalty`, a chat's `messages`
sent to /v1/completions) is refused as OpenAI refuses it, so a client never gets an answer to a question it did
not ask; only fields that change no answer (`user`, `metadata`, `store`, ...: `IGNORED`) pass unread.
`ignore_eos` (vLLM's too) lets a benchmark fix every request's length. Defaults are OpenAI's: temperature 1,
top_p 1, max_tokens 16 for a completion and the rest of the context for a chat, either cut to what the server can
hold. At most
MAX_STOP_STRINGS stop strings of at most MAX_STOP_CHARS characters: each token's text is checked against them.
"""

from __future__ import annotations

import difflib
import json
import sys
import uuid
from dataclasses import dataclass, field

from ..core.checks import check_seed, is_int, is_number

__all__ = ["RequestError", "Sampling", "parse_completion", "parse_chat", "check_length", "check_chat_size",
           "max_body_bytes", "error_body", "StopText", "completion_body", "completion_chunk", "chat_body",
           "chat_chunk", "usage", "quote", "sendable", "shorten", "cut", "MAX_STOP_STRINGS", "MAX_STOP_CHARS",
           "ONLY_DEFAULT", "IGNORED", "FIELDS"]

MAX_STOP_STRINGS = 4  # OpenAI's limit on `stop`
MAX_STOP_CHARS = 1000  # ours: every token's text is checked against each stop string, so they must stay short
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# Fields whose only value llmstep serves is their default (OpenAI's, or vLLM's for its extensions): anything else
# is refused by name. null is the default too; a tuple lists defaults (chat's logprobs is false, a completion's
# null). A value must be of the default's kind: `n: true` is not `n: 1`, nor `echo: 0` false.
ONLY_DEFAULT = {"n": 1, "best_of": 1, "echo": False, "logprobs": (None, False), "top_logprobs": None, "suffix": None,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
                "response_format": {"type": "text"},
                "tools": None, "tool_choice": "none", "functions": None, "function_call": "none", "audio": None,
                "modalities": ["text"], "prediction": None, "reasoning_effort": None, "web_search_options": None,
                # vLLM's sampling extensions
                "min_p": 0.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "min_tokens": 0,
                "use_beam_search": False, "stop_token_ids": None, "include_stop_str_in_output": False,
                "skip_special_tokens": True, "prompt_logprobs": None, "truncate_prompt_tokens": None,
                "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
                "add_generation_prompt": True, "continue_final_message": False, "chat_template": None}
# Fields that change no answer (who asks, what to keep, which tier or cache bucket): taken and not read, their type
# checked (as OpenAI and vLLM do: a client's mistake is named, not passed over)
IGNORED = {"user": str, "metadata": dict, "store": bool, "service_tier": str, "parallel_tool_calls": bool,
           "prompt_cache_key": str, "prompt_cache_retention": str, "safety_identifier": str,
           "priority": int, "request_id": str, "cache_salt": str}  # vLLM's: a queue's order, a log's id, a cache's
_TYPE_NAMES = {str: "a string", dict: "an object of strings", bool: "a boolean", int: "an integer"}
_READ = {"model", "stream", "stream_options", "stop", "max_tokens", "temperature", "top_p", "top_k", "seed",
         "ignore_eos"}
# Every field an endpoint takes; any other is refused by name (OpenAI's "Unrecognized request argument").
FIELDS = {"completions": _READ | set(IGNORED) | set(ONLY_DEFAULT) | {"prompt"},
          "chat": _READ | set(IGNORED) | set(ONLY_DEFAULT) | {"messages", "max_completion_tokens"}}


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

    max_tokens: int | None  # None: not given, default_max_tokens then
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    ignore_eos: bool = False  # vLLM's extension, for benchmarks: run to max_tokens past end-of-sequence tokens
    default_max_tokens: int | None = None  # without max_tokens: this many, or as many as fit (None: all that fit)
    max_tokens_param: str = "max_tokens"  # the field max_tokens came in (or max_completion_tokens), for errors


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value) or not (low < value if low_open else low <= value) \
            or value > high:
        span = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"{name} must be a number in {span}, got {shorten(value)}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise RequestError(f"{name} must be an integer {span}, got {shorten(value)}", name, "invalid_value")
    return int(value)


def _is_default(value, default) -> bool:
    """JSON's value `value` is `default`: equal and of its kind (in Python True == 1 and 0 == False; not in JSON)."""
    if isinstance(default, tuple):
        return any(_is_default(value, d) for d in default)
    if value is None or default is None:
        return value is None
    if isinstance(default, bool):
        return value is default
    if isinstance(default, int):
        return is_int(value) and value == default
    if isinstance(default, float):
        return is_number(value) and value == default
    return type(value) is type(default) and value == default  # str, list, dict: JSON's own kinds


def _seed(body: dict) -> int | None:
    """null, or an integer in the engine's own range (check_seed's, so the two cannot drift apart)."""
    seed = body.get("seed")
    try:
        check_seed(seed)  # a bool, a float, a string or out of range
    except ValueError:  # its message quotes as Python writes, whole: worded here as every field's
        raise RequestError(f"seed must be an integer in 0 .. 2**64 - 1, got {shorten(seed)}", "seed",
                           "invalid_value") from None
    return seed


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, got "
                           f"{shorten(body.get('stop'))}", "stop", "invalid_value")
    long = [i for i, s in enumerate(stop) if len(s) > MAX_STOP_CHARS]
    if long:
        raise RequestError(f"stop string {long[0]} is {len(stop[long[0]]):,} characters; llmstep serve takes at most "
                           f"{MAX_STOP_CHARS:,}", "stop", "invalid_value")
    unreadable = [i for i, s in enumerate(stop) if any("\ud800" <= c <= "\udfff" for c in s)]
    if unreadable:  # a lone surrogate (JSON's "\ud800"): no text the model writes holds one
        raise RequestError(f"stop string {unreadable[0]} is not Unicode text (it holds a lone surrogate): it could "
                           f"never match", "stop", "invalid_value")
    return stop


def _check_fields(body: dict, endpoint: str) -> None:
    """Refuse the first field `endpoint` does not take, with the nearest one it does where a name is mistyped."""
    unknown = [name for name in body if name not in FIELDS[endpoint]]
    if unknown:
        name = unknown[0]
        near = difflib.get_close_matches(str(name), sorted(FIELDS[endpoint]), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        where = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        raise RequestError(f"unrecognized request argument supplied to {where}: {shorten(name)}{hint}",
                           cut(str(name)), "unrecognized_argument")
    for name, kind in IGNORED.items():  # taken unread, but of the type they are
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)
                                  or kind is dict and not all(isinstance(v, str) for v in value.values())):
            raise RequestError(f"{name} must be {_TYPE_NAMES[kind]}, got {shorten(value)}", name, "invalid_type")


def _sampling(body: dict, default_max_tokens: int | None, endpoint: str) -> Sampling:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_body")
    _check_fields(body, endpoint)
    for name, default in ONLY_DEFAULT.items():
        if name in body and not _is_default(body[name], default):
            only = " or ".join(json.dumps(d) for d in (default if isinstance(default, tuple) else (default,)))
            raise RequestError(f"{name}={shorten(body[name])} is not supported by llmstep serve (only {only})", name,
                               "unsupported_value")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        usage = options.get("include_usage") if isinstance(options, dict) else None  # null: not asked
        if not isinstance(options, dict) or not (usage is None or isinstance(usage, bool)):
            raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options",
                               "invalid_type")
        unknown = [name for name in options if name != "include_usage"]
        if unknown:
            raise RequestError(f"stream_options.{shorten(unknown[0])} is not supported by llmstep serve (only "
                               "include_usage)",
                               f"stream_options.{cut(unknown[0])}", "unrecognized_argument")
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:  # a stream's usage chunk, with no stream asked for (asking nothing passes)
        raise RequestError("stream_options is only allowed with \"stream\": true", "stream_options",
                           "invalid_value")
    stop = _stops(body)
    max_tokens, max_tokens_param = _integer(body, "max_tokens", 1), "max_tokens"
    if "max_completion_tokens" in body:  # chat's newer name (a completion refused it), read first where both come
        newer = _integer(body, "max_completion_tokens", 1)
        if newer is not None:
            max_tokens, max_tokens_param = newer, "max_completion_tokens"
    top_k = _integer(body, "top_k", -1)
    ignore_eos = _flag(body, "ignore_eos")
    return Sampling(max_tokens=max_tokens, default_max_tokens=default_max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's range
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    top_k=0 if top_k in (None, -1) else top_k,  # -1: off, as vLLM has it
                    seed=_seed(body), stop=stop, stream=stream,
                    include_usage=include_usage, ignore_eos=ignore_eos,
                    max_tokens_param=max_tokens_param)


def _flag(body: dict, name: str) -> bool:
    """A true/false field; absent or null: false."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {shorten(value)}", name, "invalid_type")
    return value


def parse_completion(body: dict, encode, vocab_size: int) -> tuple[list[int], Sampling]:
    """/v1/completions: `prompt` as text, or as token ids -> (prompt ids, Sampling). encode: text -> ids, a
    ValueError for text it cannot encode (not Unicode, too long for the context)."""
    sampling = _sampling(body, COMPLETION_MAX_TOKENS, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        try:
            return encode(prompt), sampling
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(f"prompt: {e}", "prompt", "invalid_value") from None
    if isinstance(prompt, list) and prompt and all(is_int(i) for i in prompt):
        bad = [i for i in prompt if not 0 <= i < vocab_size]
        if bad:
            raise RequestError(f"prompt token id {shorten(bad[0])} is outside the vocabulary (0..{vocab_size - 1})",
                               "prompt", "invalid_value")
        return [int(i) for i in prompt], sampling
    raise RequestError("prompt must be a non-empty string or a non-empty list of token ids (one prompt per request), "
                       f"got {shorten(prompt)}", "prompt", "invalid_value")


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: dict) -> tuple[list[dict], Sampling]:
    """/v1/chat/completions: `messages` -> (messages with text content, Sampling); max_tokens None: the rest of
    the context. A content given as parts (`[{"type": "text", "text": ...}]`) is joined; other parts refused."""
    sampling = _sampling(body, None, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, got {shorten(messages)}", "messages",
                           "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with a role and a content, got {shorten(m)}", where,
                               "invalid_value")
        if m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {shorten(m.get('role'))}",
                               f"{where}.role", "invalid_value")
        unread = [name for name in m if name not in ("role", "content") and m[name] is not None]
        if unread:  # a name, a tool call: the chat template reads role and content only
            raise RequestError(f"{where}.{shorten(unread[0])} is not supported by llmstep serve (a message's role and "
                               "content are read)", f"{where}.{cut(unread[0])}", "unsupported_value")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"{where}.content: llmstep serve reads text parts only", f"{where}.content",
                                   "unsupported_value")
            extra = [(j, name) for j, p in enumerate(content) for name in p
                     if name not in ("type", "text") and p[name] is not None]  # null says nothing, as on a message
            if extra:  # as a message's own unknown fields: named, not passed over
                part = f"{where}.content[{extra[0][0]}]"
                raise RequestError(f"{part}.{shorten(extra[0][1])} is not supported by llmstep serve (a text part's "
                                   "type and text are read)", f"{part}.{cut(extra[0][1])}", "unsupported_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string, got {shorten(content)}", f"{where}.content",
                               "invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for the system turn
        out.append({"role": role, "content": content})
    return out, sampling


def max_body_bytes(context: int, longest: int) -> int:
    """The largest request body a server holding `context` tokens a request reads: their text at `longest` bytes a
    token, JSON-escaped (at most 6 bytes a byte, \\u0000), and 1 MiB for the rest; a larger one is refused (413)
    before it is all read, so a body of gigabytes takes no memory."""
    return 6 * context * longest + 2**20


def check_chat_size(messages: list[dict], context: int, longest: int) -> None:
    """Refuse, before tokenising, messages whose text alone must make more than `context` tokens: no token holds
    more than `longest` bytes of UTF-8 (whitespace around a turn's text may be cut)."""
    _check_size(sum(_utf8_bytes(m["content"].strip()) for m in messages), context, longest, "messages", "their text")


def check_prompt_size(text: str, context: int, longest: int) -> None:
    """`check_chat_size` for a completion's prompt text: refused, unread, where it must make more than `context`
    tokens (the same code, context_length_exceeded, as a prompt found too long once tokenised; the tokenizer's own
    rule, `Tokenizer.encode(max_tokens=)`, which never refuses what passes here)."""
    _check_size(_utf8_bytes(text), context, longest, "prompt", "the text")


def _utf8_bytes(text: str) -> int:
    """Its length in UTF-8, a lone surrogate (not Unicode: refused by the tokenizer, named) counted as 3 bytes."""
    return len(text.encode("utf-8", "surrogatepass"))


def _check_size(size: int, context: int, longest: int, param: str, what: str) -> None:
    if size > context * longest:
        raise RequestError(f"{param}: {what} is {size:,} bytes of UTF-8, at least {size // longest:,} tokens; "
                           f"this server holds {context} tokens a request", param, "context_length_exceeded")


def check_length(prompt_len: int, sampling: Sampling, context: int, prompt_param: str = "prompt") -> int:
    """The new tokens a request may make: max_tokens, else its default cut to what fits in `context` (the most
    tokens, prompt and new, the server holds for one request); refused if they do not fit. prompt_param: the
    field the prompt came in ("prompt" or "messages")."""
    if prompt_len >= context:
        raise RequestError(f"{prompt_param}: the prompt is {prompt_len} tokens; this server holds {context} tokens "
                           "a request, prompt and new tokens, with room for at least one new token", prompt_param,
                           "context_length_exceeded")
    if sampling.max_tokens is None:
        room = context - prompt_len
        return room if sampling.default_max_tokens is None else min(sampling.default_max_tokens, room)
    if prompt_len + sampling.max_tokens > context:
        name = sampling.max_tokens_param
        raise RequestError(f"this server holds {context} tokens a request; the prompt ({prompt_len}) and {name} "
                           f"({shorten(sampling.max_tokens)}) need {shorten(prompt_len + sampling.max_tokens)}",
                           name, "context_length_exceeded")
    return sampling.max_tokens


def quote(value) -> str:
    """A value as an error message quotes it to a JSON client: as JSON writes it (true, null, "text", NaN), a value
    JSON cannot hold as Python writes it; a lone surrogate (JSON's "\\ud800" parses to one) as its escape, so the
    message can be sent as UTF-8."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except RecursionError:
            text = f"a {type(value).__name__} nested too deep to quote"
        except ValueError:  # an integer of more digits than Python writes
            text = f"an integer of over {sys.get_int_max_str_digits():,} digits"
    return sendable(text)


def sendable(text: str) -> str:
    """`text` with each lone surrogate (no Unicode character: from JSON's "\\ud800" or undecodable bytes in argv)
    written as its escape, so the text encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shorten(value) -> str:
    """`quote(value)` cut to 60 characters."""
    return cut(quote(value))


def cut(text: str, most: int = 60) -> str:
    """`text` cut to `most` characters, the last three "..." (a field name the client sent, as an error's param)."""
    return text if len(text) <= most else text[:most - 3] + "..."


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
        keep = max((_overlap(self.held, s) for s in self.stops), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (shorter than stop: stop itself is not in
    text). Only the places where stop's first character stands are tried, found by str.find."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


# ---- response bodies ------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}], "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                     use: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [] if use else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None,
               use: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [] if use else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}

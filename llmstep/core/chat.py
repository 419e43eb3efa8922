"""A checkpoint's own chat template, rendered as Hugging Face transformers renders it.

A chat model's prompt format ships with the model as Jinja source: tokenizer_config.json's `chat_template` (or a
chat_template.jinja file beside it), a GGUF's `tokenizer.chat_template`. transformers' `apply_chat_template`
(transformers/utils/chat_template_utils.py) renders it in an `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with Jinja's `loopcontrols` extension (`break`, `continue`) and:
- a `tojson` filter that leaves non-ASCII and HTML characters as they are (Jinja's own escapes `<` as `\\u003c`),
- the globals `raise_exception(message)` (a template refuses a conversation it cannot format) and
  `strftime_now(format)` (today's date, for templates that print it), and `namespace`/`dict` that cannot reach
  underscore attributes,
- a `{% generation %}` block (it marks the assistant's text for training masks; rendering keeps the text).
The template sees `messages`, `add_generation_prompt`, `tools`, `documents` and the special-token strings
(`bos_token`, `eos_token`, ...). `render` builds the same environment and context, so one template and one
conversation give one string in both. A template is code written by whoever published the checkpoint: the sandbox
keeps it from reaching Python's internals and bounds what one `*` or `**` makes (`MAX_REPEAT`, `MAX_POWER_BITS`),
and every way it can fail is a ValueError saying which.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .config import read_json_object

__all__ = ["render", "check_messages", "check_template", "template_literals", "read_tokenizer_config", "TOKEN_NAMES"]


def render(template: str, messages, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str] | None = None, tools: list | None = None,
           documents: list | None = None) -> str:
    """The prompt string `template` makes of `messages`: equal to transformers'
    `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` for a tokenizer whose
    special_tokens_map is `special_tokens` ({"bos_token": "<|begin_of_text|>", "eos_token": ...})."""
    compiled = _compile(template)
    context = {**(special_tokens or {}), "messages": check_messages(messages),
               "tools": _plain(tools, "tools"), "documents": _plain(documents, "documents"),
               "add_generation_prompt": bool(add_generation_prompt)}
    try:
        return compiled.render(**context)
    except _Refused as e:
        raise ValueError(f"the chat template refused these messages: {e.message}") from None
    except SecurityError as e:
        raise ValueError(f"the chat template tried what the sandbox forbids ({e}); it was not rendered") from None
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from None
    except Exception as e:  # the template's own expressions: 'a' + 1, a missing key, ...
        raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None


def check_template(template: str) -> None:
    """Compile `template` now (ValueError if it is not valid Jinja), so that a file whose template is broken is
    refused when it is read rather than at its first chat; the compiled template is cached for render."""
    _compile(template)


@lru_cache(maxsize=32)
def template_literals(template: str) -> str:
    """The text `template` writes as it is (its text outside tags, its string constants), joined by NULs so that no
    search matches across two: where transformers looks for the added tokens that are a chat's control tokens."""
    tree = _compile(template).environment.parse(template)
    texts = {n.data for n in tree.find_all(jinja2.nodes.TemplateData)}
    return "\0".join(texts | {n.value for n in tree.find_all(jinja2.nodes.Const) if isinstance(n.value, str)})


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' order: the first given wins


def check_messages(messages) -> list[dict]:
    """Messages -> a list of plain dicts, each with str 'role' and 'content' (an iterator is read once), but for an
    assistant turn of tool calls, whose content may be None. Keys whose value is None are dropped, as transformers
    drops them (templates test `'tool_calls' in message`); a reasoning field (`reasoning_content`, `thinking`,
    `reasoning`) is given under the names templates read, as transformers gives it."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                         f"got {type(messages).__name__}")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if not isinstance(m["role"], str) or not isinstance(m.get("content"), str | None):
            raise ValueError(f"message {i}: 'role' and 'content' must be strings, got {m!r}")
        if m.get("content") is None and not m.get("tool_calls"):
            raise ValueError(f"message {i}: only a turn of tool calls may have no content, got {m!r}")
        plain = {k: _plain(v, f"message {i}, {k!r}") for k, v in m.items() if v is not None}
        reasoning = next((plain[k] for k in REASONING_FIELDS if k in plain), None)
        checked.append(plain if reasoning is None else {"thinking": reasoning, **plain, "reasoning_content": reasoning})
    if not checked:
        raise ValueError("there are no messages: a chat needs at least one")
    return checked


def _plain(value, where: str):
    """A fresh copy in plain JSON types: what a template sees can neither change the caller's data nor carry
    methods the sandbox does not know (a subclass of str, an array, an object)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):  # as transformers passes it: a template prints (1, 2), not [1, 2]
        return tuple(_plain(v, where) for v in value)
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {str.__str__(k): _plain(v, where) for k, v in value.items()}
    raise ValueError(f"{where}: a chat template reads plain data (text, numbers, lists, dicts with text keys), "
                     f"got {type(value).__name__}")


# ---- the environment, one per template text -------------------------------------------------------------
class _Refused(jinja2.TemplateError):
    """raise_exception(message) called by a template."""


def _raise_exception(message):
    raise _Refused(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _check_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template cannot store {name!r} on a namespace: names starting with '_' "
                            "are Python's internals")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing names that start with '_'."""

    def __init__(*args, **kwargs):  # Jinja's own signature: namespace(self=...) must still work
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _Dict:
    """The template's `dict`: makes dicts, but is not the type (whose unbound methods would mutate a dict)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


MAX_REPEAT = 1_000_000  # the most characters or items a template's `*` makes at once ('x' * 10**10: refused)
MAX_POWER_BITS = 100_000  # the largest integer a template's `**` makes, in bits (10 ** 1000000: refused)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with its `*` and `**` bounded: Jinja's own bounds `range` alone, so one expression could ask for
    gigabytes or hours. A real template repeats a separator or indents a few times."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise SecurityError(f"{type(seq).__name__} * {n} would make {len(seq) * n:,} "
                                        f"{'characters' if isinstance(seq, str) else 'items'} (at most {MAX_REPEAT:,})")
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > MAX_POWER_BITS:
                raise SecurityError(f"{left} ** {right} is an integer of more than {MAX_POWER_BITS:,} bits")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """The template compiled once per text (a chat compiles nothing after its first message)."""
    if not isinstance(template, str):
        raise ValueError(f"a chat template is Jinja source text, got {type(template).__name__}")
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       namespace=_Namespace, dict=_Dict())
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja: line {e.lineno}: {e.message}") from None


# ---- a checkpoint's tokenizer_config.json ----------------------------------------------------------------

TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_tokenizer_config(folder: Path) -> dict:
    """`Tokenizer`'s add_bos, chat_template, named_tokens, chat_control_tokens, unused_ids and literal_ids from a
    checkpoint folder's tokenizer_config.json and chat_template.jinja, the ones present."""
    options: dict = {}
    f = folder / "tokenizer_config.json"
    if f.is_file():
        data = read_json_object(f)
        if data.get("add_bos_token") is not None:
            if not isinstance(data["add_bos_token"], bool):
                raise ValueError(f"{f}: add_bos_token must be true or false, got {data['add_bos_token']!r}")
            options["add_bos"] = data["add_bos_token"]
        template = data.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if len(named) != len(template) or not all(isinstance(v, str) for v in named.values()):
                raise ValueError(f"{f}: chat_template as a list holds {{'name': ..., 'template': ...}} entries, "
                                 f"one per name, got {template!r:.200}")
            if "default" not in named:  # transformers uses the one named "default" unless asked for another
                raise ValueError(f"{f}: chat_template names {sorted(map(str, named))} but none 'default'")
            template = named["default"]
        if not (template is None or isinstance(template, str)):
            raise ValueError(f"{f}: chat_template must be Jinja source text or a list of {{'name', 'template'}}, "
                             f"got {type(template).__name__}")
        options["chat_template"], source = template, f"{f}: chat_template"
        controls = data.get("chat_control_tokens")  # the tokens only the template may write (transformers' own key)
        if not (controls is None or isinstance(controls, list) and all(isinstance(t, str) for t in controls)):
            raise ValueError(f"{f}: chat_control_tokens must be a list of token texts, got {controls!r:.200}")
        if controls is not None:
            options["chat_control_tokens"] = controls
        for key in ("unused_ids", "literal_ids"):  # llmstep's own keys: a GGUF file's token types, kept by save_dir
            ids = data.get(f"llmstep_{key}")
            if not (ids is None or isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
                raise ValueError(f"{f}: llmstep_{key} must be a list of token ids, got {ids!r:.200}")
            if ids is not None:
                options[key] = ids
        options["named_tokens"] = _token_names(data, f)
    names = folder / "special_tokens_map.json"
    if names.is_file():  # older saves name the tokens here (too); where both name one, this file's (transformers')
        given = _token_names(read_json_object(names), names)
        options["named_tokens"] = options.get("named_tokens", {}) | {k: v for k, v in given.items() if v is not None}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():  # newer checkpoints keep the template in its own file; transformers prefers it
        try:
            options["chat_template"], source = jinja.read_text(encoding="utf-8"), str(jinja)
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja} is not UTF-8 text (byte {e.start} cannot be read)") from None
    if options.get("chat_template") is not None:  # the template used: a stale one it replaces is not read
        check_template_in(options["chat_template"], source)
    return options


def _token_names(data: dict, f: Path) -> dict[str, str | None]:
    """{"bos_token": its text, ...} of a tokenizer_config.json or special_tokens_map.json object (a name's value
    plain text or an AddedToken written out, {"content": ...})."""
    names = {}
    for name in TOKEN_NAMES:
        value = data.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if not (value is None or isinstance(value, str)):
            raise ValueError(f"{f}: {name} must be a token's text, got {data[name]!r}")
        names[name] = value
    return names


def check_template_in(template: str, where: str) -> None:
    """A checkpoint's chat template compiled when it is read (as a GGUF file's is), its error naming the file: a
    broken one is refused now, not after the weights load at the first chat (or at an export writing it on)."""
    try:
        check_template(template)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None

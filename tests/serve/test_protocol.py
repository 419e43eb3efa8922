"""llmstep.serve.protocol without a server: stop strings across streamed pieces, the defaults, and the fields
refused by name."""

from __future__ import annotations

import random

import pytest

from llmstep.core.checks import check_seed
from llmstep.serve.protocol import (
    MAX_STOP_CHARS,
    RequestError,
    StopText,
    _overlap,
    chat_chunk,
    check_chat_size,
    check_length,
    check_prompt_size,
    completion_body,
    parse_chat,
    parse_completion,
    shorten,
)


def completion(**fields):
    return parse_completion({"prompt": [1, 2]} | fields, lambda text: [1], vocab_size=10)[1]


def refused(**fields) -> RequestError:
    with pytest.raises(RequestError) as caught:
        completion(**fields)
    return caught.value


@pytest.mark.parametrize("pieces", [["Good morrow, ", "my lord"], ["Good mor", "row, m", "y lord"],
                                    list("Good morrow, my lord")])
def test_a_stop_string_split_across_pieces_is_found_and_nothing_after_it_leaves(pieces):
    cut = StopText(["row,", "zz"])
    out = "".join(cut.feed(p) for p in pieces) + cut.flush()
    assert out == "Good mor" and cut.stopped


def test_text_without_a_stop_string_leaves_whole_once_flushed():
    cut = StopText(["XYZ"])
    streamed = [cut.feed(p) for p in ["abcX", "Y", "def"]]
    assert "".join(streamed) + cut.flush() == "abcXYdef" and not cut.stopped
    assert streamed == ["abc", "", "XYdef"]  # "X", then "XY", might begin the stop string: held back till "d"


def test_openais_defaults():
    ids, s = parse_completion({"prompt": "hi"}, lambda text: [1, 2], vocab_size=10)
    assert ids == [1, 2] and (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stream) == (None, 1.0, 1.0, 0, False)
    assert check_length(10, s, context=64) == 16  # a completion without max_tokens: 16
    assert check_length(60, s, context=64) == 4  # ... or what fits: a default never makes a request fail
    messages, s = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                              {"type": "text", "text": "b"}]}]})
    assert messages == [{"role": "system", "content": "ab"}] and s.max_tokens is None
    assert check_length(10, s, context=64) == 54  # a chat without max_tokens: the rest of the context


def test_a_prompt_that_fills_the_context_is_refused():
    _, s = parse_completion({"prompt": "hi", "max_tokens": 1}, lambda text: [1], vocab_size=10)
    with pytest.raises(RequestError) as caught:
        check_length(64, s, context=64)
    assert caught.value.code == "context_length_exceeded"


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, True, 1.5, "7"])
def test_a_seed_the_engine_would_refuse_is_refused_here_by_name(seed):
    with pytest.raises(ValueError):
        check_seed(seed)  # the engine's rule ...
    error = refused(seed=seed)  # ... is the protocol's: never a 500 from the engine thread
    assert error.param == "seed" and "seed" in error.message


@pytest.mark.parametrize("seed", [0, 2**64 - 1, None])
def test_a_seed_the_engine_takes_is_taken(seed):
    assert completion(seed=seed).seed == seed


def test_a_chat_prompt_too_long_is_named_messages_with_max_tokens_or_without():
    for fields in ({}, {"max_tokens": 4}):
        _, s = parse_chat({"messages": [{"role": "user", "content": "hi"}]} | fields)
        with pytest.raises(RequestError) as caught:
            check_length(65, s, context=65, prompt_param="messages")
        assert caught.value.param == "messages" and caught.value.code == "context_length_exceeded"
    _, s = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100})
    with pytest.raises(RequestError) as caught:
        check_length(10, s, context=65, prompt_param="messages")
    assert caught.value.param == "max_tokens" and "65" in caught.value.message


def test_a_prompt_that_cannot_be_encoded_is_a_400_naming_prompt():
    import llmstep

    _, tokenizer = llmstep.load()
    for text in ["\ud800", "a" * (64 * tokenizer.longest + 1)]:  # not Unicode; more tokens than 64, unread
        with pytest.raises(RequestError) as caught:
            parse_completion({"prompt": text}, lambda t: tokenizer.encode(t, max_tokens=64), vocab_size=10)
        assert caught.value.param == "prompt" and caught.value.status == 400


def test_chat_text_that_cannot_fit_is_refused_before_it_is_tokenised():
    messages = [{"role": "user", "content": "a" * 301}]
    with pytest.raises(RequestError) as caught:
        check_chat_size(messages, context=10, longest=30)
    assert caught.value.param == "messages" and caught.value.code == "context_length_exceeded"
    check_chat_size([{"role": "user", "content": "a" * 300}], context=10, longest=30)  # may fit: tokenise it


def test_completion_text_that_cannot_fit_is_refused_before_it_is_tokenised_as_a_context_length():
    """The code a client reads for a prompt too long is context_length_exceeded however the prompt came: as text
    far too long to tokenise, as token ids, or as messages."""
    with pytest.raises(RequestError) as caught:
        check_prompt_size("a" * 301, context=10, longest=30)
    assert caught.value.param == "prompt" and caught.value.code == "context_length_exceeded"
    check_prompt_size("a" * 300, context=10, longest=30)


def test_max_completion_tokens_is_checked_and_read_first_where_max_tokens_comes_too():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    _, s = parse_chat(chat | {"max_tokens": 2, "max_completion_tokens": 5})
    assert (s.max_tokens, s.max_tokens_param) == (5, "max_completion_tokens")
    _, s = parse_chat(chat | {"max_tokens": 2, "max_completion_tokens": None})
    assert (s.max_tokens, s.max_tokens_param) == (2, "max_tokens")
    for bad in (-5, "abc", 0, 1.5):
        with pytest.raises(RequestError) as caught:
            parse_chat(chat | {"max_tokens": 2, "max_completion_tokens": bad})
        assert caught.value.param == "max_completion_tokens"


def test_null_true_false_fields_are_their_defaults_and_other_values_refused():
    _, s = parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": None, "ignore_eos": None})
    assert (s.stream, s.ignore_eos) == (False, False)
    for name in ("stream", "ignore_eos"):
        error = refused(**{name: "yes"})
        assert error.param == name and error.code == "invalid_type" and '"yes"' in error.message


def test_stream_options_other_than_include_usage_and_message_fields_other_than_role_and_content_are_refused():
    error = refused(stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert error.param == "stream_options.continuous_usage_stats" and error.code == "unrecognized_argument"
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": None}).include_usage  # null: not asked
    assert refused(stream=True, stream_options={"include_usage": 0}).param == "stream_options"
    for field in ({"name": "bob"}, {"tool_call_id": "c1"}, {"weight": 1}):
        with pytest.raises(RequestError) as caught:
            parse_chat({"messages": [{"role": "user", "content": "hi"} | field]})
        assert caught.value.param == f"messages[0].{next(iter(field))}" and caught.value.code == "unsupported_value"
    assert parse_chat({"messages": [{"role": "user", "content": "hi", "name": None}]})[0] == [
        {"role": "user", "content": "hi"}]  # a null field says nothing
    with pytest.raises(RequestError) as caught:
        parse_chat({"messages": ["hi"]})
    assert caught.value.param == "messages[0]" and "object" in caught.value.message


def test_a_response_and_its_chunks_carry_the_time_they_are_given():
    assert completion_body("cmpl-1", 1234, "m", "hi", "stop", {})["created"] == 1234
    assert chat_chunk("chatcmpl-1", 1234, "m", {}, None)["created"] == 1234


UNSUPPORTED = [("min_p", 0.1), ("repetition_penalty", 1.2), ("tool_choice", "auto"), ("functions", [{"name": "f"}]),
               ("function_call", "auto"), ("n", True), ("echo", 0), ("best_of", 1.0), ("logprobs", 0),
               ("presence_penalty", False), ("use_beam_search", True), ("min_tokens", 3), ("stop_token_ids", [2]),
               ("response_format", {"type": "json_object"}), ("guided_json", {}), ("logit_bias", {"5": 100})]


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED, ids=[f"{n}={v!r}" for n, v in UNSUPPORTED])
def test_a_field_llmstep_does_not_do_is_refused_by_name_even_where_python_calls_it_equal(name, value):
    error = refused(**{name: value})
    assert error.param == name and error.code == "unsupported_value" and name in error.message


DEFAULTS = [("n", 1), ("echo", False), ("presence_penalty", 0), ("frequency_penalty", 0.0), ("logprobs", False),
            ("logprobs", None), ("min_p", 0), ("repetition_penalty", 1), ("tool_choice", "none"), ("logit_bias", {}),
            ("response_format", {"type": "text"}), ("skip_special_tokens", True)]


@pytest.mark.parametrize(("name", "value"), DEFAULTS, ids=[f"{n}={v!r}" for n, v in DEFAULTS])
def test_a_field_at_its_default_is_taken(name, value):
    assert completion(**{name: value}).max_tokens is None


def test_a_stop_string_longer_than_the_limit_is_refused_by_name():
    assert completion(stop=["x" * MAX_STOP_CHARS] * 4).stop == ["x" * MAX_STOP_CHARS] * 4
    error = refused(stop=["a", "x" * (MAX_STOP_CHARS + 1)])
    assert error.param == "stop" and f"{MAX_STOP_CHARS:,}" in error.message and "stop string 1" in error.message


def test_a_stop_string_that_is_not_unicode_is_refused_as_a_prompt_so_is():
    """JSON's "\\ud800" parses to a lone surrogate, which no text the model writes holds: it could never match."""
    error = refused(stop=["ok", "a\ud800"])
    assert error.param == "stop" and "stop string 1 is not Unicode text" in error.message
    assert completion(stop="\U0001f600").stop == ["\U0001f600"]  # a character beyond the BMP is one


def test_the_fields_taken_unread_are_of_their_types():
    assert completion(user="u1", store=False, metadata={"k": "v"}, priority=0, service_tier=None)
    for name, value in [("user", 5), ("store", "yes"), ("metadata", [1]), ("metadata", {"k": 5}), ("priority", True),
                        ("priority", 1.5),
                        ("parallel_tool_calls", 1), ("request_id", {})]:
        error = refused(**{name: value})
        assert (error.param, error.code) == (name, "invalid_type") and f"{name} must be" in error.message


def test_a_text_parts_fields_other_than_type_and_text_are_refused_by_name():
    with pytest.raises(RequestError) as caught:
        parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b", "bogus": 1}]}]})
    assert caught.value.param == "messages[0].content[1].bogus" and caught.value.code == "unsupported_value"
    assert parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": None}]}]})[0] == [
        {"role": "user", "content": "a"}]  # a null field says nothing, as on a message


def test_the_held_back_end_is_the_longest_end_that_begins_a_stop_string():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        stop = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 8)))
        if stop in text:
            continue  # found, not held back
        naive = max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        assert _overlap(text, stop) == naive, (text, stop)


@pytest.mark.parametrize("field, value, quoted", [("temperature", True, "got true"), ("top_p", "0.5", 'got "0.5"'),
                                                  ("max_tokens", 2.5, "got 2.5"), ("top_k", [1], "got [1]"),
                                                  ("stream", "yes", 'got "yes"'), ("max_tokens", False, "got false"),
                                                  ("seed", True, "got true"), ("seed", "1", 'got "1"'),
                                                  ("seed", float("nan"), "got NaN"),
                                                  ("seed", {"a": None}, 'got {"a": null}')])
def test_a_refused_value_is_quoted_as_json_writes_it(field, value, quoted):
    """The client wrote JSON: true, null and "text" in the error, not Python's True, None and 'text'."""
    error = refused(**{field: value})
    assert str(error).endswith(quoted) and error.param == field


def test_quote_writes_json_and_never_a_lone_surrogate():
    assert [shorten(v) for v in (True, None, "a", float("nan"), 2.5)] == [
        "true", "null", '"a"', "NaN", "2.5"]
    assert shorten("\ud800x") == '"\\ud800x"' and shorten("\ud800x").encode("utf-8")
    assert shorten("x" * 100).endswith("...") and len(shorten("x" * 100)) == 60
    assert shorten(b"ab") == "b'ab'"  # no JSON value: as Python writes it


HUGE = int("9" * 4300)  # the most digits JSON's parser reads


@pytest.mark.parametrize("fields", [{"seed": "x" * 100_000}, {"seed": HUGE}, {"prompt": [1, HUGE]},
                                    {"x" * 100_000: 1}, {"stream": True, "stream_options": {"x" * 100_000: True}}],
                         ids=["seed string", "seed out of range", "token id", "field name", "stream_options name"])
def test_what_the_client_sent_is_quoted_short_in_the_message_and_the_param(fields):
    """A value, or a field's name, is cut to 60 characters where a refusal quotes it, never echoed whole."""
    error = refused(**fields)
    assert len(error.message) < 200 and len(error.param) <= 80 and "..." in error.message


def test_a_message_field_and_a_max_tokens_past_the_context_are_quoted_short():
    with pytest.raises(RequestError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "hi", "\ud800" * 10_000: 1}]})
    assert len(caught.value.message) < 200 and caught.value.param == "messages[0]." + "\ud800" * 57 + "..."
    for max_tokens in (10**4298, HUGE):  # the sum with the prompt's length: more digits than Python writes
        with pytest.raises(RequestError) as caught:
            check_length(5, completion(max_tokens=max_tokens), context=64)
        assert len(caught.value.message) < 250 and caught.value.param == "max_tokens"

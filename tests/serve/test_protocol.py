"""llmstep.serve.protocol without a server: stop strings across streamed pieces, and the defaults."""

from __future__ import annotations

import pytest

from llmstep.serve.protocol import RequestError, StopText, check_length, parse_chat, parse_completion


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
    assert ids == [1, 2] and (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stream) == (16, 1.0, 1.0, 0, False)
    messages, s = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                              {"type": "text", "text": "b"}]}]})
    assert messages == [{"role": "system", "content": "ab"}] and s.max_tokens is None
    assert check_length(10, s, context=64) == 54  # a chat without max_tokens: the rest of the context


def test_a_prompt_that_fills_the_context_is_refused():
    _, s = parse_completion({"prompt": "hi", "max_tokens": 1}, lambda text: [1], vocab_size=10)
    with pytest.raises(RequestError) as caught:
        check_length(64, s, context=64)
    assert caught.value.code == "context_length_exceeded"

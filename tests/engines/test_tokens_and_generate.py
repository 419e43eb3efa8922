"""Tokenizer, streaming detokenisation, the generation loop and the CLI."""

import copy
import json

import pytest
import torch

import llmstep
from llmstep.cli import main as cli
from llmstep.core.tokens import Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return Tokenizer.from_file(tokenizer_file)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return llmstep.load(tiny_checkpoint)


def test_special_tokens_come_from_the_file(tok):
    assert tok.bos_id == tok.token_to_id("<|begin_of_text|>") == 295
    assert tok.eos_ids == [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    assert set(tok.special_tokens) >= {"<|begin_of_text|>", "<|eot_id|>"}


def test_round_trip_and_bos(tok, sample_text):
    TEXT = sample_text
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert tok.decode(ids[1:]) == TEXT
    assert tok.encode(TEXT, bos=False) == ids[1:]


def test_special_tokens_in_text_become_ids(tok):
    ids = tok.encode("hi<|eot_id|>", bos=False)
    assert ids[-1] == tok.token_to_id("<|eot_id|>")


def test_chat_format(tok):
    prompt = tok.chat([{"role": "user", "content": "Shall I compare thee?"}])
    assert prompt == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nShall I compare thee?"
                      "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode_chat([{"role": "user", "content": "Shall I compare thee?"}])
    assert ids[0] == tok.bos_id and ids.count(tok.token_to_id("<|start_header_id|>")) == 2
    with pytest.raises(ValueError, match="message 0"):
        tok.chat([{"content": "no role"}])


def test_streaming_never_emits_broken_utf8(tok):
    """Multi-byte characters (東京, 🙂) span several byte-level tokens: pieces must stay valid text."""
    text = "Naïve café 東京 🙂 thy beauty's field"
    ids = tok.encode(text, bos=False)
    single = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in single), "test text should split a character across tokens"
    stream = tok.stream()
    pieces = [stream.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stream_events_add_up_to_the_generation(loaded):
    model, tok = loaded
    run = llmstep.stream(model, tok, "thy beauty", max_new_tokens=25, temperature=1.0, seed=3, stop_ids=[])
    events = list(run)
    assert [e.index for e in events] == list(range(25))
    assert [e.id for e in events] == run.result.tokens
    assert "".join(e.text for e in events) == run.result.text == tok.decode(run.result.tokens, True)
    assert all(e.seconds > 0 for e in events)
    assert len(run.result.step_seconds) == 24 and run.result.prefill_seconds > 0
    assert run.result.stop_reason == "length"
    assert run.result.decode_tokens_per_second > 0 and run.result.bandwidth_gb_per_second > 0


def test_seeded_runs_reproduce_and_seeds_differ(loaded):
    model, tok = loaded
    kw = dict(max_new_tokens=30, temperature=1.2, top_k=50, top_p=0.95, stop_ids=[])
    a = llmstep.generate(model, tok, "When forty", seed=11, **kw)
    b = llmstep.generate(model, tok, "When forty", seed=11, **kw)
    c = llmstep.generate(model, tok, "When forty", seed=12, **kw)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_greedy_generation_equals_argmax_of_full_forward(loaded):
    model, tok = loaded
    out = llmstep.generate(model, tok, "Shall I", max_new_tokens=12, temperature=0, stop_ids=[])
    ids = out.prompt_ids + out.tokens
    with torch.no_grad():
        full = model(torch.tensor([ids[:-1]]))[0].argmax(-1)
    assert full[len(out.prompt_ids) - 1 :].tolist() == out.tokens


def test_stops_on_a_stop_token(loaded):
    model, tok = loaded
    free = llmstep.generate(model, tok, "Shall I", max_new_tokens=10, temperature=0, stop_ids=[])
    stop = free.tokens[4]
    out = llmstep.generate(model, tok, "Shall I", max_new_tokens=10, temperature=0, stop_ids=[stop])
    first = free.tokens.index(stop)
    assert out.tokens == free.tokens[: first + 1] and out.stop_reason == "stop"


def test_stops_when_the_context_is_full(loaded):
    model, tok = loaded
    prompt = list(range(120))
    out = llmstep.generate(model, tok, prompt, max_new_tokens=50, temperature=0, stop_ids=[])
    assert out.stop_reason == "context" and len(out.tokens) == 128 - 120 + 1


def test_max_new_tokens_zero_generates_nothing(loaded):
    model, tok = loaded
    assert llmstep.generate(model, tok, "x", max_new_tokens=0).tokens == []


def test_cli_generate_streams_and_summarises(tiny_checkpoint, capsys):
    cli(["generate", "--model", str(tiny_checkpoint), "--prompt", "Shall I", "--max-new-tokens", "8",
         "--temperature", "0", "--seed", "1"])
    out, err = capsys.readouterr()
    assert out.startswith("Shall I")
    for field in ("prefill", "tok/s", "MB read per token", "GB/s achieved"):
        assert field in err


def test_cli_reports_bad_input_without_a_traceback(tiny_checkpoint, capsys):
    with pytest.raises(SystemExit, match=r"argument --top-p: must be in \(0, 1\]"):
        cli(["generate", "--model", str(tiny_checkpoint), "--prompt", "x", "--top-p", "2"])
    with pytest.raises(SystemExit, match="no model directory"):
        cli(["generate", "--model", "/nonexistent/dir", "--prompt", "x"])


def test_cli_info_for_a_preset(capsys):
    cli(["info", "--preset", "llama-3-8b"])
    out = capsys.readouterr().out
    assert "8.030 B parameters" in out and "KV cache per token: 128.0 KiB" in out


def test_generation_config_defaults_are_read(tiny_checkpoint, tmp_path):
    model, _ = llmstep.load(tiny_checkpoint)
    assert isinstance(model.generation_config, dict)
    path = tmp_path / "g"
    model2, tok = llmstep.load(tiny_checkpoint)
    llmstep.save(model2, path, tokenizer=tok, generation_config={"temperature": 0.6, "top_p": 0.9})
    again, _ = llmstep.load(path)
    assert again.generation_config["temperature"] == 0.6
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] in (tok.eos_ids, tok.eos_ids[0])


def test_cli_trace_prints_every_stage(tiny_checkpoint, capsys):
    cli(["trace", "--model", str(tiny_checkpoint), "--context", "16", "--repeats", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    for stage in ("embedding", "qkv projection", "attention", "mlp (SwiGLU)", "lm head", "sampling", "traced step"):
        assert stage in out


def test_prompt_as_a_tensor_equals_the_list(loaded):
    model, tok = loaded
    ids = tok.encode("Shall I")
    as_list = llmstep.generate(model, tok, ids, max_new_tokens=6, temperature=0, stop_ids=[])
    for prompt in (torch.tensor(ids), torch.tensor([ids])):
        out = llmstep.generate(model, tok, prompt, max_new_tokens=6, temperature=0, stop_ids=[])
        assert out.tokens == as_list.tokens
    with pytest.raises(ValueError, match=r"one sequence, \[T\] or \[1, T\]; got shape \[2, 3\]"):
        llmstep.generate(model, tok, torch.zeros(2, 3, dtype=torch.long))


def test_stream_flush_returns_what_was_held_back(tok):
    """A stream that ends inside a character: flush gives the rest, so the pieces add up to decode(ids)."""
    ids = tok.encode("thy 東京", bos=False)
    ids = ids[:-1]  # the last byte of 京 never comes
    for skip in (True, False):
        stream = tok.stream(skip_special_tokens=skip)
        pieces = [stream.step(i) for i in [tok.bos_id] + ids]
        assert all("\ufffd" not in p for p in pieces)
        rest = stream.flush()
        assert rest.endswith("\ufffd") and "".join(pieces) + rest == tok.decode([tok.bos_id] + ids, skip)


def test_chat_messages_must_hold_strings(tok):
    with pytest.raises(ValueError, match="message 1: 'role' and 'content' must be strings"):
        tok.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": 42}])


def test_cli_info_refuses_bad_arguments_without_a_traceback(capsys):
    with pytest.raises(SystemExit):
        cli(["info", "--preset", "llama-3-8b", "--dtype", "float8"])
    assert "invalid choice: 'float8'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="argument --context: must be an integer in 0 .."):
        cli(["info", "--preset", "llama-3-8b", "--context", "-5"])


def test_cli_eval_reports_bad_input_without_a_traceback(tiny_checkpoint):
    with pytest.raises(SystemExit, match="llmstep eval: error: argument --max-tokens: must be an integer in 1 .."):
        cli(["eval", str(tiny_checkpoint), "--max-tokens", "-3", "--no-baseline"])
    with pytest.raises(SystemExit, match="llmstep eval: error: max_tokens must be at least 2"):
        cli(["eval", str(tiny_checkpoint), "--max-tokens", "1", "--no-baseline"])
    with pytest.raises(SystemExit, match="llmstep eval: error: no model directory"):
        cli(["eval", "/nonexistent/dir", "--no-baseline"])


@pytest.mark.parametrize("seed", [3, 0, 7])
def test_the_text_is_the_decoded_tokens_even_when_a_character_is_cut(loaded, seed):
    """A generation that ends inside a multi-byte character still hands over the held-back bytes (as U+FFFD):
    the streamed texts add up to result.text, and that is decode(tokens), for both loops."""
    model, tok = loaded
    draft = llmstep.LayerSkipDraft(model, 1)
    for run in (llmstep.stream(model, tok, "thy", max_new_tokens=30, temperature=1.5, seed=seed, stop_ids=[]),
                llmstep.speculative_stream(model, draft, tok, "thy", k=3, max_new_tokens=30, temperature=1.5,
                                           seed=seed, stop_ids=[])):
        streamed = "".join(event.text for event in run)
        assert streamed == run.result.text == tok.decode(run.result.tokens, skip_special_tokens=True)


def test_the_helper_reproduction_ends_inside_a_character(loaded):
    model, tok = loaded  # the case that lost its tail: make sure the test above really covers a cut character
    out = llmstep.generate(model, tok, "thy", max_new_tokens=30, temperature=1.5, seed=3, stop_ids=[])
    assert out.text.endswith("\ufffd")


def test_stop_ids_may_be_a_tensor(loaded):
    model, tok = loaded
    free = llmstep.generate(model, tok, "Shall I", max_new_tokens=8, temperature=0, stop_ids=[])
    stop = free.tokens[3]
    for stops in (torch.tensor([stop]), [torch.tensor(stop)]):
        out = llmstep.generate(model, tok, "Shall I", max_new_tokens=8, temperature=0, stop_ids=stops)
        assert out.stop_reason == "stop" and out.tokens == free.tokens[: free.tokens.index(stop) + 1]
        spec = llmstep.speculative_generate(model, llmstep.LayerSkipDraft(model, 1), tok, "Shall I", k=2,
                                            max_new_tokens=8, temperature=0, stop_ids=stops)
        assert spec.tokens == out.tokens


@pytest.mark.parametrize(("prompt", "message"), [
    ([295, 5.7], "prompt token ids must be integers, got 5.7"),
    ([295, True], "prompt token ids must be integers, got True"),
    ([295, None], "prompt token ids must be integers, got None"),
    (torch.tensor([295.0, 5.0]), "prompt token ids must be integers"),
    (__import__("numpy").array([[295, 5, 6], [1, 2, 3]]), r"one sequence, \[T\] or \[1, T\]; got shape \[2, 3\]"),
])
def test_prompt_ids_of_the_wrong_kind(loaded, prompt, message):
    model, tok = loaded
    with pytest.raises(ValueError, match=message):
        llmstep.generate(model, tok, prompt, max_new_tokens=2)


def test_numpy_prompt_equals_the_list(loaded):
    import numpy as np

    model, tok = loaded
    ids = [295, 5, 6, 7]
    want = llmstep.generate(model, tok, ids, max_new_tokens=5, temperature=0).tokens
    assert llmstep.generate(model, tok, np.array(ids), max_new_tokens=5, temperature=0).tokens == want
    assert llmstep.generate(model, tok, np.array([ids]), max_new_tokens=5, temperature=0).tokens == want


def test_max_new_tokens_must_be_a_count(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got True"):
        llmstep.generate(model, tok, "thy", max_new_tokens=True)


def test_a_cache_for_another_batch_size_is_named(loaded):
    model, _ = loaded
    with pytest.raises(ValueError, match="the KV cache holds 2 sequences but the tokens hold 1"):
        model(torch.tensor([[1, 2, 3]]), cache=model.new_cache(batch_size=2, max_len=8))


@pytest.mark.parametrize(("stops", "message"), [
    (7, "stop_ids must be a collection of token ids, got 7"),
    ("eos", "stop_ids must be a collection of token ids, got 'eos'"),
    ([7, None], "stop_ids must hold integer token ids, got None"),
    ([7.0], "stop_ids must hold integer token ids, got 7.0"),
])
def test_bad_stop_ids_are_named(loaded, stops, message):
    model, tok = loaded
    with pytest.raises(ValueError, match=message):
        llmstep.generate(model, tok, "thy", max_new_tokens=2, stop_ids=stops)
    with pytest.raises(ValueError, match=message):
        llmstep.speculative_generate(model, llmstep.LayerSkipDraft(model, 1), tok, "thy", k=2, max_new_tokens=2,
                                     stop_ids=stops)
    from llmstep.fast import FastDecoder

    with pytest.raises(ValueError, match=message):
        FastDecoder(model, max_len=16, compile=False).generate([295, 5], 2, stop_ids=stops, temperature=0)


def test_a_vocabulary_padded_past_the_tokenizer_decodes_its_padding_to_nothing(tmp_path, tokenizer_file):
    from conftest import make_checkpoint

    make_checkpoint(tmp_path, tokenizer_file, seed=2, vocab_size=400)  # the tokenizer has 300 ids: 100 padded rows
    model, tok = llmstep.load(tmp_path, device="cpu", dtype=torch.float32)
    assert (tok.vocab_size, model.config.vocab_size) == (300, 400)
    out = llmstep.generate(model, tok, "ab", max_new_tokens=40, temperature=1.5, seed=0, stop_ids=())
    assert any(t >= 300 for t in out.tokens)  # the run did sample padding (a quarter of the ids)
    kept = [t for t in out.tokens if t < 300]
    assert out.text == tok.decode(kept) and len(out.tokens) == 40  # every token kept, the padding silent
    stream = tok.stream()
    assert "".join(stream.step(t) for t in out.tokens) + stream.flush() == out.text
    with pytest.raises(ValueError, match="cannot decode token id 400: ids are integers in 0..399"):
        tok.decode([5, 400])
    with pytest.raises(ValueError, match="cannot decode token id 400"):
        tok.stream().step(400)


def test_a_stream_not_yet_read_says_it_is_unfinished():
    model, tok = llmstep.load()
    s = llmstep.stream(model, tok, "ROMEO:", max_new_tokens=3, temperature=0)
    assert s.result.stop_reason == "interrupted" and s.result.tokens == []
    assert len(list(s)) == 3 and s.result.stop_reason == "length"


def test_generate_names_a_model_and_tokenizer_given_in_the_wrong_places(loaded):
    model, tok = loaded
    with pytest.raises(TypeError, match=r"model must be a llmstep model \(llmstep.load returns \(model, tokenizer\)"
                                        r"\), got Tokenizer"):
        llmstep.generate(tok, model, "ROMEO:")
    with pytest.raises(TypeError, match="tokenizer must be a llmstep Tokenizer .*, got str"):
        llmstep.generate(model, "tok", "ROMEO:")


def test_every_engine_picks_from_float32_logits_so_a_float64_near_tie_goes_one_way(tiny64):
    """generate and the teaching speculative loop took the argmax of float64 logits, the other engines of their
    float32 cast: two logits apart in float64 but one value in float32 gave different tokens."""
    from llmstep.core.model import LAST
    from llmstep.engines.batching import Request, run_batch
    from llmstep.engines.fast import FastDecoder
    from llmstep.engines.speculative import speculative_generate

    model, tok = tiny64
    model = copy.deepcopy(model)
    ids = tok.encode("ROMEO:", bos=True)
    with torch.no_grad():
        first = int(model(torch.tensor([ids]), keep=LAST)[0, -1].argmax())
        lo, hi = sorted([first, 5 if first != 5 else 6])
        logit = model(torch.tensor([ids]), keep=LAST)[0, -1, first]
        w = model.output.weight[first].clone()
        model.output.weight[lo] = w
        model.output.weight[hi] = w * (1 + (1e-12 if logit > 0 else -1e-12))  # float64 apart, float32 equal
    assert (model(torch.tensor([ids]), keep=LAST)[0, -1].argmax()) == hi  # the float64 argmax
    tokens = {"generate": llmstep.generate(model, tok, ids, 1, temperature=0).tokens,
              "fast": FastDecoder(model, compile=False).generate(ids, 1, temperature=0).tokens,
              "batch": run_batch(model, [Request(ids, 1, temperature=0)]).completions[0].tokens,
              "speculative": speculative_generate(model, model, tok, ids, k=2, max_new_tokens=1,
                                                  temperature=0).tokens}
    assert tokens == dict.fromkeys(tokens, [lo])  # float32's argmax: the first of the tied pair


def test_a_model_whose_ids_its_tokenizer_cannot_decode_is_refused_before_the_run(loaded):
    """A random model of a preset's vocabulary with the shipped tokenizer ran 7 steps, then failed to decode."""
    model, tok = loaded
    wide = llmstep.Llama(model.config.__class__(**{**model.config.__dict__, "vocab_size": 2 * tok.vocab_size}))
    with pytest.raises(ValueError, match=r"the model's vocabulary \(600 ids\) is larger than its tokenizer's "
                                         r"\(300\): an id it samples past 299 has no text"):
        llmstep.stream(wide, tok, "ROMEO:", max_new_tokens=4)
    padded = copy.copy(tok)
    padded.padded_vocab_size = 2 * tok.vocab_size  # ids past the tokenizer's are padding: decode to nothing
    assert llmstep.generate(wide, padded, "ROMEO:", max_new_tokens=2, temperature=0).tokens


def test_chat_messages_with_one_that_is_not_a_message_name_it(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match="message 1 must be a dict with 'role' and 'content', got 'and hello'"):
        llmstep.generate(model, tok, [{"role": "user", "content": "Hi"}, "and hello"], max_new_tokens=2)


def test_stream_without_a_tokenizer_is_refused_at_the_call(loaded):
    model, _ = loaded
    with pytest.raises(TypeError, match="tokenizer must be a llmstep Tokenizer .*, got None"):
        llmstep.stream(model, None, [1, 2, 3], max_new_tokens=2)

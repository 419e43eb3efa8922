"""Continuous batching: every request gets the tokens it would get alone, the scheduler fills slots as
it claims, and bad requests are refused before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import make_checkpoint
from llmstep.batching import BatchRunner, ContinuousBatcher, Request, run_batch

import llmstep
from llmstep.cli import main as llmstep_main
from llmstep.engines.decoding import NonFiniteLogitsError
from llmstep.lab import bench_batching
from llmstep.lab.bench_batching import measure_batch_scaling, random_workload
from llmstep.lab.probe import no_recompiles

GREEDY = dict(temperature=0, stop_ids=())  # greedy, never stopping early: what these runs ask for


def main(argv: list[str]) -> dict:
    """`llmstep batch ...`: the command lives in llmstep.cli."""
    return llmstep_main(["batch", *argv])


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory, tokenizer_file):
    """A float64 model (batched and single-row matmuls agree to ~1e-15: token equality is exact) with a
    short context, so requests can run into its end."""
    path = tmp_path_factory.mktemp("tiny64")
    make_checkpoint(path, tokenizer_file, seed=3, max_position_embeddings=48, num_hidden_layers=3)
    model, tok = llmstep.load(path, dtype="float32")
    return model.double(), tok


@pytest.fixture(scope="module")
def shipped():
    return llmstep.load(None, dtype="float32")


def solo(model, tok, r: Request):
    """What llmstep.generate gives the request alone."""
    return llmstep.generate(model, tok, r.prompt_ids, r.max_new_tokens, r.temperature, r.top_k, r.top_p, r.seed,
                            stop_ids=r.stop_ids)


def mixed_requests(vocab: int, n: int = 9, seed: int = 0) -> list[Request]:
    """Greedy and sampled requests of different lengths, arriving over time, some at the same step."""
    g = torch.Generator().manual_seed(seed)
    samplers = [dict(temperature=0.0), dict(temperature=0.9, seed=11), dict(temperature=1.3, top_k=20, seed=5),
                dict(temperature=0.7, top_p=0.8, seed=2)]
    out = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(Request(prompt, max_new_tokens=int(torch.randint(1, 16, (1,), generator=g)), arrival=(i * 3) // 2,
                           **samplers[i % len(samplers)]))
    return out


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("n_slots", [1, 2, 5])
def test_every_request_gets_the_tokens_it_gets_alone(tiny64, policy, n_slots):
    model, tok = tiny64
    requests = mixed_requests(model.config.vocab_size)
    run = run_batch(model, requests, n_slots=n_slots, policy=policy)
    assert [c.id for c in run.completions] == list(range(len(requests)))
    for r, c in zip(requests, run.completions, strict=True):
        alone = solo(model, tok, r)
        assert c.tokens == alone.tokens, f"request {c.id}"
        assert c.stop_reason == alone.stop_reason
        assert c.prompt_ids == alone.prompt_ids


def test_shipped_model_in_float32_batched_gives_the_solo_tokens(shipped):
    model, tok = shipped
    prompts = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me speak.",
               "KING HENRY", "To be"]
    requests = [Request(tok.encode(p, bos=True), max_new_tokens=n, temperature=t, top_k=k, seed=i,
                        stop_ids=tok.eos_ids, arrival=a)
                for i, (p, n, t, k, a) in enumerate(zip(prompts, [30, 6, 40, 12, 25], [0, 0.8, 1.0, 0, 0.7],
                                                         [0, 0, 50, 0, 0], [0, 0, 1, 2, 8], strict=True))]
    run = run_batch(model, requests, n_slots=3)
    for r, c in zip(requests, run.completions, strict=True):
        assert c.tokens == solo(model, tok, r).tokens


def test_int4_with_8_bit_activations_batched_gives_the_solo_tokens(shipped):
    """int4-a8 rounds each row's activations by that row's own blocks, and its CPU kernel takes each row alone:
    a request's tokens cannot depend on the rows batched beside it."""
    from llmstep.core.quantize import quantize

    model, tok = shipped
    a8 = quantize(model, "int4-g64-a8+lm_head-int8", inplace=False)
    requests = [Request(tok.encode(p, bos=True), max_new_tokens=n, temperature=t, seed=i, stop_ids=tok.eos_ids,
                        arrival=a)
                for i, (p, n, t, a) in enumerate(zip(["ROMEO:", "JULIET:\nO Romeo, Romeo", "KING HENRY", "To be"],
                                                     [20, 8, 16, 12], [0, 0.8, 0, 1.0], [0, 0, 2, 5], strict=True))]
    run = run_batch(a8, requests, n_slots=3)
    for r, c in zip(requests, run.completions, strict=True):
        assert c.tokens == solo(a8, tok, r).tokens


def test_stop_tokens_end_a_request_inside_the_batch(tiny64):
    model, tok = tiny64
    base = Request(list(range(3, 12)), max_new_tokens=20, **GREEDY)
    alone = solo(model, tok, base).tokens
    stop = alone[6]  # a token it makes on the way: stopping there frees its slot early
    first = alone.index(stop)
    requests = [Request(base.prompt_ids, 20, stop_ids=[stop], temperature=0), Request([7, 8, 9], 12, **GREEDY),
                Request([1, 2], 10, arrival=2, **GREEDY)]
    run = run_batch(model, requests, n_slots=2)
    c = run.completions[0]
    assert c.tokens == alone[: first + 1] and c.stop_reason == "stop"
    for r, c in zip(requests, run.completions, strict=True):
        assert c.tokens == solo(model, tok, r).tokens


def test_a_reused_slot_never_sees_its_previous_occupant(tiny64):
    """One slot: a long request leaves keys at positions a shorter successor never writes. The causal
    mask must hide them (a cache that attended over every written slot would not)."""
    model, tok = tiny64
    long_req = Request(list(range(1, 31)), max_new_tokens=12, **GREEDY)
    short_req = Request([40, 41, 42], max_new_tokens=12, temperature=1.0, seed=9, stop_ids=())
    run = run_batch(model, [long_req, short_req], n_slots=1)
    assert run.completions[1].slot == run.completions[0].slot == 0
    assert run.completions[1].tokens == solo(model, tok, short_req).tokens


def test_the_end_of_the_context_stops_a_request_as_generate_does(tiny64):
    model, tok = tiny64  # 48 positions
    requests = [Request(list(range(1, 41)), max_new_tokens=30, **GREEDY), Request([5] * 45, 10, **GREEDY),
                Request([9, 9], 60, **GREEDY)]
    run = run_batch(model, requests, n_slots=2)
    for r, c in zip(requests, run.completions, strict=True):
        alone = solo(model, tok, r)
        assert (c.tokens, c.stop_reason) == (alone.tokens, alone.stop_reason) == (alone.tokens, "context")
        assert len(c.prompt_ids) + len(c.tokens) == 48 + 1  # the last token is made but never written


def test_continuous_schedule_by_hand(tiny64):
    """Two slots, four requests of 2, 5, 3 and 1 new tokens arriving together: one token a step for each running
    request (a newcomer's from its prefill); a finished request's slot is free at the next step."""
    model, _ = tiny64
    requests = [Request([1, 2, 3], n, **GREEDY) for n in (2, 5, 3, 1)]
    run = run_batch(model, requests, n_slots=2, policy="continuous")
    assert [c.admitted for c in run.completions] == [0, 0, 2, 5]
    assert [c.finished for c in run.completions] == [1, 4, 4, 5]
    assert [c.slot for c in run.completions] == [0, 1, 0, 0]
    assert run.timeline == [[0, 1], [0, 1], [2, 1], [2, 1], [2, 1], [3, -1]]
    assert run.prefills == [(0, 0, 0), (0, 1, 1), (2, 0, 2), (5, 0, 3)]
    assert [len(c.tokens) for c in run.completions] == [2, 5, 3, 1]
    assert run.slot_utilisation == pytest.approx(11 / 12)


def test_static_schedule_by_hand(tiny64):
    """The same requests in static batches: the second batch waits for the slowest of the first."""
    model, _ = tiny64
    requests = [Request([1, 2, 3], n, **GREEDY) for n in (2, 5, 3, 1)]
    run = run_batch(model, requests, n_slots=2, policy="static")
    assert [c.admitted for c in run.completions] == [0, 0, 5, 5]
    assert [c.finished for c in run.completions] == [1, 4, 7, 5]
    assert run.timeline == [[0, 1], [0, 1], [-1, 1], [-1, 1], [-1, 1], [2, 3], [2, -1], [2, -1]]
    assert run.slot_utilisation == pytest.approx(11 / 16)
    assert [c.latency_steps for c in run.completions] == [2, 5, 8, 6]


def test_idle_steps_until_a_late_arrival(tiny64):
    model, _ = tiny64
    run = run_batch(model, [Request([1, 2], 2, **GREEDY), Request([3, 4], 2, arrival=6, **GREEDY)], n_slots=2)
    assert run.completions[1].admitted == 6 and run.completions[1].queued_steps == 0
    assert run.timeline[2:6] == [[-1, -1]] * 4 and run.step_seconds[2:6] == [0.0] * 4
    assert run.timeline[6] == [1, -1]  # the lowest free slot


def test_zero_new_tokens_and_empty_workload(tiny64):
    model, _ = tiny64
    run = run_batch(model, [Request([1, 2], 0, **GREEDY), Request([3], 3, **GREEDY)], n_slots=1)
    assert run.completions[0].tokens == [] and run.completions[0].stop_reason == "length"
    assert len(run.completions[1].tokens) == 3
    empty = run_batch(model, [], n_slots=2)
    assert empty.completions == [] and empty.steps == 0 and empty.tokens == 0


def test_continuous_beats_static_on_a_mixed_workload(tiny64):
    """Counted in engine steps (deterministic), not seconds: fewer steps for the same tokens."""
    model, _ = tiny64
    requests = random_workload(24, model.config.vocab_size, prompt_len=(2, 8), new_tokens=(1, 30), seed=4)
    static, continuous = (run_batch(model, requests, n_slots=4, policy=p) for p in ("static", "continuous"))
    assert static.tokens == continuous.tokens == sum(r.max_new_tokens for r in requests)
    assert continuous.steps < static.steps
    assert continuous.slot_utilisation > static.slot_utilisation
    assert [c.tokens for c in continuous.completions] == [c.tokens for c in static.completions]


def test_continuous_admits_as_soon_as_a_slot_is_free(tiny64):
    """No request waits while a slot sits free: at every step a queued request sees every row busy."""
    model, _ = tiny64
    requests = random_workload(30, model.config.vocab_size, prompt_len=(1, 6), new_tokens=(1, 12), rate=0.8, seed=1)
    run = run_batch(model, requests, n_slots=3)
    for c in run.completions:
        for step in range(c.arrival, c.admitted):
            assert all(r >= 0 for r in run.timeline[step]), (c.id, step)
    assert any(c.queued_steps > 0 for c in run.completions)  # the workload does make requests wait
    admitted = sorted(run.completions, key=lambda c: (c.admitted, c.slot))
    assert [c.id for c in admitted] == sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))  # FIFO


def test_a_request_done_at_its_first_token_frees_its_slot_for_the_next_step(tiny64):
    """A request that stops at its first token leaves at the end of its admission step: a queued request takes its
    slot at the next; one that wants no token is done at admission and takes no slot."""
    model, tok = tiny64
    first = solo(model, tok, Request([1, 2, 3], 1, **GREEDY)).tokens[0]
    requests = [Request([4, 5], 6, **GREEDY), Request([1, 2, 3], 5, stop_ids=[first], temperature=0),
                Request([6], 0, **GREEDY), Request([7, 8], 3, **GREEDY)]
    run = run_batch(model, requests, n_slots=2)
    assert [c.admitted for c in run.completions] == [0, 0, 1, 1]
    assert [c.slot for c in run.completions] == [0, 1, -1, 1]
    assert run.timeline[:2] == [[0, 1], [0, 3]]
    assert run.completions[1].tokens == [first] and run.completions[1].stop_reason == "stop"
    for r, c in zip(requests, run.completions, strict=True):
        assert c.tokens == solo(model, tok, r).tokens
    static = run_batch(model, requests, n_slots=2, policy="static")  # a static batch is formed once
    assert [c.admitted for c in static.completions] == [0, 0, 6, 6]


def test_stop_ids_and_arrival_of_other_kinds(tiny64):
    """stop_ids given as a one-shot iterator still stop the request (the check must not use them up), and
    an arrival may be any integer type (numpy's), but not a bool."""
    import numpy as np

    model, tok = tiny64
    alone = solo(model, tok, Request([1, 2, 3], 10, **GREEDY)).tokens
    c = run_batch(model, [Request([1, 2, 3], 10, stop_ids=iter([alone[4]]), temperature=0)], n_slots=1).completions[0]
    assert c.tokens == alone[: alone.index(alone[4]) + 1] and c.stop_reason == "stop"
    c = run_batch(model, [Request([1, 2, 3], 10, arrival=np.int64(2), **GREEDY)], n_slots=1).completions[0]
    assert c.arrival == c.admitted == 2 and type(c.arrival) is int and c.tokens == alone
    with pytest.raises(ValueError, match="request 0: arrival must be an engine step"):
        run_batch(model, [Request([1], 2, arrival=True, **GREEDY)])


def test_kv_cache_slot_is_a_view_of_one_row(tiny64):
    model, _ = tiny64
    cache = model.new_cache(batch_size=3, max_len=16)
    with torch.no_grad():
        model(torch.tensor([[4, 5, 6]]), cache=cache.slot(1))
    assert cache.lengths.tolist() == [0, 3, 0]
    k, v = torch.stack(cache.k), torch.stack(cache.v)  # [L, 3, n_kv, max_len, hd]
    assert k[:, 1, :, :3].abs().sum() > 0 and v[:, 1, :, :3].abs().sum() > 0
    assert k[:, [0, 2]].abs().sum() == 0 and v[:, [0, 2]].abs().sum() == 0
    with pytest.raises(IndexError, match="slot 3 does not exist"):
        cache.slot(3)


@pytest.mark.parametrize(("request_", "message"), [
    (Request([1] * 49, 4, **GREEDY), "request 1: the prompt is 49 tokens, but the model's context is 48"),
    (Request([], 4, **GREEDY), "request 1: the prompt is empty"),
    (Request([1, 999], 4, **GREEDY), "request 1: prompt token id 999 is outside the vocabulary"),
    (Request([1], 4, temperature=-1, stop_ids=()), "request 1: temperature must be"),
    (Request([1], 4, top_p=0, **GREEDY), "request 1: top_p"),
    (Request([1], -2, **GREEDY), "request 1: max_new_tokens"),
    (Request([1], 4, arrival=-1, **GREEDY), "request 1: arrival must be an engine step"),
    (Request([1], 4, arrival=1.5, **GREEDY), "request 1: arrival must be an engine step"),
    (Request([1], 4, stop_ids=7, temperature=0), "request 1: stop_ids must be a collection of token ids, got 7"),
    (Request([1], 4, stop_ids=[7, 2.5], temperature=0), "request 1: stop_ids must hold integer token ids, got 2.5"),
])
def test_bad_requests_are_named_before_any_work(tiny64, request_, message, monkeypatch):
    model, _ = tiny64
    batcher = ContinuousBatcher(model, n_slots=2)
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=message):
        batcher.run([Request([1, 2], 3, **GREEDY), request_])
    assert calls == []


def test_a_fixed_slot_length_is_named_as_such(tiny64):
    with pytest.raises(ValueError, match="request 0: the prompt is 17 tokens, but a batch slot's length is 16"):
        ContinuousBatcher(tiny64[0], n_slots=2, max_len=16).run([Request([1] * 17, 4, **GREEDY)])


def test_bad_batcher_arguments(tiny64):
    model, _ = tiny64
    with pytest.raises(ValueError, match="n_slots must be an integer >= 1"):
        ContinuousBatcher(model, n_slots=0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        ContinuousBatcher(model, n_slots=2, max_len=49)
    with pytest.raises(ValueError, match="unknown batching policy 'fifo'"):
        run_batch(model, [Request([1], 1, **GREEDY)], policy="fifo")


def test_random_workload_is_seeded_and_in_range():
    a = random_workload(50, 100, prompt_len=(3, 7), new_tokens=(2, 9), rate=0.5, seed=7)
    b = random_workload(50, 100, prompt_len=(3, 7), new_tokens=(2, 9), rate=0.5, seed=7)
    assert [(r.prompt_ids, r.max_new_tokens, r.arrival) for r in a] == [(r.prompt_ids, r.max_new_tokens, r.arrival)
                                                                        for r in b]
    assert all(3 <= len(r.prompt_ids) <= 7 and 2 <= r.max_new_tokens <= 9 for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt_ids)
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and 40 < arrivals[-1] < 200  # ~ 49 / 0.5 steps
    assert {r.arrival for r in random_workload(5, 100)} == {0}
    with pytest.raises(ValueError, match="prompt_len range"):
        random_workload(3, 100, prompt_len=(5, 2))
    with pytest.raises(ValueError, match="rate must be > 0"):
        random_workload(3, 100, rate=0)


def test_batch_scaling_rows(tiny64):
    model, _ = tiny64
    rows = measure_batch_scaling(model, [1, 4], context=8, repeats=2)
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["tokens_per_second"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3))
    assert rows[1]["bytes_per_token"] < rows[0]["bytes_per_token"] / 3  # the weights are shared by 4 rows
    assert rows[1]["flops_per_byte"] > 3 * rows[0]["flops_per_byte"]


def test_command_writes_both_policies(tmp_path, capsys):
    out = tmp_path / "batch.json"
    record = main(["--requests", "6", "--slots", "1,3", "--new-tokens", "2:6", "--prompt-len", "2:5",
                   "--batch-sizes", "1,2", "--context", "8", "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(record["runs"]))
    assert [(r["policy"], r["slots"]) for r in record["runs"]] == [("continuous", 1), ("continuous", 3),
                                                                   ("static", 3)]
    assert all(r["same_tokens_as_first_run"] for r in record["runs"])
    assert all(r["tokens"] == record["runs"][0]["tokens"] for r in record["runs"])
    assert "static" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--slots", "0,2"])
    with pytest.raises(SystemExit):
        main(["--new-tokens", "a:b"])


@pytest.mark.parametrize(("args", "message"), [
    (["--requests", "0"], "argument --requests: must be an integer in 1 .."),
    (["--threads", "-1"], "argument --threads: must be an integer in 1 .."),
    (["--prompt-len", "600:700"], "prompts of --prompt-len 700 need 700 positions; the model's context holds 512"),
    # from the config: before the weights load
])
def test_command_refuses_bad_arguments_without_a_traceback(args, message):
    with pytest.raises(SystemExit, match=f"llmstep batch: error: {message}"):
        main(["--slots", "1", "--requests", "2", *args])


def test_command_lets_long_requests_stop_at_the_models_context(monkeypatch):
    """A workload whose prompt + new tokens pass the model's context runs (its requests stop there)."""
    monkeypatch.setattr(bench_batching, "measure_batch_scaling", lambda *a, **k: [])
    record = main(["--requests", "2", "--slots", "1", "--prompt-len", "509:510", "--new-tokens", "5:6",
                   "--threads", "1"])
    assert {c["stop_reason"] for c in record["runs"][0]["completions"]} == {"context"}
    with pytest.raises(ValueError, match=r"n_requests must be an integer in 0\.\.100,000, got -1"):
        random_workload(-1, 100)


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~30 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
def test_compiled_batcher_gives_the_eager_tokens(one_layer_checkpoint):
    # A one-block random model, not the shipped six-block one: what is checked is the batcher's compiled step
    # (slots, positions, sampling rows, the timeline), not the model; the compile is much shorter.
    model, _ = llmstep.load(one_layer_checkpoint, dtype="float32")
    requests = random_workload(10, model.config.vocab_size, prompt_len=(2, 12), new_tokens=(1, 20), rate=1.0,
                               seed=2)
    requests[3].temperature, requests[3].seed = 0.8, 1
    eager = run_batch(model, requests, n_slots=3, max_len=40, compile=False)
    batcher = ContinuousBatcher(model, n_slots=3, max_len=40, compile=True)
    batcher.warmup()  # public, as a benchmark calls it: the step the runs use, compiled in the runs' mode
    with no_recompiles():
        compiled = batcher.run(requests)
    assert [c.tokens for c in compiled.completions] == [c.tokens for c in eager.completions]
    assert compiled.timeline == eager.timeline
    # The public step, called outside any mode, runs the code compiled in the runs' mode: no recompile
    rows = [(5, 0), None, (7, 0)]
    with no_recompiles():
        logits = batcher.decode(rows)
    expected = BatchRunner(model, n_slots=3, max_len=40, compile=False).decode(rows)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_batch_reads_the_weights_once():
    from llmstep.core.config import LlamaConfig
    from llmstep.core.cost import decode_step_cost

    cfg = LlamaConfig.preset("llama-3.1-8b")
    one, many = decode_step_cost(cfg, context=1023), decode_step_cost(cfg, context=1023, batch=64)
    assert many.weight_bytes == one.weight_bytes
    assert many.kv_bytes == 64 * one.kv_bytes == 64 * 1024 * 128 * 1024
    assert many.flops == 64 * one.flops
    assert 0.99 < one.arithmetic_intensity < 1.05
    assert 40 < many.arithmetic_intensity < 64  # 64x the FLOPs, but the KV cache (~8.6 GB) now rivals the weights
    assert decode_step_cost(cfg, batch=64).arithmetic_intensity == pytest.approx(64, rel=0.01)
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        decode_step_cost(cfg, batch=0)



@pytest.fixture(scope="module")
def long64():
    """A random float64 model with a 1,024-token context: room to see a cache sized for its requests."""
    torch.manual_seed(0)
    config = llmstep.LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
                                 max_seq_len=1024, rope_theta=500000.0)
    return llmstep.Llama(config).eval().double()


def test_a_batcher_sizes_its_slots_for_its_requests_not_the_whole_context(long64):
    """max_len None: every slot holds what the longest request needs (decoding.cache_len, rounded), grown when a
    run needs more; the tokens are those of slots the whole context long."""
    requests = [Request([5, 17, 101], 20, **GREEDY), Request([7] * 30, 12, temperature=0.8, seed=3, stop_ids=()),
                Request([9], 5, arrival=2, **GREEDY)]
    batcher = ContinuousBatcher(long64, n_slots=2, compile=False)
    assert batcher.max_len == 256 and batcher.cache.k[0].shape[2] == 256
    sized = batcher.run(requests)
    assert batcher.max_len == 256
    whole = run_batch(long64, requests, n_slots=2, max_len=1024, compile=False)
    assert [c.tokens for c in sized.completions] == [c.tokens for c in whole.completions]
    assert [c.stop_reason for c in sized.completions] == ["length"] * 3
    batcher.run([Request([5] * 300, 4, **GREEDY)])  # 304 slots: the cache grows to 512
    assert batcher.max_len == 512 and batcher.cache.k[0].shape[2] == 512


def test_an_eager_runner_runs_its_step_once_in_the_warmup(tiny64):
    """Nothing times a never-run step: BatchRunner.warmup runs the step once when eager (compile_seconds 0)."""
    model, _ = tiny64
    calls = []
    handle = model.output.register_forward_hook(lambda *_: calls.append(1))
    try:
        runner = BatchRunner(model, 3, max_len=16, compile=False)
        assert runner.warmup() == 0 and len(calls) == 1 and runner.compile_seconds == 0  # nothing compiled
        assert runner.warmup() == 0 and len(calls) == 1
        assert runner.cache.lengths.tolist() == [0, 0, 0]
    finally:
        handle.remove()


def test_non_finite_logits_are_named_per_request(tiny64):
    """The batcher flags non-finite logits with decoding.NonFiniteLogits, one flag per request: only the broken
    request is named."""
    model, _ = tiny64
    calls = []

    def hook(module, args, out):  # NaN logits in the first row of the fourth forward (request 1's prefill)
        calls.append(1)
        if len(calls) == 4:
            out = out.clone()
            out[0] = float("nan")
        return out

    handle = model.output.register_forward_hook(hook)
    try:
        with pytest.raises(NonFiniteLogitsError, match=r"request\(s\) 1: their tokens"):
            run_batch(model, [Request([1, 2], 2, **GREEDY), Request([3, 4], 2, arrival=5, **GREEDY)], n_slots=1,
                      max_len=16,
                      compile=False)
    finally:
        handle.remove()


def test_a_sparse_workload_costs_its_requests_not_its_idle_steps(tiny64):
    from llmstep.engines.batching import MAX_ARRIVAL_STEP

    model, _ = tiny64
    sparse = [Request([1, 2], 2), Request([3], 2, arrival=MAX_ARRIVAL_STEP)]  # a million idle steps between them
    run = run_batch(model, sparse, n_slots=2, max_len=16)
    assert run.steps == MAX_ARRIVAL_STEP + run.completions[1].latency_steps  # every idle step is still recorded
    assert len({id(row) for row in run.timeline[2:MAX_ARRIVAL_STEP]}) == 1  # ~8 bytes an idle step, not a list each
    assert run.summary()["slot_utilisation"] == run.tokens / (2 * run.steps)  # a busy slot makes a token a step
    with pytest.raises(ValueError, match=r"request 1: arrival step 1,000,001 is past the 1,000,000 steps a run"):
        run_batch(model, [Request([1], 1), Request([2], 1, arrival=MAX_ARRIVAL_STEP + 1)], n_slots=2, max_len=16)


def test_the_runners_public_step_refuses_a_position_that_names_no_slot(tiny64):
    """BatchRunner.step is static when compiled (its mask reads nothing back): position -1 was written into every
    row's last slot silently. The public step checks its positions on a CPU first."""
    model, _ = tiny64
    runner = BatchRunner(model, n_slots=2, max_len=8)
    runner.static = True
    tokens = torch.tensor([[5], [6]])
    for bad in (-1, 8):
        with pytest.raises(ValueError, match=f"position {bad} names no slot of the KV cache's 8 \\(0..7\\)"):
            runner.step(tokens, torch.tensor([[0], [bad]]))
    assert runner.step(tokens, torch.tensor([[0], [7]])).shape == (2, model.config.vocab_size)

"""llmstep.lab.bench_batching: the batch-scaling rows count the bytes the model holds, and the record is built here."""

import pytest
import torch

from llmstep import Llama, LlamaConfig
from llmstep.core import attention_backend
from llmstep.core.cost import decode_step_cost, model_step_cost
from llmstep.core.quantize import QuantConfig, quantize
from llmstep.lab import bench_batching
from llmstep.lab.bench_batching import measure_batch_scaling, run_batch_bench

CFG = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=112, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Llama(CFG).eval()


def test_batch_scaling_of_a_quantized_model_counts_its_stored_bytes(model):
    q = quantize(model, QuantConfig("int8"), inplace=False)
    rows = measure_batch_scaling(q, [1, 3], context=4, repeats=1)
    for row in rows:
        want = model_step_cost(q, 4, batch=row["batch"]).bytes
        assert row["bytes_per_step"] == pytest.approx(want)
        assert row["bytes_per_token"] == pytest.approx(want / row["batch"])
        assert want < decode_step_cost(CFG, 4, model.dtype, batch=row["batch"]).bytes


def test_batch_scaling_runs_the_step_before_timing_it(model, monkeypatch):
    """The timed step is never the first one: even eager, one untimed step runs before the repeats."""
    calls = []
    real = bench_batching.runinfo.time_repeats
    monkeypatch.setattr(bench_batching.runinfo, "time_repeats",
                        lambda fn, device, repeats, warmup=1: calls.append(warmup) or real(fn, device, repeats, warmup))
    measure_batch_scaling(model, [1], context=2, repeats=2)
    assert calls == [1]


def test_the_batch_record_has_the_run_metadata_header(model):
    seen = []
    workload = {"n_requests": 2, "prompt_len": (2, 3), "new_tokens": (1, 2), "rate": None, "seed": 0,
                "temperature": 0.0}
    record = run_batch_bench(model, "tiny", workload, [1], [1], context=2, compile=False, argv=["batch", "-x"],
                             on_run=lambda rec, run: seen.append(run["policy"]),
                             on_row=lambda rec, row: seen.append(row["batch"]))
    assert record["command"] == "llmstep batch -x"
    assert record["machine"]["device"] == "cpu" and record["machine"]["dtype"] == "float32"
    assert set(record["versions"]) >= {"llmstep", "torch", "python"}
    assert len(record["load_average_1min_before_after"]) == 2 and record["finished"]
    assert record["workload"]["requests"] == 2 and record["model"] == "tiny"
    assert seen == ["continuous", 1] and len(record["runs"]) == 1 and len(record["batch_scaling"]) == 1


def test_a_context_past_the_model_is_refused_before_the_workload_runs(model, monkeypatch):
    monkeypatch.setattr(bench_batching, "serve_both_ways", lambda *a, **k: pytest.fail("the workload ran"))
    too_long = model.config.max_seq_len
    with pytest.raises(ValueError, match=rf"context must be an integer in 0..{too_long - 1} .*got {too_long}"):
        run_batch_bench(model, "m", {"n_requests": 2}, [1], [1], too_long)


def test_a_workload_too_large_to_hold_is_refused_before_it_is_built():
    with pytest.raises(ValueError, match="n_requests must be an integer in 0..100,000"):
        bench_batching.random_workload(10**8, 100)


def test_the_batch_record_says_what_attention_its_compiled_steps_took(model, monkeypatch):
    """The header is written before anything compiles; compiling a CPU step installs llmstep's attention kernel, so
    the record reads it again at the end (as the peers record does)."""
    monkeypatch.setattr(attention_backend, "_cpu_step", None)  # no kernel yet, as in a fresh process
    monkeypatch.setattr(attention_backend, "_cpu_step_op", None)
    monkeypatch.setattr(attention_backend, "_chosen", "auto")
    serve = bench_batching.serve_both_ways

    def compiles_then_serves(*args, **kwargs):  # what compiling a CPU step does first
        attention_backend.use_cpu_step_kernel(lambda q, k, v, mask: q, op="llmstep_cpu_x::attention")
        yield from serve(*args, **kwargs)

    monkeypatch.setattr(bench_batching, "serve_both_ways", compiles_then_serves)
    workload = {"n_requests": 1, "prompt_len": (2, 2), "new_tokens": (1, 1), "rate": None, "seed": 0}
    record = run_batch_bench(model, "tiny", workload, [1], [1], context=2, compile=False)
    assert record["attention"] == {"asked": "auto", "decode_step": "llmstep_cpu",
                                   "decode_step_op": "llmstep_cpu_x::attention"}

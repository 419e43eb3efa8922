"""llmstep.lab.profile: a torch.profiler trace of one decode step, its timeline, and the regime rule."""

import itertools
import os

import matplotlib

matplotlib.use("agg")
import pytest
import torch

from llmstep import Llama, LlamaConfig
from llmstep.core.cost import StepCost, model_step_cost
from llmstep.lab.profile import decode_rates, op_kind, plot_timeline, profile_ops, profile_step, regime

CFG = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=112, max_seq_len=64)
COST = StepCost(weight_bytes=1e9, kv_bytes=0.0, flops=2e9)  # 1 GB, 2 GFLOP: 2 FLOPs per byte


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Llama(CFG).eval()


def test_a_step_near_its_memory_floor_is_memory_bound():
    # 100 GB/s: the bytes alone take 10 ms; 100 TFLOP/s: the FLOPs 0.02 ms
    r = regime(COST, 0.012, bandwidth_gb_per_s=100, peak_tflops=100)
    assert r.name == "memory"
    assert r.memory_seconds == pytest.approx(0.010) and r.compute_seconds == pytest.approx(2e-5)
    assert r.overhead_seconds == pytest.approx(0.002)


def test_a_step_near_its_compute_floor_is_compute_bound():
    r = regime(COST, 0.025, bandwidth_gb_per_s=1000, peak_tflops=0.1)  # FLOPs 20 ms, bytes 1 ms
    assert r.name == "compute"


def test_a_step_far_slower_than_both_floors_is_overhead_bound():
    r = regime(COST, 0.050, bandwidth_gb_per_s=100, peak_tflops=100)  # 10 ms floor, 50 ms measured
    assert r.name == "overhead"
    assert r.overhead_seconds == pytest.approx(0.040)
    assert "overhead-bound" in str(r)


def test_the_attained_threshold_is_the_boundary():
    assert regime(COST, 0.020, 100, 100, attained=0.5).name == "memory"  # exactly half the rate
    assert regime(COST, 0.0201, 100, 100, attained=0.5).name == "overhead"


@pytest.mark.parametrize("kwargs", [dict(step_seconds=0.0), dict(bandwidth_gb_per_s=-1.0), dict(peak_tflops=0.0),
                                    dict(attained=0.0), dict(attained=1.5)])
def test_regime_refuses_bad_inputs(kwargs):
    args = dict(cost=COST, step_seconds=0.01, bandwidth_gb_per_s=100.0, peak_tflops=100.0) | kwargs
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        regime(**args)


def test_profile_records_the_step_s_operators_inside_it(model):
    p = profile_step(model, context=8, repeats=3)
    assert not p.compiled and p.compile_seconds == 0.0
    assert len(p.step_seconds) == 3 and p.median_seconds > 0 and p.spread >= 0
    assert p.rows()[0] == "host ops"
    names = {e.name for e in p.events if e.row == "host ops"}
    assert "aten::linear" in names  # every projection is an nn.Linear
    # every event lies inside the profiled step (1 us of clock slack)
    end_us = 1e6 * p.profiled_seconds + 1.0
    assert all(-1.0 <= e.start_us and e.start_us + e.duration_us <= end_us for e in p.events)
    assert [e.start_us for e in p.events] == sorted(e.start_us for e in p.events)
    top = [e for e in p.events if e.row == "host ops"]  # the step's own operators run one after another
    assert all(b.start_us >= a.start_us + a.duration_us - 1.0 for a, b in itertools.pairwise(top))
    calls = dict((name, n) for name, n, _ in p.top(50))
    assert calls["aten::linear"] == 7 * CFG.n_layers + 1  # q, k, v, o, w1, w3, w2 per layer, and the LM head
    assert p.cost == model_step_cost(model, 8)


def test_profile_refuses_a_context_past_the_window_before_building_anything(model):
    with pytest.raises(ValueError, match=r"integer in 1..63 \(the model.s 64-token window less .*, got 64"):
        profile_step(model, context=CFG.max_seq_len)
    with pytest.raises(ValueError, match="repeats"):
        profile_step(model, context=4, repeats=0)
    with pytest.raises(ValueError, match="context must be"):
        profile_step(model, context=0)


def test_timeline_draws_one_bar_per_event(model):
    p = profile_step(model, context=4, repeats=1)
    ax = plot_timeline({"eager": p})
    assert len(ax.patches) == len(p.events)
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"eager: {r}" for r in p.rows()]


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"),
                    reason="torch.compile on the CPU takes ~30 s; set LLMSTEP_SLOW_TESTS=1")
def test_profile_of_a_compiled_step():
    torch.manual_seed(0)
    one_block = Llama(CFG.replace(n_layers=1)).eval()  # the profiler is checked, not the model: a shorter compile
    p = profile_step(one_block, context=8, compile=True, repeats=3)
    assert p.compiled and p.compile_seconds > 0
    assert p.events and p.median_seconds > 0


def test_profile_step_leaves_stderr_quiet_and_a_users_kineto_level_alone():
    """Kineto reads KINETO_LOG_LEVEL once, when a process's first profile starts: so a fresh process each time."""
    import subprocess
    import sys

    script = ("import torch\nfrom llmstep import Llama, LlamaConfig\nfrom llmstep.lab.profile import profile_step\n"
              f"model = Llama(LlamaConfig(**{CFG.__dict__!r})).eval()\n"
              "profile_step(model, context=4, repeats=1)\nprofile_step(model, context=4, repeats=1)\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "profiler_start" not in quiet.stderr and "profiler_stop" not in quiet.stderr
    loud = subprocess.run([sys.executable, "-c", script], env=env | {"KINETO_LOG_LEVEL": "0"}, capture_output=True,
                          text=True, timeout=120)
    assert loud.returncode == 0 and "profiler_start" in loud.stderr  # the user's own setting wins


# ---- operators over many steps: `llmstep profile` ----------------------------------------------------------

def test_profile_ops_counts_each_operator_per_step_not_per_run(model):
    from llmstep.engines.fast import FastDecoder

    decoder = FastDecoder(model, max_len=16, compile=False)
    ops = profile_ops(decoder, context=8, steps=3, warmup=1)
    assert ops.steps == 3 and ops.wall_us_per_step > 0
    calls = {op.name: op.calls_per_step for op in ops.ops}
    assert calls["aten::linear"] == 7 * CFG.n_layers + 1  # q, k, v, o, w1, w3, w2 per layer, and the LM head
    assert [op.us_per_step for op in ops.ops] == sorted((op.us_per_step for op in ops.ops), reverse=True)
    kinds = ops.by_kind()
    assert sum(kinds.values()) == pytest.approx(ops.total_us_per_step) and kinds["matmul"] > 0
    assert ops.table(3).count("\n") == 1 + len(kinds) + 3  # the header, one line per kind, the title, 3 ops


@pytest.mark.parametrize(("name", "kind"), [("aten::mm", "matmul"), ("aten::_weight_int8pack_mm", "matmul"),
                                            ("aten::addmm", "matmul"), ("aten::_softmax", "attention"),
                                            ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
                                            ("cpp_fused_add_mean_mul_pow_rsqrt_0", "norm/rope/elementwise"),
                                            # inductor's kernels (llmstep profile --kernel-profile): a GEMM template,
                                            # and attention's matmuls with their softmax or bmm in the name
                                            ("graph_1_gemm_m1n3072k576_cpp_fused__to_copy_mean_mm_mul", "matmul"),
                                            ("graph_1_gemm_m3n64k256_cpp_fused__softmax__to_copy_bmm_view_5",
                                             "attention"), ("aoti_torch_cpu_bmm_out", "attention"),
                                            ("aten::empty_strided", "other")])
def test_op_kind_names_the_work_an_operator_does(name, kind):
    assert op_kind(name) == kind


def test_profile_ops_refuses_a_position_past_the_decoders_cache(model):
    from llmstep.engines.fast import FastDecoder

    decoder = FastDecoder(model, max_len=8, compile=False)
    with pytest.raises(ValueError, match="context 8 leaves no room"):
        profile_ops(decoder, context=8)
    with pytest.raises(ValueError, match="steps"):
        profile_ops(decoder, context=2, steps=0)


def test_decode_rates_times_each_repeat_after_an_untimed_run(model):
    from llmstep.engines.fast import FastDecoder

    decoder = FastDecoder(model, max_len=16, compile=False)
    runs = []
    generate = decoder.generate

    def counting(*args, **kwargs):
        runs.append(args[1])
        return generate(*args, **kwargs)

    decoder.generate = counting
    rates = decode_rates(decoder, [1, 2, 3], new_tokens=5, repeats=2)
    assert runs == [5, 5, 5] and len(rates) == 2 and all(r > 0 for r in rates)


def test_the_profile_command_prints_the_rate_then_the_operators(tiny_checkpoint, capsys):
    from llmstep.cli import CommandFailed, main

    record = main(["profile", "--model", str(tiny_checkpoint), "--no-compile", "--prompt-len", "8", "--new-tokens",
                   "4", "--repeats", "2", "--steps", "2", "--top", "3"])
    out = capsys.readouterr().out
    assert "eager] decode" in out and "median of 2 runs of 4 tokens" in out and "2 steps profiled" in out
    assert len(record["decode_tokens_per_s_runs"]) == 2 and record["us_per_step_by_kind"]["matmul"] > 0
    with pytest.raises(CommandFailed, match="need 129 positions; the model's context holds 128"):
        main(["profile", "--model", str(tiny_checkpoint), "--prompt-len", "100", "--new-tokens", "29"])
    with pytest.raises(CommandFailed, match="--kernel-profile names a compiled step's kernels"):  # before any load
        main(["profile", "--model", "/no/such/model", "--no-compile", "--kernel-profile"])
    main(["profile", "--model", str(tiny_checkpoint), "--no-compile", "--prompt-len", "8", "--new-tokens", "4",
          "--repeats", "1", "--rate-only", "--quantize", "int4-g16+lm_head-int8"])
    assert "float32 int4-g16+lm_head-int8 eager] decode" in capsys.readouterr().out  # the model's own settings
    main(["profile", "--model", str(tiny_checkpoint), "--no-compile", "--prompt-len", "8", "--new-tokens", "4",
          "--repeats", "1", "--rate-only", "--quantize", "int8"])
    assert "float32 int8 eager] decode" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["profile", "--quantize", "int4+lm_head-int4"])
    assert "after '+lm_head' only '-int8' or '-int8-a8' may follow" in capsys.readouterr().err


def test_a_decode_rate_needs_a_decode_step_and_is_refused_by_name_as_bench_refuses_it(model, capsys):
    """One new token is the prefill's: no decode step to time, so no rate (it printed "decode 0.0 tok/s")."""
    from llmstep.cli import main
    from llmstep.engines.fast import FastDecoder

    with pytest.raises(ValueError, match="new_tokens must be"):
        decode_rates(FastDecoder(model, max_len=16, compile=False), [1, 2, 3], new_tokens=1, repeats=1)
    for command in (["profile", "--no-compile", "--rate-only"], ["bench"]):
        with pytest.raises(SystemExit):
            main([*command, "--new-tokens", "1"])
        assert "--new-tokens: must be an integer in 2 .. " in capsys.readouterr().err


def test_an_aten_matmul_is_a_matmul_not_elementwise():
    """"mul" is in "matmul": the matmul keys are tried first, and "matmul" is one of them."""
    from llmstep.lab.profile import op_kind

    assert op_kind("aten::matmul") == "matmul" and op_kind("aten::mul") == "norm/rope/elementwise"

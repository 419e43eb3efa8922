"""Run metadata and timing statistics (llmstep.lab.runinfo): the one place the benchmarks take them from."""

from __future__ import annotations

import math
import platform

import pytest
import torch

import llmstep
from llmstep.core.config import LlamaConfig
from llmstep.core.cost import decode_step_cost, model_step_cost
from llmstep.core.model import Llama
from llmstep.lab import bench, runinfo


def test_median_is_a_measured_run_and_spread_is_relative():
    assert runinfo.median([3.0, 1.0, 2.0]) == 2.0
    assert runinfo.median([4.0, 1.0, 2.0, 3.0]) == 3.0  # the upper middle: a run that happened
    assert runinfo.spread([9.0, 10.0, 11.0]) == pytest.approx(0.2)
    assert runinfo.timing([2.0, 2.0]) == {"median": 2.0, "spread": 0.0, "all_runs": [2.0, 2.0]}
    with pytest.raises(ValueError, match="no timings"):
        runinfo.median([])


@pytest.mark.parametrize("values", [[math.nan, 1.0, 2.0], [1.0, math.nan, 2.0], [1.0, math.inf], [1.0, None],
                                    [True, 2.0], ["1.0"]])
def test_a_timing_that_is_not_a_finite_number_is_refused_whatever_its_place(values):
    """A NaN sorts anywhere: the median of [nan, 1, 2] was 1 and of [1, nan, 2] nan."""
    with pytest.raises(ValueError, match="timings must be finite numbers"):
        runinfo.median(values)
    with pytest.raises(ValueError, match="timings must be finite numbers"):
        runinfo.spread(values)


def test_spread_of_no_runs_and_of_a_zero_median_is_told():
    with pytest.raises(ValueError, match="no timings"):
        runinfo.spread([])  # was max() of an empty sequence
    assert runinfo.spread([0.0, 0.0]) == 0.0  # was a ZeroDivisionError: runs all alike spread 0
    assert runinfo.timing([0.0, 0.0, 0.0]) == {"median": 0.0, "spread": 0.0, "all_runs": [0.0, 0.0, 0.0]}
    with pytest.raises(ValueError, match="median is 0"):
        runinfo.spread([0.0, 0.0, 0.5])


def test_versions_and_machine():
    v = runinfo.versions(transformers=None)
    assert v == {"llmstep": llmstep.__version__, "torch": torch.__version__, "python": platform.python_version(),
                 "transformers": None}
    m = runinfo.machine("cpu", torch.bfloat16)
    assert m["device"] == "cpu" and m["dtype"] == "bfloat16" and m["cores"] >= 1 and m["torch_threads"] >= 1
    assert isinstance(m["cpu"], str) and "device_name" not in m
    load = runinfo.load_average()
    assert load is None or load >= 0


def test_cpu_flags_name_the_kind_of_cpu_from_proc_cpuinfo(monkeypatch):
    """The flags that change which kernels run, in CPU_FLAGS' order, from the first processor's `flags` line."""
    text = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu amx_tile sse avx512_bf16 avx2 fma\n\n"
            "processor\t: 1\nflags\t\t: fpu avx512f\n")
    assert runinfo.cpu_flags(text) == ["avx2", "avx512_bf16", "amx_tile"]
    assert runinfo.cpu_flags("processor\t: 0\n") == []  # no flags line: none
    monkeypatch.setattr(runinfo, "cpu_flags", lambda cpuinfo=None: ["avx2"])
    assert runinfo.machine("cpu")["cpu_flags"] == ["avx2"]  # what a record's machine says


def test_cpu_model_names_the_generation_behind_a_vms_cpu_name(monkeypatch):
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
    assert runinfo.cpu_model(text) == "family 25 model 17"  # the first processor's, not the "model name" line
    assert runinfo.cpu_model("processor\t: 0\nmodel name\t: AMD EPYC\n") is None  # no family or model: None
    monkeypatch.setattr(runinfo, "cpu_model", lambda cpuinfo=None: "family 6 model 143")
    assert runinfo.machine("cpu")["cpu_model"] == "family 6 model 143"


def test_command_line_quotes_what_a_shell_would_need():
    assert runinfo.command_line(["bench", "--set", "a b"]) == "llmstep bench --set 'a b'"
    assert runinfo.command_line([]) == "llmstep"


def test_the_bench_counts_bytes_with_llmstep_cost():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=300,
                              max_seq_len=64, rope_theta=500000.0)).eval()
    cost = bench.mean_step_cost(model, prompt_len=8, new_tokens=7)  # steps at contexts 8..13: mean 10.5
    first, last = model_step_cost(model, context=8), model_step_cost(model, context=13)
    assert (cost.kv_bytes, cost.flops) == ((first.kv_bytes + last.kv_bytes) / 2, (first.flops + last.flops) / 2)
    assert cost.weight_bytes == decode_step_cost(model.config, dtype=model.dtype).weight_bytes
    assert cost.kv_bytes == pytest.approx((8 + 13) / 2 * decode_step_cost(model.config, 0, model.dtype).kv_bytes
                                          + decode_step_cost(model.config, 0, model.dtype).kv_bytes)


def test_time_repeats_runs_the_warm_ups_untimed_then_times_each_repeat():
    calls = []
    seconds = runinfo.time_repeats(lambda: calls.append(1), "cpu", repeats=3, warmup=2)
    assert len(calls) == 5 and len(seconds) == 3 and all(s >= 0 for s in seconds)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        runinfo.time_repeats(lambda: None, "cpu", repeats=0)
    with pytest.raises(ValueError, match="warmup must be an integer >= 0"):
        runinfo.time_repeats(lambda: None, "cpu", repeats=1, warmup=-1)


def test_hardware_reports_the_fastest_of_its_repeats(monkeypatch):
    """measure_bandwidth keeps STREAM's convention: the best run, timed by runinfo.time_repeats."""
    from llmstep.lab import hardware

    monkeypatch.setattr(hardware, "time_repeats", lambda fn, device, repeats, warmup=1: [4.0, 1.0, 2.0])
    assert hardware.measure_bandwidth("cpu", nbytes=4096, repeats=3) == pytest.approx(2 * 4096 / 1.0 / 1e9)


def test_header_is_the_one_run_metadata_block():
    h = runinfo.header("cpu", torch.float32, ["bench", "--x"], 0.5)
    assert h["command"] == "llmstep bench --x" and h["machine"]["dtype"] == "float32"
    assert h["versions"]["llmstep"] and h["load_average_1min_before_after"][0] == 0.5


def test_a_scripts_header_names_the_script_not_llmstep():
    """scripts/bench_paged.py's records said `llmstep python scripts/bench_paged.py ...`."""
    h = runinfo.header("cpu", None, ["--out", "a b.json"], None, prog="python scripts/bench_paged.py")
    assert h["command"] == "python scripts/bench_paged.py --out 'a b.json'"
    assert runinfo.header("cpu", None, [], None, prog="python scripts/x.py")["command"] == "python scripts/x.py"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_the_measuring_tools_counts_are_refused_by_the_one_integer_check(bad):
    from llmstep.engines.decoding import check_int

    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        check_int(bad, "n", low=1)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        runinfo.time_repeats(lambda: None, "cpu", bad)

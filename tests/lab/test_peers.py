"""The peer benchmark (llmstep.lab.peers, `llmstep bench --peers`): peers named and checked before any work, each
one that cannot run skipped with its reason in the record, the ones that run decode llmstep's weights to
llmstep's greedy tokens (float32) and are timed interleaved, reported as median and spread."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import llmstep
from llmstep.core.config import LlamaConfig
from llmstep.lab import peers
from llmstep.lab.hardware import random_model


def tiny(dtype: torch.dtype = torch.float32):
    config = LlamaConfig.preset("llama-3.2-1b", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=128,
                                vocab_size=256, max_seq_len=64, bos_token_id=None, eos_token_id=[])
    return random_model(config, "cpu", dtype, 0)


def missing(*modules):
    """importlib.util.find_spec as if `modules` were not installed."""
    real = importlib.util.find_spec
    return lambda name, *a: None if name in modules else real(name, *a)


def test_peers_are_parsed_in_order_and_unknown_repeated_or_no_names_are_refused_by_name():
    assert peers.parse_peers("transformers, llama.cpp") == ["transformers", "llama.cpp"]
    with pytest.raises(peers.PeerError, match="unknown peer vllm: choose from llama.cpp, ctranslate2, transformers"):
        peers.parse_peers("llama.cpp,vllm")
    with pytest.raises(peers.PeerError, match="named twice"):
        peers.parse_peers("llama.cpp,llama.cpp")
    with pytest.raises(peers.PeerError, match="unknown peer ''"):
        peers.parse_peers("")


def test_quantize_modes_are_compared_at_the_models_float_dtype_and_as_int8_int4():
    assert peers.precisions(torch.bfloat16, ["none", "int8", "int4"]) == ["bfloat16", "int8", "int4"]
    assert peers.precisions(torch.float32, ["int4-a8"]) == ["int4-a8"]
    assert peers.precisions(torch.float32, ["none"]) == ["float32"]


def test_each_reason_a_peer_cannot_run_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", missing("llama_cpp"))
    assert peers.why_not("llama.cpp", "float32", tmp_path, None) == "not installed (pip install llama-cpp-python)"
    monkeypatch.undo()
    real = importlib.util.find_spec  # installed or not, llama.cpp without a tokenizer is refused for that reason
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    assert "tokenizer" in peers.why_not("llama.cpp", "float32", tmp_path, None)
    monkeypatch.undo()
    assert peers.why_not("transformers", "int8", None, None).startswith("no weight-only int8/int4")
    assert peers.why_not("transformers", "int4-a8", None, None).startswith("no int8/int4 with 8-bit activations")
    assert peers.why_not("transformers", "float32", None, None) is None
    monkeypatch.setattr(importlib.util, "find_spec", missing("ctranslate2"))
    assert peers.why_not("ctranslate2", "float32", tmp_path, None).startswith("not installed (pip install ")
    monkeypatch.undo()  # installed or not (these are refused before it is imported), CTranslate2 is refused:
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "ctranslate2" else real(name, *a))
    assert "checkpoint directory" in peers.why_not("ctranslate2", "float32", None, None)  # without safetensors
    assert peers.why_not("ctranslate2", "int4", tmp_path, None) == "no int4 weights on a CPU in CTranslate2"


def test_bad_settings_are_refused_before_any_peer_is_built():
    model = tiny()
    with pytest.raises(peers.PeerError, match="unknown peer 'vllm'"):
        peers.run_peers(model, ["vllm"], ["float32"])
    with pytest.raises(peers.PeerError, match="unknown precision 'int3'"):
        peers.run_peers(model, ["transformers"], ["int3"])
    with pytest.raises(peers.PeerError, match="past the model's 64 positions"):
        peers.run_peers(model, ["transformers"], ["float32"], prompt_len=60, new_tokens=8)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_decodes_llmsteps_greedy_tokens_and_a_missing_peer_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", missing("llama_cpp"))
    record = peers.run_peers(tiny(), ["llama.cpp", "transformers"], ["float32", "int8"], prompt_len=8,
                             new_tokens=16, repeats=2, compile=False, bandwidth=False, log=lambda m: None)
    rows = {(r["precision"], r["engine"]): r for r in record["rows"]}
    assert set(rows) == {("float32", "llmstep FastDecoder"), ("float32", "transformers generate()"),
                         ("int8", "llmstep FastDecoder")}
    hf = rows["float32", "transformers generate()"]
    assert hf["same_tokens_as_llmstep"] == 16 and len(hf["tokens"]) == 16
    assert len(hf["decode_tokens_per_s"]["all_runs"]) == 2 and hf["decode_tokens_per_s"]["median"] > 0
    assert hf["llmstep_vs_this"] == pytest.approx(
        rows["float32", "llmstep FastDecoder"]["decode_tokens_per_s"]["median"] / hf["decode_tokens_per_s"]["median"])
    assert hf["copy_bandwidth_share"] is None and hf["copy_bandwidth_share_paired"] is None  # none measured
    assert "copy_bandwidth_beside_runs_gb_s" not in record and "copy_bandwidth_paired" not in record
    skipped = {(s["peer"], s["precision"]): s["why"] for s in record["skipped"]}
    assert skipped == {("llama.cpp", "float32"): "not installed (pip install llama-cpp-python)",
                       ("llama.cpp", "int8"): "not installed (pip install llama-cpp-python)",
                       ("transformers", "int8"): "no weight-only int8/int4 on a CPU without further packages"}
    table = peers.format_peers(record)
    assert "llama.cpp skipped at float32: not installed" in table and "16/16" in table


@pytest.fixture(scope="module")
def shipped():
    return llmstep.load("target", device="cpu", dtype="float32")


def test_llama_cpp_and_ctranslate2_decode_the_shipped_models_greedy_tokens_in_float32(shipped):
    installed = [p for p, module in (("llama.cpp", "llama_cpp"), ("ctranslate2", "ctranslate2"))
                 if importlib.util.find_spec(module) is not None]
    if not installed:
        pytest.skip("neither llama-cpp-python nor ctranslate2 is installed (pip install 'llmstep[peers]')")
    model, tokenizer = shipped
    checkpoint = llmstep.core.checkpoint.resolve_model_path("target")
    record = peers.run_peers(model, installed, ["float32"], tokenizer, checkpoint, prompt_len=16, new_tokens=12,
                             repeats=1, compile=False, bandwidth=False, log=lambda m: None)
    assert record["skipped"] == []
    for row in record["rows"][1:]:
        assert row["same_tokens_as_llmstep"] == 12, row["engine"]
    weights = [row["weights"] for row in record["rows"][1:]]
    assert ("GGUF f32" in weights) == ("llama.cpp" in installed)


def test_llama_cpp_at_int8_runs_llmsteps_own_int8_codes_as_q8_0_and_int4_as_llama_cpps_q4_0(shipped):
    if peers.why_not("llama.cpp", "int8", None, shipped[1]) is not None:
        pytest.skip(f"llama.cpp: {peers.why_not('llama.cpp', 'int8', None, shipped[1])}")
    model = llmstep.load("target", device="cpu", dtype="bfloat16")[0]  # bf16 scales are float16 numbers here
    record = peers.run_peers(model, ["llama.cpp"], ["int8", "int4", "int8-a8", "int4-a8"], shipped[1], prompt_len=8,
                             new_tokens=4, repeats=1, compile=False, bandwidth=False, log=lambda m: None)
    weights = {row["precision"]: row["weights"] for row in record["rows"] if row["engine"].startswith("llama")}
    # int8-a8 and int4-a8 (8-bit activations) meet Q8_0 and Q4_0 again: llama.cpp's own Q8_0 and Q4_0 matmuls round
    # their activations to Q8_0
    assert weights == {"int8": "GGUF q8_0", "int4": "GGUF q4_0 (llama.cpp's quantiser)", "int8-a8": "GGUF q8_0",
                       "int4-a8": "GGUF q4_0 (llama.cpp's quantiser)"}
    ours = {row["precision"]: row for row in record["rows"] if row["engine"].startswith("llmstep")}
    assert ours["int4-a8"]["weights"] == "int4-g64-a8+lm_head-int8-a8" and "a8_matmul" in ours["int4-a8"]
    assert ours["int8-a8"]["weights"] == "int8-a8+lm_head" and "a8_matmul" in ours["int8-a8"]
    assert "a8_matmul" not in ours["int4"] and "a8_matmul" not in ours["int8"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_the_bench_command_with_peers_prints_the_table_and_writes_the_record(tiny_checkpoint, tmp_path, capsys):
    from llmstep import cli

    out = tmp_path / "peers.json"
    record = cli.main(["bench", "--model", str(tiny_checkpoint), "--peers", "transformers", "--no-compile",
                       "--dtype", "float32", "--prompt-len", "4", "--new-tokens", "16", "--repeats", "1",
                       "--no-bandwidth", "--json", str(out)])  # 15 decode steps: measurable beside prefill under load
    assert record["benchmark"] == "peers" and record["compile"] is False
    assert [r["engine"] for r in record["rows"]] == ["llmstep FastDecoder", "transformers generate()"]
    assert record["rows"][1]["same_tokens_as_llmstep"] == 16
    assert "transformers generate()" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][1]["tokens"] == record["rows"][1]["tokens"]


def test_roofline_points_put_each_row_at_its_own_bytes_and_rate():
    row = {"precision": "int8", "engine": "llama.cpp", "bytes_per_step": 2e6, "copy_bandwidth_share": 0.25,
           "decode_tokens_per_s": {"median": 500.0}}
    record = {"rows": [row, row | {"precision": "float32", "bytes_per_step": 8e6, "copy_bandwidth_share": None}]}
    (x8, y8, label8), (x32, y32, label32) = peers.roofline_points(record, flops_per_step=4e6)
    assert (x8, x32) == (2.0, 0.5)  # the same FLOPs over each row's bytes: fewer bytes, further right
    assert y8 == y32 == pytest.approx(500 * 4e6 / 1e12)
    assert label8 == "int8, llama.cpp: 500 tok/s, 25% of copy bw" and label32 == "float32, llama.cpp: 500 tok/s"


class FakeBandwidth:
    """hardware.Bandwidth measuring `values` in turn; `made` counts the probes, `closed` the closed ones."""

    def __init__(self, values):
        self.values, self.made, self.closed = iter(values), 0, 0

    def __call__(self, *args, **kwargs):  # Bandwidth(device, nbytes, kind)
        self.made += 1
        fake = self

        class Probe:
            def __call__(self, repeats=3):
                return next(fake.values)

            def close(self):
                fake.closed += 1

        return Probe()


def test_each_run_is_paired_with_the_copy_bandwidth_measured_just_before_and_just_after_it(monkeypatch):
    """A machine whose bandwidth comes and goes: each timed run's rate against the mean of the measurements on
    either side of it, the median of those; a failed run is followed by a measurement too, so the next run's are
    its neighbours; the plain share stays of the faster of the measurements before and after the work."""
    plain = iter([100.0, 90.0])  # before the work, after it
    monkeypatch.setattr(peers, "measure_bandwidth", lambda *a, **k: next(plain))
    probe = FakeBandwidth([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])  # before the first run; then after each attempt
    monkeypatch.setattr(peers, "Bandwidth", probe)
    attempt, seen = peers._attempt, []

    def int8_dies_in_repeat_2(record, e, ids, n, doing, log):
        seen.append((e.precision, doing))
        if (e.precision, doing) == ("int8", "repeat 2"):
            e.failed = "died"  # as _fail marks a peer that died
            return None
        return attempt(record, e, ids, n, doing, log)

    monkeypatch.setattr(peers, "_attempt", int8_dies_in_repeat_2)
    record = peers.run_peers(tiny(), [], ["float32", "int8"], prompt_len=8, new_tokens=6, repeats=3, compile=False,
                             log=lambda m: None)
    assert next(probe.values, None) is None and (probe.made, probe.closed) == (1, 1)  # r1: 2 runs, r2: 2, r3: 1
    assert next(plain, None) is None and record["copy_bandwidth_gb_s"] == 100.0
    assert record["copy_bandwidth_beside_runs_gb_s"]["all_runs"] == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    (row,) = record["rows"]  # int8's failed: its row is left out
    assert row["precision"] == "float32"
    rates, step = row["decode_tokens_per_s"]["all_runs"], row["bytes_per_step"]
    paired = sorted(r * step / (b * 1e9) for r, b in zip(rates, [15.0, 35.0, 55.0], strict=True))
    assert row["copy_bandwidth_share_paired"] == pytest.approx(paired[1])
    assert row["copy_bandwidth_share"] == pytest.approx(row["decode_tokens_per_s"]["median"] * step / 100e9)
    header, first = peers.format_peers(record).splitlines()[:2]
    column = header.index("paired")  # right-aligned under its 6-character heading
    assert first[column:column + 6].strip() == f"{paired[1]:.0%}"
    assert "copy bandwidth beside the runs, measured 6 times: median 40.0 GB/s, 10.0 to 60.0" in \
        peers.format_peers(record)


def test_without_memory_for_the_bandwidth_once_the_engines_are_loaded_the_run_goes_on_unpaired(monkeypatch):
    """Free memory holds the copy's buffers before the work, not once the engines hold their models: no pairing,
    no measurement after the work, the record says so, and the rows still come."""
    from llmstep.core.cost import MemoryBudgetError
    from llmstep.lab import hardware

    refusal = "nbytes 1,073,741,824 needs 2.1 GB; 1.0 GB free"
    checked = []

    def room_only_before_the_work(nbytes, device, kind="copy", name="nbytes"):
        checked.append(nbytes)
        if len(checked) > 1:
            raise MemoryBudgetError(refusal)

    monkeypatch.setattr(hardware, "check_bandwidth_bytes", room_only_before_the_work)
    record = peers.run_peers(tiny(), [], ["float32"], prompt_len=8, new_tokens=4, repeats=2, compile=False,
                             bandwidth_bytes=2**20, log=lambda m: None)
    assert len(checked) == 3  # before the work; the probe once the engines are warm; after the work
    assert record["copy_bandwidth_paired"] == record["copy_bandwidth_after"] == f"not measured: {refusal}"
    (row,) = record["rows"]
    assert row["copy_bandwidth_share_paired"] is None and row["copy_bandwidth_share"] is not None
    table = peers.format_peers(record)
    assert f"copy bandwidth beside the runs not measured: {refusal}" in table
    assert f"copy bandwidth after the work not measured: {refusal}" in table


def test_an_error_before_the_timed_runs_is_the_one_raised(monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError("disk full while exporting the GGUF")

    monkeypatch.setattr(peers, "plan_inputs", disk_full)
    with pytest.raises(OSError, match="disk full while exporting"):
        peers.run_peers(tiny(), [], ["float32"], prompt_len=8, new_tokens=4, repeats=1, compile=False,
                        log=lambda m: None)


def test_the_table_gives_each_rows_bandwidth_share_source_and_what_failed():
    def row(engine, weights, rate, share, **extra):
        return {"precision": "int4", "engine": engine, "weights": weights, "source": f"{weights} source",
                "decode_tokens_per_s": {"median": rate, "spread": 0.05}, "copy_bandwidth_share": share,
                "tokens": [1, 2, 3]} | extra
    record = {"repeats": 5, "threads": 2, "prompt_len": 128, "new_tokens": 128, "copy_bandwidth_gb_s": 20.0,
              "llama_cpp_extra_buffer_types": "off (asked)", "skipped": [],
              "failed": [{"peer": "llama.cpp", "precision": "int8", "weights": "GGUF q8_0",
                          "why": "killed by signal SIGILL (Illegal instruction) while warming up"}],
              "rows": [row("llmstep FastDecoder", "int4-g32", 70.0, 0.42),
                       row("llama.cpp (llama-cpp-python)", "GGUF q4_1 (the file)", 76.0, 0.37,
                           llmstep_vs_this=70 / 76, same_tokens_as_llmstep=3),
                       row("llama.cpp (llama-cpp-python)", "GGUF q4_0 (llama.cpp's quantiser)", 77.0, 0.35,
                           requantized=True, llmstep_vs_this=70 / 77, same_tokens_as_llmstep=1)]}
    lines = peers.format_peers(record).splitlines()
    assert "42%" in lines[1] and "int4-g32 source" in lines[1]
    assert "37%" in lines[2] and "0.92x" in lines[2] and "3/3" in lines[2] and "lossy" not in lines[2]
    assert "35%" in lines[3] and "GGUF q4_0 (llama.cpp's quantiser)" in lines[3] and "[lossy: requantized]" in lines[3]
    assert "copy bandwidth 20.0 GB/s" in lines[4]
    assert lines[5:] == ["llama.cpp's extra buffer types: off (asked)",
                         "llama.cpp FAILED at int8 (GGUF q8_0): killed by signal SIGILL (Illegal instruction) "
                         "while warming up"]


def test_the_record_names_the_attention_the_compiled_steps_ran_not_the_one_before_they_compiled(monkeypatch):
    from llmstep.core import attention_backend

    monkeypatch.setattr(attention_backend, "_cpu_step", None)  # no CPU step kernel yet, as a fresh process
    monkeypatch.setattr(attention_backend, "_chosen", "auto")
    run = peers._Llmstep.run

    def compiles_then_runs(self, ids, n, doing=""):  # what compile_step does on a CPU: install the kernel
        attention_backend.use_cpu_step_kernel(lambda q, k, v, mask: q)
        return run(self, ids, n, doing)

    monkeypatch.setattr(peers._Llmstep, "run", compiles_then_runs)
    record = peers.run_peers(tiny(), ["transformers"], ["float32"], prompt_len=8, new_tokens=2, repeats=1,
                             compile=False, bandwidth=False, log=lambda m: None)
    assert record["attention"]["decode_step"] == "llmstep_cpu"

"""scripts/gpu_probe.py cannot rot: its dry mode runs every phase on the CPU with tiny shapes and writes the
JSON lines a GPU run writes; the verdict table and the time budget are checked on made-up records; and
issue 12's speedup targets are held below what the bytes each layer streams allow."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from llmstep.core.config import LlamaConfig
from llmstep.core.quantize import QuantConfig

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_writes_one_json_line_per_phase(probe, tmp_path, capsys):
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--dry", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["machine"] + [name for name, _ in probe.PHASES]
    assert all(r["status"] == "ok" and r["dry"] for r in rows), [r for r in rows if r["status"] != "ok"]
    decodes = [r for r in rows if "decode_tokens_per_s" in r]
    assert {r["phase"] for r in decodes} >= {"8b_bf16", "8b_int4", "8b_int8", "1b_bf16", "hf_eager"}
    for r in decodes:
        assert r["decode_tokens_per_s"] > 0
    quantized = {r["phase"]: r for r in rows if "speedup_vs_bf16" in r}
    assert set(quantized) == {"8b_int4", "8b_int8"} and all(r["ceiling"] > 1 for r in quantized.values())
    by_phase = {r["phase"]: r for r in rows}
    assert all(r["fused"] for r in decodes if r["phase"] not in ("hf_static_compile", "hf_eager"))
    one_b = by_phase["1b_bf16"]  # the sampled run (eager here: the eager forward reads its length back per token)
    assert one_b["decode_tokens_per_s_sampled"] > 0 and one_b["syncs_per_token_sampled"] > 0
    assert by_phase["gemv"]["qkv_fused_us"] > 0 and by_phase["gemv"]["qkv_separate_us"] > 0
    printed = capsys.readouterr().out
    assert "8B bf16 tok/s >= 225" in printed and "CUDA graph skips" in printed


def test_phases_skip_themselves_when_time_is_short(probe, tmp_path):
    out = tmp_path / "probe.jsonl"
    probe.main(["--dry", "--out", str(out), "--budget", "-1"])
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert rows and all(r["status"] == "skipped" for r in rows)


def test_the_verdict_table_passes_fails_and_misses(probe):
    records = [
        {"phase": "8b_bf16", "status": "ok", "decode_tokens_per_s": 230.0, "syncs_per_token": 0.01,
         "cudagraph_skips": 0},
        {"phase": "8b_int8", "status": "ok", "speedup_vs_bf16": 1.2, "decode_tokens_per_s": 276.0,
         "syncs_per_token": 0.5, "cudagraph_skips": 1},
        {"phase": "1b_bf16", "status": "error", "error": "boom"},
    ]
    verdict = {target.split(" >=")[0].split(" ==")[0].split(" <=")[0]: v for target, _, v in probe.verdicts(records)}
    assert verdict["8B bf16 tok/s"] == "PASS" and verdict["8B int8 / bf16"] == "FAIL"
    assert verdict["1B bf16 tok/s"] == "MISSING" and verdict["8B int4 / bf16"] == "MISSING"
    assert verdict["CUDA graph skips"] == "FAIL" and verdict["host syncs per token"] == "FAIL"


def test_no_speedup_target_is_above_its_ceiling_from_the_bytes_streamed(probe):
    cfg = LlamaConfig.preset("llama-3.1-8b")
    for name, (phase, metric, least) in probe.TARGETS.items():
        if metric != "speedup_vs_bf16":
            continue
        ceiling = probe.ideal_speedup(cfg, probe.QUANT[phase])
        assert least <= ceiling, f"{name}: target {least}x but the bytes streamed allow at most {ceiling:.2f}x"
        assert least <= 0.9 * ceiling, f"{name}: target {least}x needs over 90% of the {ceiling:.2f}x ceiling"
    # Why the probe quantizes the LM head: in bf16 it caps int8 at 1.87x, leaving 9% of headroom over 1.7x.
    assert 1.86 < probe.ideal_speedup(cfg, QuantConfig("int8")) < 1.88
    assert 1.99 < probe.ideal_speedup(cfg, QuantConfig("int8", lm_head=True)) < 2.01
    assert 3.0 < probe.ideal_speedup(cfg, QuantConfig("int4", 64)) < 3.5 < probe.ideal_speedup(
        cfg, QuantConfig("int4", 64, lm_head=True))


def test_the_compiled_decode_path_asks_no_host_sync_per_token(probe, monkeypatch):
    """The path a compiled step traces (torch.compiler.is_compiling() true) reads no position back to the host:
    a run's host syncs (Tensor.item/tolist/bool/int/float, cuda.synchronize) do not grow with its length."""
    import torch

    from llmstep.engines.fast import FastDecoder
    from llmstep.lab.hardware import random_model

    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64)
    model = random_model(cfg, device="cpu", dtype=torch.float32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    counts = []
    for n in (4, 20):
        decoder = FastDecoder(model, max_len=32, compile=False)
        counter = probe.SyncCounter()
        with counter.counting():
            decoder.generate([1, 2, 3], n)
        counts.append(counter.count)
    assert counts[0] == counts[1] <= 3, counts  # the prompt's and the final copy of the tokens

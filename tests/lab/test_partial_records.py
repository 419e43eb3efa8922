"""A long benchmark hands out its record after every repeat, so the command can write it as the run goes and an
interrupt keeps the repeats that finished."""

from __future__ import annotations

import pytest
import torch

from llmstep.core.config import LlamaConfig
from llmstep.lab import bench as decode_bench
from llmstep.lab.hardware import random_model


@pytest.fixture(scope="module")
def small():
    config = LlamaConfig.preset("llama-3.2-1b", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, hidden_dim=64,
                                vocab_size=128, max_seq_len=32, bos_token_id=None, eos_token_id=[])
    return random_model(config, "cpu", torch.float32, 0)


def test_run_bench_hands_out_the_record_after_each_repeat_but_the_last(small):
    partial = []
    record = decode_bench.run_bench(small, ["none"], prompt_len=4, new_tokens=4, compile=False, repeats=3,
                                    hf=False, bandwidth=False, log=lambda _: None, on_repeat=partial.append)
    assert [p["repeats_done"] for p in partial] == [1, 2]
    assert [len(p["rows"][0]["decode_tokens_per_s_all"]) for p in partial] == [1, 2]
    assert "repeats_done" not in record and len(record["rows"][0]["decode_tokens_per_s_all"]) == 3
    assert partial[0]["rows"][0]["tokens"] == record["rows"][0]["tokens"]


def test_run_bench_refuses_zero_repeats_before_any_work(small):
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        decode_bench.run_bench(small, ["none"], 4, 4, compile=False, repeats=0, hf=False, bandwidth=False)


@pytest.mark.parametrize("variants, kw, words", [
    (["int4"], {"group_size": 7}, "int4 group_size must be an even integer"),
    (["int4"], {"group_size": 48}, "group_size 48 does not divide"),
    (["int3"], {}, "unknown quantization mode 'int3'"),
    (["int8"], {"lm_head": "int4"}, "lm_head must be True, False, 'int8' or 'int8-a8'"),
])
def test_run_bench_refuses_a_variant_before_measuring_the_bandwidth(small, monkeypatch, variants, kw, words):
    """The bandwidth copy takes gigabytes and seconds: a variant the model cannot take is refused before it."""
    monkeypatch.setattr(decode_bench, "measure_bandwidth", lambda *a, **k: pytest.fail("measured the bandwidth"))
    with pytest.raises(ValueError, match=words):
        decode_bench.run_bench(small, variants, 4, 4, compile=False, repeats=1, hf=False, **kw)


def test_the_speculative_benchmarks_refuse_settings_that_give_no_rate(small):
    from llmstep.lab.bench_speculative import bench

    for kw, name in ((dict(max_new_tokens=2), "max_new_tokens must be an integer >= 3"),  # no round proposes
                     (dict(repeats=0), "repeats"), (dict(ks=[0]), "k"),
                     (dict(ks=[2, 1, 2]), "k = 2 is given twice")):
        with pytest.raises(ValueError, match=name):
            bench(small, small, None, **kw)


def test_run_bench_names_its_own_arguments_not_the_commands_flags(small):
    for kw, message in ((dict(prompt_len=0), "prompt_len must be an integer >= 1"),
                        (dict(new_tokens=1), "new_tokens must be an integer >= 2")):
        args = dict(prompt_len=4, new_tokens=4) | kw
        with pytest.raises(ValueError, match=message) as e:
            decode_bench.run_bench(small, ["none"], compile=False, hf=False, bandwidth=False, **args)
        assert "--" not in str(e.value)


def test_every_benchmark_record_starts_with_the_one_header(small):
    record = decode_bench.run_bench(small, ["none"], prompt_len=4, new_tokens=4, compile=False, repeats=1, hf=False,
                                    bandwidth=False, log=lambda _: None, argv=["bench", "--x"])
    assert record["command"] == "llmstep bench --x" and record["machine"]["dtype"] == "float32"
    assert {"device", "dtype", "threads"}.isdisjoint(record["settings"])  # said once, in record["machine"]
    assert len(record["load_average_1min_before_after"]) == 2 and record["versions"]["llmstep"]
    assert "float32" in decode_bench.format_table(record)

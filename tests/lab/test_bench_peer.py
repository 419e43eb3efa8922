"""bench's transformers peer: built in the model's own dtype on the model's own weights (no float32 twin of a
bf16 model), checked against free memory first, run eagerly and (asked, or by default on CUDA) with a static
cache and its forward compiled, and the record says which of the two ran and why the other did not."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmstep.core.checkpoint import hf_names
from llmstep.core.config import LlamaConfig
from llmstep.core.cost import kv_cache_bytes, model_bytes
from llmstep.lab import bench as decode_bench
from llmstep.lab.hardware import random_model

pytest.importorskip("transformers")

slow = pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"),
                          reason="torch.compile of transformers on the CPU takes ~a minute; set LLMSTEP_SLOW_TESTS=1")


def tiny(dtype: torch.dtype, tie: bool = False):
    config = LlamaConfig.preset("llama-3.2-1b", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=128,
                                vocab_size=256, max_seq_len=64, bos_token_id=None, eos_token_id=[],
                                tie_embeddings=tie)
    return random_model(config, "cpu", dtype, 0)


class Allocations(TorchDispatchMode):
    """Every real (not meta) tensor an operation returns while the mode is on: (op, dtype, elements)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(str(func), t.dtype, t.numel()) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor) and not t.is_meta]
        return out


@pytest.mark.parametrize("tie", [False, True])
def test_the_twin_of_a_bf16_model_is_bf16_on_the_same_weights_and_no_float32_copy_is_built(tie):
    model = tiny(torch.bfloat16, tie)
    with Allocations() as seen:
        hf = decode_bench.hf_twin(model)
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    smallest_weight = model.config.dim  # a norm's weight: every matrix is larger
    big_float32 = [s for s in seen.seen if s[1] == torch.float32 and s[2] >= smallest_weight]
    assert not big_float32, f"a float32 twin was built: {big_float32[:3]}"
    ours = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(hf.named_parameters(remove_duplicate=False))
    for hf_name, (name, _) in hf_names(model.config).items():  # shared, not copied
        assert theirs[hf_name].data_ptr() == ours[name].data_ptr(), hf_name
    assert not any(p.requires_grad for p in hf.parameters())
    assert all(not t.is_meta for t in (*hf.parameters(), *hf.buffers()))


def test_the_twin_gives_the_logits_of_the_model_it_shares_weights_with():
    model = tiny(torch.float32)
    hf = decode_bench.hf_twin(model)
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def test_another_dtype_is_one_copy_built_in_that_dtype():
    model = tiny(torch.bfloat16)
    hf = decode_bench.hf_twin(model, torch.float32)
    assert {p.dtype for p in hf.parameters()} == {torch.float32}
    assert torch.equal(hf.model.embed_tokens.weight, model.tok_embeddings.weight.float())  # the same numbers


def test_peer_bytes_count_a_weight_copy_only_in_another_dtype_and_a_cache_per_peer():
    model = tiny(torch.bfloat16)
    cache = kv_cache_bytes(model.config, 1, 40, torch.bfloat16)
    assert decode_bench.peer_bytes(model, torch.bfloat16, 40, compiled=False) == cache
    assert decode_bench.peer_bytes(model, torch.bfloat16, 40, compiled=True) == 2 * cache
    assert decode_bench.peer_bytes(model, torch.float32, 40, compiled=False) == (
        model_bytes(model.config, torch.float32) + kv_cache_bytes(model.config, 1, 40, torch.float32))


def run(model, **kw):
    # 16 tokens: transformers' 15 decode steps measurable beside its prefill on a loaded machine (time_hf)
    return decode_bench.run_bench(model, ["none"], prompt_len=6, new_tokens=16, compile=False, repeats=1,
                                  bandwidth=False, log=lambda _: None, **kw)


def test_on_a_cpu_transformers_runs_eagerly_and_the_record_says_why_the_compiled_peer_did_not():
    record = run(tiny(torch.float32))
    assert [r["name"] for r in record["rows"]] == ["llmstep eager float", "transformers generate()"]
    peers = record["transformers_peers"]
    assert peers["eager"]["ran"] and not peers["static_compiled"]["ran"]
    assert "off by default on cpu" in peers["static_compiled"]["why"]
    assert record["rows"][1]["kv_cache"] == "dynamic" and not record["rows"][1]["compiled"]
    assert "static compiled skipped: off by default on cpu" in decode_bench.format_table(record)
    assert run(tiny(torch.float32), hf_compile=False)["transformers_peers"]["static_compiled"]["why"] == \
        "hf_compile=False"


def test_a_peer_that_does_not_fit_in_free_memory_is_skipped_and_said_so(monkeypatch):
    monkeypatch.setattr(decode_bench, "peer_bytes", lambda *a: 10**18)  # an exabyte: no machine has it free
    record = run(tiny(torch.float32), hf_compile=True)
    assert [r["name"] for r in record["rows"]] == ["llmstep eager float"]  # the benchmark itself still runs
    for peer in record["transformers_peers"].values():
        assert not peer["ran"] and "transformers' peer needs about" in peer["why"]


def test_peer_settings_without_transformers_are_refused_by_name():
    model = tiny(torch.float32)
    for kw, name in ((dict(hf_compile=True), "hf_compile"), (dict(hf_dtype=torch.float32), "hf_dtype")):
        with pytest.raises(ValueError, match=f"{name}=.* but hf=False skips transformers"):
            run(model, hf=False, **kw)
    assert run(model, hf=False, hf_compile=False)["transformers_peers"]["eager"]["why"] == "hf=False"


@slow
def test_the_compiled_static_cache_peer_gives_the_eager_peers_greedy_tokens():
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    record = run(tiny(torch.float32), hf_compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # transformers' step did compile
    names = [r["name"] for r in record["rows"]]
    assert names == ["llmstep eager float", "transformers generate()", "transformers static cache + compile"]
    ours, eager, compiled = record["rows"]
    assert compiled["compiled"] and compiled["kv_cache"] == "static" and compiled["compile_mode"] == "default"
    assert compiled["tokens"] == eager["tokens"] == ours["tokens"]
    assert compiled["same_tokens_as_transformers_eager"] and compiled["compile_seconds"] > 0
    assert all(p["ran"] for p in record["transformers_peers"].values())
    assert ours["decode_speedup_vs_transformers_compiled"] > 0
    assert "vs HF compiled" in decode_bench.format_table(record)


def test_the_static_cache_peer_is_its_own_row_with_the_eager_peers_tokens(monkeypatch):
    # The compile itself is the slow test above; here the static-cache path runs on the eager forward.
    kw = decode_bench.static_compiled_generate_kw
    monkeypatch.setattr(decode_bench, "static_compiled_generate_kw", lambda *a: kw(*a) | {"disable_compile": True})
    record = run(tiny(torch.float32), hf_compile=True)
    ours, eager, static = record["rows"]
    assert static["name"] == "transformers static cache + compile" and static["kv_cache"] == "static"
    assert static["tokens"] == eager["tokens"] == ours["tokens"] and static["same_tokens_as_transformers_eager"]
    assert ours["decode_speedup_vs_transformers_compiled"] == ours["decode_tokens_per_s"] / static[
        "decode_tokens_per_s"]


def test_a_compiled_peer_that_fails_is_recorded_and_the_rest_is_timed(monkeypatch):
    kw = decode_bench.static_compiled_generate_kw
    monkeypatch.setattr(decode_bench, "static_compiled_generate_kw", lambda *a: kw(*a) | {"no_such_argument": 1})
    record = run(tiny(torch.float32), hf_compile=True)
    assert [r["name"] for r in record["rows"]] == ["llmstep eager float", "transformers generate()"]
    failed = record["transformers_peers"]["static_compiled"]
    assert not failed["ran"] and failed["why"].startswith("failed: ValueError") and "no_such_argument" in failed["why"]


def test_time_hf_times_again_when_noise_hides_the_decode_and_refuses_a_negative_rate(monkeypatch):
    """The decode time is a difference of two runs: a pair where the 1-token run came out slower is timed again,
    and never turned into a negative rate."""
    clock = iter([2.0, 1.0, 1.0, 3.0])  # first pair: 1 token slower than all (noise); second pair: fine
    monkeypatch.setattr(decode_bench.runinfo, "time_repeats", lambda fn, device, n, warmup=0: (fn(), [next(clock)])[1])

    class HF:
        def generate(self, prompt, max_new_tokens, **kw):
            return torch.zeros(1, prompt.shape[1] + max_new_tokens, dtype=torch.long)

    assert decode_bench.time_hf(HF(), torch.zeros(1, 4, dtype=torch.long), 6)[:2] == (1.0, 3.0)
    clock = iter([2.0, 1.0] * 3)
    with pytest.raises(RuntimeError, match="no measurable time beyond its prefill in 3 tries"):
        decode_bench.time_hf(HF(), torch.zeros(1, 4, dtype=torch.long), 6)

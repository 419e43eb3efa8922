"""Presets carry the published shapes; the cost model reproduces the article's arithmetic."""

import pytest
import torch

from llmstep import LlamaConfig
from llmstep.core.cost import decode_step_cost, kv_bytes_per_token, n_params, param_counts

# Parameter counts of the published checkpoints (sum of tensor sizes in their safetensors).
PUBLISHED = {"llama-3-8b": 8_030_261_248, "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
             "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-405b": 405_853_388_800}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    assert n_params(LlamaConfig.preset(name)) == PUBLISHED[name]


def test_llama3_8b_decode_arithmetic():
    cfg = LlamaConfig.preset("llama-3-8b")
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 128 * 1024  # the 128 KiB
    mha = cfg.replace(n_kv_heads=cfg.n_heads)
    assert kv_bytes_per_token(mha, torch.bfloat16) == 4 * 128 * 1024
    cost = decode_step_cost(cfg, context=0, dtype=torch.bfloat16)
    counts = param_counts(cfg)
    # every weight but the input embedding table is streamed: 16.06 GB - 1.05 GB
    assert cost.weight_bytes == 2 * (n_params(cfg) - counts["embedding"] + cfg.dim)
    assert round(cost.weight_bytes / 1e9, 2) == 15.01
    assert 0.99 < cost.arithmetic_intensity < 1.01  # ~2 FLOPs per 2-byte weight


def test_tied_head_streams_the_embedding_once():
    cfg = LlamaConfig.preset("llama-3.2-1b")
    cost = decode_step_cost(cfg, dtype=torch.float32)
    assert cost.weight_bytes == 4 * n_params(cfg)


def test_kv_bytes_grow_with_context():
    cfg = LlamaConfig.preset("llama-3.1-8b")
    a, b = decode_step_cost(cfg, context=0), decode_step_cost(cfg, context=8191)
    assert b.kv_bytes == 8192 * a.kv_bytes and b.weight_bytes == a.weight_bytes


def test_hf_round_trip_of_every_preset():
    for name in ("llama-3.1-8b", "llama-3.2-1b"):
        cfg = LlamaConfig.preset(name)
        assert LlamaConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("spec", [None, ("int8", False), ("int4", False), ("int8", True), ("int4", True),
                                  ("int4", "int8")])
def test_checkpoint_bytes_is_the_sum_over_the_checkpoints_tensors(spec, tied):
    """cost.checkpoint_bytes (the loader's memory estimate) = every tensor of the checkpoint's table, floats in
    the dtype, int8/uint8 codes one byte each: one estimate, in cost.py."""
    import math

    from llmstep.core.checkpoint import tensor_table
    from llmstep.core.cost import checkpoint_bytes, dtype_bytes
    from llmstep.core.quantize import QuantConfig

    cfg = LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
                      tie_embeddings=tied)
    qc = None if spec is None else QuantConfig(spec[0], 32 if spec[0] == "int4" else None, spec[1])
    want = sum(math.prod(shape) * (dtype_bytes(torch.bfloat16) if kind == "float" else 1)
               for _, shape, kind in tensor_table(cfg, qc).values())
    assert checkpoint_bytes(cfg, torch.bfloat16, qc) == want


@pytest.mark.parametrize("dtype", ["int8", "auto", "float8_e4m3fn"])
def test_a_torch_dtype_llmstep_does_not_load_in_is_refused_by_name(dtype):
    hf = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "intermediate_size": 96, "torch_dtype": dtype}
    with pytest.raises(ValueError, match=f"^m/config.json: torch_dtype must be one of bfloat16, float16, float32, "
                                         f"float64 .*got '{dtype}'"):
        LlamaConfig.from_hf(hf, "m/config.json")
    assert LlamaConfig.from_hf(hf | {"torch_dtype": "float16"}).torch_dtype == "float16"


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("spec", [None, "int8", "int4-g32", "int4-g64", "int8+lm_head", "int4-g32+lm_head",
                                  "int4-g32+lm_head-int8", "int8-a8", "int4-g32-a8+lm_head-int8-a8"])
def test_a_quantized_steps_bytes_from_the_config_are_the_models_own(spec, tied):
    """decode_step_cost(config, qc=...) (what `llmstep info` reports for a quantized checkpoint) = weight_bytes of
    the model quantized so: codes, scales and zeros, the norms, one embedding row or the table a tied float head
    streams."""
    from llmstep.core.cost import weight_bytes
    from llmstep.core.model import Llama
    from llmstep.core.quantize import quantize

    cfg = LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
                      tie_embeddings=tied)
    torch.manual_seed(0)
    model = Llama(cfg).to(torch.bfloat16)
    if spec is not None:
        quantize(model, spec)
    qc = getattr(model, "quantization", None)
    assert (qc is None) == (spec is None)
    assert decode_step_cost(cfg, dtype=torch.bfloat16, qc=qc).weight_bytes == weight_bytes(model)
    with pytest.raises(ValueError, match="not both"):
        decode_step_cost(cfg, qc=qc or "x", weight_bytes_per_param=1)


def test_a_dtype_is_named_as_load_names_it_and_nothing_else_is_taken():
    """dtype_bytes resolves names through core.device (bf16, fp16, half, as load takes them); an integer or bool
    type's name, "auto" and non-names are refused with the choices (getattr(torch, name) took "int8")."""
    from llmstep.core.cost import dtype_bytes, model_bytes

    assert [dtype_bytes(n) for n in ("bf16", "fp16", "half", "fp32", "float64")] == [2, 2, 2, 4, 8]
    assert dtype_bytes(torch.float16) == 2
    cfg = LlamaConfig.preset("llama-3.2-1b")
    assert model_bytes(cfg, "bf16") == model_bytes(cfg, torch.bfloat16)
    assert decode_step_cost(cfg, dtype="fp16") == decode_step_cost(cfg, dtype=torch.float16)
    for bad in ("int8", "bool", "auto", "bfloat", None, 2):
        with pytest.raises(ValueError, match=r"dtype must be a torch dtype or one of bf16, bfloat16, .*half"):
            dtype_bytes(bad)


@pytest.mark.parametrize("context", [-5, 2.5, True, "8"])
def test_a_decode_step_refuses_a_context_that_is_not_a_whole_number_of_tokens(context):
    with pytest.raises(ValueError, match=f"context must be an integer >= 0, got {context!r}"):
        decode_step_cost(LlamaConfig.preset("llama-3.2-1b"), context)


def test_the_cpus_free_memory_counts_what_ulimit_v_leaves():
    """A process under `ulimit -v` was told the machine's free RAM, then died in the allocator, not refused."""
    import subprocess
    import sys

    code = """if True:
        import resource
        from pathlib import Path
        from llmstep.core import cost
        mapped = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**29, resource.RLIM_INFINITY))  # 512 MiB more to map
        print(cost.free_memory_bytes("cpu"))"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 0 <= int(out.stdout) <= 2**29

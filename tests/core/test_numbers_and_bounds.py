"""Numbers that cannot be right are refused at load, naming the tensor or the field; sizes are bounded, and an
allocation the device cannot hold is refused with its estimate, before anything is built."""

import json
import math
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import llmstep
from llmstep import CheckpointError, ConfigError, LlamaConfig
from llmstep.core import cost
from llmstep.core.kv_cache import KVCache
from llmstep.core.quantize import quantize


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    return dst


def rewrite_tensor(ckpt, name, change):
    file = ckpt / "model.safetensors"
    tensors = load_file(file)
    with open(file, "rb") as f:  # keep the header's metadata (a quantised file records its settings there)
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    change(tensors[name])
    save_file(tensors, file, metadata=header.get("__metadata__"))


def rewrite_config(ckpt, change: dict, file="config.json"):
    cfg = json.loads((ckpt / file).read_text())
    (ckpt / file).write_text(json.dumps(cfg | change))


# ---- non-finite numbers ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"])
def test_a_non_finite_weight_is_refused_with_its_name(ckpt, name, value):
    rewrite_tensor(ckpt, name, lambda t: t.view(-1).__setitem__(3, value))
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor {name} holds NaN or Inf"):
        llmstep.load(ckpt)


def test_a_weight_too_large_for_float16_is_refused_in_float16(ckpt):
    rewrite_tensor(ckpt, "model.norm.weight", lambda t: t.view(-1).__setitem__(0, 1e6))
    llmstep.load(ckpt, dtype="float32")  # a finite float32 number: loads
    with pytest.raises(CheckpointError, match="model.norm.weight holds NaN or Inf values in float16"):
        llmstep.load(ckpt, dtype="float16")


@pytest.mark.parametrize("mode, tensor", [("int8", "scales"), ("int4", "scales"), ("int4", "zeros")])
def test_a_non_finite_quantized_scale_or_zero_is_refused_with_its_name(tiny_checkpoint, tmp_path, mode, tensor):
    model, tok = llmstep.load(tiny_checkpoint)
    out = llmstep.save(quantize(model, mode, group_size=16 if mode == "int4" else None), tmp_path / "q",
                       tokenizer=tok)
    name = f"model.layers.0.self_attn.q_proj.{tensor}"
    rewrite_tensor(out, name, lambda t: t.view(-1).__setitem__(0, math.nan))
    with pytest.raises(CheckpointError, match=rf"tensor {name} holds NaN or Inf"):
        llmstep.load(out)


@pytest.mark.parametrize("change, message", [
    ({"rope_theta": 1e-300, "rope_parameters": None}, "rope_theta must be greater than 1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e-300}}, "rope_theta must be greater than 1"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps must be a finite number"),
    ({"rms_norm_eps": 5.0}, "norm_eps must be between 0 and 1"),
    ({"rope_theta": math.inf, "rope_parameters": None}, "rope_theta must be a finite number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": math.inf, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}, "factor must be a finite number"),
])
def test_config_numbers_must_be_finite_and_in_range(ckpt, change, message):
    rewrite_config(ckpt, change)  # json writes NaN/Infinity, and Python's json (like transformers') reads them
    with pytest.raises(ConfigError, match=rf"config\.json: .*{message}"):
        llmstep.load(ckpt)


def test_direct_configs_with_non_finite_numbers_are_refused():
    with pytest.raises(ConfigError, match="norm_eps must be a finite number"):
        LlamaConfig(norm_eps=math.nan)
    with pytest.raises(ConfigError, match="rope_theta must be greater than 1"):
        LlamaConfig(rope_theta=1e-300)


# ---- names and files ---------------------------------------------------------------------------------

def test_only_the_real_rotary_buffer_names_may_be_skipped(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    inv_freq = torch.ones(4)
    save_file(tensors | {"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq,
                         "model.rotary_emb.inv_freq": inv_freq.clone()}, ckpt / "model.safetensors")
    llmstep.load(ckpt)  # old checkpoints carry these: recomputed from the config
    save_file(tensors | {"garbagerotary_emb.inv_freq": inv_freq}, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor garbagerotary_emb.inv_freq"):
        llmstep.load(ckpt)


def test_a_config_json_that_is_not_utf8_is_named(ckpt):
    (ckpt / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match=r"config\.json is not UTF-8 text"):
        llmstep.load(ckpt)


@pytest.mark.parametrize("change, message", [
    ({"temperature": "hot"}, "temperature must be a number >= 0, got 'hot'"),
    ({"temperature": -1}, "temperature must be a number >= 0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"do_sample": "yes"}, "do_sample must be true or false"),
    ({"max_length": True}, "max_length must be a positive integer"),
])
def test_a_generation_config_field_of_the_wrong_kind_is_refused_at_load(ckpt, change, message):
    rewrite_config(ckpt, change, "generation_config.json")
    with pytest.raises(CheckpointError, match=rf"generation_config\.json: {message}"):
        llmstep.load(ckpt)
    with pytest.raises(CheckpointError, match=rf"generation_config\.json: {message}"):
        llmstep.load_model(ckpt)


@pytest.mark.parametrize("text, message", [("not json", "is not valid JSON"),
                                           (None, "quantization_config must be an object, got")])
def test_a_quantized_checkpoint_with_a_broken_config_is_one_library_error(tiny_checkpoint, tmp_path, text, message):
    model, tok = llmstep.load(tiny_checkpoint)
    out = llmstep.save(quantize(model, "int8"), tmp_path / "q", tokenizer=tok)
    if text is None:
        rewrite_config(out, {"quantization_config": [{"quant_method": "llmstep"}]})
    else:
        (out / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"config\.json:? {message}"):
        llmstep.load(out)
    with pytest.raises(ValueError, match=rf"config\.json:? {message}"):
        llmstep.load_model(out)


# ---- sizes bounded before anything is built ----------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 1_000_000}, "n_layers is 1,000,000, above llmstep's bound"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings is 1,000,000,000,000, above"),
    ({"vocab_size": 10**9}, "vocab_size is 1,000,000,000, above"),
    ({"intermediate_size": 10**9}, "intermediate_size is 1,000,000,000, above"),
])
def test_absurd_sizes_are_refused_at_once(ckpt, change, message):
    rewrite_config(ckpt, change)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        llmstep.load(ckpt)
    assert time.perf_counter() - start < 10  # was 27 s and 4 GB for a million layers (bound loose: a loaded machine)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_any_weight_is_read(ckpt, monkeypatch):
    import llmstep.core.loader as loader

    cfg = json.loads((ckpt / "config.json").read_text())
    rewrite_config(ckpt, {"vocab_size": 200, "bos_token_id": None, "eos_token_id": None})
    (ckpt / "generation_config.json").unlink()
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(CheckpointError, match="tokenizer.json has 300 tokens, but the model's vocabulary is 200"):
        llmstep.load(ckpt)
    assert cfg["vocab_size"] == 300


def _free(monkeypatch, nbytes):
    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: nbytes)


def test_check_fits_refuses_with_the_estimate(monkeypatch):
    _free(monkeypatch, 24e9)
    cost.check_fits(23e9, "cpu", "something")
    with pytest.raises(cost.MemoryBudgetError, match="something needs about 25.00 GB, but cpu has 24.00 GB free"):
        cost.check_fits(25e9, "cpu", "something")
    _free(monkeypatch, None)
    cost.check_fits(1e30, "cpu", "anything")  # unknown free memory: allowed


def test_free_memory_is_known_on_this_machine():
    free = cost.free_memory_bytes("cpu")
    assert free is None or free > 0
    assert cost.free_memory_bytes("meta") is None


def test_a_kv_cache_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    config = LlamaConfig.preset("llama-3.1-8b")
    _free(monkeypatch, 24e9)
    with pytest.raises(cost.MemoryBudgetError, match=r"KV cache of 8 x 131,072 positions .* needs about 137.44 GB"):
        KVCache(config, 8, 131072, device="cpu", dtype=torch.bfloat16)
    assert cost.kv_cache_bytes(config, 8, 131072, torch.bfloat16) == 8 * 131072 * 131072
    with pytest.raises(ValueError, match="positive integer max_len"):
        KVCache(config, 1, 10.5)


def test_a_random_405b_is_refused_on_a_24gb_machine_with_a_message(monkeypatch):
    from llmstep.lab.hardware import random_model

    _free(monkeypatch, 24e9)
    with pytest.raises(cost.MemoryBudgetError, match=r"random model of 405.85B parameters in bfloat16 needs about "
                                                       r"811.71 GB, but cpu has 24.00 GB free"):
        random_model(LlamaConfig.preset("llama-3.1-405b"), device="cpu", dtype="bfloat16")


def test_a_checkpoint_that_cannot_fit_is_refused_before_any_weight_is_read(ckpt, monkeypatch):
    import llmstep.core.loader as loader

    _free(monkeypatch, 1000)
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(cost.MemoryBudgetError, match=r"ckpt in float32 needs about 0.00 GB, but cpu has 0.00 GB"):
        llmstep.load(ckpt, device="cpu", dtype="float32")


def test_a_llama_too_large_for_the_device_is_refused_before_its_weights_are_made(monkeypatch):
    from llmstep.core.model import Llama

    _free(monkeypatch, 24e9)
    with pytest.raises(cost.MemoryBudgetError, match=r"a Llama of 4096x32 in float32 needs about 32.12 GB"):
        Llama(LlamaConfig.preset("llama-3-8b"))
    with torch.device("meta"):
        Llama(LlamaConfig.preset("llama-3.1-405b"))  # shapes only: nothing to refuse

"""A frozen CPU step is named in torch.compile's cache by its weights' values (compile.weights_digest): inductor's FX
graph cache keys a frozen graph by its weights' shapes alone and keeps the weights its GEMM template packed by value,
so without the digest a second model of the same shapes ran the first one's weights."""

from __future__ import annotations

import copy

import pytest
import torch

import llmstep
from llmstep.engines import engine
from llmstep.engines.compile import compile_step, weights_digest
from llmstep.engines.fast import FastDecoder

CPU = torch.device("cpu")


def linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16).eval()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within bf16's rounding of the outputs (the stale weights of another model are off by their whole size)."""
    return bool((got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max())


@pytest.mark.parametrize("named", [True, False])
def test_two_linears_of_the_same_shape_each_compute_with_their_own_weights(tmp_path, monkeypatch, named):
    """Named by their models (the digest in the key), or given none (then never cached across compiles)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # one cache, as two processes of a user share
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        for seed in (0, 1):  # the second finds the first's graph in the cache without the digest in its key
            layer = linear(seed)
            # the C++ template alone, which packs the weight, as the tuner picks it for a decode step's matmuls
            step = compile_step(layer.forward, CPU, gemm_backends="CPP", models=[layer] if named else ())
            assert close(step(x), torch.nn.functional.linear(x, layer.weight)), seed


def test_a_frozen_steps_cache_key_names_the_vector_isa_inductor_writes_for(tmp_path, monkeypatch):
    """Inductor's FX graph cache names no CPU ISA (its system key is empty on a CPU): without it in the key, a cache
    shared by an AMX Xeon and a Zen 4 (a Docker image's) would serve the Xeon's AMX code to the Zen 4, wherever this
    torch caches a frozen graph. The key's tag while the step runs names the weights and the ISA."""
    from llmstep.core import torch_compat
    from llmstep.engines import compile as compile_module

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # not the user's cache
    tags, hold = [], torch_compat.holding_freezing

    def recording(compiled):  # the frozen step, its cache key's tag read as it is called
        return lambda *a: tags.append(torch.compiler.config.cache_key_tag) or hold(compiled)(*a)

    monkeypatch.setattr(torch_compat, "holding_freezing", recording)
    layer, x = linear(0), torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        for isa in ("amx", "avx2"):
            monkeypatch.setattr(compile_module, "_vector_isa", lambda isa=isa: isa)
            step = compile_step(layer.forward, CPU, gemm_backends=None, models=[layer])
            assert close(step(x), torch.nn.functional.linear(x, layer.weight))
        monkeypatch.setattr(compile_module, "_vector_isa", lambda: "")  # not read (a torch past the tested range)
        compile_step(layer.forward, CPU, gemm_backends=None, models=[layer])(x)
        compile_step(layer.forward, CPU, gemm_backends=None, models=[layer])(x)
    assert [t.rpartition("+")[2] for t in tags[:2]] == [f"{weights_digest(layer)}-isa-amx",
                                                        f"{weights_digest(layer)}-isa-avx2"]
    unread = [t.rpartition("-isa-")[2] for t in tags[2:]]
    assert all(u.startswith("unread-") for u in unread) and unread[0] != unread[1]  # never another step's
    assert torch.compiler.config.cache_key_tag == "" or "isa-" not in torch.compiler.config.cache_key_tag


@pytest.mark.tuned_matmuls  # as the engines compile by default: the GEMM template packs the weights
def test_a_second_model_of_the_same_shapes_decodes_with_its_own_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engine, "gemm_backends", lambda *models: "CPP")  # the template alone: it packs the weights
    config = llmstep.LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256,
                                 max_seq_len=128)
    token, position = torch.tensor([[7]]), torch.tensor([[0]])
    for seed in (3, 4):  # bf16: the GEMM template packs its weights (float32 ones are not cached so)
        torch.manual_seed(seed)
        model = llmstep.Llama(config).to(torch.bfloat16).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
            want = FastDecoder(model, compile=False, max_len=16).step(token, position)  # [1, 512] float32
            got = FastDecoder(model, compile=True, max_len=16).step(token, position)
        error = (got - want).abs().max().item()
        assert error < 0.05 * want.abs().max().item(), (seed, error)  # bf16 rounding; stale weights: ~1.4x


def test_the_digest_names_values_dtypes_and_shapes_and_counts_a_tied_weight_once():
    a, b = linear(0), linear(0)
    assert weights_digest(a) == weights_digest(b)
    with torch.no_grad():
        b.weight[3, 5] += 1  # one weight of 6,144
    assert weights_digest(a) != weights_digest(b)
    assert weights_digest(a) != weights_digest(copy.deepcopy(a).float())  # the same numbers in another dtype
    reshaped = torch.nn.Linear(96, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        reshaped.weight.copy_(a.weight.reshape(64, 96))  # the same bytes in another shape
    assert weights_digest(a) != weights_digest(reshaped)
    tied = torch.nn.Module()
    tied.embed, tied.head = a, torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    tied.head.weight = a.weight
    assert weights_digest(tied) == weights_digest(a)  # named once, as the model holds it once
    assert weights_digest(a, a) == weights_digest(a)


def test_the_digest_follows_in_place_changes_and_unreadable_weights_get_names_of_their_own():
    a = linear(0)
    first = weights_digest(a)
    assert weights_digest(a) == first  # the same tensors, unchanged
    with torch.no_grad():
        a.weight.mul_(2)  # in place: the same tensor at the same address, a new version
    assert weights_digest(a) != first
    with torch.no_grad():
        a.weight.div_(2)
    assert weights_digest(a) == first  # the same values again
    meta = torch.nn.Linear(64, 96, bias=False, device="meta")
    assert weights_digest(meta).startswith("weights-unread-") and weights_digest(meta) != weights_digest(meta)

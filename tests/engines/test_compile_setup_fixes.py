"""A compiled step's setup (llmstep/engines/compile.py, llmstep/core/torch_compat.py): the weights' digest follows
every write to them, a mode must name one, and inductor's vector ISA is read only where the micro_gemm feature is on
and, where it is not read, says so as the RuntimeError its callers catch. Nothing is compiled here."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from llmstep.core import torch_compat
from llmstep.engines import compile as compile_module
from llmstep.kernels import cpu_gemm


def test_a_write_through_data_gives_a_new_digest():
    """`p.data.copy_(...)` leaves the parameter's address and in-place version as they were: a digest remembered by
    those came back for other weights, and a step compiled after the edit could be served the old frozen weights
    from inductor's cache."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    first = compile_module.weights_digest(layer)
    version, address = layer.weight._version, layer.weight.data_ptr()
    layer.weight.data.copy_(torch.randn(96, 64))
    assert (layer.weight._version, layer.weight.data_ptr()) == (version, address)  # nothing to see on the tensor
    edited = compile_module.weights_digest(layer)
    assert edited != first
    layer.weight.data[3, 5] += 1  # one weight of 6,144, through .data again
    assert compile_module.weights_digest(layer) not in (first, edited)


@pytest.mark.parametrize("mode", ["", None, 3])
def test_a_mode_that_is_not_a_non_empty_string_is_refused_by_name(mode, monkeypatch):
    """inductor's list_mode_options("") gives its whole table: "" was taken as a mode of every option at once."""
    with pytest.raises(ValueError, match=rf"unknown torch.compile mode {mode!r}"):
        torch_compat.mode_options(mode)
    with pytest.raises(ValueError, match="unknown torch.compile mode ''"):
        compile_module.compile_options(torch.device("cpu"), "")
    monkeypatch.delattr(importlib.import_module("torch._inductor"), "list_mode_options")  # torch 2.13's table
    with pytest.raises(ValueError, match=rf"unknown torch.compile mode {mode!r}"):
        torch_compat.mode_options(mode)
    assert torch_compat.mode_options("default") == {}


def test_the_vector_isa_is_not_read_where_the_micro_gemm_feature_is_off(monkeypatch):
    """The feature gated off (an untested torch): its private names are not asked, and each caller takes its
    fallback (it catches RuntimeError)."""
    asked = []
    vec = importlib.import_module("torch._inductor.cpu_vec_isa")
    monkeypatch.setattr(vec, "pick_vec_isa", lambda *a: asked.append(a) or pytest.fail("inductor's ISA was read"))
    monkeypatch.setitem(torch_compat.FEATURES, "micro_gemm", dataclasses.replace(
        torch_compat.FEATURES["micro_gemm"], probe=lambda: "torch 9.9 moved cpp_micro_gemm"))
    with pytest.raises(RuntimeError, match="no CPU vector ISA to read: torch 9.9 moved cpp_micro_gemm"):
        torch_compat.cpu_vector_isa()
    assert compile_module._vector_isa() == "" and compile_module._bf16_instructions() is True
    assert cpu_gemm.int4_takes(4096, 4096, 32) is False
    assert not asked


def test_the_gate_of_the_tested_range_holds_the_vector_isa_too(monkeypatch):
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.14.0"))
    with pytest.raises(RuntimeError, match="outside the range llmstep was tested on"):
        torch_compat.cpu_vector_isa()


@pytest.mark.parametrize("error", [AttributeError("'VecAVX2' has no attribute 'is_avx512_bf16_supported'"),
                                   OSError("cannot read /proc/cpuinfo"), KeyError("avx2")])
def test_whatever_inductors_internals_raise_is_a_runtime_error(monkeypatch, error):
    def broken(*args):
        raise error

    monkeypatch.setattr(importlib.import_module("torch._inductor.cpu_vec_isa"), "pick_vec_isa", broken)
    with pytest.raises(RuntimeError, match=f"no CPU vector ISA to read: {type(error).__name__}") as raised:
        torch_compat.cpu_vector_isa()
    assert raised.value.__cause__ is error
    assert compile_module._vector_isa() == "" and compile_module._bf16_instructions() is True
    assert cpu_gemm.int4_takes(4096, 4096, 32) is False

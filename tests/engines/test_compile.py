"""How a step is compiled (llmstep/engines/compile.py) where this torch lacks one of the private pieces it uses
(llmstep/core/torch_compat.py): the step still compiles, without that piece, and computes what the eager step does."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import llmstep
from llmstep.core import torch_compat
from llmstep.engines.compile import Step, compile_options, compile_step
from llmstep.engines.fast import FastDecoder

CPU = torch.device("cpu")
slow = pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"),
                          reason="torch.compile on the CPU takes ~30 s; set LLMSTEP_SLOW_TESTS=1")


def force_missing(monkeypatch, *names: str) -> None:
    """Features `names` reported missing, whatever this torch has (inductor itself still reads its config)."""
    for name in names:
        feature = torch_compat.FEATURES[name]
        monkeypatch.setitem(torch_compat.FEATURES, name, dataclasses.replace(feature, probe=lambda: "forced off"))


def test_without_freezing_a_cpu_step_is_compiled_unfrozen_and_called_through_torch_compile(monkeypatch):
    assert compile_options(CPU)["freezing"] and hasattr(compile_step(lambda x: x + 1, CPU), "traced")
    force_missing(monkeypatch, "freezing")
    options = compile_options(CPU)
    assert not options.get("freezing") and options["cpp_wrapper"]  # the rest as before
    step = Step(lambda x: x + 1, CPU, compile=True)  # torch.compile is lazy: nothing compiles here
    assert not hasattr(step.fn, "traced") and step.unguarded() is step


def test_without_inductors_mode_table_the_options_are_the_same(monkeypatch):
    want = {mode: compile_options(device, mode) for device in (CPU, torch.device("cuda"))
            for mode in (None, "default", "reduce-overhead", "max-autotune")}
    monkeypatch.delattr(torch._inductor, "list_mode_options")
    assert {mode: compile_options(device, mode) for device in (CPU, torch.device("cuda"))
            for mode in (None, "default", "reduce-overhead", "max-autotune")} == want


def cache_step():
    """A step that writes a buffer in place (as a decode step writes its KV cache) and reads a weight."""
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(16, 8, bias=False).requires_grad_(False)
    linear.weight.copy_(torch.randn(8, 16, generator=g))
    cache = torch.zeros(4, 16)  # [slots, dim]

    def step(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:  # x [1, 16], slot [1] -> [1, 8]
        cache.index_copy_(0, slot, x)
        return linear(cache.sum(0, keepdim=True))

    return step, cache


@slow
def test_a_step_compiled_without_freezing_or_static_addresses_computes_the_eager_step(monkeypatch):
    force_missing(monkeypatch, "freezing", "static_addresses")
    eager, eager_cache = cache_step()
    fn, cache = cache_step()
    step = Step(fn, CPU, compile=True, static=(cache,))
    xs = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i, x in enumerate(xs):
            slot = torch.tensor([i])
            torch.testing.assert_close(step(x, slot), eager(x, slot), rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, eager_cache)


@slow
def test_without_dynamos_cache_entries_the_fast_loop_calls_the_guarded_step_and_gives_the_eager_tokens(
        monkeypatch, one_layer_checkpoint):
    model, _ = llmstep.load(one_layer_checkpoint, device="cpu", dtype=torch.float32)  # one block: a shorter compile
    prompt, greedy = list(range(3, 20)), dict(temperature=0, stop_ids=())
    want = FastDecoder(model, max_len=64, compile=False).generate(prompt, 12, **greedy).tokens
    monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    decoder = FastDecoder(model, max_len=64, compile=True)
    assert decoder.generate(prompt, 12, **greedy).tokens == want
    step = decoder._advance_step((0, 0, 1.0))
    with torch.inference_mode():  # the mode the step was compiled in: only the missing cache entries refuse it
        assert step.unguarded() is step  # the fallback: the guarded call


def test_an_unmarked_test_makes_its_steps_untuned_and_a_marked_one_as_the_engines_do(one_layer_checkpoint):
    """conftest's `untuned_matmuls`: an engine's steps untuned here; the next test, marked, gets the default."""
    from llmstep.engines import compile as compiling
    from llmstep.engines import engine

    model, _ = llmstep.load(one_layer_checkpoint, device="cpu", dtype=torch.float32)
    assert compiling.gemm_backends(model) == "ATEN,CPP" and engine.gemm_backends(model) is None


@pytest.mark.tuned_matmuls
def test_a_test_marked_tuned_matmuls_makes_its_steps_as_the_engines_do(one_layer_checkpoint):
    from llmstep.engines import compile as compiling
    from llmstep.engines import engine

    model, _ = llmstep.load(one_layer_checkpoint, device="cpu", dtype=torch.float32)
    assert engine.gemm_backends is compiling.gemm_backends and engine.gemm_backends(model) == "ATEN,CPP"

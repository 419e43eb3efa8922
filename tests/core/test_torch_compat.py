"""PyTorch's private pieces (llmstep/core/torch_compat.py): each probe finds its piece on the torch CI runs, says what
is missing when the piece is taken away, and its fallback then runs and computes the same numbers; gated pieces
are off below the floor and from the ceiling on; pyproject's floor is the torch CI installs."""

from __future__ import annotations

import importlib
import re
import types
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib
import torch
import torch.nn.functional as F

from llmstep.core import torch_compat
from llmstep.core.quantize import Int4Linear, Int8Linear, dequantize_int4

ROOT = Path(__file__).resolve().parents[2]


def in_range() -> bool:
    return torch_compat.in_tested_range() is None


@pytest.mark.skipif(not in_range(), reason="a torch outside the tested range: its gated pieces are off")
def test_every_piece_is_found_on_the_tested_torch():
    assert torch_compat.features() == dict.fromkeys(torch_compat.FEATURES)


def test_an_unknown_feature_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="int8_mm"):
        torch_compat.missing("int9_mm")


def test_the_floor_is_pyprojects_environment_ymls_and_the_torch_ci_installs():
    floor = ".".join(map(str, torch_compat.FLOOR))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch>={floor}" in project["dependencies"]  # environment.yml agrees: tests/test_packaging.py
    ci = re.search(r"torch==(\d+)\.(\d+)\.\d+", (ROOT / ".ci" / "run").read_text())
    assert ci and (int(ci[1]), int(ci[2])) == torch_compat.FLOOR  # CI runs every test on the floor
    readme = re.search(r"torch==(\d+)\.(\d+)\.\d+", (ROOT / "README.md").read_text())
    assert readme and (int(readme[1]), int(readme[2])) == torch_compat.FLOOR
    assert torch_compat.FLOOR < torch_compat.CEILING


# The private name each probe looks for, and where: taken away, the probe must name it.
PIECES = [(name, path.rpartition(".")[0], path.rpartition(".")[2]) for name, paths in {
    "int8_mm": ["torch._weight_int8pack_mm"],
    "int4_mm_cpu": ["torch._weight_int4pack_mm_for_cpu", "torch._convert_weight_to_int4pack_for_cpu"],
    "int4_mm_cuda": ["torch._weight_int4pack_mm", "torch._convert_weight_to_int4pack"],
    "inductor_modes": ["torch._inductor.list_mode_options"],
    "inductor_options": ["torch._inductor.list_options"],
    "freezing": ["torch._inductor.config.freezing"],
    "static_addresses": ["torch._dynamo.mark_static_address"],
    "unguarded": ["torch._dynamo.eval_frame._debug_get_cache_entry_list"],
    "micro_gemm": ["torch._inductor.codegen.cpp_micro_gemm.register_micro_gemm",
                   "torch._inductor.cpu_vec_isa.VecAVX512VNNI", "torch._inductor.select_algorithm.KernelTemplate"],
}.items() for path in paths]


@pytest.mark.skipif(not in_range(), reason="a torch outside the tested range: its gated pieces are off")
@pytest.mark.parametrize("name,owner,attribute", PIECES, ids=[f"{n}-{a}" for n, _, a in PIECES])
def test_a_piece_taken_away_is_reported_by_name(monkeypatch, name, owner, attribute):
    torch_compat.features()  # every probe's modules imported first: inductor's own import reads torch's int8 op
    assert torch_compat.missing(name) is None
    monkeypatch.delattr(importlib.import_module(owner), attribute)
    why = torch_compat.missing(name)
    assert why is not None and attribute in why, why
    assert torch_compat.features()[name] == why


@pytest.mark.parametrize("version,off", [("2.12.1", True), ("2.13.0+cpu", False), ("2.13.9", False),
                                         ("2.14.0", True), ("2.14.0a0+git1234", True), ("3.0.0", True)])
def test_gated_pieces_are_off_below_the_floor_and_from_the_ceiling_on(monkeypatch, version, off):
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    for name, feature in torch_compat.FEATURES.items():
        why = torch_compat.missing(name)
        if feature.gated and off:
            assert why is not None and version in why and "outside the range" in why, (name, why)
        elif not off:
            assert why is None or "outside" not in why, (name, why)
    assert torch_compat.FEATURES["int8_mm"].missing() is None  # an ungated piece: found by what is there


# --------------------------------------------------------------------------------------------------
# Each fallback runs and gives the same numbers
# --------------------------------------------------------------------------------------------------


def weights(out_features=64, in_features=128, dtype=torch.float32) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g))
    return linear


def test_without_the_int8_kernel_the_layer_dequantises_and_gives_the_dequantised_matmul(monkeypatch):
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    assert Int8Linear.from_linear(weights(), kernel="packed").kernel == "packed"  # this torch has it
    monkeypatch.delattr(torch, "_weight_int8pack_mm")
    layer = Int8Linear.from_linear(weights(), kernel="packed")
    assert layer.kernel == "dequant"
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight.to(x.dtype)) * layer.scales)


def test_without_the_cpu_int4_kernel_the_layer_dequantises_and_gives_the_dequantised_matmul(monkeypatch):
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert Int4Linear.from_linear(weights(dtype=torch.bfloat16), group_size=32).kernel == "packed"
    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    layer = Int4Linear.from_linear(weights(dtype=torch.bfloat16), group_size=32)
    assert layer.kernel == "dequant" and layer.kernel_weight is None
    want = F.linear(x, dequantize_int4(layer.weight, layer.scales, layer.zeros, x.dtype))
    with torch.no_grad():
        assert torch.equal(layer(x), want)


def test_without_inductors_mode_table_the_modes_are_torch_2_13s(monkeypatch):
    import torch._inductor

    real = {mode: torch._inductor.list_mode_options(mode) for mode in torch_compat.MODES}
    assert {mode: torch_compat.mode_options(mode) for mode in real} == real
    monkeypatch.delattr(torch._inductor, "list_mode_options")
    assert {mode: torch_compat.mode_options(mode) for mode in real} == real
    with pytest.raises(ValueError, match="unknown torch.compile mode 'fastest'"):
        torch_compat.mode_options("fastest")


def test_options_inductor_does_not_know_are_left_out_and_passed_as_given_where_it_cannot_say(monkeypatch):
    import torch._inductor

    options = {"freezing": True, "cpp_wrapper": True, "no_such_option": 1}
    assert torch_compat.known_options(options) == {"freezing": True, "cpp_wrapper": True}
    known = [o for o in torch._inductor.list_options() if o != "cpp_wrapper"]
    monkeypatch.setattr(torch._inductor, "list_options", lambda: known)  # an inductor without cpp_wrapper
    assert torch_compat.known_options(options) == {"freezing": True}
    monkeypatch.delattr(torch._inductor, "list_options")
    assert torch_compat.known_options(options) == options


def test_kernel_profile_names_each_compiled_cpu_kernel_and_changes_nothing_where_inductor_lacks_the_option(
        monkeypatch):
    import torch._inductor
    import torch._inductor.config as inductor_config

    def kernels(fn) -> set[str]:  # fn compiled (each lambda its own code object), profiled: the kernels named in it
        compiled = torch.compile(fn, fullgraph=True)
        x = torch.randn(64)
        compiled(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(x)
        return {e.key for e in prof.key_averages() if "cpp_fused" in e.key}

    with torch_compat.kernel_profile():
        assert inductor_config.cpp.enable_kernel_profile
        named = kernels(lambda x: torch.sin(x) * 2 + 1)
    assert not inductor_config.cpp.enable_kernel_profile  # restored on leaving
    assert named and all("sin" in k for k in named)  # the fused kernel, under its own name
    assert not kernels(lambda x: torch.cos(x) * 2 + 1)  # outside it, no kernel shows on its own
    monkeypatch.setattr(torch._inductor, "list_options", lambda: ["freezing"])  # an inductor without the option
    with torch_compat.kernel_profile():
        assert not inductor_config.cpp.enable_kernel_profile


def test_without_static_addresses_nothing_is_marked(monkeypatch):
    t = torch.zeros(3)
    monkeypatch.delattr(torch._dynamo, "mark_static_address")
    assert torch_compat.mark_static_address(t) is False


def compiled_eagerly(fn):
    """fn behind its own code object, compiled by Dynamo with the eager backend (no inductor: fast), and that
    function, whose code Dynamo keeps the compiled entries of."""
    def step(*args):
        return fn(*args)

    traced = types.FunctionType(step.__code__.replace(), step.__globals__, "step", None, step.__closure__)
    return torch.compile(traced, backend="eager", fullgraph=True, dynamic=False), traced


def f_locals(traced) -> dict:
    code = traced.__code__
    return {"args": ()} | {n: c.cell_contents for n, c in zip(code.co_freevars, traced.__closure__, strict=True)}


def test_the_unguarded_code_is_dynamos_entry_for_this_state_and_none_for_another_or_without_the_api(monkeypatch):
    class State:
        x = torch.zeros(4)

    def bump():
        State.x.add_(1)
        return State.x * 2

    compiled, traced = compiled_eagerly(bump)
    assert torch_compat.unguarded_code(traced, f_locals(traced)) is None  # nothing compiled yet
    compiled()
    code = torch_compat.unguarded_code(traced, f_locals(traced))
    assert isinstance(code, types.CodeType) and code is not traced.__code__
    call = types.FunctionType(code, traced.__globals__, "step", None, traced.__closure__)
    assert torch.equal(call(), torch.full((4,), 4.0)) and torch.equal(State.x, torch.full((4,), 2.0))
    State.x = torch.zeros(6)  # a state its guards refuse
    assert torch_compat.unguarded_code(traced, f_locals(traced)) is None
    State.x = torch.zeros(4)
    assert torch_compat.unguarded_code(traced, f_locals(traced)) is not None
    monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    assert torch_compat.unguarded_code(traced, f_locals(traced)) is None
    assert torch.equal(compiled(), torch.full((4,), 2.0))  # the guarded call, as before


def test_outside_the_tested_range_no_code_is_handed_out_unguarded(monkeypatch):
    class State:
        x = torch.ones(2)

    compiled, traced = compiled_eagerly(lambda: State.x + 1)
    compiled()
    assert torch_compat.unguarded_code(traced, f_locals(traced)) is not None
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.14.0"))
    assert torch_compat.unguarded_code(traced, f_locals(traced)) is None


def test_without_the_micro_gemm_registry_the_cpu_kernel_is_not_installed_and_says_why(monkeypatch):
    from llmstep.kernels import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "BF16", replace(cpu_gemm.BF16, cls=None, why=None))
    monkeypatch.setattr(cpu_gemm, "INT4", replace(cpu_gemm.INT4, cls=None, why=None))
    monkeypatch.setattr(cpu_gemm, "INT8", replace(cpu_gemm.INT8, cls=None, why=None))
    monkeypatch.setattr(cpu_gemm, "INT8_AVX512", replace(cpu_gemm.INT8_AVX512, cls=None, why=None))
    monkeypatch.delattr(importlib.import_module("torch._inductor.codegen.cpp_micro_gemm"), "register_micro_gemm")
    assert cpu_gemm.BF16.install() is False and not cpu_gemm.BF16.installed
    assert "register_micro_gemm" in cpu_gemm.BF16.why
    assert cpu_gemm.INT4.install() is False and "register_micro_gemm" in cpu_gemm.INT4.why
    assert cpu_gemm.INT8.install() is False and "register_micro_gemm" in cpu_gemm.INT8.why
    assert cpu_gemm.INT8_AVX512.install() is False and "register_micro_gemm" in cpu_gemm.INT8_AVX512.why
    with cpu_gemm.withheld():  # nothing to withhold: a no-op
        pass

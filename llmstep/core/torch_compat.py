"""Every private (underscore-prefixed) piece of PyTorch that llmstep uses, in one place.

PyTorch promises nothing about its private names: a release may rename, move or change any of them. So each
one is used only here, behind a `Feature` whose probe says whether the running torch has it and, where it does
not, what is missing and what llmstep does instead (its fallback). Each fallback computes the same function; it
may be slower. A torch upgrade is then a review of this one file: `features()` lists what the running torch
has, and tests/core/test_torch_compat.py takes each piece away in turn and runs its fallback.

The supported range: torch FLOOR (pyproject.toml's floor: the torch CI installs and every test runs on) up to,
not including, CEILING. The floor is the torch the tests prove: CI has no older CPU build of torch to run a
second lane on. Outside the range the probes still decide by what they find, except for the features marked
`gated`: a wrong guess there would not raise but give wrong numbers or run stale code (a C++ kernel written
against inductor's template interface, compiled code called without its guards), so outside the tested range
they are off and their fallback runs.

| feature            | private torch names                                    | fallback                          |
|--------------------|--------------------------------------------------------|-----------------------------------|
| int8_mm            | _weight_int8pack_mm                                    | dequantise + matmul               |
| int4_mm_cpu        | _convert_weight_to_int4pack_for_cpu, _weight_int4pack_mm_for_cpu | dequantise + matmul     |
| int4_mm_cuda       | _convert_weight_to_int4pack, _weight_int4pack_mm       | dequantise + matmul               |
| inductor_modes     | _inductor.list_mode_options                            | torch 2.13's table (MODES)        |
| inductor_options   | _inductor.list_options                                 | every option passed as given      |
| freezing           | _inductor.config.freezing, held set while a step traces | no frozen weights                |
| static_addresses   | _dynamo.mark_static_address                            | tensors left unmarked             |
| unguarded (gated)  | _dynamo.eval_frame._debug_get_cache_entry_list         | the guarded compiled call         |
| micro_gemm (gated) | _inductor.codegen.cpp_micro_gemm, cpu_vec_isa, select_algorithm | inductor's own kernels   |

(every name under `torch.`). The public switch for guards, `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`,
checks only the guards that tell a function's compiled versions apart, for every compiled call made under it, and
still runs torch.compile's wrapper each call; `unguarded_code` checks all of one step's guards once and returns
the compiled code itself (scripts/overhead_cpu.py times both).
"""

from __future__ import annotations

import contextlib
import re
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["FLOOR", "CEILING", "Feature", "FEATURES", "features", "missing", "in_tested_range", "int8_mm",
           "int4_pack_cpu", "int4_pack_cuda", "int4_mm", "mode_options", "known_options", "holding_freezing",
           "mark_static_address", "unguarded_code", "cpu_vector_isa", "register_micro_gemm",
           "register_int4_micro_gemm", "register_vec_micro_gemm", "micro_gemm_withheld", "compiling_constant_bytes",
           "kernel_profile"]

FLOOR = (2, 13)  # pyproject.toml's `torch>=2.13`: the torch CI installs (.ci/run) and the tests run on
CEILING = (2, 14)  # the first torch release not yet tested: gated features are off from here on

# torch.compile's modes as torch 2.13's inductor spells them (`torch._inductor.list_mode_options`)
MODES: dict[str, dict[str, bool]] = {
    "default": {},
    "reduce-overhead": {"triton.cudagraphs": True},
    "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune": {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True},
}

# Inductor's matmul tuner (torch 2.13) reads a tensor's size through the deprecated TypedStorage and warns once per
# process; the warning is about inductor's own code, not the caller's, so the tuned steps compile without it.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", module="torch._inductor.select_algorithm")


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of torch's version string ("2.13.0+cpu" -> (2, 13); a 2.14 nightly is (2, 14))."""
    version = str(torch.__version__ if version is None else version)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"cannot read a torch release from the version string {version!r}")
    return int(found[1]), int(found[2])


def in_tested_range() -> str | None:
    """None where the running torch is in [FLOOR, CEILING); else a sentence saying it is not."""
    if FLOOR <= torch_release() < CEILING:
        return None
    low, high = ".".join(map(str, FLOOR)), ".".join(map(str, CEILING))
    return f"torch {torch.__version__} is outside the range llmstep was tested on ({low} up to, not including, {high})"


@dataclass(frozen=True)
class Feature:
    """One private piece of torch: what it touches, what llmstep does without it, and a probe that finds it."""

    name: str
    uses: str  # the private torch names it reads
    fallback: str  # what llmstep does where this torch lacks it
    probe: Callable[[], str | None]  # None where the running torch has it; else what is missing
    gated: bool = False  # used only within the tested range (a changed interface would not raise)

    def missing(self) -> str | None:
        """None where this torch has the feature (and, if gated, is in the tested range); else why not."""
        if self.gated and (outside := in_tested_range()):
            return outside
        return self.probe()


def _attributes(owner: object, where: str, *names: str) -> str | None:
    """None where `owner` has every name; else which one is missing."""
    for name in names:
        if not hasattr(owner, name):
            return f"{where} has no {name}"
    return None


def _module(path: str):
    """The module at `path` (its parents first imported), or a sentence saying this torch has none."""
    import importlib

    try:
        return importlib.import_module(path)
    except ImportError as e:
        return f"this torch has no {path} ({e})"


def _inductor():
    return _module("torch._inductor")


def _probe_inductor(name: str) -> str | None:
    inductor = _inductor()
    return inductor if isinstance(inductor, str) else _attributes(inductor, "torch._inductor", name)


def _probe_freezing() -> str | None:
    config = _module("torch._inductor.config")
    return config if isinstance(config, str) else _attributes(config, "torch._inductor.config", "freezing")


def _probe_static() -> str | None:
    dynamo = _module("torch._dynamo")
    return dynamo if isinstance(dynamo, str) else _attributes(dynamo, "torch._dynamo", "mark_static_address")


def _probe_unguarded() -> str | None:
    eval_frame = _module("torch._dynamo.eval_frame")
    if isinstance(eval_frame, str):
        return eval_frame
    return _attributes(eval_frame, "torch._dynamo.eval_frame", "_debug_get_cache_entry_list")


def _micro_gemm_modules():
    """(cpp_micro_gemm, cpu_vec_isa, select_algorithm), or a sentence saying what is missing."""
    select_algorithm = _module("torch._inductor.select_algorithm")  # first: inductor's codegen modules import it
    if isinstance(select_algorithm, str):
        return select_algorithm
    mg, isa = _module("torch._inductor.codegen.cpp_micro_gemm"), _module("torch._inductor.cpu_vec_isa")
    for m in (mg, isa):
        if isinstance(m, str):
            return m
    why = (_attributes(mg, "cpp_micro_gemm", "CppMicroGemm", "LayoutType", "generate_gemm_config",
                       "register_micro_gemm", "micro_gemm_configs")
           or _attributes(isa, "cpu_vec_isa", "pick_vec_isa", "VecAMX", "VecAVX512VNNI")
           or _attributes(getattr(select_algorithm, "KernelTemplate", None), "select_algorithm.KernelTemplate",
                          "_template_from_string")
           or _attributes(mg.LayoutType, "cpp_micro_gemm.LayoutType", "VNNI2"))
    return why or (mg, isa, select_algorithm)


def _probe_micro_gemm() -> str | None:
    found = _micro_gemm_modules()
    return found if isinstance(found, str) else None


DEQUANT = "dequantise the weights and call the ordinary matmul (kernel 'dequant')"
FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("int8_mm", "torch._weight_int8pack_mm", DEQUANT,
            lambda: _attributes(torch, "torch", "_weight_int8pack_mm")),
    Feature("int4_mm_cpu", "torch._convert_weight_to_int4pack_for_cpu, torch._weight_int4pack_mm_for_cpu", DEQUANT,
            lambda: _attributes(torch, "torch", "_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")),
    Feature("int4_mm_cuda", "torch._convert_weight_to_int4pack, torch._weight_int4pack_mm", DEQUANT,
            lambda: _attributes(torch, "torch", "_convert_weight_to_int4pack", "_weight_int4pack_mm")),
    Feature("inductor_modes", "torch._inductor.list_mode_options",
            "torch.compile's modes as torch 2.13 defines them (torch_compat.MODES)",
            lambda: _probe_inductor("list_mode_options")),
    Feature("inductor_options", "torch._inductor.list_options",
            "every inductor option passed as llmstep names it (an unknown one is torch.compile's error)",
            lambda: _probe_inductor("list_options")),
    Feature("freezing", "torch._inductor.config.freezing",
            "a CPU step compiles without frozen weights (no packed layouts, no concatenated linears)",
            _probe_freezing),
    Feature("static_addresses", "torch._dynamo.mark_static_address",
            "a step's cache is left unmarked (on CUDA inductor may then skip the CUDA graph of a step that "
            "writes it)", _probe_static),
    Feature("unguarded", "torch._dynamo.eval_frame._debug_get_cache_entry_list (CacheEntry.guard_manager, .code)",
            "the compiled step called through torch.compile, its guards evaluated every call", _probe_unguarded,
            gated=True),
    Feature("micro_gemm", "torch._inductor.codegen.cpp_micro_gemm, torch._inductor.cpu_vec_isa, "
            "torch._inductor.select_algorithm.KernelTemplate", "inductor's own matmul kernels (no llmstep kernel)",
            _probe_micro_gemm, gated=True),
)}


def missing(name: str) -> str | None:
    """None where the running torch has feature `name`; else what is missing (see FEATURES)."""
    if name not in FEATURES:
        raise KeyError(f"no torch feature named {name!r}: one of {', '.join(FEATURES)}")
    return FEATURES[name].missing()


def features() -> dict[str, str | None]:
    """Every feature's name -> None where the running torch has it, else why not (its fallback runs)."""
    return {name: f.missing() for name, f in FEATURES.items()}


# --------------------------------------------------------------------------------------------------
# Quantised matmuls (llmstep.core.quantize): PyTorch's packed weight-only kernels
# --------------------------------------------------------------------------------------------------


def int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 * scales [N])^T -> [M, N]: PyTorch's int8 weight-only kernel."""
    return torch._weight_int8pack_mm(x, weight, scales)


def int4_pack_cpu(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] int32 (0..15) -> the CPU int4 kernel's packed layout."""
    return torch._convert_weight_to_int4pack_for_cpu(codes, 1)


def int4_pack_cuda(packed: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """Two codes a byte [N, K/2] uint8 -> tinygemm's layout (CUDA)."""
    return torch._convert_weight_to_int4pack(packed, inner_k_tiles)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N], W in the packed layout of x's device, scales_and_zeros [K/g, N, 2]."""
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


# --------------------------------------------------------------------------------------------------
# Compiling a step (llmstep.engines.compile)
# --------------------------------------------------------------------------------------------------


def mode_options(mode: str) -> dict:
    """The inductor options torch.compile's `mode` stands for (torch.compile takes a mode or options, not both);
    ValueError for a mode it does not name (inductor's table gives all its modes for "": not a mode, refused)."""
    table = missing("inductor_modes")  # None: inductor's own table
    if not isinstance(mode, str) or not mode or (table and mode not in MODES):
        raise ValueError(f"unknown torch.compile mode {mode!r}: should be one of {', '.join(MODES)}")
    if table:
        return dict(MODES[mode])
    import torch._inductor

    try:
        return dict(torch._inductor.list_mode_options(mode))
    except RuntimeError as e:  # "Unrecognized mode=..., should be one of: ..."
        raise ValueError(f"unknown torch.compile mode {mode!r}: {e}") from None


def known_options(options: dict) -> dict:
    """`options` less those this torch's inductor does not know (every one, where it cannot say)."""
    if missing("inductor_options"):
        return dict(options)
    import torch._inductor

    known = set(torch._inductor.list_options())
    return {k: v for k, v in options.items() if k in known}


def kernel_profile() -> contextlib.AbstractContextManager:
    """Steps compiled inside it record each of inductor's C++ kernels in torch.profiler under its own name
    (inductor's `cpp.enable_kernel_profile`), so a compiled CPU step's profile lists its kernels, not one call of
    the whole step. Where this torch's inductor does not know the option, a context that changes nothing."""
    option = {"cpp.enable_kernel_profile": True}
    if not known_options(option):
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(option)


def holding_freezing(compiled: Callable) -> Callable:
    """`compiled` behind a call that holds inductor's global `freezing` flag set: Dynamo decides whether parameters
    become constants from that flag when it traces, not from torch.compile's options (cost: ~1 us a call)."""
    import torch._inductor.config as inductor_config

    def frozen_step(*args):
        before, inductor_config.freezing = inductor_config.freezing, True
        try:
            return compiled(*args)
        finally:
            inductor_config.freezing = before

    return frozen_step


def mark_static_address(t: torch.Tensor) -> bool:
    """Tell torch.compile that `t` keeps its address (a CUDA graph then reads and writes it in place); False where
    this torch cannot be told (FEATURES["static_addresses"])."""
    if missing("static_addresses"):
        return False
    torch._dynamo.mark_static_address(t)
    return True


def unguarded_code(fn: types.FunctionType, f_locals: dict) -> types.CodeType | None:
    """The code Dynamo compiled for `fn` that a call with these frame locals would run, its guards evaluated
    once, now; None where no one entry passes, or this torch cannot say (FEATURES["unguarded"])."""
    if missing("unguarded"):
        return None
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    try:
        entries = _debug_get_cache_entry_list(fn.__code__)
        passed = [e for e in entries if e.guard_manager.check(f_locals)]  # the frame Dynamo would see
        return passed[0].code if len(passed) == 1 and isinstance(passed[0].code, types.CodeType) else None
    except (AttributeError, RuntimeError, TypeError):  # a cache entry of another shape: the guarded call
        return None


# --------------------------------------------------------------------------------------------------
# A micro-kernel for inductor's C++ GEMM template (llmstep.kernels.cpu_gemm)
# --------------------------------------------------------------------------------------------------


def cpu_vector_isa() -> str:
    """The vector instructions inductor compiles CPU kernels for: "amx", "avx512_bf16" (AVX-512 with BF16 dot
    products, no AMX), or inductor's name for another ("avx2", "none"). RuntimeError where it is not read: the
    feature off (FEATURES["micro_gemm"]: gated), or inductor's names failing as they are asked (whatever they raise)."""
    if why := missing("micro_gemm"):
        raise RuntimeError(f"no CPU vector ISA to read: {why}")
    try:
        _, vec, _ = _micro_gemm_modules()
        isa = vec.pick_vec_isa()
        bf16 = isinstance(isa, vec.VecAVX512VNNI) and isa.is_avx512_bf16_supported()
        return "amx" if isinstance(isa, vec.VecAMX) else "avx512_bf16" if bf16 else str(isa) or "none"
    except Exception as e:  # an inductor whose internals moved under the same names
        raise RuntimeError(f"no CPU vector ISA to read: {type(e).__name__}: {e}") from e


def compiling_constant_bytes() -> int | None:
    """Bytes of the constants of the graph inductor is generating code for (a frozen step's weights, packed as its
    kernels read them); None outside code generation, or where this inductor's graph keeps no `constants`."""
    virtualized = _module("torch._inductor.virtualized")  # a sentence where this torch has none
    graph = getattr(getattr(virtualized, "V", None), "graph", None)  # outside a graph, a handler without constants
    constants = getattr(graph, "constants", None)
    if isinstance(constants, dict):
        return sum(t.nbytes for t in constants.values() if isinstance(t, torch.Tensor))
    return None


def _with_options(base: type, options: Callable[[], dict] | None) -> dict:
    """Class attributes that add `options()` (read at each rendering, inside the graph's code generation) to the
    variables a micro-kernel's Jinja template is rendered with."""
    def get_common_options(self):
        return {**base.get_common_options(self), **(options() if options else {})}

    return {"get_common_options": get_common_options}


def register_micro_gemm(name: str, source: str, blockings: list[tuple[int, int, int]], fits: Callable,
                        rank: str = "avx512_bf16", options: Callable[[], dict] | None = None) -> type:
    """Register a bf16 x bf16 -> float32 micro-kernel for AVX-512 BF16 with inductor's C++ GEMM template.

    source: the kernel as a Jinja template of inductor's (`declare_kernel`, `kernel_name` and the template's
    own variables); blockings: (block_m, block_n, block_k) it serves, best first; fits(config, m, n, k, alpha,
    num_threads, **kwargs): whether a matmul may use it. Its weights come packed in pairs along k (VNNI2).
    rank: the ISA it is filed under, "avx512_bf16" or "amx": inductor ranks the kernels that fit a matmul by ISA
    first (AMX above AVX-512), so one filed under "amx" competes with inductor's AMX kernels (on the matmuls
    `fits` admits) and one under "avx512_bf16" runs only where no AMX kernel fits. options: more variables for the
    template, read at each rendering (`_with_options`).
    Returns the registered class (`micro_gemm_withheld` takes it)."""
    found = _micro_gemm_modules()
    if isinstance(found, str):
        raise RuntimeError(f"cannot register {name}: {found}")
    mg, vec, select_algorithm = found

    def codegen_define(self, kernel) -> str:
        options = {"declare_kernel": self.get_kernel_declaration(), "kernel": kernel, **self.get_common_options()}
        return select_algorithm.KernelTemplate._template_from_string(source).render(options)

    def get_b_layout(self):
        return mg.LayoutType.VNNI2

    cls = type(name, (mg.CppMicroGemm,), {"codegen_define": codegen_define, "get_b_layout": get_b_layout,
                                          **_with_options(mg.CppMicroGemm, options)})
    ranks = {"avx512_bf16": vec.VecAVX512VNNI, "amx": vec.VecAMX}
    if rank not in ranks:
        raise ValueError(f"rank must be one of {sorted(ranks)}, not {rank!r}")
    configs = mg.generate_gemm_config(ranks[rank], blockings, input_dtype=torch.bfloat16, output_dtype=torch.float,
                                      extra_check=fits)
    mg.register_micro_gemm(*configs)(cls)
    return cls


def register_int4_micro_gemm(name: str, source: str, blockings: list[tuple[int, int, int]], fits: Callable,
                             isa: str = "avx2", options: Callable[[], dict] | None = None) -> type:
    """Register an int4 micro-kernel for AVX2 (or, isa "avx512", AVX-512) with inductor's weight-only int4 GEMM
    template (the template that can replace `_weight_int4pack_mm_for_cpu` in a step whose matmuls are tuned), for
    bf16 activations (the class it builds on declares bf16 scales and zeros, as a bf16 model's int4 layers hold them).

    source: the Jinja template of the kernel that inductor's AVX-512 int4 micro-kernel calls per block of columns
    (its `TEMPLATE_KERNEL`: `{{kernel_name}}_kernel<BLOCK_M, BLOCK_N, accum>(A, B, C, K, lda, ldb, ldc, group
    size, scales and zeros, their row stride, k_start)`); that class's entry and arguments are kept. The weights come
    as torch's CPU int4 kernel packed them; options: more variables for the template, read at each rendering
    (`_with_options`). Returns the registered class (`micro_gemm_withheld` takes it)."""
    return _register_woq(name, "CppMicroGemmWoQInt4Avx512", lambda base: source, blockings, fits, torch.uint8, isa,
                         options)


def register_vec_micro_gemm(name: str, blockings: list[tuple[int, int, int]], fits: Callable,
                            weight_dtype: torch.dtype, source: str | None = None, isa: str = "avx2",
                            options: Callable[[], dict] | None = None) -> type:
    """Register a micro-kernel with inductor's float32-vector entry (`CppMicroGemmFP32Vec`) for bf16 activations and
    `weight_dtype` weights (int8, or bf16 widened to float32) on AVX2 (isa "avx512": AVX-512) at other blockings
    (block_m, block_n, block_k) than inductor's. source: the Jinja template of the kernel the entry calls per block
    (`{{kernel_name}}_kernel<BLOCK_M, BLOCK_N, accum, prefetch>(A, B, C, K, lda, ldb, ldc)`); None: inductor's own,
    named. options: as for the int4 kernels."""
    return _register_woq(name, "CppMicroGemmFP32Vec",
                         lambda base: source or f"\n// {name}: llmstep/kernels/cpu_gemm.py\n{base.TEMPLATE_KERNEL}",
                         blockings, fits, weight_dtype, isa, options)


def _register_woq(name, base_name, kernel, blockings, fits, weight_dtype, isa, options) -> type:
    """Inductor's micro-kernel class `base_name` with kernel(base) as its template, for `weight_dtype` on `isa`."""
    found = _micro_gemm_modules()
    if isinstance(found, str):
        raise RuntimeError(f"cannot register {name}: {found}")
    mg, vec, _ = found
    if isa not in ("avx2", "avx512"):
        raise ValueError(f"isa must be 'avx2' or 'avx512', not {isa!r}")
    base = getattr(mg, base_name)  # AttributeError where this inductor has none
    cls = type(name, (base,), {"TEMPLATE_KERNEL": kernel(base), **_with_options(base, options)})
    mg.register_micro_gemm(*mg.generate_gemm_config(vec.VecAVX2 if isa == "avx2" else vec.VecAVX512, blockings,
                                                    input_dtype=torch.bfloat16, input2_dtype=weight_dtype,
                                                    output_dtype=torch.float, compute_dtype=torch.float,
                                                    extra_check=fits))(cls)
    return cls


@contextlib.contextmanager
def micro_gemm_withheld(cls: type):
    """Inside, inductor's registry lacks `cls` (a class `register_micro_gemm` or `register_int4_micro_gemm`
    returned); restored after."""
    from torch._inductor.codegen import cpp_micro_gemm as mg

    configs = mg.micro_gemm_configs.pop(cls)
    try:
        yield
    finally:
        mg.micro_gemm_configs[cls] = configs

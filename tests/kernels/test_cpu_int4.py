"""The AVX2 int4 micro-kernel that inductor's weight-only int4 template gets on CPUs with AVX2 and no AVX-512
(llmstep/kernels/cpu_gemm.py's `INT4`): registered only where torch packs int4 weights in the layout it
reads, and the same function as a float64 matmul of the dequantised weights to within float32 sums, at every row
count, group size and split along k the template hands it. The kernel tests run in a child process with torch and
inductor held to AVX2 (ATEN_CPU_CAPABILITY=avx2), so they run on every x86 CPU with AVX2, AVX-512 ones included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from llmstep.kernels import cpu_gemm

slow = pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"),
                          reason="compiles with tuned matmuls on the CPU (~1 min); set LLMSTEP_SLOW_TESTS=1")


def test_the_layout_probe_reads_how_this_torch_packs_int4_weights():
    """torch packs CPU int4 weights in 32-column blocks where it runs its AVX2 kernels and in 64-column ones with
    AVX-512: the probe must tell them apart, or a kernel would read every other block's codes as its own."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert cpu_gemm._int4_layout(32) == (capability == "AVX2")
    assert cpu_gemm._int4_layout(64) == (capability == "AVX512")


def test_elsewhere_nothing_is_registered_and_the_reason_is_given(monkeypatch):
    import torch._inductor.select_algorithm  # noqa: F401  (inductor's codegen modules import it first)
    from torch._inductor.codegen import cpp_micro_gemm

    from llmstep.core import torch_compat

    before = dict(cpp_micro_gemm.micro_gemm_configs)
    tag = torch.compiler.config.cache_key_tag
    for name, isa, layout, why in [("INT4", "avx512_bf16", True, "avx512_bf16, not AVX2"),
                                   ("INT4", "amx", True, "amx, not AVX2"), ("INT4", "avx2", False, "32-column blocks"),
                                   ("INT4_AVX512", "avx2", True, "(avx2) is not AVX-512 with BF16"),
                                   ("INT4_AVX512", "amx", True, "(amx) is not AVX-512 with BF16 and without AMX"),
                                   ("INT4_AVX512", "avx512_bf16", False, "64-column blocks")]:
        monkeypatch.setattr(cpu_gemm, name, replace(getattr(cpu_gemm, name), cls=None, why=None))
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        monkeypatch.setattr(cpu_gemm, "_int4_layout", lambda block, layout=layout: layout)
        kernel = getattr(cpu_gemm, name)
        assert not kernel.install() and why in kernel.why, (name, isa, kernel.why)
        assert cpp_micro_gemm.micro_gemm_configs == before and torch.compiler.config.cache_key_tag == tag


# The child: each case (rows, columns, depth, group size, activation dtype) compiled as one Int4Linear, two threads
# (the template calls a kernel once per cache block of k, the later calls adding to the output; a thread's share
# starting mid-group, which inductor does not ask for by default, scripts/int4_kernel_bench.py's --k-split checks).
CHILD = r"""
import json, sys, torch
from torch._inductor.utils import run_and_get_code
from llmstep.core.quantize import Int4Linear, dequantize_int4
from llmstep.kernels import cpu_gemm
from llmstep.engines.compile import compile_step

torch.set_num_threads(2)
kernel = getattr(cpu_gemm, sys.argv[2])
if not kernel.install():
    sys.exit("not installed: " + str(kernel.why))
streaming = cpu_gemm.streaming(json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)  # null: the rule's
streaming.__enter__()
results = []
for rows, n, k, group, dtype in json.loads(sys.argv[1]):
    # bf16: held to the template; float32 has no template choice for an int4 matmul here, only torch's kernel
    torch._inductor.config.max_autotune_gemm_backends = "CPP" if dtype == "bfloat16" else "ATEN,CPP"
    g = torch.Generator().manual_seed(rows * 1000 + n + k + group)
    linear = torch.nn.Linear(k, n, bias=False).to(getattr(torch, dtype)).requires_grad_(False)
    linear.weight.copy_(torch.randn(n, k, generator=g))
    layer = Int4Linear.from_linear(linear, group_size=group)
    x = torch.randn(rows, k, generator=g).to(getattr(torch, dtype))
    torch._dynamo.reset()
    step = compile_step(layer, torch.device("cpu"), mode="max-autotune-no-cudagraphs")
    with torch.no_grad():
        out, code = run_and_get_code(step, x)
    w = dequantize_int4(layer.codes(), layer.scales, layer.zeros, torch.float64)  # [n, k], each weight unrounded
    want = x.double() @ w.T  # [rows, n]
    bound = (x.double().abs() @ w.abs().T).max().item()  # the size of the sums' terms
    results.append({"kernel": any(kernel.name in c for c in code), "layer": layer.kernel,
                    "streamed": any("_MM_HINT_NTA" in c for c in code), "bits": out.view(-1).tolist(),
                    "error": (out.double() - want).abs().max().item(), "largest": want.abs().max().item(),
                    "bound": bound})
print(json.dumps(results))
"""

CASES = [(1, 96, 192, 32, "bfloat16"), (3, 64, 576, 64, "bfloat16"), (1, 32, 1024, 128, "bfloat16"),
         (9, 64, 128, 64, "bfloat16"), (4, 256, 256, 32, "bfloat16"), (1, 32, 1024, 128, "float32")]


# The AVX-512 kernel serves one row (a decode step's matmuls); more rows keep inductor's own kernel, checked too.
CASES_AVX512 = [(1, 64, 1024, 128, "bfloat16"), (1, 128, 576, 32, "bfloat16"), (1, 192, 192, 32, "bfloat16"),
                (1, 64, 128, 64, "bfloat16"), (1, 576, 1536, 32, "bfloat16"), (2, 64, 256, 32, "bfloat16"),
                (1, 64, 256, 32, "float32")]


def _run_child(cases: list, kernel: str, env: dict, stream: bool | None = None) -> list[dict]:
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases), kernel, json.dumps(stream)],
                         env=os.environ | env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@slow
def test_the_kernel_computes_the_matmul_at_every_row_count_group_and_split():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"an x86 CPU with AVX2 (torch's CPU capability here: {torch.backends.cpu.get_cpu_capability()})")
    results = _run_child(CASES, "INT4", {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"})
    for case, r in zip(CASES, results, strict=True):
        assert r["layer"] == "packed", (case, r)  # torch's packed layout
        if case[-1] == "float32":  # a float32 model's int4 layers: torch's own kernel (the kernel takes bf16)
            assert not r["kernel"] and r["error"] <= 1e-5 * r["bound"], (case, r)
            continue
        assert r["kernel"], (case, r)
        # float32 sums, the output rounded once to bf16: within half a bf16 step of the largest output, and then some
        assert r["error"] <= 2 ** -8 * r["largest"] + 1e-5 * r["bound"], (case, r)


@slow
def test_the_avx512_kernel_computes_the_one_row_matmul_at_every_group_and_split():
    from llmstep.core import torch_compat

    if torch_compat.cpu_vector_isa() != "avx512_bf16":
        pytest.skip(f"a CPU with AVX-512 BF16 and no AMX (inductor's vector ISA here: {torch_compat.cpu_vector_isa()})")
    results = _run_child(CASES_AVX512, "INT4_AVX512", {"OMP_NUM_THREADS": "2"})
    for case, r in zip(CASES_AVX512, results, strict=True):
        assert r["layer"] == "packed", (case, r)
        assert r["kernel"] == (case[0] == 1 and case[-1] == "bfloat16"), (case, r)  # one bf16 row: this kernel
        if case[-1] == "float32":
            assert r["error"] <= 1e-5 * r["bound"], (case, r)
            continue
        # float32 sums, the output rounded once to bf16: within half a bf16 step of the largest output, and then some
        assert r["error"] <= 2 ** -8 * r["largest"] + 1e-5 * r["bound"], (case, r)


@slow
def test_the_avx512_kernel_streaming_its_codes_computes_the_same_bits():
    """Streaming the codes and the scale rows past the caches (cpu_gemm.streams_weights) is a prefetch hint: the
    outputs are the unstreamed kernel's, bit for bit."""
    from llmstep.core import torch_compat

    if torch_compat.cpu_vector_isa() != "avx512_bf16":
        pytest.skip(f"a CPU with AVX-512 BF16 and no AMX (inductor's vector ISA here: {torch_compat.cpu_vector_isa()})")
    cases = [c for c in CASES_AVX512 if c[0] == 1 and c[-1] == "bfloat16"][:3]
    runs = [_run_child(cases, "INT4_AVX512", {"OMP_NUM_THREADS": "2"}, stream) for stream in (True, False)]
    for case, streamed, held in zip(cases, *runs, strict=True):
        assert streamed["kernel"] and streamed["streamed"] and not held["streamed"], case
        assert streamed["bits"] == held["bits"], case


def test_an_inductor_without_its_avx512_int4_kernel_to_build_on_registers_nothing(monkeypatch):
    import importlib

    from torch._inductor.codegen import cpp_micro_gemm

    from llmstep.core import torch_compat

    before = dict(cpp_micro_gemm.micro_gemm_configs)
    monkeypatch.delattr(importlib.import_module("torch._inductor.codegen.cpp_micro_gemm"), "CppMicroGemmWoQInt4Avx512")
    monkeypatch.setattr(cpu_gemm, "_int4_layout", lambda block: True)
    for name, isa in [("INT4", "avx2"), ("INT4_AVX512", "avx512_bf16")]:
        monkeypatch.setattr(cpu_gemm, name, replace(getattr(cpu_gemm, name), cls=None, why=None))
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        kernel = getattr(cpu_gemm, name)
        assert not kernel.install() and "CppMicroGemmWoQInt4Avx512" in kernel.why
        assert cpp_micro_gemm.micro_gemm_configs == before

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
    AVX-512: the probe must tell them apart, or the kernel would read every other block's codes as its own."""
    assert cpu_gemm._avx2_int4_layout() == (torch.backends.cpu.get_cpu_capability() == "AVX2")


def test_elsewhere_nothing_is_registered_and_the_reason_is_given(monkeypatch):
    import torch._inductor.select_algorithm  # noqa: F401  (inductor's codegen modules import it first)
    from torch._inductor.codegen import cpp_micro_gemm

    from llmstep.core import torch_compat

    before = dict(cpp_micro_gemm.micro_gemm_configs)
    tag = torch.compiler.config.cache_key_tag
    for isa, layout, why in [("avx512_bf16", True, "avx512_bf16, not AVX2"), ("amx", True, "amx, not AVX2"),
                             ("avx2", False, "32-column blocks")]:
        monkeypatch.setattr(cpu_gemm, "INT4", replace(cpu_gemm.INT4, cls=None, why=None))
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        monkeypatch.setattr(cpu_gemm, "_avx2_int4_layout", lambda layout=layout: layout)
        assert not cpu_gemm.INT4.install() and why in cpu_gemm.INT4.why
        assert cpp_micro_gemm.micro_gemm_configs == before and torch.compiler.config.cache_key_tag == tag


# The child: each case (rows, columns, depth, group size, activation dtype) compiled as one Int4Linear, two threads
# (the template may split k between them, mid-group).
CHILD = r"""
import json, sys, torch
from torch._inductor.utils import run_and_get_code
from llmstep.core.quantize import Int4Linear, dequantize_int4
from llmstep.kernels import cpu_gemm
from llmstep.engines.compile import compile_step

torch.set_num_threads(2)
if not cpu_gemm.INT4.install():
    sys.exit("not installed: " + str(cpu_gemm.INT4.why))
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
    results.append({"kernel": any(cpu_gemm.INT4_KERNEL_NAME in c for c in code), "layer": layer.kernel,
                    "error": (out.double() - want).abs().max().item(), "largest": want.abs().max().item(),
                    "bound": bound})
print(json.dumps(results))
"""

CASES = [(1, 96, 192, 32, "bfloat16"), (3, 64, 576, 64, "bfloat16"), (1, 32, 1024, 128, "bfloat16"),
         (9, 64, 128, 64, "bfloat16"), (4, 256, 256, 32, "bfloat16"), (1, 32, 1024, 128, "float32")]


@slow
def test_the_kernel_computes_the_matmul_at_every_row_count_group_and_split():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"an x86 CPU with AVX2 (torch's CPU capability here: {torch.backends.cpu.get_cpu_capability()})")
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for case, r in zip(CASES, results, strict=True):
        assert r["layer"] == "packed", (case, r)  # torch's packed layout
        if case[-1] == "float32":  # a float32 model's int4 layers: torch's own kernel (the kernel takes bf16)
            assert not r["kernel"] and r["error"] <= 1e-5 * r["bound"], (case, r)
            continue
        assert r["kernel"], (case, r)
        # float32 sums, the output rounded once to bf16: within half a bf16 step of the largest output, and then some
        assert r["error"] <= 2 ** -8 * r["largest"] + 1e-5 * r["bound"], (case, r)


def test_an_inductor_without_its_avx512_int4_kernel_to_build_on_registers_nothing(monkeypatch):
    import importlib

    from torch._inductor.codegen import cpp_micro_gemm

    from llmstep.core import torch_compat

    before = dict(cpp_micro_gemm.micro_gemm_configs)
    monkeypatch.setattr(cpu_gemm, "INT4", replace(cpu_gemm.INT4, cls=None, why=None))
    monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda: "avx2")
    monkeypatch.setattr(cpu_gemm, "_avx2_int4_layout", lambda: True)
    monkeypatch.delattr(importlib.import_module("torch._inductor.codegen.cpp_micro_gemm"), "CppMicroGemmWoQInt4Avx512")
    assert not cpu_gemm.INT4.install() and "CppMicroGemmWoQInt4Avx512" in cpu_gemm.INT4.why
    assert cpp_micro_gemm.micro_gemm_configs == before

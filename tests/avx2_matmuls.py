"""One-row matmuls compiled as a CPU step in a child process held to AVX2 (ATEN_CPU_CAPABILITY=avx2), with one of
kernels/cpu_gemm's float32-vector micro-kernels (`BF16_AVX2`, `INT8`) withheld or not, streaming or not: their outputs,
the template's constants per matmul, and the float64 matmul to hold them to. Runs on every x86 CPU with AVX2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

CHILD = r"""
import json, sys, torch
from torch._inductor.utils import run_and_get_code
from llmstep.core.quantize import Int8Linear
from llmstep.engines.compile import compile_step
from llmstep.kernels import cpu_gemm

torch.set_num_threads(2)
torch.set_grad_enabled(False)
kernel, shapes, variants, int8 = getattr(cpu_gemm, sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), \
    sys.argv[4] == "int8"
if not kernel.install():
    sys.exit("not installed: " + str(kernel.why))
g = torch.Generator().manual_seed(0)
layers = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for n, k in shapes]
for layer in layers:
    layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
if int8:
    layers = [Int8Linear.from_linear(layer) for layer in layers]
# [1, 1, depth]: a decode step's x (on a 2-D int8 x inductor folds the widened weights into a bf16 constant)
xs = [torch.randn(1, 1, k, generator=g).bfloat16() for n, k in shapes]


def step(*xs):
    return [layer(x) for layer, x in zip(layers, xs)]


runs = {}
for name, withheld, stream in variants:
    torch._dynamo.reset()
    with cpu_gemm.streaming(stream), cpu_gemm.withheld(withheld, only=(kernel,)):
        out, code = run_and_get_code(compile_step(step, torch.device("cpu"), gemm_backends="CPP", models=layers),
                                     *xs)
    code = "\n".join(code)
    def ints(name):  # one of the template's constants, one per matmul (where the template sets it), in code order
        return [int(line.split("=")[1].strip(" ;")) for line in code.splitlines()
                if line.strip().startswith(f"constexpr int64_t {name} =")]

    runs[name] = {"out": [o.float().flatten().tolist() for o in out], "widths": ints("Nr"), "ks": ints("K"),
                  "kr": ints("Kr"), "kc_blocks": ints("Kc_blocks"), "named": kernel.name in code,
                  "nta": "_MM_HINT_NTA" in code}
weights = [layer.weight.double() * layer.scales.double()[:, None] if int8 else layer.weight.double()
           for layer in layers]
want = [(x.double() @ w.T).flatten().tolist() for w, x in zip(weights, xs)]
print(json.dumps({"runs": runs, "want": want}))
"""


def one_row_matmuls(kernel: str, shapes: list[tuple[int, int]], variants: list[tuple[str, bool, bool | None]],
                    int8: bool = False) -> dict:
    """Each (columns, depth) of `shapes` a bf16 linear (int8: an Int8Linear of it) of a one-row x, compiled together
    once per variant (name, withheld, streaming's argument) with `cpu_gemm.<kernel>`: {"runs": {name: {"out",
    "widths", "ks", "kr", "kc_blocks", "named", "nta"}}, "want": the float64 matmuls}. Skips off x86 AVX2."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"an x86 CPU with AVX2 (torch's CPU capability here: {torch.backends.cpu.get_cpu_capability()})")
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"}
    args = [kernel, json.dumps(shapes), json.dumps(variants), "int8" if int8 else "bf16"]
    run = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])

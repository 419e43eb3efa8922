"""inductor's own int8 micro-kernel registered at wider blockings for one-row decode on AVX2
(llmstep/kernels/cpu_gemm.py's `INT8`): a compiled int8 decode step runs it (64 columns, where 64 divide the matmul)
and makes the eager step's tokens; `withheld` leaves inductor's own. In a child process with torch and
inductor held to AVX2 (ATEN_CPU_CAPABILITY=avx2), so it runs on every x86 CPU with AVX2, AVX-512 ones included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

slow = pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"),
                          reason="compiles with tuned matmuls on the CPU (~1 min); set LLMSTEP_SLOW_TESTS=1")

CHILD = r"""
import json, sys, torch
from torch._inductor.utils import run_and_get_code
import llmstep
from llmstep.core.config import LlamaConfig
from llmstep.core.quantize import quantize
from llmstep.engines.fast import FastDecoder
from llmstep.kernels import cpu_gemm

torch.set_num_threads(2)
if not cpu_gemm.INT8.install():
    sys.exit("not installed: " + str(cpu_gemm.INT8.why))
torch.manual_seed(0)
config = LlamaConfig(vocab_size=384, dim=192, n_layers=2, n_heads=3, n_kv_heads=1, hidden_dim=544, max_seq_len=64)
model = llmstep.Llama(config).to(torch.bfloat16)  # hidden 544 = 8.5 x 64: gate and up keep inductor's blockings
quantize(model, "int8", lm_head=True)
ids = torch.randint(0, 384, (9,)).tolist()
eager = FastDecoder(model, compile=False).generate(ids, 6, temperature=0, stop_ids=())
results = {}
for withheld in (False, True):
    torch._dynamo.reset()
    with cpu_gemm.withheld(withheld), torch.no_grad():
        decoder = FastDecoder(model, compile=True)
        out, code = run_and_get_code(decoder.generate, ids, 6, temperature=0, stop_ids=())
    results[str(withheld)] = {"kernel": any(cpu_gemm.INT8_KERNEL_NAME in c for c in code),
                              "wide": sum(c.count("_kernel<1, 64") for c in code),
                              "same_tokens": out.tokens == eager.tokens}
print(json.dumps(results))
"""


@slow
def test_a_one_row_decode_takes_the_wide_blocking_and_the_same_tokens():
    """A compiled int8 decode step (every linear int8, the LM head too) on a random model, some of whose matmuls 64
    does not divide: the step names the kernel, runs it at 64 columns, and decodes the eager step's greedy tokens;
    withheld, it runs inductor's own blockings, the same tokens."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"an x86 CPU with AVX2 (torch's CPU capability here: {torch.backends.cpu.get_cpu_capability()})")
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    on, off = results["False"], results["True"]
    assert on["kernel"] and on["wide"] and on["same_tokens"], on
    assert not off["kernel"] and off["same_tokens"], off


def test_elsewhere_nothing_is_registered_and_the_reason_is_given(monkeypatch):
    from dataclasses import replace

    import torch._inductor.select_algorithm  # noqa: F401  (inductor's codegen modules import it first)
    from torch._inductor.codegen import cpp_micro_gemm

    from llmstep.core import torch_compat
    from llmstep.kernels import cpu_gemm

    before = dict(cpp_micro_gemm.micro_gemm_configs)
    for isa in ("avx512_bf16", "amx", "avx512"):
        monkeypatch.setattr(cpu_gemm, "INT8", replace(cpu_gemm.INT8, cls=None, why=None))
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        assert not cpu_gemm.INT8.install() and f"{isa}, not AVX2" in cpu_gemm.INT8.why
        assert cpp_micro_gemm.micro_gemm_configs == before

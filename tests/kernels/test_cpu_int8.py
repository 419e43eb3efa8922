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


# ---- llmstep's own int8 kernel for one-row decode on AVX-512 (cpu_gemm.INT8_AVX512, kernels/cpu_int8.py) ----------

@pytest.fixture
def avx512_int8():
    from llmstep.kernels import cpu_gemm

    if not cpu_gemm.INT8_AVX512.install():
        pytest.skip(f"the kernel is not used on this machine: {cpu_gemm.INT8_AVX512.why}")


def _int8_linear(cols: int, depth: int, seed: int):
    from llmstep.core.quantize import Int8Linear

    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(depth, cols, bias=False).to(torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(torch.randn(cols, depth, generator=g))
    # x as a decode step has it, [batch 1, 1 token, depth]: on a 2-D x inductor folds the widened weights into a
    # bf16 constant for oneDNN's matmul instead of matching its weight-only int8 pattern
    return Int8Linear.from_linear(linear).requires_grad_(False), torch.randn(1, 1, depth, generator=g).bfloat16()


def _compiled(layer, x, stream, withheld=False):
    """layer(x) compiled as a CPU step (weights frozen), with the kernel streaming (`stream`: streaming's argument)
    or withheld: (output, generated code)."""
    from torch._inductor.utils import run_and_get_code

    from llmstep.engines.compile import compile_step
    from llmstep.kernels import cpu_gemm

    torch._dynamo.reset()
    backends = torch._inductor.config.max_autotune_gemm_backends
    torch._inductor.config.max_autotune_gemm_backends = "CPP"  # the template, whichever the tuner would time faster
    try:
        with cpu_gemm.streaming(stream), cpu_gemm.withheld(withheld), torch.no_grad():
            step = compile_step(lambda x: layer(x), torch.device("cpu"))
            out, code = run_and_get_code(step, x)
    finally:
        torch._inductor.config.max_autotune_gemm_backends = backends
    return out, "\n".join(code)


@slow
@pytest.mark.parametrize("cols,depth", [(2048, 384), (576, 576), (96, 128)])
def test_on_avx512_a_one_row_int8_matmul_runs_the_kernel_and_gives_inductors_bits(avx512_int8, cols, depth):
    """The kernel does inductor's arithmetic in inductor's order: streaming or not, its outputs are those of the step
    compiled without it, bit for bit, and the dequantised matmul's to within float32 sums; each matmul runs it at
    the width that keeps the threads evenly busy (576 columns: 32 wide with two threads, 18 blocks, not 9 of 64)
    among those that divide the matmul (96: 32, which 64 does not divide)."""
    from llmstep.kernels import cpu_gemm

    layer, x = _int8_linear(cols, depth, seed=cols + depth)
    inductors, code = _compiled(layer, x, None, withheld=True)
    assert cpu_gemm.INT8_AVX512_KERNEL_NAME not in code
    width = cpu_gemm.balanced_width(cols, torch.get_num_threads(), (64, 32) if cols % 64 == 0 else (32,))
    for stream in (True, False):
        out, code = _compiled(layer, x, stream)
        assert cpu_gemm.INT8_AVX512_KERNEL_NAME in code and f"constexpr int64_t Nr = {width};" in code, stream
        assert ("_MM_HINT_NTA" in code) == stream
        assert torch.equal(out, inductors), stream
    want = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).T  # [1, 1, cols]
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3


def test_on_avx512_it_is_named_in_the_cache_keys_and_only_where_it_was_measured(avx512_int8, monkeypatch):
    from dataclasses import replace

    from llmstep.core import torch_compat
    from llmstep.kernels import cpu_gemm

    tags = set()
    for on in (None, True, False):
        with cpu_gemm.streaming(on):
            assert cpu_gemm.INT8_AVX512.tag() in torch.compiler.config.cache_key_tag.split("+")
            tags.add(cpu_gemm.INT8_AVX512.tag())
    assert len(tags) == 3  # a step compiled streaming is never served to one that does not
    with cpu_gemm.withheld():
        assert not any(t.startswith(cpu_gemm.INT8_AVX512_KERNEL_NAME)
                       for t in torch.compiler.config.cache_key_tag.split("+"))
    for isa in ("amx", "avx2", "avx512"):  # not measured there: inductor's own kernels, and the reason
        monkeypatch.setattr(cpu_gemm, "INT8_AVX512", replace(cpu_gemm.INT8_AVX512, cls=None, why=None))
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        assert not cpu_gemm.INT8_AVX512.install() and f"({isa})" in cpu_gemm.INT8_AVX512.why

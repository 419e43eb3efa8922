"""llmstep's int8 micro-kernels for inductor's weight-only int8 template (llmstep/kernels/cpu_gemm.py).

`INT8`, inductor's own kernel registered at wider blockings for one-row decode on AVX2: a one-row int8 matmul runs
it at 64 columns where 64 divide the matmul, and gives the bits of inductor's own blockings (withheld), whole k or k
in the blocks the template adds up; a compiled int8 decode step runs it and makes the eager step's tokens. In child
processes with torch and inductor held to AVX2 (ATEN_CPU_CAPABILITY=avx2), so they run on every x86 CPU with AVX2,
AVX-512 ones included.

`INT8_AVX512`, llmstep's own kernel for one-row matmuls with AVX-512 BF16 and no AMX (kernels/cpu_int8.py): the
same bits as inductor's kernel, streaming or not (the widths it takes: tests/kernels/test_cpu_gemm.py); registered only
where it was measured; named in the compile cache keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from avx2_matmuls import one_row_matmuls

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


# (columns, depth) -> whether the kernel takes the matmul (64 columns) with two threads: 64 divides it (576: 9 blocks,
# 192: 3) or not (96, 40, 544: inductor's blockings); k in one block of the template (64 deep) or several
MATMULS = {(2048, 384): True, (576, 576): True, (192, 576): True, (128, 64): True, (96, 128): False,
           (40, 128): False, (544, 192): False, (640, 1024): True}

def test_on_avx2_a_one_row_int8_matmul_takes_64_columns_and_gives_inductors_bits():
    """Each matmul 64 divides runs the kernel at 64 columns, the rest inductor's own blockings; the outputs are those
    of inductor's blockings (withheld) bit for bit, whole k or in the template's blocks of k (each added to the sums
    before), and the float64 matmul of the dequantised weights' to within bf16's rounding."""
    result = one_row_matmuls("INT8", list(MATMULS), [("inductor", True, None), ("kernel", False, None)], int8=True)
    runs, want = result["runs"], result["want"]
    assert runs["kernel"]["named"] and not runs["inductor"]["named"]
    assert len(runs["inductor"]["widths"]) == len(runs["kernel"]["widths"]) == len(MATMULS)  # each the template's
    assert 64 not in runs["inductor"]["widths"]
    for (shape, takes), width in zip(MATMULS.items(), runs["kernel"]["widths"], strict=True):
        assert (width == 64) == takes, (shape, width)
    # Kr: the k-rows of each call of the kernel, the sums of the calls before coming in through C
    matmuls = list(zip(runs["kernel"]["widths"], runs["kernel"]["ks"], runs["kernel"]["kr"], strict=True))
    assert {block < k for width, k, block in matmuls if width == 64} == {True, False}, matmuls  # several, one
    for shape, got, inductors, exact in zip(MATMULS, runs["kernel"]["out"], runs["inductor"]["out"], want,
                                            strict=True):
        assert got == inductors, shape
        got, exact = torch.tensor(got, dtype=torch.float64), torch.tensor(exact, dtype=torch.float64)
        assert (got - exact).abs().max() <= 2 ** -7 * exact.abs().max(), shape


@pytest.mark.parametrize("name,isas,why", [
    ("INT8", ("avx512_bf16", "amx", "avx512"), "{isa}, not AVX2"),  # inductor's kernel, re-registered for AVX2 alone
    ("INT8_AVX512", ("amx", "avx2", "avx512"), "({isa})"),  # llmstep's: AVX-512 BF16 without AMX, where measured
])
def test_elsewhere_nothing_is_registered_and_the_reason_is_given(monkeypatch, name, isas, why):
    from dataclasses import replace

    import torch._inductor.select_algorithm  # noqa: F401  (inductor's codegen modules import it first)
    from torch._inductor.codegen import cpp_micro_gemm

    from llmstep.core import torch_compat
    from llmstep.kernels import cpu_gemm

    before = dict(cpp_micro_gemm.micro_gemm_configs)
    for isa in isas:
        monkeypatch.setattr(cpu_gemm, name, replace(getattr(cpu_gemm, name), cls=None, why=None))
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        kernel = getattr(cpu_gemm, name)
        assert not kernel.install() and why.format(isa=isa) in kernel.why
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
    """layer(x) compiled as a CPU step (weights frozen), its matmul held to inductor's C++ template (gemm_backends
    "CPP": no tuner choosing oneDNN instead), with the kernel streaming (`stream`: streaming's argument) or withheld:
    (output, generated code)."""
    from torch._inductor.utils import run_and_get_code

    from llmstep.engines.compile import compile_step
    from llmstep.kernels import cpu_gemm

    torch._dynamo.reset()
    with cpu_gemm.streaming(stream), cpu_gemm.withheld(withheld), torch.no_grad():
        step = compile_step(lambda x: layer(x), torch.device("cpu"), gemm_backends="CPP")
        out, code = run_and_get_code(step, x)
    return out, "\n".join(code)


@slow
@pytest.mark.parametrize("cols,depth,width", [(2048, 384, 64), (576, 576, 32), (96, 128, 32)])
def test_on_avx512_a_one_row_int8_matmul_runs_the_kernel_and_gives_inductors_bits(avx512_int8, cols, depth, width):
    """The kernel does inductor's arithmetic in inductor's order: streaming or not, its outputs are those of the step
    compiled without it, bit for bit, and the dequantised matmul's to within float32 sums; with two threads each
    matmul runs it at the width that keeps them evenly busy (576 columns: 32 wide, 18 blocks, not 9 of 64) among
    those that divide the matmul (96: 32, which 64 does not divide)."""
    from llmstep.kernels import cpu_gemm

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layer, x = _int8_linear(cols, depth, seed=cols + depth)
        inductors, code = _compiled(layer, x, None, withheld=True)
        runs = [(stream, *_compiled(layer, x, stream)) for stream in (True, False)]
    finally:
        torch.set_num_threads(threads)
    assert cpu_gemm.INT8_AVX512_KERNEL_NAME not in code
    for stream, out, code in runs:
        assert cpu_gemm.INT8_AVX512_KERNEL_NAME in code and f"constexpr int64_t Nr = {width};" in code, stream
        assert ("_MM_HINT_NTA" in code) == stream
        assert torch.equal(out, inductors), stream
    want = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).T  # [1, 1, cols]
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3


def test_on_avx512_it_is_named_in_the_cache_keys_streaming_or_not(avx512_int8):
    from llmstep.kernels import cpu_gemm

    tags = set()
    for on in (None, True, False):
        with cpu_gemm.streaming(on):
            assert cpu_gemm.INT8_AVX512.tag() in torch.compiler.config.cache_key_tag.split("+")
            tags.add(cpu_gemm.INT8_AVX512.tag())
    assert len(tags) == 3  # a step compiled streaming is never served to one that does not
    with cpu_gemm.withheld(only=(cpu_gemm.INT8_AVX512,)):
        tags = torch.compiler.config.cache_key_tag.split("+")
        assert not any(t.startswith(cpu_gemm.INT8_AVX512_KERNEL_NAME) for t in tags)
        assert all(k.tag() in tags for k in cpu_gemm.kernels() if k.installed and k is not cpu_gemm.INT8_AVX512)

"""llmstep's bf16 kernel for one-row matmuls on CPUs with AVX2 alone (cpu_gemm.BF16_AVX2, kernels/cpu_bf16.py).

Inductor's arithmetic in inductor's order, so a compiled one-row bf16 matmul gives the same bits with it as with
inductor's own float32-vector kernel (withheld), streaming or not, whole k or k in blocks the template adds up; it
takes the balanced width that divides the matmul and leaves the rest to inductor (the rule's table, shared with
INT8_AVX512: tests/kernels/test_cpu_gemm.py). In a child process with torch and inductor held to AVX2
(ATEN_CPU_CAPABILITY=avx2), so it runs on every x86 CPU with AVX2, AVX-512 ones included.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from avx2_matmuls import one_row_matmuls

from llmstep.core import torch_compat
from llmstep.kernels import cpu_gemm

# (columns, depth): 64 and 32 columns wide, a matmul neither divides (48: inductor's kernel), k in several blocks
SHAPES = [(2048, 384), (576, 576), (96, 128), (48, 128), (640, 1024)]
WIDTHS = {(2048, 384): 64, (576, 576): 32, (96, 128): 32, (48, 128): None, (640, 1024): 64}

@pytest.fixture(scope="module")
def avx2_runs():
    variants = [("inductor", True, None), ("kernel", False, False), ("streaming", False, True)]
    result = one_row_matmuls("BF16_AVX2", SHAPES, variants)
    for run in result["runs"].values():  # the k-rows of each call of the kernel, where the template sets them
        run["blocks"] = [kc * kr for kc, kr in zip(run["kc_blocks"], run["kr"], strict=False)]
    return result


def test_on_avx2_a_one_row_bf16_matmul_gives_inductors_bits_streaming_or_not(avx2_runs):
    """The same bits as inductor's kernel, whole k or in the template's blocks of k (the 384- and 1024-deep ones come
    in several, each added to the sums before), streaming its weights or not; and the float64 matmul's to within
    bf16's rounding of the outputs."""
    runs, want = avx2_runs["runs"], avx2_runs["want"]
    for name in ("kernel", "streaming"):
        for shape, got, inductors in zip(SHAPES, runs[name]["out"], runs["inductor"]["out"], strict=True):
            assert got == inductors, (name, shape)
    for shape, got, exact in zip(SHAPES, runs["kernel"]["out"], want, strict=True):
        got, exact = torch.tensor(got, dtype=torch.float64), torch.tensor(exact, dtype=torch.float64)
        assert (got - exact).abs().max() <= 2 ** -7 * exact.abs().max(), shape


def test_on_avx2_each_matmul_takes_the_balanced_width_that_divides_it(avx2_runs):
    """With two threads: 2048 and 640 columns at 64, 576 at 32 (18 blocks, not 9 of 64), 96 at 32 (64 does not
    divide it), 48 at inductor's own blocking; the code names the kernel, and streams only when told to."""
    runs = avx2_runs["runs"]
    assert not runs["inductor"]["named"] and all(w in (8, 16, 24) for w in runs["inductor"]["widths"])
    for name in ("kernel", "streaming"):
        run = runs[name]
        assert run["named"] and run["nta"] == (name == "streaming"), name
        ours = sorted(w for w in WIDTHS.values() if w)
        assert sorted(w for w in run["widths"] if w in (32, 64)) == ours, run["widths"]
        assert len(run["widths"]) == len(SHAPES), run["widths"]  # the fifth (48 columns): inductor's 8, 16 or 24
        # some of the kernel's matmuls take k in blocks of fewer rows than their depth: their sums come in through C
        matmuls = list(zip(run["widths"], run["ks"], run["blocks"], strict=True))
        assert any(block < k for width, k, block in matmuls if width in (32, 64)), matmuls


def test_elsewhere_nothing_is_registered_and_the_reason_is_given(monkeypatch):
    import torch._inductor.select_algorithm  # noqa: F401  (inductor's codegen modules import it first)
    from torch._inductor.codegen import cpp_micro_gemm

    before = dict(cpp_micro_gemm.micro_gemm_configs)
    for isa in ("avx512_bf16", "amx", "avx512", "none"):  # measured on AVX2 alone (AVX-512 BF16 has cpu_gemm.BF16)
        monkeypatch.setattr(cpu_gemm, "BF16_AVX2", replace(cpu_gemm.BF16_AVX2, cls=None, why=None))
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        assert not cpu_gemm.BF16_AVX2.install() and f"{isa}, not AVX2 alone" in cpu_gemm.BF16_AVX2.why
        assert cpp_micro_gemm.micro_gemm_configs == before

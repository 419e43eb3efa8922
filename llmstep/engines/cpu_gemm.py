"""A bf16 dot-product micro-kernel for inductor's C++ GEMM template, for one-row decode on CPUs with AVX-512 BF16.

A decode step's matmuls are GEMVs. On a CPU without AMX, the micro-kernel of inductor's tuned C++ GEMM template
widens every bf16 weight to float32 before its FMA (`CppMicroGemmFP32Vec`), where llama.cpp multiplies bf16 pairs
directly with AVX-512 BF16's `vdpbf16ps`. On a CPU with AMX, inductor's AMX kernel multiplies tiles of many rows;
on a decode step's one-row matmuls it measured slower than a dot product (results/README.md, claim 12). This module
gives the template that dot product: weights packed in pairs along k (the template's VNNI2 layout, as for AMX), each
activation pair broadcast, float32 accumulators. bf16 products are exact in float32 and the sums float32, as the
widening kernel's; only the order of the additions differs (and `vdpbf16ps` treats subnormal inputs as zero), so
the step is the same function to within float32 rounding (tests/engines/test_cpu_gemm.py holds it to a float64
matmul).

`install()` registers it once per process (compile.compile_step calls it for a CPU step) where the CPU has AVX-512
BF16: without AMX for every matmul, with AMX ranked with inductor's AMX kernels for matmuls of up to `AMX_ROWS`
rows (results/README.md, claim 12, measures both). Inductor's registry is internal to torch
(llmstep.core.torch_compat's `micro_gemm`): outside the tested torch range, or with a registry of another shape,
`install` registers nothing and says why (`skipped`).
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

from ..core import torch_compat

__all__ = ["install", "installed", "skipped", "withheld", "cache_tag", "KERNEL_NAME"]

KERNEL_NAME = "llmstep_bf16_dot"  # appears in the generated C++ of a step that uses it
_state: dict[str, object] = {"why": None, "cls": None}  # cls: the registered kernel class, once installed
AMX_ROWS = 1  # with AMX, the matmuls of up to this many rows run here (a decode step's); the rest on AMX tiles

# The kernel. `B` is packed as the template packs it for a VNNI2 micro-kernel: element (k, n) of the block at
# (k / 2) * 2 * ldb + 2 * n + k % 2, so one 512-bit load holds 16 columns' (k, k + 1) pairs, one float32 lane
# each, which `vdpbf16ps` multiplies by the broadcast pair (A[m, k], A[m, k + 1]) and adds to that lane.
_ENTRY = r"""
// llmstep_bf16_dot: llmstep/engines/cpu_gemm.py
template <int64_t ROWS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void {{kernel_name}}_rows(
    const at::BFloat16* A, const at::BFloat16* B, float* C,
    int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool accum
) {
    for (int64_t n = 0; n < N; n += 64) {
        const int64_t width = std::min<int64_t>(N - n, 64);  // columns in this block: 64, or the tail
        __mmask16 mask[4];
        for (int j = 0; j < 4; ++j) {
            const int64_t lanes = std::clamp<int64_t>(width - 16 * j, 0, 16);
            mask[j] = static_cast<__mmask16>((1u << lanes) - 1u);
        }
        __m512 acc[ROWS][4], acc2[ROWS][4];  // acc2: odd k-pairs, a second chain of sums (ROWS == 1)
        for (int r = 0; r < ROWS; ++r) {
            for (int j = 0; j < 4; ++j) {
                acc[r][j] = _mm512_setzero_ps();
                acc2[r][j] = _mm512_setzero_ps();
            }
        }
        const at::BFloat16* b = B + 2 * n;
        int64_t k = 0;
        if constexpr (ROWS == 1) {
            for (; k + 4 <= K; k += 4) {
                int32_t p0, p1;
                std::memcpy(&p0, A + k, 4);
                std::memcpy(&p1, A + k + 2, 4);
                const __m512bh a0 = (__m512bh)_mm512_set1_epi32(p0);
                const __m512bh a1 = (__m512bh)_mm512_set1_epi32(p1);
                const at::BFloat16* b0 = b + k * ldb;  // (k / 2) * 2 * ldb, k even
                const at::BFloat16* b1 = b0 + 2 * ldb;
                for (int j = 0; j < 4; ++j) {
                    if (!mask[j]) break;
                    const __m512i w0 = _mm512_maskz_loadu_epi32(mask[j], b0 + 32 * j);
                    const __m512i w1 = _mm512_maskz_loadu_epi32(mask[j], b1 + 32 * j);
                    acc[0][j] = _mm512_dpbf16_ps(acc[0][j], a0, (__m512bh)w0);
                    acc2[0][j] = _mm512_dpbf16_ps(acc2[0][j], a1, (__m512bh)w1);
                }
            }
        }
        for (; k < K; k += 2) {
            const at::BFloat16* b0 = b + k * ldb;
            __m512bh w[4];
            for (int j = 0; j < 4; ++j) {
                w[j] = (__m512bh)_mm512_maskz_loadu_epi32(mask[j], b0 + 32 * j);
            }
            for (int r = 0; r < ROWS; ++r) {
                int32_t p;
                std::memcpy(&p, A + r * lda + k, 4);
                const __m512bh a = (__m512bh)_mm512_set1_epi32(p);
                for (int j = 0; j < 4; ++j) {
                    if (!mask[j]) break;
                    acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
                }
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            for (int j = 0; j < 4; ++j) {
                if (!mask[j]) break;
                __m512 sum = _mm512_add_ps(acc[r][j], acc2[r][j]);
                float* c = C + r * ldc + n + 16 * j;
                if (accum) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask[j], c));
                _mm512_mask_storeu_ps(c, mask[j], sum);
            }
        }
    }
}

static void {{kernel_name}}_block(
    const at::BFloat16* A, const at::BFloat16* B, float* C,
    int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool accum
) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        {{kernel_name}}_rows<4>(A + m * lda, B, C + m * ldc, N, K, lda, ldb, ldc, accum);
    }
    for (; m < M; ++m) {
        {{kernel_name}}_rows<1>(A + m * lda, B, C + m * ldc, N, K, lda, ldb, ldc, accum);
    }
}

{{declare_kernel}} {
    {{kernel.assert_function}}(K % 2 == 0, "K dimension must be a multiple of 2");
{%- if pack_vnni_B_locally %}
    // B as it is in memory ([K, N], row stride ldb: a tensor computed in the step, not a frozen weight):
    // each 64 columns packed into pairs along k first, as inductor's AMX kernel does it
    {{template.codegen_allocate_weight_buffer("packed_B_buf", input2_t, "K", 64)}}
    for (int64_t n = 0; n < N; n += 64) {
        const int64_t width = std::min<int64_t>(N - n, 64);
        at::vec::pack_vnni2(B + n, packed_B_buf, ldb, K, width);
        {{kernel_name}}_block(A, packed_B_buf, C + n, M, width, K, lda, width, ldc, accum);
    }
{%- else %}
    {{kernel_name}}_block(A, B, C, M, N, K, lda, ldb, ldc, accum);
{%- endif %}
}
"""


def installed() -> bool:
    """Whether this process's inductor has the kernel."""
    return _state["cls"] is not None


def skipped() -> str | None:
    """Why `install` registered nothing, or None."""
    return _state["why"]  # type: ignore[return-value]


def install() -> bool:
    """Register the kernel with inductor's GEMM template (once per process); True when it is registered."""
    if installed() or _state["why"]:
        return installed()
    if why := torch_compat.missing("micro_gemm"):  # inductor's registry is internal: used where it was tested
        _state["why"] = f"inductor's C++ GEMM micro-kernel registry is not used: {why}"
        return False
    isa = torch_compat.cpu_vector_isa()
    if isa not in ("amx", "avx512_bf16"):
        _state["why"] = f"the CPU's vector ISA ({isa}) has no AVX-512 BF16"
        return False
    amx = isa == "amx"

    def fits(config, m, n, k, alpha, num_threads, **kwargs) -> bool:
        return alpha == 1 and k % 2 == 0 and (not amx or m <= AMX_ROWS)  # AMX_ROWS read at each compile

    try:  # (block_m, block_n, block_k): 4 rows share each weight load; 1 row (a decode step) ranks first at m = 1
        _state["cls"] = torch_compat.register_micro_gemm("BF16Dot", _ENTRY, [(4, 64, 32), (1, 64, 32)], fits,
                                                         rank=isa)
    except (AttributeError, TypeError, AssertionError) as e:
        _state["why"] = f"this torch's inductor registers micro-kernels differently ({type(e).__name__}: {e})"
        return False
    _tag(True)
    return True


def _tag(on: bool) -> None:
    """Name the kernel in torch.compile's cache keys (`cache_key_tag`): the registry is not part of them, so
    without the tag a step compiled with the kernel and one compiled without could be served from each other's
    cache entries (across processes, or either side of `withheld`)."""
    tags = [t for t in torch.compiler.config.cache_key_tag.split("+") if t and not t.startswith(KERNEL_NAME)]
    torch.compiler.config.cache_key_tag = "+".join(tags + [cache_tag()] * on)


def cache_tag() -> str:
    """The kernel's name and a hash of its source and of the rows it takes with AMX: a changed kernel or rule is
    compiled anew, not read from a cache."""
    return f"{KERNEL_NAME}-{hashlib.sha256(f'{_ENTRY}{AMX_ROWS}'.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def withheld(when: bool = True):
    """Steps compiled inside run inductor's own kernels (an A/B of this one: scripts/ab_cpu.py's `~nodot`);
    `when` False: a no-op, for callers that withhold it in some runs only."""
    if not when or not install():
        yield
        return
    _tag(False)
    try:
        with torch_compat.micro_gemm_withheld(_state["cls"]):
            yield
    finally:
        _tag(True)

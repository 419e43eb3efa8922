"""The C++ of llmstep's bf16 micro-kernels: the dot product for CPUs with AVX-512 BF16 (`AVX512`, registered by
`cpu_gemm.BF16`, whose docstring tells it), and the kernel for one-row matmuls on CPUs with AVX2 alone (`AVX2`,
registered by `cpu_gemm.BF16_AVX2`, below).

`AVX2` is a Jinja template of the body that inductor's float32-vector entry (`CppMicroGemmFP32Vec`)
calls for each block of columns, one row of bf16 activations (a decode step's matmul) times a block of bf16 weights
as the template packs them for that entry: [N / BLOCK_N, K, BLOCK_N], one k-row of a block BLOCK_N weights.

Such a CPU has no bf16 arithmetic: every weight is widened to float32 (a 16-bit shift) and multiplied-and-added into
its column's float32 sum, k after k, one chain per column. That is inductor's own kernel's arithmetic in its order, so
the step is the same function to the bit (tests/kernels/test_cpu_bf16.py). What differs is how a weight reaches its
register. Inductor's kernel loads 8 bf16 weights a vector as a part of a 16-wide bf16 vector
(`Vectorized<BFloat16>::loadu(ptr, 8)`), which at::vec does by zeroing a buffer on the stack, copying the 16 bytes in
and loading it back: each 8 weights cost two stores and a load more, and on the AVX2 EPYC its one-row matmuls ran at
~2 weights a cycle a core whether their weights came from memory or from the L3 (results/README.md, claim 2,
session 32).
Here one 256-bit load brings 16 columns' weights: the even columns' are the low halves of its 32-bit lanes (shifted
up 16 bits), the odd ones' the high halves (the low halves masked off), two chains of multiply-adds; the sums go
back to column order once a block is done (and come in so, where the template adds a later block of k to them).
Blocks are 64 or 32 columns (four or two pairs of chains), as `cpu_gemm.balanced_width` splits the matmul over the
threads, and as many as the threads at least.
"""

from .cpu_int8 import VEC_SIGNATURE

# The kernel's template variables: inductor's (kernel_name, input_t, input2_t, output_t, restrict_keyword, trans_b,
# tail_n) and cpu_gemm's streaming ones (stream_weights, stream_ahead).
AVX2 = r"""
// llmstep_bf16_avx2: llmstep/kernels/cpu_bf16.py
{%- if trans_b or tail_n %}
static_assert(false, "llmstep_bf16_avx2 takes neither a transposed B nor a tail of N");
{%- endif %}
// One row of bf16 activations times a block of BLOCK_N columns of bf16 weights ([K, BLOCK_N], row stride ldb), into
// float32: per k, the activation broadcast, each 16 columns' weights one load, widened as two vectors (even and odd
// columns) and multiplied-and-added into their columns' sums, one chain per column, k after k.
template <int64_t BLOCK_M, int64_t BLOCK_N, bool accum, bool prefetch=false>
__attribute__((target("avx2,fma")))
""" + VEC_SIGNATURE + r"""    static_assert(BLOCK_M == 1, "one row: a decode step's matmul");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 64, "a block is 16, 32, 48 or 64 columns");
    constexpr int PAIRS = BLOCK_N / 16;  // 16 columns a load; lane i: column 2i in its low half, 2i + 1 in its high
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m256 even[PAIRS], odd[PAIRS];  // [PAIRS][8] float32: columns 16p + 2i and 16p + 2i + 1 in lane i
    for (int p = 0; p < PAIRS; ++p) {
        if constexpr (accum) {  // C's columns 16p .. 16p + 15 into even and odd lanes
            const __m256 lo = _mm256_loadu_ps(C + 16 * p), hi = _mm256_loadu_ps(C + 16 * p + 8);
            const __m256 a = _mm256_permute2f128_ps(lo, hi, 0x20);  // c0..c3 | c8..c11
            const __m256 b = _mm256_permute2f128_ps(lo, hi, 0x31);  // c4..c7 | c12..c15
            even[p] = _mm256_shuffle_ps(a, b, 0x88);  // c0 c2 c4 c6 | c8 c10 c12 c14
            odd[p] = _mm256_shuffle_ps(a, b, 0xDD);  // c1 c3 c5 c7 | c9 c11 c13 c15
        } else {
            even[p] = _mm256_setzero_ps();
            odd[p] = _mm256_setzero_ps();
        }
    }
    for (int64_t k = 0; k < K; ++k) {
        const {{input2_t}}* b = B + k * ldb;
{%- if stream_weights %}
        // the weight row's lines, stream_ahead bytes on, past the caches (kernels/cpu_gemm.py's streams_weights)
        for (int64_t line = 0; line < 2 * BLOCK_N; line += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(b) + {{stream_ahead}} + line, _MM_HINT_NTA);
        }
{%- endif %}
        const __m256 a = _mm256_set1_ps(static_cast<float>(A[k]));
        for (int p = 0; p < PAIRS; ++p) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * p));
            even[p] = _mm256_fmadd_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), even[p]);
            odd[p] = _mm256_fmadd_ps(a, _mm256_castsi256_ps(_mm256_and_si256(w, high)), odd[p]);
        }
    }
    for (int p = 0; p < PAIRS; ++p) {  // back to column order
        const __m256 lo = _mm256_unpacklo_ps(even[p], odd[p]);  // c0 c1 c2 c3 | c8 c9 c10 c11
        const __m256 hi = _mm256_unpackhi_ps(even[p], odd[p]);  // c4 c5 c6 c7 | c12 c13 c14 c15
        _mm256_storeu_ps(C + 16 * p, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(C + 16 * p + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}
"""


# The AVX-512 BF16 dot product. `B` is packed as the template packs it for a VNNI2 micro-kernel: element (k, n) of
# the block at (k / 2) * 2 * ldb + 2 * n + k % 2, so one 512-bit load holds 16 columns' (k, k + 1) pairs, one float32
# lane each, which `vdpbf16ps` multiplies by the broadcast pair (A[m, k], A[m, k + 1]) and adds to that lane.
AVX512 = r"""
// llmstep_bf16_dot: llmstep/kernels/cpu_bf16.py
template <int64_t ROWS, bool STREAM = false>
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
                if constexpr (STREAM) {  // the 8 * ldb bytes read STREAM_AHEAD on, past the caches (streams_weights)
                    const char* ahead = reinterpret_cast<const char*>(b0) + {{stream_ahead}};
                    for (int64_t line = 0; line < 8 * ldb; line += 64) _mm_prefetch(ahead + line, _MM_HINT_NTA);
                }
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
{%- if stream_weights and not pack_vnni_B_locally %}
    if (M == 1) {  // one row (a decode step's matmul): each weight read once a step, more bytes than the caches hold
        {{kernel_name}}_rows<1, true>(A, B, C, N, K, lda, ldb, ldc, accum);
        return;
    }
{%- endif %}
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

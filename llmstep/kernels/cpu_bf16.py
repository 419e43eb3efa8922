"""The C++ of llmstep's bf16 micro-kernel for one-row matmuls on CPUs with AVX2 alone (registered by
`cpu_gemm.BF16_AVX2`): a Jinja template of the body that inductor's float32-vector entry (`CppMicroGemmFP32Vec`)
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
inline void {{kernel_name}}_kernel(
    const {{input_t}}* {{restrict_keyword}} A,
    const {{input2_t}}* {{restrict_keyword}} B,
    {{output_t}}* {{restrict_keyword}} C,
    int64_t K,
    int64_t lda,
    int64_t ldb,
    int64_t ldc
) {
    static_assert(BLOCK_M == 1, "one row: a decode step's matmul");
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

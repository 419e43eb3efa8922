"""The C++ of llmstep's int8 micro-kernel for inductor's weight-only int8 GEMM template on AVX-512 (registered by
`cpu_gemm.INT8_AVX512`): a Jinja template of the body that inductor's float32-vector entry (`CppMicroGemmFP32Vec`)
calls for each block of columns, one row of bf16 activations (a decode step's matmul) times a block of int8
weights as the template packs them: [N / BLOCK_N, K, BLOCK_N] bytes, one k-row of a block BLOCK_N bytes.

The arithmetic is inductor's own kernel's, in its order: each weight widened to float32, multiplied by the row's
activation (bf16, exact in float32) and added to its column's float32 sum, k after k, one chain per column; the
per-column scale is the template's epilogue. So the step is the same function to the bit as with inductor's
kernel (tests/kernels/test_cpu_int8.py). What differs is where the weights go: in a step whose weights outgrow the
last-level cache they stream past it (`_MM_HINT_NTA`, `stream_ahead` bytes ahead, by cpu_gemm's `streams_weights`
rule), where inductor's kernel prefetches them into every cache (`_MM_HINT_T0`) and so evicts what the rest of the
step reads again. The blocks are 64 columns, or 32 where that splits the matmul more evenly over the threads
(cpu_gemm.balanced_width), against inductor's 32 at small m; that alone measured level (results/README.md, claim 2).
"""

# What inductor's float32-vector entry calls for each block of columns (CppMicroGemmFP32Vec's TEMPLATE_KERNEL): the
# kernels for that entry (this one, cpu_bf16.AVX2) are declared so, after their template line and instruction set
VEC_SIGNATURE = r"""inline void {{kernel_name}}_kernel(
    const {{input_t}}* {{restrict_keyword}} A,
    const {{input2_t}}* {{restrict_keyword}} B,
    {{output_t}}* {{restrict_keyword}} C,
    int64_t K,
    int64_t lda,
    int64_t ldb,
    int64_t ldc
) {
"""

# The kernel's template variables: inductor's (kernel_name, input_t, input2_t, output_t, restrict_keyword, block_k,
# trans_b, tail_n) and cpu_gemm's streaming ones (stream_weights, stream_ahead).
AVX512 = r"""
// llmstep_int8_avx512: llmstep/kernels/cpu_int8.py
{%- if trans_b or tail_n %}
static_assert(false, "llmstep_int8_avx512 takes neither a transposed B nor a tail of N");
{%- endif %}
// One row of bf16 activations times a block of BLOCK_N columns of int8 weights ([K, BLOCK_N] bytes, row stride
// ldb), into float32: per k, the activation broadcast, BLOCK_N / 16 vectors of weights widened to float32 and
// multiplied-and-added into one chain of sums per 16 columns, as inductor's kernel does, in its order.
template <int64_t BLOCK_M, int64_t BLOCK_N, bool accum, bool prefetch=false>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
""" + VEC_SIGNATURE + r"""    static_assert(BLOCK_M == 1, "one row: a decode step's matmul");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 64, "a block is 16, 32, 48 or 64 columns");
    constexpr int COLS = BLOCK_N / 16;
    __m512 acc[COLS];
    for (int c = 0; c < COLS; ++c) acc[c] = accum ? _mm512_loadu_ps(C + 16 * c) : _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const int8_t* b = B + k * ldb;
{%- if stream_weights %}
        // a weight row's line, stream_ahead bytes on, past the caches (kernels/cpu_gemm.py's streams_weights)
        if (((k * ldb) & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(b) + {{stream_ahead}}, _MM_HINT_NTA);
{%- else %}
        if constexpr (prefetch) {  // inductor's own prefetch: the row block_k on, into every cache
            if (((k * ldb) & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(b + {{block_k}} * ldb), _MM_HINT_T0);
        }
{%- endif %}
        const __m512 a = _mm512_set1_ps(static_cast<float>(A[k]));
        for (int c = 0; c < COLS; ++c) {
            const __m128i w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * c));
            acc[c] = _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(w8)), acc[c]);
        }
    }
    for (int c = 0; c < COLS; ++c) _mm512_storeu_ps(C + 16 * c, acc[c]);
}
"""

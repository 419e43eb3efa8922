"""The C++ of llmstep's int4 micro-kernels for inductor's weight-only int4 GEMM template (registered by
`cpu_gemm.INT4` and `cpu_gemm.INT4_AVX512`): Jinja templates of the body that the template's entry calls for each
block of columns, in torch's CPU int4 layout: [N / B, K, B / 2] bytes, byte j of a block's k-row holding column j's
4-bit code q in its low nibble and column j + B / 2's in its high one, B = 32 where torch runs its AVX2 kernels and
64 with AVX-512; weight (k, n) = (q - 8) * s + z, (s, z) its group's bf16 scale and zero.

Both take a group's sum as s * sum(a * q) + (z - 8 * s) * sum(a), the scale and zero applied once per group and
column rather than per weight (so an infinite activation gives NaN, inf * 0 or inf - inf, where dequantise + matmul
gives an infinity: a step with one is lost either way). scripts/int4_kernel_bench.py times either alone, out of
inductor.
"""

# What inductor's int4 template entry calls for each block of columns (CppMicroGemmWoQInt4Avx512's entry): both
# kernels are declared so, after their template line and instruction set
_SIGNATURE = r"""inline void {{kernel_name}}_kernel(
    const {{input_t}}* {{restrict_keyword}} A,
    const uint8_t* {{restrict_keyword}} B,
    {{output_t}}* {{restrict_keyword}} C,
    int64_t K,
    int64_t lda,
    int64_t ldb,
    int64_t ldc,
    int64_t q_group_size,
    const at::BFloat16* {{restrict_keyword}} ScaleAndZeros,
    int64_t lds,
    int64_t k_start) {
"""
# and both walk k a group at a time, [k0, k1), reading the group's (scale, zero) row `sz`
_GROUPS = r"""  // groups start where k_start + k is a multiple of the group size: the first may be a group's tail
  for (int64_t k0 = 0, kb = 0, k1; k0 < K; k0 = k1, ++kb) {
    k1 = std::min<int64_t>(K, k0 + q_group_size - (k_start + k0) % q_group_size);
    // (scale, zero) pairs of bf16: one 32-bit lane per column, the scale in its low half, the zero in its high
    const at::BFloat16* sz = ScaleAndZeros + kb * lds;
"""

# The AVX2 kernel: the body that inductor's int4 micro-kernel entry calls for each block of 32 columns (its
# `TEMPLATE_KERNEL`; torch_compat.register_int4_micro_gemm).
AVX2 = r"""
// llmstep_int4_avx2: llmstep/kernels/cpu_int4.py
// A block of 32 columns in torch's int4 layout on an AVX2 CPU ([N / 32, K, 16] bytes: byte j of a k-row holds
// column j in its low nibble, column j + 16 in its high one) times ROWS rows of A, in float32. Weight (k, n) is
// (q - 8) * s + z, q its 4-bit code, (s, z) its group's; the sum over a group is taken as
// s * sum(a * q) + (z - 8 * s) * sum(a): per weight one widening and one multiply-add, the scale applied per group.
// Even and odd k go to two chains of sums (vg, vh; asum's two halves), added per group: a chain waits for its last
// multiply-add, and one row's four vectors alone would leave the FMA units waiting on that latency.
template <int64_t BLOCK_M, int64_t BLOCK_N, bool accum>
__attribute__((target("avx2,fma")))
""" + _SIGNATURE + r"""  static_assert(BLOCK_N == 32, "a block is 32 columns");
  constexpr int ROWS = BLOCK_M;
  constexpr int COLS = 4;  // vectors of 8 floats
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256i high16 = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m256 eight = _mm256_set1_ps(8.0f);
  __m256 vc[ROWS][COLS], vg[ROWS][COLS], vh[ROWS][COLS];  // the output; this group's sum(a * q), even and odd k
  __m256 scale[COLS], shift[COLS];  // this group's s and z - 8 s, per column
  float asum[ROWS][2];  // this group's sum(a), per row, even and odd k
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      vc[r][c] = accum ? _mm256_loadu_ps(C + r * ldc + 8 * c) : _mm256_setzero_ps();
    }
  }
  auto flush = [&]() {  // the group's sums into the output
    for (int r = 0; r < ROWS; ++r) {
      const __m256 as = _mm256_set1_ps(asum[r][0] + asum[r][1]);
      for (int c = 0; c < COLS; ++c) {
        vc[r][c] = _mm256_fmadd_ps(_mm256_add_ps(vg[r][c], vh[r][c]), scale[c], vc[r][c]);
        vc[r][c] = _mm256_fmadd_ps(as, shift[c], vc[r][c]);
      }
    }
  };
""" + _GROUPS + r"""    for (int c = 0; c < COLS; ++c) {
      const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 16 * c));
      scale[c] = _mm256_castsi256_ps(_mm256_slli_epi32(t, 16));
      shift[c] = _mm256_fnmadd_ps(eight, scale[c], _mm256_castsi256_ps(_mm256_and_si256(t, high16)));
    }
    for (int r = 0; r < ROWS; ++r) {
      asum[r][0] = asum[r][1] = 0.0f;
      for (int c = 0; c < COLS; ++c) vg[r][c] = vh[r][c] = _mm256_setzero_ps();
    }
    auto row = [&](int64_t k, __m256 (&acc)[ROWS][COLS], int half) {  // weight row k into one chain
      const uint8_t* b = B + k * ldb;
      __m256 q[COLS];
      for (int c = 0; c < 2; ++c) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * c)));
        q[c] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low4));
        q[c + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
      }
      for (int r = 0; r < ROWS; ++r) {
        const float a = static_cast<float>(A[r * lda + k]);
        asum[r][half] += a;
        const __m256 va = _mm256_set1_ps(a);
        for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_fmadd_ps(va, q[c], acc[r][c]);
      }
    };
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {
      row(k, vg, 0);
      row(k + 1, vh, 1);
    }
    if (k < k1) row(k, vg, 0);
    flush();
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) _mm256_storeu_ps(C + r * ldc + 8 * c, vc[r][c]);
  }
}
"""


# The AVX-512 int4 kernel: the same body's place for 64-column blocks (torch's layout with AVX-512), where inductor's
# own kernel widens each code to float32 and dequantises it with a multiply-add before a second one with the
# activation: two float32 multiply-adds a weight, 4 chains of them at one row.
AVX512 = r"""
// llmstep_int4_avx512: llmstep/kernels/cpu_int4.py
// A block of 64 columns in torch's int4 layout on an AVX-512 CPU ([N / 64, K, 32] bytes: byte j of a k-row holds
// column j in its low nibble, column j + 32 in its high one) times ROWS rows of bf16 activations, with AVX-512
// BF16's dot product of pairs: rows k and k + 1 become, per column, the pair of their 4-bit codes q as bf16
// (0..15, exact) in one 32-bit lane, multiplied by the broadcast pair (a[k], a[k + 1]) and added in float32.
// Weight (k, n) is (q - 8) * s + z, so a group's sum is s * sum(a * q) + (z - 8 * s) * sum(a): the scale and zero
// applied once per group and column, as the AVX2 kernel does. For one row, even and odd pairs of rows go to two
// chains of sums, added per group: four chains alone would wait on the dot product's latency.

// word i -> bf16(i % 16): vpermw reads an index's low 5 bits, so a byte's bit 4 (its high nibble's) is ignored
alignas(64) static const uint16_t {{kernel_name}}_codes[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
// word 2 i of a pair vector: row k's byte i (16 + i for the second vector); word 2 i + 1: row k + 1's (+ 32)
alignas(64) static const uint16_t {{kernel_name}}_pairs[2][32] = {
    {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
    {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};

// rows k and k + 1 of a block's codes times ROWS rows' pairs (a[k], a[k + 1]), into acc; a tail row k alone pairs
// with itself and its activation pair is (a[k], 0), so the second code does not count
template <int64_t ROWS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"), always_inline))
static inline void {{kernel_name}}_pair(
    const {{input_t}}* {{restrict_keyword}} A, int64_t lda, int64_t k, const uint8_t* b0, const uint8_t* b1,
    bool tail, __m512 (&acc)[ROWS][4]) {
  const __m512i codes = _mm512_load_si512({{kernel_name}}_codes);
  const __m512i r0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0)));
  const __m512i r1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1)));
  const __m512i p0 = _mm512_permutex2var_epi16(r0, _mm512_load_si512({{kernel_name}}_pairs[0]), r1);
  const __m512i p1 = _mm512_permutex2var_epi16(r0, _mm512_load_si512({{kernel_name}}_pairs[1]), r1);
  __m512bh w[4];  // columns 0..15, 16..31 (low nibbles), 32..47, 48..63 (high)
  w[0] = (__m512bh)_mm512_permutexvar_epi16(p0, codes);
  w[1] = (__m512bh)_mm512_permutexvar_epi16(p1, codes);
  w[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(p0, 4), codes);
  w[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(p1, 4), codes);
  for (int r = 0; r < ROWS; ++r) {
    int32_t p = 0;
    std::memcpy(&p, A + r * lda + k, tail ? 2 : 4);
    const __m512bh a = (__m512bh)_mm512_set1_epi32(p);
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w[c]);
  }
}

template <int64_t BLOCK_M, int64_t BLOCK_N, bool accum>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
""" + _SIGNATURE + r"""  static_assert(BLOCK_N == 64, "a block is 64 columns");
  constexpr int ROWS = BLOCK_M;
  constexpr int COLS = 4;  // vectors of 16 columns
  const __m512i high16 = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512i ones = _mm512_set1_epi16(0x3F80);  // bf16 1.0: sum(a) as a dot product with ones
  const __m512 eight = _mm512_set1_ps(8.0f);
  __m512 vc[ROWS][COLS], vg[ROWS][COLS], vh[ROWS][COLS];  // the output; this group's sum(a * q), two chains
  __m512 scale[COLS], shift[COLS];  // this group's s and z - 8 s, per column
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      vc[r][c] = accum ? _mm512_loadu_ps(C + r * ldc + 16 * c) : _mm512_setzero_ps();
    }
  }
""" + _GROUPS + r"""{%- if stream_weights %}
    // the (scale, zero) row of this block's group 4 on, past the caches too: 256 bytes a group, read once a step
    for (int c = 0; c < COLS; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(sz + 4 * lds + 32 * c), _MM_HINT_NTA);
    }
{%- endif %}
    for (int c = 0; c < COLS; ++c) {
      const __m512i t = _mm512_loadu_si512(sz + 32 * c);
      scale[c] = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
      shift[c] = _mm512_fnmadd_ps(eight, scale[c], _mm512_castsi512_ps(_mm512_and_si512(t, high16)));
    }
    for (int r = 0; r < ROWS; ++r) {
      for (int c = 0; c < COLS; ++c) vg[r][c] = vh[r][c] = _mm512_setzero_ps();
    }
    int64_t k = k0;
    if constexpr (ROWS == 1) {
      for (; k + 4 <= k1; k += 4) {
{%- if stream_weights %}
        // the 4 * ldb bytes of codes read stream_ahead on, past the caches (kernels/cpu_gemm.py's streams_weights)
        for (int64_t line = 0; line < 4 * ldb; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(B + k * ldb) + {{stream_ahead}} + line, _MM_HINT_NTA);
        }
{%- endif %}
        {{kernel_name}}_pair<ROWS>(A, lda, k, B + k * ldb, B + (k + 1) * ldb, false, vg);
        {{kernel_name}}_pair<ROWS>(A, lda, k + 2, B + (k + 2) * ldb, B + (k + 3) * ldb, false, vh);
      }
    }
    for (; k + 2 <= k1; k += 2) {
      {{kernel_name}}_pair<ROWS>(A, lda, k, B + k * ldb, B + (k + 1) * ldb, false, vg);
    }
    if (k < k1) {
      {{kernel_name}}_pair<ROWS>(A, lda, k, B + k * ldb, B + k * ldb, true, vg);
    }
    for (int r = 0; r < ROWS; ++r) {
      __m512 s = _mm512_setzero_ps();  // this group's sum(a)
      for (int64_t j = k0; j < k1; j += 32) {
        const int64_t n = std::min<int64_t>(32, k1 - j);
        const __mmask32 m = n == 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << n) - 1u);
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_maskz_loadu_epi16(m, A + r * lda + j), (__m512bh)ones);
      }
      const __m512 as = _mm512_set1_ps(_mm512_reduce_add_ps(s));
      for (int c = 0; c < COLS; ++c) {
        vc[r][c] = _mm512_fmadd_ps(_mm512_add_ps(vg[r][c], vh[r][c]), scale[c], vc[r][c]);
        vc[r][c] = _mm512_fmadd_ps(as, shift[c], vc[r][c]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) _mm512_storeu_ps(C + r * ldc + 16 * c, vc[r][c]);
  }
}
"""

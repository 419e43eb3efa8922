"""The C++ of llmstep's CPU kernels of 8-bit activations (kernels/cpu_int4a8.py builds it, once per machine and ISA):
int4-a8's one-row and many-row matmul (`mm`), int8-a8's (`mm8`) and the rounding of a row of activations to 8 bits
(`quantize`). LLMSTEP_NS stands for the op namespace of the ISA's build (`cpu_int4a8.namespace`); the one source
builds for AVX2 or, where the build's flags include AVX-512 VNNI and VL, for those (`LLMSTEP_VNNI`: the same integers,
in fewer instructions).
"""

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

#ifndef AHEAD
#define AHEAD 4096
#endif
// AVX-512 VNNI's 256-bit dot products of bytes (a build for AVX512-VNNI and VL), else AVX2's
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LLMSTEP_VNNI 1
#else
#define LLMSTEP_VNNI 0
#endif

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is float32's upper half: widening is exact, a shift
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// One row of K activations -> K codes p and K / 32 steps d, x ~= p * d per block of 32: d = max|x| / 127,
// p = round-half-even(x * (1 / d)) (0 where 1 / d is 0 or not finite), each in float32 as
// int4a8.quantize_activations takes them; a block holding a NaN gets d = NaN. E[g] (where E is not null): the sum
// over group g's blocks b of d[b] * sum(p of b), in order.
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t blocks_per_group, int8_t* p, float* d, float* E) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  float e = 0.0f;
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + 32 * b + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    float db = hmax(m) / 127.0f;
    float id = db != 0.0f ? 1.0f / db : 0.0f;
    if (!std::isfinite(id)) id = 0.0f;  // a step below 1 / FLT_MAX: the block's codes 0, as the reference has them
    if (_mm256_movemask_ps(nan)) {  // max() may drop a NaN: the block's step says it
      db = std::numeric_limits<float>::quiet_NaN();
      id = 0.0f;
    }
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(r);
    }
    // 32 int32 -> 32 int8 in order (the packs interleave 128-bit lanes; the permute puts them back)
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32 * b), bytes);
    d[b] = db;
    if (E == nullptr) continue;  // int8-a8's weights are symmetric: no zero point, no sum of codes
    const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    e += db * static_cast<float>(_mm_cvtsi128_si32(t));
    if ((b + 1) % blocks_per_group == 0) {
      E[b / blocks_per_group] = e;
      e = 0.0f;
    }
  }
}

inline void load_sz(const float* p, __m256& s, __m256& z) { s = _mm256_loadu_ps(p); z = _mm256_loadu_ps(p + 8); }
inline void load_sz(const c10::BFloat16* p, __m256& s, __m256& z) { s = load8(p); z = load8(p + 8); }

// The hint a weight stream is prefetched with: into the L1 (T0), or past the outer caches (NTA: a step whose weights
// outgrow the last-level cache, where keeping them would evict what the step reads again).
template <bool NT>
inline void prefetch(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), NT ? _MM_HINT_NTA : _MM_HINT_T0);
}

// A block's 8 columns' exact sums of 32 products of 4-bit codes (a vector's 32 bytes per 8 inputs, CV vectors apart)
// and 8-bit activations p: with AVX-512 VNNI, `vpdpbusd` adds each lane's 4 products into 32 bits at once; with AVX2,
// `vpmaddubsw` adds them in pairs (at most 2 * 15 * 127 = 3,810), eight of those sum in 16-bit lanes without
// overflow (30,480) and `vpmaddwd` widens them. The same integers either way.
template <int CV>
inline __m256i block_sums(const uint8_t* wb, const int8_t* pb) {
  const __m256i low4 = _mm256_set1_epi8(15);
#if LLMSTEP_VNNI
  __m256i lo_sums = _mm256_setzero_si256(), hi_sums = _mm256_setzero_si256();  // two chains: half the latency
#else
  __m256i is = _mm256_setzero_si256();  // 16 int16 sums: at most 8 * 3,810
#endif
#pragma GCC unroll 4
  for (int o = 0; o < 4; ++o) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + o * CV * 32));
    const __m256i lo = _mm256_and_si256(w, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
    int32_t lo4, hi4;  // 4 activations each, as one 32-bit lane to broadcast
    std::memcpy(&lo4, pb + 8 * o, 4);
    std::memcpy(&hi4, pb + 8 * o + 4, 4);
    const __m256i a0 = _mm256_set1_epi32(lo4), a1 = _mm256_set1_epi32(hi4);
#if LLMSTEP_VNNI
    lo_sums = _mm256_dpbusd_epi32(lo_sums, lo, a0);
    hi_sums = _mm256_dpbusd_epi32(hi_sums, hi, a1);
#else
    is = _mm256_add_epi16(is, _mm256_maddubs_epi16(lo, a0));
    is = _mm256_add_epi16(is, _mm256_maddubs_epi16(hi, a1));
#endif
  }
#if LLMSTEP_VNNI
  return _mm256_add_epi32(lo_sums, hi_sums);
#else
  return _mm256_madd_epi16(is, _mm256_set1_epi16(1));
#endif
}

// A tile of CV vectors of 8 columns ([K / 8][CV][32] bytes: one stream) times one row's codes p, steps d and E.
template <int CV, bool NT, typename S>
inline void columns(const int8_t* p, const float* d, const float* E, const uint8_t* W, const S* SZ, int64_t K,
                    int64_t bpg, float* y) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  __m256 acc[CV];
  for (int c = 0; c < CV; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / (32 * bpg); ++g) {
    const __m256 eg = _mm256_set1_ps(E[g]);
    for (int64_t l = 0; l < bpg * CV * 128; l += 64) prefetch<NT>(W + g * bpg * CV * 128 + AHEAD + l);  // AHEAD on
    for (int c = 0; c < CV; ++c) {  // a column vector at a time: its sums stay in registers
      __m256 ag = _mm256_setzero_ps();  // sum_b d_b * sum(p q) over the group's blocks
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        const uint8_t* wb = W + b * 4 * CV * 32 + c * 32;
        const int8_t* pb = p + 32 * b;
        ag = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums<CV>(wb, pb)), _mm256_set1_ps(d[b]), ag);
      }
      __m256 s, z;
      load_sz(SZ + (g * CV + c) * 16, s, z);
      acc[c] = _mm256_fmadd_ps(s, ag, acc[c]);
      acc[c] = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, s, z), eg, acc[c]);  // (z - 8 s) * sum_b d_b * sum(p)
    }
  }
  for (int c = 0; c < CV; ++c) _mm256_storeu_ps(y + 8 * c, acc[c]);
}

// A call's rounded rows (codes p, steps d, group sums E) in buffers the calling thread keeps for its next call (~120
// calls a decode step: each malloc and free of them was host time the other threads waited through); a prompt's past
// KEEP bytes are freed after its call. Taken in the calling thread, read by its tasks on the other threads.
struct Buffers {
  std::vector<int8_t> p;
  std::vector<float> d, E;
};
struct Rounded : Buffers {
  static constexpr size_t KEEP = 1 << 20;
  static Buffers& kept() { thread_local Buffers buffers; return buffers; }
  Rounded(int64_t M, int64_t K, int64_t G) {
    std::swap<Buffers>(*this, kept());
    p.resize(std::max<size_t>(p.size(), M * K));
    d.resize(std::max<size_t>(d.size(), M * K / 32));
    E.resize(std::max<size_t>(E.size(), M * G));
  }
  ~Rounded() { if (p.size() <= KEEP) std::swap<Buffers>(*this, kept()); }  // else a prompt's: freed
};

template <bool NT, typename T, typename S>
void mm_rows(const T* x, const uint8_t* W, const S* SZ, float* y, int64_t M, int64_t N, int64_t K, int64_t group) {
  const int64_t bpg = group / 32, blocks = K / 32, G = K / group;
  Rounded rounded(M, K, G);
  int8_t* p = rounded.p.data();
  float *d = rounded.d.data(), *E = rounded.E.data();
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x + m * K, K, bpg, p + m * K, d + m * blocks, E + m * G);
  }
  const int64_t wstride = K * 4, szstride = G * 16;  // a vector of 8 columns: K / 2 * 8 bytes, G * 16 values
  constexpr int64_t TILE = 4;  // column vectors a task takes at a time
  at::parallel_for(0, (N / 8 + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = TILE * t, cv = std::min<int64_t>(TILE, N / 8 - v0);
      for (int64_t m = 0; m < M; ++m) {  // the tile's weights stay in cache for the next row
        const int8_t* pm = p + m * K;
        const float* dm = d + m * blocks;
        const float* Em = E + m * G;
        const uint8_t* w = W + v0 * wstride;
        const S* sz = SZ + v0 * szstride;
        float* ym = y + m * N + 8 * v0;
        switch (cv) {
          case 4: columns<4, NT>(pm, dm, Em, w, sz, K, bpg, ym); break;
          case 3: columns<3, NT>(pm, dm, Em, w, sz, K, bpg, ym); break;
          case 2: columns<2, NT>(pm, dm, Em, w, sz, K, bpg, ym); break;
          default: columns<1, NT>(pm, dm, Em, w, sz, K, bpg, ym); break;
        }
      }
    }
  });
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float to_float(float s) { return s; }
inline float to_float(c10::BFloat16 s) { return static_cast<float>(s); }

// int8-a8: one column's K int8 weights (a row of the plain [N, K] matrix) times R rows' codes p (row stride K) and
// steps d (row stride K / 32): s * sum_b d_b * sum(p q), the block sums exact in integers. `vpmaddubsw` takes unsigned
// times signed bytes, so each weight's sign moves onto its activation (|q| * sign(q) p; |-128| reads as 128 unsigned):
// a pair of products is at most 2 * 128 * 127 = 32,512, inside int16; `vpmaddwd` adds pairs into 32-bit lanes (with
// VNNI, `vpdpbusd` adds each lane's 4 products into 32 bits at once: the same integers). Eight lanes of 4 products,
// scaled by the block's step, accumulate in float32 and are summed once at the end. The R rows (a prompt's) share
// each load of the weights and their magnitudes; every row's arithmetic is the one-row order.
template <int R, bool NT, typename S>
inline void column8(const int8_t* p, const float* d, const int8_t* w, S s, int64_t K, float* y, int64_t N) {
  const int64_t blocks = K / 32;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch<NT>(w + 32 * b + AHEAD);  // the stream AHEAD bytes on
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * b));
    const __m256i magnitude = _mm256_sign_epi8(q, q);
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + r * K + 32 * b));
#if LLMSTEP_VNNI
      const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(a, q));
#else
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a, q)),
                                               _mm256_set1_epi16(1));
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = hsum(acc[r]) * to_float(s);
}

template <bool NT, typename T, typename S>
void mm8_rows(const T* x, const int8_t* W, const S* scales, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = K / 32;
  Rounded rounded(M, K, 0);
  int8_t* p = rounded.p.data();
  float* d = rounded.d.data();
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, blocks, p + m * K, d + m * blocks, nullptr);
  // each thread a run of columns: its weights one stream, each column's K bytes read once for all the rows, 4 at a time
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        column8<4, NT>(p + m * K, d + m * blocks, W + n * K, scales[n], K, y + m * N + n, N);
      }
      for (; m < M; ++m) {
        column8<1, NT>(p + m * K, d + m * blocks, W + n * K, scales[n], K, y + m * N + n, N);
      }
    }
  });
}

void check8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8a8 mm: x must be [M, K] float32 or bfloat16 with K a multiple of 32, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) == x.size(1) && w.is_contiguous(),
              "int8a8 mm: weights must be contiguous int8 [N, K] for K = ", x.size(1), ", got ", w.sizes(), " ",
              w.scalar_type());
  TORCH_CHECK(s.dim() == 1 && s.size(0) == w.size(0) && s.is_contiguous() &&
              (s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16),
              "int8a8 mm: scales must be contiguous bf16 or float32 [N] for N = ", w.size(0), ", got ", s.sizes());
}

// f(activations, scales) with each tensor's data as its element type: float32 or bf16
template <typename F>
void with_types(const at::Tensor& x, const at::Tensor& s, F&& f) {
  const bool bf16_scales = s.scalar_type() == at::kBFloat16;
  if (x.scalar_type() == at::kBFloat16) {
    const auto* a = x.data_ptr<c10::BFloat16>();
    if (bf16_scales) f(a, s.data_ptr<c10::BFloat16>());
    else f(a, s.data_ptr<float>());
  } else {
    const auto* a = x.data_ptr<float>();
    if (bf16_scales) f(a, s.data_ptr<c10::BFloat16>());
    else f(a, s.data_ptr<float>());
  }
}

at::Tensor mm8_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, bool stream) {
  check8(x, w, s);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, xc.options().dtype(at::kFloat));
  const int8_t* W = w.data_ptr<int8_t>();
  float* out = y.data_ptr<float>();
  with_types(xc, s, [&](auto a, auto scales) {
    if (stream && M == 1) mm8_rows<true>(a, W, scales, out, M, N, K);  // a decode step's weights, read once
    else mm8_rows<false>(a, W, scales, out, M, N, K);
  });
  return y;
}

at::Tensor mm8_meta(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, bool stream) {
  return at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
}

void check(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4a8 mm: x must be [M, K] float32 or bfloat16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t K = x.size(1);
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, "int4a8 mm: K = ", K, " and the group ", group,
              " must be multiples of 32, K of the group");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == 4 * K && w.is_contiguous(),
              "int4a8 mm: weights must be contiguous uint8 [N / 8, 4 K] for K = ", K, ", got ", w.sizes());
  TORCH_CHECK(sz.is_contiguous() && (sz.scalar_type() == at::kFloat || sz.scalar_type() == at::kBFloat16) &&
              sz.numel() == w.size(0) * (K / group) * 16,
              "int4a8 mm: scales and zeros must be contiguous bf16 or float32, 16 K / group per 8 columns");
}

at::Tensor mm_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t group, bool stream) {
  check(x, w, sz, group);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0) * 8;
  at::Tensor y = at::empty({M, N}, xc.options().dtype(at::kFloat));
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  with_types(xc, sz, [&](auto a, auto z) {
    if (stream && M == 1) mm_rows<true>(a, W, z, out, M, N, K, group);  // a decode step's weights, read once
    else mm_rows<false>(a, W, z, out, M, N, K, group);
  });
  return y;
}

at::Tensor mm_meta(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t group, bool stream) {
  return at::empty({x.size(0), w.size(0) * 8}, x.options().dtype(at::kFloat));
}

// x [M, K] -> its 8-bit codes [M, K] (int8) and each block of 32's step [M, K / 32] (float32), unset
std::tuple<at::Tensor, at::Tensor> quantized_like(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4a8 quantize: x must be [M, K] float32 or bfloat16 with K a multiple of 32");
  return {at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kChar)),
          at::empty({x.size(0), x.size(1) / 32}, x.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> quantize_meta(const at::Tensor& x) { return quantized_like(x); }

std::tuple<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x) {
  auto [p, d] = quantized_like(x);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  std::vector<float> E(K / 32);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* pm = p.data_ptr<int8_t>() + m * K;
    float* dm = d.data_ptr<float>() + m * (K / 32);
    if (xc.scalar_type() == at::kBFloat16) quantize_row(xc.data_ptr<c10::BFloat16>() + m * K, K, 1, pm, dm, E.data());
    else quantize_row(xc.data_ptr<float>() + m * K, K, 1, pm, dm, E.data());
  }
  return {p, d};
}

}  // namespace

TORCH_LIBRARY(LLMSTEP_NS, m) {
  m.def("mm(Tensor x, Tensor w, Tensor sz, int group, bool stream=False) -> Tensor");
  m.def("quantize(Tensor x) -> (Tensor, Tensor)");
  m.def("mm8(Tensor x, Tensor w, Tensor s, bool stream=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(LLMSTEP_NS, CPU, m) {
  m.impl("mm", &mm_cpu);
  m.impl("quantize", &quantize_cpu);
  m.impl("mm8", &mm8_cpu);
}
TORCH_LIBRARY_IMPL(LLMSTEP_NS, Meta, m) {
  m.impl("mm", &mm_meta);
  m.impl("mm8", &mm8_meta);
  m.impl("quantize", &quantize_meta);
}
"""

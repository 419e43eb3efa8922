"""The C++ of llmstep's CPU attention op (kernels/cpu_attention.py builds it, once per machine and ISA): the masked
attention of a few query rows per KV head over the cache as it lies (`attention`), and a decode step's form that
takes the last slot each row sees instead of a mask (`attention_prefix`). LLMSTEP_NS stands for the op namespace of
the ISA's build (`cpu_attention.op_name`).
"""

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

// The vector of W float32 lanes the kernel is written in: AVX-512's 16 or AVX2's 8, whichever the build targets
// (install() builds the one the CPU runs; the tests build both where the CPU runs both).
#if defined(__AVX512F__)
constexpr int W = 16;
using vec = __m512;
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec load(const c10::BFloat16* p) {  // bf16 is float32's upper half: widening is exact, a shift
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec splat(float x) { return _mm512_set1_ps(x); }
inline vec zero() { return _mm512_setzero_ps(); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline vec nearest(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
inline vec times_pow2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p 2^n
inline vec zero_below(vec p, vec x, float floor) {  // p where x >= floor, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(floor), _CMP_GE_OQ), p);
}
inline float sum(vec x) { return _mm512_reduce_add_ps(x); }
inline float top(vec x) { return _mm512_reduce_max_ps(x); }
inline int nan_lanes(vec x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }  // a bit per NaN lane
#else
constexpr int W = 8;
using vec = __m256;
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec load(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec splat(float x) { return _mm256_set1_ps(x); }
inline vec zero() { return _mm256_setzero_ps(); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec fnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline vec nearest(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec times_pow2(vec p, vec n) {  // p 2^n for whole n in [-126, 0]: 2^n built in float32's exponent field
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vec zero_below(vec p, vec x, float floor) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(floor), _CMP_GE_OQ), p);
}
inline float sum(vec x) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
inline float top(vec x) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}
inline int nan_lanes(vec x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
#endif

// e^x for W values x <= 0 (below -87: 0) to within ~3 float32 ulps: x = n ln2 + r with |r| <= ln2/2, e^r by its
// Taylor polynomial to r^6, times 2^n. The same bits on both widths.
inline vec exp_lanes(vec x) {
  const vec y = max(x, splat(-87.0f));
  const vec n = nearest(mul(y, splat(1.44269504f)));  // in [-126, 0]
  vec r = fnmadd(n, splat(0.693145752f), y);  // ln2 in two parts: no cancellation error
  r = fnmadd(n, splat(1.42860677e-6f), r);
  vec p = splat(1.0f / 720);
  p = fmadd(p, r, splat(1.0f / 120));
  p = fmadd(p, r, splat(1.0f / 24));
  p = fmadd(p, r, splat(1.0f / 6));
  p = fmadd(p, r, splat(0.5f));
  p = fmadd(p, r, splat(1.0f));
  p = fmadd(p, r, splat(1.0f));
  return zero_below(times_pow2(p, n), x, -87.0f);
}

constexpr int64_t MOST_ROWS = 4;  // query rows taken together at most: their chains and keys fill the registers

// G query rows of one KV head that see the same n slots, listed in seen (a decode step's n_rep stacked query heads)
// -> their outputs: only those slots read, each key and value widened once for all G rows, KEYS keys at a
// time (G KEYS chains of multiply-adds in flight, within the 16 vector registers). Each row's arithmetic is that of
// a row alone: its dot with each key a chain over d, its softmax, its even and odd chains over the values.
// With part, the slots are one chunk of the rows' slots: each row's partial softmax goes there instead (D + 2
// floats a row: its top score, the sum of its weights e^(score - top) or NaN for a NaN score, and its values'
// weighted mean, 0 where every weight is 0), for `combine` to join with the other chunks'. Its weights divided by
// their sum first, so a chunk's sums stay within its values' range (a chunk of large values, each weighted near 1
// by its own top, would otherwise overflow where the whole row, weighting them against its top, does not).
template <typename T, int G, int KEYS>
void attend_rows(const T* q, const T* kh, const T* vh, const int64_t* seen, int64_t n, T* out, int64_t S, int64_t D,
                 float scale, float* rows, float* score, float* part) {
  const int64_t padded = (S + W - 1) / W * W;
  for (int g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; d += W) store(rows + g * D + d, mul(load(q + g * D + d), splat(scale)));
  }
  int64_t i = 0;
  for (; i + KEYS <= n; i += KEYS) {  // the scores of the visible keys, KEYS at a time
    const T* key[KEYS];
    for (int j = 0; j < KEYS; ++j) key[j] = kh + seen[i + j] * D;
    vec a[G][KEYS];
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < KEYS; ++j) a[g][j] = zero();
    }
    for (int64_t d = 0; d < D; d += W) {
      vec kx[KEYS];
      for (int j = 0; j < KEYS; ++j) kx[j] = load(key[j] + d);
      for (int g = 0; g < G; ++g) {
        const vec x = load(rows + g * D + d);
        for (int j = 0; j < KEYS; ++j) a[g][j] = fmadd(x, kx[j], a[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < KEYS; ++j) score[g * padded + i + j] = sum(a[g][j]);
    }
  }
  for (; i < n; ++i) {
    const T* ks = kh + seen[i] * D;
    vec a[G];
    for (int g = 0; g < G; ++g) a[g] = zero();
    for (int64_t d = 0; d < D; d += W) {
      const vec kx = load(ks + d);
      for (int g = 0; g < G; ++g) a[g] = fmadd(load(rows + g * D + d), kx, a[g]);
    }
    for (int g = 0; g < G; ++g) score[g * padded + i] = sum(a[g]);
  }
  vec inverse[G];
  const int64_t used = (n + W - 1) / W * W;  // the scores' vectors (not the cache's: a row seeing 10 of 4,096 slots)
  for (int g = 0; g < G; ++g) {  // each row's weights, e^(score - top), and 1 / their sum (a chunk: their sum)
    float* sc = score + g * padded;
    const float hidden = -std::numeric_limits<float>::infinity();
    for (int64_t j = n; j < used; ++j) sc[j] = hidden;  // past the visible ones: weight 0
    vec highest = splat(hidden);
    int nans = 0;  // max() passes a NaN on or drops it by its place: a NaN score is looked for apart
    for (int64_t j = 0; j < used; j += W) {
      const vec s = load(sc + j);
      highest = max(highest, s);
      nans |= nan_lanes(s);
    }
    const float topmost = top(highest);
    const vec shift = splat(topmost);
    vec total = zero();
    for (int64_t j = 0; j < used; j += W) {
      const vec p = exp_lanes(sub(load(sc + j), shift));
      store(sc + j, p);
      total = add(total, p);
    }
    // a NaN score: the row NaN, as SDPA's softmax makes it; none visible (n = 0, no value summed): the row 0, as
    // SDPA gives for a mask row that shows nothing (1 / a sum of 0 would make it NaN)
    const float nan = std::numeric_limits<float>::quiet_NaN(), weights = sum(total);
    // (a chunk whose weights are all 0, its scores all -inf: a mean of 0, its weight in `combine` 0)
    inverse[g] = nans ? splat(nan) : n == 0 || (part != nullptr && weights == 0) ? zero() : splat(1.0f / weights);
    if (part != nullptr) {  // a chunk's weights divided by their sum before the values: its mean cannot overflow
      part[g * (D + 2)] = topmost;
      part[g * (D + 2) + 1] = nans ? nan : weights;
      for (int64_t j = 0; j < used; j += W) store(sc + j, mul(load(sc + j), inverse[g]));
    }
  }
  for (int64_t d = 0; d < D; d += W) {  // the weighted sums of the visible values, W columns at a time
    vec even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = zero();
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      const vec v0 = load(vh + seen[j] * D + d), v1 = load(vh + seen[j + 1] * D + d);
      for (int g = 0; g < G; ++g) {
        even[g] = fmadd(splat(score[g * padded + j]), v0, even[g]);
        odd[g] = fmadd(splat(score[g * padded + j + 1]), v1, odd[g]);
      }
    }
    if (j < n) {
      const vec v0 = load(vh + seen[j] * D + d);
      for (int g = 0; g < G; ++g) even[g] = fmadd(splat(score[g * padded + j]), v0, even[g]);
    }
    for (int g = 0; g < G; ++g) {
      if (part != nullptr) {
        store(part + g * (D + 2) + 2 + d, add(even[g], odd[g]));
        continue;
      }
      alignas(64) float o[W];
      store(o, mul(add(even[g], odd[g]), inverse[g]));
      for (int c = 0; c < W; ++c) out[g * D + d + c] = static_cast<T>(o[c]);
    }
  }
}

// The outputs of G rows whose slots were taken in nc chunks, from each chunk's partial softmax (`attend_rows`'s part,
// chunk after chunk): with M the top of the chunks' tops and a_c = e^(top_c - M) l_c each chunk's share of the
// weights, out = sum_c a_c m_c / sum_c a_c (m_c its mean), summed in chunk order (the same bits on every machine and
// thread count); a NaN in any chunk makes the row NaN.
template <typename T>
void combine(const float* part, int64_t nc, int64_t G, int64_t D, T* out) {
  const int64_t stride = MOST_ROWS * (D + 2);
  std::vector<float> w(nc);
  for (int64_t g = 0; g < G; ++g) {
    const float* p = part + g * (D + 2);
    float highest = -std::numeric_limits<float>::infinity(), total = 0.0f;
    bool nans = false;
    for (int64_t c = 0; c < nc; ++c) {
      highest = std::max(highest, p[c * stride]);
      nans |= std::isnan(p[c * stride + 1]);
    }
    for (int64_t c = 0; c < nc; ++c) {
      alignas(64) float e[W];
      store(e, exp_lanes(splat(p[c * stride] - highest)));
      w[c] = e[0] * p[c * stride + 1];
      total += w[c];
    }
    const vec inverse = splat(nans ? std::numeric_limits<float>::quiet_NaN() : 1.0f / total);
    for (int64_t d = 0; d < D; d += W) {
      vec acc = zero();
      for (int64_t c = 0; c < nc; ++c) acc = fmadd(splat(w[c]), load(p + c * stride + 2 + d), acc);
      alignas(64) float o[W];
      store(o, mul(acc, inverse));
      for (int64_t i = 0; i < W; ++i) out[g * D + d + i] = static_cast<T>(o[i]);
    }
  }
}

// A run: g query rows of KV head bh (batch row bh / H) from row r that see the same n slots.
struct Run {
  int64_t bh, r, g, n;
};

// The runs' attention: one task a run, or, where a run sees n > chunk slots (chunk 0: none), a task a chunk of its
// slots, min(most, ceil(n / chunk)) chunks of equal size (the last smaller); the tasks shared among the threads by
// torch's `at::parallel_for`, then each split run's chunks combined. The chunks follow from the slots a run sees,
// not the threads: the same bits on every machine. visible(b, r, first, count, seen) lists the count slots row r of
// batch row b sees from its first-th on in seen (every row of a run sees the same).
template <typename T, typename Visible>
void attend_runs(const std::vector<Run>& runs, const T* q, const T* k, const T* v, T* out, int64_t H, int64_t R,
                 int64_t S, int64_t D, float scale, int64_t chunk, int64_t most, Visible visible) {
  struct Task {
    int64_t run, first, count, part;  // the run's slots first .. first + count - 1; part: its chunk's (-1: none)
  };
  struct Split {
    int64_t run, part, chunks;  // a run taken in chunks: its first chunk's part, how many
  };
  std::vector<Task> tasks;
  std::vector<Split> split;
  int64_t parts = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(runs.size()); ++i) {
    const int64_t n = runs[i].n;
    const int64_t pieces = chunk <= 0 ? 1 : std::min(most, (n + chunk - 1) / chunk);
    if (pieces <= 1) {
      tasks.push_back({i, 0, n, -1});
      continue;
    }
    const int64_t size = (n + pieces - 1) / pieces;
    split.push_back({i, parts, (n + size - 1) / size});
    for (int64_t first = 0; first < n; first += size) tasks.push_back({i, first, std::min(size, n - first), parts++});
  }
  const int64_t stride = MOST_ROWS * (D + 2);
  std::unique_ptr<float[]> partial(new float[parts * stride]);  // each written before it is read: left unset
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    const int64_t padded = (S + W - 1) / W * W;
    std::vector<float> rows(MOST_ROWS * D), score(MOST_ROWS * padded);
    std::vector<int64_t> seen(padded);
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      const Run& run = runs[t.run];
      visible(run.bh / H, run.r, t.first, t.count, seen.data());
      const int64_t* from = seen.data();
      const T *qr = q + (run.bh * R + run.r) * D, *kh = k + run.bh * S * D, *vh = v + run.bh * S * D;
      T* o = out + (run.bh * R + run.r) * D;
      float* part = t.part < 0 ? nullptr : partial.get() + t.part * stride;
      static_assert(MOST_ROWS == 4, "a case below for each run length");
      switch (run.g) {
        case 1: attend_rows<T, 1, 4>(qr, kh, vh, from, t.count, o, S, D, scale, rows.data(), score.data(), part); break;
        case 2: attend_rows<T, 2, 4>(qr, kh, vh, from, t.count, o, S, D, scale, rows.data(), score.data(), part); break;
        case 3: attend_rows<T, 3, 3>(qr, kh, vh, from, t.count, o, S, D, scale, rows.data(), score.data(), part); break;
        default: attend_rows<T, 4, 2>(qr, kh, vh, from, t.count, o, S, D, scale, rows.data(), score.data(), part);
      }
    }
  });
  // a decode step's few split runs combine here; a prefill's many among the threads
  at::parallel_for(0, static_cast<int64_t>(split.size()), 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[split[i].run];
      combine<T>(partial.get() + split[i].part * stride, split[i].chunks, run.g, D, out + (run.bh * R + run.r) * D);
    }
  });
}

// q [B, H, R, D], k/v [B, H, S, D], mask [B, 1, R, S] (contiguous; D a multiple of 16) -> out [B, H, R, D]: one
// run a span of up to MOST_ROWS consecutive query rows of one KV head whose mask rows are equal (in a decode step,
// a KV head's n_rep query heads); its slots in chunks (`attend_runs`).
template <typename T>
void attend(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t B, int64_t H, int64_t R,
            int64_t S, int64_t D, float scale, int64_t chunk, int64_t most) {
  if (B * H * R == 0) return;  // nothing to attend (a head count of 0 would otherwise list rows)
  std::vector<Run> runs;  // each head of a batch row runs its rows alike
  for (int64_t b = 0; b < B; ++b) {
    const size_t first = runs.size();
    for (int64_t r = 0, g; r < R; r += g) {
      const bool* m = mask + (b * R + r) * S;
      for (g = 1; g < MOST_ROWS && r + g < R && std::memcmp(m, m + g * S, S) == 0; ++g) {
      }
      runs.push_back({b * H, r, g, std::count(m, m + S, true)});
    }
    const size_t last = runs.size();
    for (int64_t h = 1; h < H; ++h) {
      for (size_t i = first; i < last; ++i) runs.push_back({b * H + h, runs[i].r, runs[i].g, runs[i].n});
    }
  }
  attend_runs(runs, q, k, v, out, H, R, S, D, scale, chunk, most,
              [&](int64_t b, int64_t r, int64_t first, int64_t count, int64_t* seen) {
                const bool* m = mask + (b * R + r) * S;
                for (int64_t s = 0, i = -first; i < count && s < S; ++s) {  // i: visible slots so far, less first
                  if (m[s] && i++ >= 0) seen[i - 1] = s;
                }
              });
}

// The same with every query row of batch row b seeing slots 0..last[b] (a static decode step's, Mask.last): no mask
// to read or to make, runs of MOST_ROWS rows.
template <typename T>
void attend_prefix(const T* q, const T* k, const T* v, const int64_t* last, T* out, int64_t B, int64_t H,
                   int64_t R, int64_t S, int64_t D, float scale, int64_t chunk, int64_t most) {
  if (B * H * R == 0) return;
  std::vector<Run> runs;
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, n = last[b] < 0 ? 0 : std::min<int64_t>(last[b], S - 1) + 1;  // S = 0: none
    for (int64_t r = 0; r < R; r += MOST_ROWS) runs.push_back({bh, r, std::min(MOST_ROWS, R - r), n});
  }
  attend_runs(runs, q, k, v, out, H, R, S, D, scale, chunk, most,
              [&](int64_t, int64_t, int64_t first, int64_t count, int64_t* seen) {
                for (int64_t i = 0; i < count; ++i) seen[i] = first + i;
              });
}

// q [B, H, R, D], k and v [B, H, S, D] of one dtype, D a multiple of 16: checked, made contiguous
std::vector<at::Tensor> checked(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == v.sizes() && k.dim() == 4 && q.size(0) == k.size(0) &&
                  q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "LLMSTEP_NS::", op, ": q [B, H, R, D], k and v [B, H, S, D]; got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.size(3) % 16 == 0, "LLMSTEP_NS::", op, ": head_dim a multiple of 16, got ", q.size(3));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "LLMSTEP_NS::", op, ": q, k, v of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "LLMSTEP_NS::", op, ": float32 or bfloat16, got ", q.scalar_type());
  return {q.contiguous(), k.contiguous(), v.contiguous()};
}

// run(T{}) with T the element type of q (float32 or bf16: `checked`), into a fresh contiguous output
template <typename F>
at::Tensor by_dtype(const at::Tensor& q, F run) {
  if (q.scalar_type() == at::kFloat) return run(float{});
  return run(c10::BFloat16{});
}

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale, int64_t chunk, int64_t most) {
  const auto c = checked("attention", q, k, v);
  TORCH_CHECK(chunk >= 0 && most >= 1, "LLMSTEP_NS::attention: chunk >= 0 (0: no chunks) and most >= 1, got ",
              chunk, " and ", most);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == q.size(0) &&
                  mask.size(1) == 1 && mask.size(2) == q.size(2) && mask.size(3) == k.size(2),
              "LLMSTEP_NS::attention: mask bool [B, 1, R, S]; got ", mask.scalar_type(), " ", mask.sizes());
  const auto mc = mask.contiguous();
  return by_dtype(q, [&](auto t) {
    using T = decltype(t);
    auto out = at::empty_like(c[0]);
    attend<T>(c[0].data_ptr<T>(), c[1].data_ptr<T>(), c[2].data_ptr<T>(), mc.data_ptr<bool>(), out.data_ptr<T>(),
              q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), static_cast<float>(scale), chunk, most);
    return out;
  });
}

at::Tensor attention_prefix_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& last, double scale, int64_t chunk, int64_t most) {
  const auto c = checked("attention_prefix", q, k, v);
  TORCH_CHECK(chunk >= 0 && most >= 1, "LLMSTEP_NS::attention_prefix: chunk >= 0 (0: no chunks) and most >= 1, "
              "got ", chunk, " and ", most);
  TORCH_CHECK(last.scalar_type() == at::kLong && last.dim() == 1 && last.size(0) == q.size(0),
              "LLMSTEP_NS::attention_prefix: last int64 [B]; got ", last.scalar_type(), " ", last.sizes());
  const auto lc = last.contiguous();
  return by_dtype(q, [&](auto t) {
    using T = decltype(t);
    auto out = at::empty_like(c[0]);
    attend_prefix<T>(c[0].data_ptr<T>(), c[1].data_ptr<T>(), c[2].data_ptr<T>(), lc.data_ptr<int64_t>(),
                     out.data_ptr<T>(), q.size(0), q.size(1), q.size(2), k.size(2), q.size(3),
                     static_cast<float>(scale), chunk, most);
    return out;
  });
}

at::Tensor attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale, int64_t chunk, int64_t most) {
  return at::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

TORCH_LIBRARY(LLMSTEP_NS, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, int chunk, int most) -> Tensor");
  m.def("attention_prefix(Tensor q, Tensor k, Tensor v, Tensor last, float scale, int chunk, int most) -> Tensor");
}
TORCH_LIBRARY_IMPL(LLMSTEP_NS, CPU, m) {
  m.impl("attention", &attention_cpu);
  m.impl("attention_prefix", &attention_prefix_cpu);
}
TORCH_LIBRARY_IMPL(LLMSTEP_NS, Meta, m) {
  m.impl("attention", &attention_meta);
  m.impl("attention_prefix", &attention_meta);
}
"""

"""llmstep's attention kernel for a compiled CPU step of one sequence: the masked attention of a few query rows
per KV head over the cache as it lies, in float32, reading only the slots a row sees.

A compiled decode step has fixed shapes, so it attends over every slot of its cache with the unwritten ones
masked (kv_cache.KVCache.mask). As plain ops (matmul, mask, softmax, matmul: sessions 6-26), inductor widened
every slot of K and V to float32 copies a layer before its matmuls, and its tuned choice for those small matmuls
varied between compiles; SDPA's CPU kernel reads the bf16 cache where it lies, but costs ~35 us a call on
SmolLM2's shapes, and rounds the probabilities to bf16 before multiplying them with V. This kernel does what a
decode step needs and nothing more. For each query row (the n_rep query heads of a KV head stacked, as
`attention.sdpa` stacks them; one task a row, shared among the threads by torch's `at::parallel_for`) it lists
the visible slots, dots the (scaled) row with those keys four at a time (float32 products and sums), takes the
softmax in float32 (e^x by a degree-6 polynomial and a power of two, within ~4 float32 ulps), sums the visible
values with those weights in float32 and rounds once to the output's dtype. AVX-512
intrinsics (both CPU kinds the project measures have them); head_dim a multiple of 16. The same function as SDPA
to within float32 rounding on what a decode step gives it, every row seeing a key and every score finite (a row
that sees none gives NaN; a NaN score is not propagated): tests/kernels/test_cpu_attention.py holds it to a
float64 computation, float32 and bf16, and shows the masked values unread.

One call on SmolLM2's decode shapes (9 query heads over 3 KV heads, 200 of 256 slots visible, bf16) took 15.5 us
on one Zen 4 thread where SDPA's took 45 us. In the step (scripts/ab_cpu.py `%ATTENTION`, results/README.md claim
2's attention row, paired in one process) SmolLM2's int4 step ran 1.21x SDPA's and 1.12x the plain ops', its bf16
step 1.10x / 1.19x, and the shipped model's 1.21-1.25x / 1.12-1.15x.

`install()` builds it once per machine (torch.utils.cpp_extension with ninja and the C++ compiler inductor needs
anyway: ~8 s the first time, kept in $LLMSTEP_HOME/kernels) and registers it with `attention_backend`, so that
`sdpa` calls it for a static CPU step of one sequence in float32 or bf16 under the "auto" choice;
compile.compile_step installs it for every CPU step. On a CPU without AVX-512, or where the build fails, it
registers nothing and says why (`why()`): SDPA's kernel runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import torch

from ..core import attention_backend, registry
from ..core.files import atomic_write_text

__all__ = ["SOURCE", "install", "installed", "why", "attend"]

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
#include <vector>

namespace {

// 16 floats from 16 float32 or bf16 values (bf16 is float32's upper half: widening is exact, a shift).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for 16 values x <= 0 (below -87: 0) to within ~2 float32 ulps: x = n ln2 + r with |r| <= ln2/2, e^r by its
// Taylor polynomial to r^6, times 2^n (scalef).
inline __m512 exp16(__m512 x) {
  const __m512 y = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), y);  // ln2 in two parts: no cancellation error
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// q [B, H, R, D], k/v [B, H, S, D], mask [B, 1, R, S] (contiguous; D a multiple of 16) -> out [B, H, R, D]: one
// task a query row. Its visible slots are listed first; only they are read.
template <typename T>
void attend(const T* q, const T* k, const T* v, const bool* mask, T* out, int64_t B, int64_t H, int64_t R,
            int64_t S, int64_t D, float scale) {
  at::parallel_for(0, B * H * R, 1, [&](int64_t begin, int64_t end) {
    const int64_t padded = (S + 15) / 16 * 16;
    std::vector<float> row(D), score(padded);
    std::vector<int64_t> seen(padded);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task % R, bh = task / R, b = bh / H;
      const T* kh = k + bh * S * D;
      const T* vh = v + bh * S * D;
      const bool* m = mask + (b * R + r) * S;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(row.data() + d, _mm512_mul_ps(load16(q + task * D + d), _mm512_set1_ps(scale)));
      int64_t n = 0;
      for (int64_t s = 0; s < S; ++s) {
        seen[n] = s;
        n += m[s];
      }
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) {  // the scores of the visible keys, four at a time
        const T *k0 = kh + seen[i] * D, *k1 = kh + seen[i + 1] * D, *k2 = kh + seen[i + 2] * D,
                *k3 = kh + seen[i + 3] * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 x = _mm512_loadu_ps(row.data() + d);
          a0 = _mm512_fmadd_ps(x, load16(k0 + d), a0);
          a1 = _mm512_fmadd_ps(x, load16(k1 + d), a1);
          a2 = _mm512_fmadd_ps(x, load16(k2 + d), a2);
          a3 = _mm512_fmadd_ps(x, load16(k3 + d), a3);
        }
        score[i] = _mm512_reduce_add_ps(a0), score[i + 1] = _mm512_reduce_add_ps(a1);
        score[i + 2] = _mm512_reduce_add_ps(a2), score[i + 3] = _mm512_reduce_add_ps(a3);
      }
      for (; i < n; ++i) {
        const T* ks = kh + seen[i] * D;
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(row.data() + d), load16(ks + d), a);
        score[i] = _mm512_reduce_add_ps(a);
      }
      const float hidden = -std::numeric_limits<float>::infinity();
      for (int64_t j = n; j < padded; ++j) score[j] = hidden;  // past the visible ones: weight 0
      __m512 top16 = _mm512_set1_ps(hidden);
      for (int64_t j = 0; j < padded; j += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(score.data() + j));
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(top16));
      __m512 total16 = _mm512_setzero_ps();
      for (int64_t j = 0; j < padded; j += 16) {  // the weights, e^(score - top)
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(score.data() + j), top));
        _mm512_storeu_ps(score.data() + j, p);
        total16 = _mm512_add_ps(total16, p);
      }
      const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total16));  // none visible: inf, as NaN
      for (int64_t d = 0; d < D; d += 16) {  // the weighted sum of the visible values, 16 columns at a time
        __m512 even = _mm512_setzero_ps(), odd = even;
        int64_t j = 0;
        for (; j + 2 <= n; j += 2) {
          even = _mm512_fmadd_ps(_mm512_set1_ps(score[j]), load16(vh + seen[j] * D + d), even);
          odd = _mm512_fmadd_ps(_mm512_set1_ps(score[j + 1]), load16(vh + seen[j + 1] * D + d), odd);
        }
        if (j < n) even = _mm512_fmadd_ps(_mm512_set1_ps(score[j]), load16(vh + seen[j] * D + d), even);
        alignas(64) float o[16];
        _mm512_store_ps(o, _mm512_mul_ps(_mm512_add_ps(even, odd), inverse));
        for (int c = 0; c < 16; ++c) out[task * D + d + c] = static_cast<T>(o[c]);
      }
    }
  });
}

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == v.sizes() && k.dim() == 4 && q.size(0) == k.size(0) &&
                  q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "llmstep_cpu::attention: q [B, H, R, D], k and v [B, H, S, D]; got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == q.size(0) &&
                  mask.size(1) == 1 && mask.size(2) == q.size(2) && mask.size(3) == k.size(2),
              "llmstep_cpu::attention: mask bool [B, 1, R, S]; got ", mask.scalar_type(), " ", mask.sizes());
  TORCH_CHECK(q.size(3) % 16 == 0, "llmstep_cpu::attention: head_dim a multiple of 16, got ", q.size(3));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "llmstep_cpu::attention: q, k, v of one dtype");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), mc = mask.contiguous();
  auto out = at::empty_like(qc);
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), S = k.size(2), D = q.size(3);
  if (q.scalar_type() == at::kFloat) {
    attend<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), mc.data_ptr<bool>(),
                  out.data_ptr<float>(), B, H, R, S, D, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "llmstep_cpu::attention: float32 or bfloat16, got ",
                q.scalar_type());
    attend<c10::BFloat16>(qc.data_ptr<c10::BFloat16>(), kc.data_ptr<c10::BFloat16>(), vc.data_ptr<c10::BFloat16>(),
                          mc.data_ptr<bool>(), out.data_ptr<c10::BFloat16>(), B, H, R, S, D,
                          static_cast<float>(scale));
  }
  return out;
}

at::Tensor attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale) {
  return at::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

TORCH_LIBRARY(llmstep_cpu, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(llmstep_cpu, CPU, m) { m.impl("attention", &attention_cpu); }
TORCH_LIBRARY_IMPL(llmstep_cpu, Meta, m) { m.impl("attention", &attention_meta); }
"""

# AVX-512F and FMA named, not -march=native: a build shared between machines runs on any with AVX-512 (`install`
# checks the one it runs on); OpenMP for at::parallel_for, whose loop is inlined from torch's headers.
_FLAGS = ["-O3", "-mavx512f", "-mavx2", "-mfma", "-fopenmp"]
_STALE_LOCK_SECONDS = 300  # a build takes ~10 s; a lock this old is a killed build's
_state: dict[str, str | bool] = {}  # "installed": True, or "why": what stopped it (once per process)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, R, hd], k/v [B, H, S, hd], mask [B, 1, R, S] (True: visible) -> [B, H, R, hd], SDPA's function:
    softmax(q k^T / sqrt(hd), masked) v, in float32 inside. Needs `install()` first."""
    return torch.ops.llmstep_cpu.attention(q, k, v, mask, q.shape[-1] ** -0.5)


def _build() -> None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel (a dependency) without its environment's bin/ on PATH
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])

    digest = hashlib.sha256((SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    name = f"llmstep_cpu_attention_{digest}"
    folder = registry.home() / "kernels" / name  # llmstep's cache ($LLMSTEP_HOME), the build torch's own
    source = folder / "cpu_attention.cpp"
    if not source.exists() or source.read_text() != SOURCE:
        atomic_write_text(source, SOURCE)  # a reader (another process building) never sees half of it
    lock = folder / "lock"  # torch's build lock: a build killed midway leaves it, and every later load waits forever
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    cpp_extension.load(name, [str(source)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                       build_directory=str(folder), is_python_module=False, verbose=False)


def install() -> bool:
    """Build (once per machine) and load the kernel, and register it for static CPU steps of one sequence
    (`attention_backend.use_cpu_step_kernel`). Returns whether it is registered; `why()` says what stopped it."""
    if not _state:
        capability = torch.backends.cpu.get_cpu_capability()
        try:
            if capability != "AVX512":
                raise RuntimeError(f"it is written for AVX-512; this CPU's vector instructions: {capability}")
            _build()
            _state["installed"] = True
        except Exception as e:  # no compiler, no ninja, a build error: SDPA's kernel stays
            _state["why"] = f"{type(e).__name__}: {_first_error(str(e))}"
    if _state.get("installed"):
        attention_backend.use_cpu_step_kernel(attend)
        return True
    return False


def _first_error(message: str) -> str:
    """The compiler's first error line in a failed build's output, else its last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "")


def installed() -> bool:
    return bool(_state.get("installed"))


def why() -> str | None:
    """What stopped `install` (None: installed, or not yet tried)."""
    return _state.get("why")  # type: ignore[return-value]

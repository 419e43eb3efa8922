"""llmstep's int4 micro-kernels alone (llmstep/kernels/cpu_int4.py: the AVX2 one, `cpu_gemm.INT4`, and the AVX-512
BF16 one, `cpu_gemm.INT4_AVX512`), out of inductor: a kernel's C++ text compiled by g++ with a small driver, timed
over the blocks of columns of one-row matmuls, checked against a float64 sum of the same weights.

    PYTHONPATH=. python scripts/int4_kernel_bench.py                       # SmolLM2's four int4 shapes, g = 32
    PYTHONPATH=. python scripts/int4_kernel_bench.py --layout avx512       # the AVX-512 kernel, 64-column blocks
    PYTHONPATH=. python scripts/int4_kernel_bench.py --kernel my.cpp       # another kernel text, the same driver

A compiled step's kernels run inside OpenMP regions beside other work, and a Python loop over one compiled matmul
times the call around it more than the kernel (tens of microseconds each). Here one thread runs the kernel alone
over every block of a [N, K] matrix, hot in cache or not as the matrix fits, so a change to the kernel's inner loop
can be timed in seconds. The driver lays the weights as torch's int4 packing does for the layout asked (32- or
64-column blocks, as cpu_int4's docstring gives; tests/kernels/test_cpu_int4.py checks the kernels on torch's own
packing) and the (scale, zero) pairs as inductor's template hands them: [K / group, N, 2] bf16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jinja2

from llmstep.core.files import atomic_write_json
from llmstep.kernels import cpu_gemm, cpu_int4
from llmstep.lab import runinfo

# SmolLM2-135M's int4 matmuls of one decode step, [N, K]: q|k|v and gate|up fused (FastDecoder's default), wo, w2
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]

# The driver: a bf16 shim for the kernel's at::BFloat16, random codes, scales, zeros and one row of activations,
# the kernel over every block (the template's call), best of `reps` timings, then the float64 reference.
DRIVER = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
namespace at {
struct BFloat16 {
  uint16_t x;
  operator float() const { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
}
#include "kernel.inc"
int main(int argc, char** argv) {
  const int64_t N = atoll(argv[1]), K = atoll(argv[2]), G = atoll(argv[3]), reps = atoll(argv[4]);
  const int64_t S = atoll(argv[5]);  // > 0: k in two calls, [0, S) then [S, K) added to it (a split mid-group)
  srand(N * 7 + K);
  std::vector<uint8_t> W(N * K / 2);                          // [N / BLOCK, K, HALF]: column j low, j + HALF high
  std::vector<at::BFloat16> SZ(K / G * N * 2), A(K);         // [K / G, N, 2]: (scale, zero) pairs; one row
  for (auto& w : W) w = rand() & 0xff;
  for (auto& s : SZ) s.x = 0x3c00 + (rand() & 0xff);          // about 1/128 .. 1/64
  for (auto& a : A) a.x = ((rand() & 1) << 15) | (0x3f00 + (rand() & 0xff));  // +-(0.5 .. 1)
  std::vector<float> C(N);
  double best = 1e30;
  const int64_t calls = std::max<int64_t>(1, 20000000 / (N * K));  // ~20 M weights a timing
  for (int64_t r = 0; r < reps; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (int64_t c = 0; c < calls; ++c)
      for (int64_t n = 0; n < N; n += BLOCK) {
        if (S == 0) {
          kern_kernel<1, BLOCK, false>(A.data(), W.data() + n * K / 2, C.data() + n, K, K, HALF, BLOCK, G,
                                       SZ.data() + n * 2, N * 2, 0);
        } else {  // as the template calls a thread's share of k: the group holding k_start first
          kern_kernel<1, BLOCK, false>(A.data(), W.data() + n * K / 2, C.data() + n, S, K, HALF, BLOCK, G,
                                       SZ.data() + n * 2, N * 2, 0);
          kern_kernel<1, BLOCK, true>(A.data() + S, W.data() + n * K / 2 + S * HALF, C.data() + n, K - S, K, HALF,
                                      BLOCK, G, SZ.data() + (S / G) * N * 2 + n * 2, N * 2, S);
        }
      }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / calls);
  }
  double err = 0, size = 0;
  for (int64_t n = 0; n < N; ++n) {
    double want = 0, terms = 0;
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t* row = W.data() + (n / BLOCK) * K * HALF + k * HALF;
      const int j = n % BLOCK, q = j < HALF ? row[j] & 15 : row[j - HALF] >> 4;
      const double s = float(SZ[(k / G) * N * 2 + n * 2]), z = float(SZ[(k / G) * N * 2 + n * 2 + 1]);
      const double w = (q - 8) * s + z, a = float(A[k]);
      want += a * w;
      terms += std::fabs(a * w);
    }
    err = std::max(err, std::fabs(C[n] - want));
    size = std::max(size, terms);
  }
  printf("{\"seconds\": %.9g, \"error\": %.6g, \"terms\": %.6g}\n", best, err, size);
}
"""

# What inductor's C++ build gives an AVX2 kernel (torch._inductor.cpp_builder): -O3, the ISA's flags, math-errno off
# (the AVX-512 kernel names its own instructions in a target attribute; its CPU needs them)
FLAGS = ["-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-fno-trapping-math"]
# torch's int4 layouts: the block of columns each kernel reads, that kernel, and the CPU flag it needs
LAYOUTS = {"avx2": (32, cpu_int4.AVX2, "avx2"), "avx512": (64, cpu_int4.AVX512, "avx512_bf16")}


def kernel_source(path: str | None, layout: str = "avx2") -> str:
    """The kernel's C++ rendered as inductor renders its Jinja template for a bf16-activation, float-output choice
    (its codes not streamed past the caches: one matmul timed again and again reads them from the cache)."""
    text = Path(path).read_text() if path else LAYOUTS[layout][1]
    names = {"kernel_name": "kern", "input_t": "at::BFloat16", "output_t": "float", "restrict_keyword": "__restrict__",
             "stream_weights": False, "stream_ahead": cpu_gemm.STREAM_AHEAD}
    try:
        return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(text).render(names)
    except jinja2.TemplateError as e:
        raise SystemExit(f"the kernel text does not render with the names the driver fills ({e})") from None


def shape(text: str) -> tuple[int, int]:
    """An N,K pair of positive integers."""
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is N,K (two integers), got {text!r}") from None
    if n <= 0 or k <= 0:
        raise argparse.ArgumentTypeError(f"a shape's N and K are positive, got {text!r}")
    return n, k


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", help="a kernel text to time instead of cpu_int4's (inductor's template names in it)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="avx2",
                   help="torch's int4 layout the kernel reads: 32-column blocks (AVX2) or 64 (AVX-512)")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size (32: GGUF's Q4 blocks)")
    p.add_argument("--k-split", type=int, default=0,
                   help="call the kernel on k in [0, S) and then [S, K), adding: a thread's share starting mid-group")
    p.add_argument("--shapes", nargs="+", type=shape, help="N,K pairs (default: SmolLM2-135M's int4 matmuls)")
    p.add_argument("--repeats", type=int, default=9, help="timings per shape; the best is kept")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    shapes = args.shapes or SHAPES
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.group_size <= 0:
        p.error(f"--group-size must be a positive integer, got {args.group_size}")
    block, _, needs = LAYOUTS[args.layout]
    bad = [s for s in shapes if s[0] % block or s[1] % args.group_size]
    if bad:
        p.error(f"each shape is N,K with N a multiple of {block} and K of the group size {args.group_size}: {bad}")
    if not 0 <= args.k_split < min(k for _, k in shapes):
        p.error(f"--k-split must be at least 0 and below every shape's K, got {args.k_split}")
    if (cxx := shutil.which("g++")) is None:
        p.error("needs g++ (inductor's CPU compiler)")
    if needs not in runinfo.cpu_flags():
        p.error(f"the {args.layout} kernel needs a CPU with {needs}; this one has {runinfo.cpu_flags()}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kernel.inc").write_text(kernel_source(args.kernel, args.layout))
        (Path(tmp) / "driver.cpp").write_text(DRIVER)
        binary = Path(tmp) / "driver"
        subprocess.run([cxx, *FLAGS, f"-DBLOCK={block}", f"-DHALF={block // 2}", "-o", str(binary),
                        str(Path(tmp) / "driver.cpp")], check=True)
        rows = []
        for n, k in shapes:
            call = [str(binary), *(str(v) for v in (n, k, args.group_size, args.repeats, args.k_split))]
            out = subprocess.run(call,
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out)
            rows.append({"N": n, "K": k, "group_size": args.group_size, "microseconds": r["seconds"] * 1e6,
                         "gweights_per_s": n * k / r["seconds"] / 1e9,
                         "ns_per_k_row_of_32_columns": r["seconds"] * 1e9 / (n // 32 * k),
                         "error_over_terms": r["error"] / r["terms"]})
    print(f"{'N x K':>12} {'us':>9} {'G weights/s':>12} {'ns / 32 weights':>16} {'|err| / sum|a w|':>17}")
    for r in rows:
        print(f"{r['N']:>5} x {r['K']:<4} {r['microseconds']:9.1f} {r['gweights_per_s']:12.2f} "
              f"{r['ns_per_k_row_of_32_columns']:16.3f} {r['error_over_terms']:17.2e}")
    total = sum(r["microseconds"] for r in rows)
    print(f"one layer's int4 matmuls: {total:.1f} us on one thread")
    if args.json:
        argv = sys.argv[1:] if argv is None else argv
        atomic_write_json(args.json, {"command": runinfo.command_line(argv, "python scripts/int4_kernel_bench.py"),
                                      "machine": runinfo.machine("cpu") | {"threads": 1}, "versions": runinfo.versions(
                                          gxx=subprocess.run([cxx, "-dumpfullversion"], capture_output=True,
                                                             text=True).stdout.strip()),
                                      "kernel": args.kernel or (cpu_gemm.INT4_KERNEL_NAME if args.layout == "avx2"
                                                                else cpu_gemm.INT4_AVX512_KERNEL_NAME),
                                      "layout": args.layout, "k_split": args.k_split,
                                      "flags": [*FLAGS, f"-DBLOCK={block}", f"-DHALF={block // 2}"],
                                      "load_average_1min": runinfo.load_average(), "shapes": rows,
                                      "layer_microseconds": total})
    return 0


if __name__ == "__main__":
    sys.exit(main())

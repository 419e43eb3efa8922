"""What the buffers a compiled CPU step allocates cost (results/profile_cpu_amd.md, session 7).

    python scripts/alloc_cost_cpu.py

Inductor's C++ wrapper allocates each step's intermediate buffers anew (27 `aoti_torch_empty_strided` calls in
the shipped model's bf16 decode step); this times 27 `at::empty` calls of the step's small shapes, and their
frees, in C++ (built with torch.utils.cpp_extension: needs a C++ compiler), microseconds per step.
"""

from __future__ import annotations

from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
#include <chrono>
double bench(int64_t iters) {
    auto opts = torch::TensorOptions().dtype(torch::kBFloat16);
    std::vector<std::vector<int64_t>> shapes = {{1, 1, 384}, {1, 640}, {1, 2, 1, 64}, {1, 6, 1, 64}, {1, 2, 3, 256},
                                                {1, 2, 3, 64}, {1, 2048}, {1, 1024}, {1, 384}, {1, 8192}};
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) {
        std::vector<at::Tensor> keep;
        for (int j = 0; j < 27; ++j) keep.push_back(at::empty(shapes[j % shapes.size()], opts));
    }
    auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
}
"""


def main() -> None:
    m = load_inline("alloc_bench", cpp_sources=SRC, functions=["bench"], verbose=False)
    m.bench(1000)
    print("27 allocations (and frees) per step:", [round(m.bench(20000), 2) for _ in range(3)], "us")


if __name__ == "__main__":
    main()

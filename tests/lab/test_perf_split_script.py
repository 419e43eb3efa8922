"""scripts/perf_split.py's reading of perf's samples: each sample lands in the kind of code it ran (the compiled
step's kernels by kind, OpenMP's waiting, the host code around the kernels), counted per thread."""

from __future__ import annotations

from pathlib import Path

from conftest import import_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "perf_split.py"


def load():
    return import_script("perf_split.py")


KERNELS = "/tmp/torchinductor_root/oh/cohxn47.main.so"
SAMPLES = f"""\
  100      7fd48c1b1790 cpp_fused_mm_view_1_micro_gemm_rows<1l>+0x30 ({KERNELS})
  100      7fd48c1b1790 cpp_fused_mm_view_1_micro_gemm_rows<1l>+0x34 ({KERNELS})
  100      7fd48c1b17b3 cpp_fused_bmm_cat_cos_index_copy_mul_2._omp_fn.0+0x10 ({KERNELS})
  100      7fd4ad01de62 [unknown] (/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1)
  100      7fd4ad01de62 _PyEval_EvalFrameDefault+0x99 (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
  100      7fd4ad01de62 _int_malloc+0x12 (/usr/lib/x86_64-linux-gnu/libc.so.6)
  101      7fd48c1b1790 cpp_fused_mm_view_1_micro_gemm_rows<1l>+0x30 ({KERNELS})
  101      7fd4ad01de66 [unknown] (/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1)
  101      7fd4ad01de66 cpp_fused__softmax__to_copy_bmm_view_5._omp_fn.0+0x8 ({KERNELS})
not a sample line
"""


def test_each_sample_is_counted_where_it_ran_per_thread(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    threads = load().count(SAMPLES, pid=100)
    assert set(threads) == {"main", "thread 101"}
    main, worker = threads["main"], threads["thread 101"]
    assert main["kernel: one-row matmuls (dot kernel)"] == 2
    assert main["kernel: rope, cache write, float32 K/V copies"] == 1
    assert main["OpenMP (waiting)"] == 1
    assert main["host: Python"] == 1 and main["host: C library (malloc, free)"] == 1
    assert sum(main.values()) == 6
    assert worker == {"kernel: one-row matmuls (dot kernel)": 1, "OpenMP (waiting)": 1,
                      "kernel: masked softmax and its matmuls": 1}


def test_code_outside_the_compiled_step_is_named_by_its_library(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    classify = load().classify
    assert classify("at::native::add_kernel", "/venv/torch/lib/libtorch_cpu.so") == \
        "host: libtorch (tensor handles, dispatch)"
    assert classify("x", "/usr/lib/libfoo.so.2") == "host: libfoo.so.2"
    assert classify("futex_wake", "[kernel.kallsyms]") == "host: the OS kernel (futex, page faults)"
    assert classify("cpp_fused_argmax_10._omp_fn.0", KERNELS) == "kernel: greedy pick"
    assert classify("cpp_fused_add_mean_4", KERNELS) == "kernel: other"


def test_kernels_compiled_into_a_cache_dir_of_ones_own_are_the_steps(monkeypatch):
    classify = load().classify
    dso = "/scratch/ind/af/cafe.main.so"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert classify("cpp_fused_argmax_10._omp_fn.0", dso) == "host: cafe.main.so"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/ind/")
    assert classify("cpp_fused_argmax_10._omp_fn.0", dso) == "kernel: greedy pick"
    assert classify("cpp_fused_argmax_10._omp_fn.0", "/scratch/individual/x.so") == "host: x.so"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/./ind")  # as given; perf records resolved paths
    assert classify("cpp_fused_argmax_10._omp_fn.0", dso) == "kernel: greedy pick"


def test_by_symbol_counts_each_function_once_whatever_its_offset(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    script = load()
    threads = script.count(SAMPLES, pid=100, place=script.by_symbol)
    assert threads["main"]["STEP: cpp_fused_mm_view_1_micro_gemm_rows<1l>"] == 2
    assert threads["main"]["STEP: cpp_fused_bmm_cat_cos_index_copy_mul_2._omp_fn.0"] == 1  # whole: kernels by index
    assert threads["main"]["libc.so.6: _int_malloc"] == 1
    assert threads["thread 101"]["libgomp.so.1: [unknown]"] == 1
    assert sum(threads["main"].values()) == 6


def test_a_quantization_that_does_not_exist_is_refused_before_loading():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(SCRIPT), "--quantize", "int3"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "argument --quantize: unknown quantization mode 'int3'" in done.stderr

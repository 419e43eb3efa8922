"""llmstep's CPU kernels for int4 weights times 8-bit activations (`int4-a8`, llmstep.core.int4a8), llama.cpp's
arithmetic for its 4-bit files, and for int8 weights times 8-bit activations (`int8-a8`, llmstep.core.int8a8), its
Q8_0 arithmetic: one-row matmuls in integer dot products, one library.

A row of activations is rounded to 8 bits per block of 32 (`int4a8.quantize_activations`: a step d = max|x| / 127,
codes p = round(x / d) in -127..127), once per call. Then each group of inputs of each column is
s * sum_b d_b * sum(p q) + (z - 8 s) * sum_b d_b * sum(p), the inner sums exact in integers: `vpmaddubsw` multiplies
32 unsigned 4-bit codes by 32 signed 8-bit activations and adds the products in pairs (at most 2 * 15 * 127 = 3,810),
eight of those sum in 16-bit lanes without overflow (30,480), `vpmaddwd` widens them to 32 bits (with AVX-512 VNNI
one `vpdpbusd` adds each lane's 4 products into 32 bits: the same integers), and the block's float step, the group's
scale and zero are applied once per 32 inputs and 8 columns. Against the float kernel
(widen every code to float32, one multiply-add a weight: kernels/cpu_int4.py) that is 32 weights per two integer
multiply-adds, where it takes 32 conversions and 32 multiply-adds.

The weights in the kernel's layout (`int4a8.layout`), in tiles of 4 vectors of 8 columns: for each 8 inputs, each
vector's 32 bytes, whose 32-bit lane c holds column c's 4 codes of inputs k..k+3 in its bytes' low nibbles and of
k+4..k+7 in their high nibbles (so a lane's 4 bytes meet 4 consecutive activations in `vpmaddubsw`, the activations
broadcast 4 bytes at a time); the scales and zeros likewise, for each group each vector's 8 scales then its 8 zeros,
in the model's bf16 or float32. A tile's bytes lie in the order it reads them, so each thread's share (tiles of 32
columns, at::parallel_for) is one stream, prefetched 4 KiB ahead.

int8-a8 (`mm8`) reads the layer's plain int8 weights, [N, K] a column's K codes after the other's: each block of 32
codes meets the row's 32 activation codes in one `vpmaddubsw` (the weights' signs moved onto the activations, their
magnitudes unsigned: a pair of products at most 2 * 128 * 127), `vpmaddwd` sums pairs into 8 lanes (with VNNI one
`vpdpbusd` does both), and the block's step scales them in float32; the row's scale multiplies the column's sum
once. Each thread's share (runs of columns) is one stream, prefetched 4 KiB ahead; measured against tiles of 8
columns (int4-a8's layout) on the Zen 1 it streams as fast (14.7 vs 14.1 GB/s over SmolLM2's matmuls at one row, 2
threads), and the plain layout is the one every other path of the layer reads.

A one-row call (a decode step's) given `stream` prefetches its weights with the non-temporal hint instead
(`_MM_HINT_NTA`: past the outer caches where the CPU honours it), as kernels/cpu_gemm.py's templates do where a
step's weights outgrow the last-level cache (the same rule, `engines.compile.streams_weights`; the flag is traced
into the step: `int4a8.streaming`): there each weight is read once a step and gone before the next, and kept in the
caches it would evict what the step reads again (the C++ wrapper's tensor handles, the KV cache). The same bits.

One source (kernels/cpu_int4a8_cpp.py), built for each ISA of ISAS: AVX2, and AVX-512 VNNI with VL (256-bit vectors
still, the same bits; on the Zen 4 SmolLM2's compiled int4-a8 step 1.07x the AVX2 build's, int8-a8's level: paired
runs in results/README.md, the step's time mostly the weights' stream and the host's, not the dot products).
`install()` builds the first this CPU runs once per machine (kernels/cpp_build.py) and registers them with
llmstep.core.int4a8 and int8a8, which call them for every such matmul on a CPU, at any row
count; elsewhere, and where the build fails (`why()`), those modules compute the same functions with torch's ops.
tests/kernels/test_cpu_int4a8.py holds the kernel's codes and steps to the reference bit for bit and its output to
a float64 computation; tests/kernels/test_cpu_int8a8.py holds int8-a8's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..core import int4a8, int8a8
from .cpp_build import first_error, isas_here, load_library, why_not
from .cpu_int4a8_cpp import SOURCE

__all__ = ["SOURCE", "ISAS", "namespace", "runs_here", "build", "install", "installed", "ops", "using", "why"]

_AVX2 = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
ISAS = {"avx512_vnni": [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"], "avx2": _AVX2}  # best first
# what each needs (cpp_build.isas_here): torch's reading of the CPU's vector width, and the CPU's features
_NEEDS = {"avx512_vnni": ({"AVX512"}, {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
          "avx2": ({"AVX2", "AVX512"}, {"avx2", "fma"})}
# "ops" and "isa": the build installed, or "why": what stopped it (once a process); "registered": (ops, isa) in use
_state: dict[str, object] = {}
_installing = threading.Lock()
_using = threading.RLock()  # `using`'s holder: one thread at a time, nested holds in it


def namespace(isa: str) -> str:
    """The op namespace of `isa`'s build ("llmstep_int4a8_avx2"): each ISA's its own, so both load in one process
    (an A/B: `using`) and a record names which one ran."""
    return f"llmstep_int4a8_{isa}"


def runs_here() -> tuple[str, ...]:
    """The ISAs of ISAS this CPU runs, best first (cpp_build.isas_here: by torch's reading of its vector width and by
    the features it lists; AVX-512 without VNNI runs the AVX2 build)."""
    return isas_here(_NEEDS)


def build(isa: str = "avx2"):
    """Build (once per machine) and load the kernels for `isa` (a key of ISAS); returns torch.ops.<namespace(isa)>
    (`mm(x, w, sz, group, stream=False)`, `quantize(x)`, int8-a8's `mm8(x, q, scales, stream=False)`; `stream`: a
    one-row call prefetches its weights past the outer caches, int4a8.streaming). An ISA this CPU does not run is
    refused before anything is built (its code would be an illegal instruction here)."""
    if isa not in ISAS:
        raise ValueError(f"no 8-bit activation kernels for the ISA {isa!r}: one of {', '.join(ISAS)}")
    if isa not in runs_here():
        raise RuntimeError(f"this CPU does not run the {isa} build ({why_not(isa, _NEEDS)})")
    return load_library(namespace(isa), "mm", SOURCE, ISAS[isa], "cpu_int4a8.cpp")


def _register(ops, isa: str) -> None:
    int4a8.use_kernel(ops.mm, f"{namespace(isa)}::mm")
    int8a8.use_kernel(ops.mm8, f"{namespace(isa)}::mm8")
    _state["registered"] = ops, isa


def install() -> bool:
    """Build and load the kernels for the best ISA this CPU runs, once a process, and register them with
    llmstep.core.int4a8 and int8a8 (inside `using`, its build). Returns whether they are registered; `why()` says
    what stopped it."""
    with _installing:
        if not _state:
            try:
                if not (here := runs_here()):
                    raise RuntimeError(f"they are written for AVX2 or AVX-512 VNNI, and this CPU runs neither "
                                       f"({why_not('avx2', _NEEDS)})")
                _state["ops"], _state["isa"] = build(here[0]), here[0]
            except Exception as e:  # no compiler, no ninja, a build error: int4a8's torch ops compute it
                _state["why"] = f"{type(e).__name__}: {first_error(str(e))}"
    if "ops" in _state:
        _register(*_state.get("registered", (_state["ops"], _state["isa"])))  # inside `using`: its build
        return True
    return False


int4a8.use_installer(install)  # the first int4-a8 or int8-a8 layer prepared on a CPU builds it


@contextlib.contextmanager
def using(isa: str) -> Iterator[None]:
    """While held, int4-a8's and int8-a8's matmuls traced or run (in every thread) take `isa`'s build; the build
    registered before after. For an A/B of the builds (scripts/ab_cpu.py's `=avx2`; Dynamo guards the registered
    kernel, so a step compiled inside runs as compiled only inside). One thread holds it at a time (it may nest
    there): a second is refused, since overlapping holds would give back each other's builds."""
    if not install():
        raise RuntimeError(f"the 8-bit activation kernels are not installed: {why()}")
    kernel = build(isa)  # an unknown ISA, or one this CPU does not run: refused before anything changes
    if not _using.acquire(blocking=False):
        raise RuntimeError("cpu_int4a8.using is held in another thread: the registered build is process-wide")
    try:
        before = _state["registered"]
        _register(kernel, isa)
        try:
            yield
        finally:
            _register(*before)
    finally:
        _using.release()


def installed() -> bool:
    return "ops" in _state


def ops():
    """torch.ops of the installed build (`install()` first)."""
    if "ops" not in _state:
        raise RuntimeError(f"the 8-bit activation kernels are not installed (install(): {why() or 'not called'})")
    return _state["ops"]


def why() -> str | None:
    """What stopped `install` (None: installed, or not yet tried)."""
    return _state.get("why")  # type: ignore[return-value]

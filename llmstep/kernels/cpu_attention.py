"""llmstep's attention kernel for a compiled CPU step of one sequence: the masked attention of a few query rows
per KV head over the cache as it lies, in float32, reading only the slots a row sees.

A compiled decode step has fixed shapes, so it attends over every slot of its cache with the unwritten ones
masked (kv_cache.KVCache.mask). As plain ops (matmul, mask, softmax, matmul: sessions 6-26), inductor widened
every slot of K and V to float32 copies a layer before its matmuls, and its tuned choice for those small matmuls
varied between compiles; SDPA's CPU kernel reads the bf16 cache where it lies, but costs ~35 us a call on
SmolLM2's shapes, and rounds the probabilities to bf16 before multiplying them with V. This kernel does what a
decode step needs and nothing more. For each query row (the n_rep query heads of a KV head stacked, as
`attention.sdpa` stacks them) it lists the visible slots, dots the (scaled) row with those keys (float32 products
and sums), takes the softmax in float32 (e^x by a degree-6 polynomial and a power of two, within ~3 float32 ulps),
sums the visible values with those weights in float32 and rounds once to the output's dtype. Consecutive rows that
see the same slots (a decode step's n_rep query heads: one mask row; a step of several tokens stacks its rows head
by head, token after token, so its equal rows are not consecutive and stay one task a row) are one task, up to four
rows, shared among the threads by torch's `at::parallel_for`: each key and value is widened once for all of them,
and each row's arithmetic is what it would be alone (the same bits; tests/kernels/test_cpu_attention.py). On one Zen
3 thread a call on SmolLM2's decode shapes went from 25.2 to 16.2 us, the shipped model's from 17.9 to 12.4 (session
33, the best of 5 loops of 2,000 calls from Python, the call's overhead in both; scratch, no record). A decode step
calls its prefix form, `attention_prefix` (`attend_prefix`): every row of batch row b sees slots 0..last[b]
(`Mask.last`), so no mask is made or read (in a compiled step inductor made the mask again in every layer's kernel);
the same bits as the masked form given that mask. A run of rows that sees more than `CHUNK` slots is split
(flash-decoding's split of the keys): up to MOST_CHUNKS chunks of its visible slots, each its own task giving its
rows' partial softmax (top score, sum of weights, the values' weighted mean), combined in chunk order once the
tasks are done. A decode step has one run a KV head, so SmolLM2's 3 KV heads left one of two threads with two of them (a
16-thread CPU 13 threads idle). The chunks follow from the slots a row sees, never the thread count: the same bits
on any machine of an ISA, and a row that sees up to CHUNK slots computes as before. A chunk's softmax runs over the
slots it sees, not the cache's (before, a row seeing 10 of 4,096 slots took 4,096 exponentials). Written once over
a float32 vector of W lanes, AVX-512's 16 or AVX2's 8 (the Zen 3 EPYC has no AVX-512), each ISA built as its
own library; head_dim a multiple of 16. The same function as SDPA
to within float32 rounding on what a decode step gives it, every row seeing a key and every score finite (a row
that sees none gives 0, and a NaN score makes its row NaN, as SDPA's do): tests/kernels/test_cpu_attention.py
holds it to a float64 computation, float32 and bf16, and shows the masked values unread.

Before rows were taken together (sessions 26-30), one call on SmolLM2's decode shapes (9 query heads over 3 KV
heads, 200 of 256 slots visible, bf16) took 15.5 us on one Zen 4 thread where SDPA's took 45 us; the AVX2 build
28-29 us on one Zen 3 thread where SDPA's took 71-72 us (the best of 5 loops of 2,000 calls from Python, the
call's overhead in both; scratch, no record). In the step
(scripts/ab_cpu.py `%ATTENTION`, results/README.md claim 2's attention rows, paired in one process) SmolLM2's int4
step ran 1.21x SDPA's and 1.12x the plain ops', its bf16 step 1.10x / 1.19x, and the shipped model's 1.21-1.25x /
1.12-1.15x; with the AVX2 build on a Zen 3, SmolLM2's int4 and bf16 steps 1.15x / 1.03x SDPA's, the shipped
model's 1.12x / 1.11x.

`install()` builds the kernel of this CPU's ISA once per machine (torch.utils.cpp_extension with ninja and the C++
compiler inductor needs anyway: ~8 s the first time, kept in $LLMSTEP_HOME/kernels) and registers it with
`attention_backend`, so that `sdpa` calls it for a static CPU step of one sequence in float32 or bf16 under the
"auto" choice; compile.compile_step installs it for every CPU step. On a CPU without AVX2, or where the build fails, it
registers nothing and says why (`why()`): SDPA's kernel runs.
"""

from __future__ import annotations

import threading

import torch

from ..core import attention_backend
from .cpp_build import first_error, isas_here, load_library, why_not
from .cpu_attention_cpp import SOURCE

__all__ = ["SOURCE", "ISAS", "CHUNK", "MOST_CHUNKS", "install", "installed", "why", "attend", "attend_prefix", "build",
           "isa_here", "runs_here"]


# The vector ISAs it is written for, each built as its own library with its own op namespace (llmstep_cpu_ISA, where
# the source says LLMSTEP_NS), by the flags that name the ISA rather than -march=native: a build shared between
# machines runs on any with that ISA (`install` picks the CPU's own). OpenMP for at::parallel_for, whose loop is
# inlined from torch's headers.
ISAS = {"avx512": ["-O3", "-mavx512f", "-mavx2", "-mfma", "-fopenmp"], "avx2": ["-O3", "-mavx2", "-mfma", "-fopenmp"]}
# what each needs (cpp_build.isas_here): torch's reading of the CPU's vector width (an AVX-512 CPU runs AVX2's build
# too), and the CPU's features (ATEN_CPU_CAPABILITY can name a capability the CPU lacks)
_NEEDS = {"avx512": ({"AVX512"}, {"avx512f", "avx2", "fma"}), "avx2": ({"AVX2", "AVX512"}, {"avx2", "fma"})}
# A run of rows that sees n > CHUNK slots is split in min(MOST_CHUNKS, ceil(n / CHUNK)) chunks of equal size, each
# its own task (flash-decoding's split of the keys), their partial softmaxes combined in order. By the slots a row
# sees, never the thread count: the same bits on every machine. On a Zen 4 with the K/V cache cold (as a step finds
# it; scripts/attention_split.py, results/attention_split_zen4_*_s53.json), 9 query heads over 3 KV heads seeing
# 2,000 slots: 134.9 -> 117.6 us a call at 2 threads, 201.6 -> 203.9 at one (128-slot chunks: 116.6, 203.5); seeing
# 230, split in two: 21.3 -> 19.8 us at 2 threads, 28.4 -> 30.4 at one, so a run that sees up to 256 stays whole.
CHUNK = 256
MOST_CHUNKS = 8
_state: dict[str, object] = {}  # "op", "isa": the installed op and its ISA, or "why": what stopped it (once a process)
_installing = threading.Lock()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, chunk: int = CHUNK,
           most: int = MOST_CHUNKS) -> torch.Tensor:
    """q [B, H, R, hd], k/v [B, H, S, hd], mask [B, 1, R, S] (True: visible) -> [B, H, R, hd], SDPA's function:
    softmax(q k^T / sqrt(hd), masked) v, in float32 inside; a run of rows seeing n > chunk slots split in
    min(most, ceil(n / chunk)) chunks (chunk 0: none). Needs `install()` first."""
    if "op" not in _state:
        raise RuntimeError(f"llmstep's CPU attention kernel is not installed (install(): {why() or 'not called'})")
    return _state["op"](q, k, v, mask, q.shape[-1] ** -0.5, chunk, most)


def runs_here() -> tuple[str, ...]:
    """The ISAs of ISAS this CPU runs, its own first (cpp_build.isas_here: by torch's reading of its vector width and
    by the features it lists)."""
    return isas_here(_NEEDS)


def isa_here() -> str | None:
    """The ISA of the kernel `install` builds for this CPU, or None: none of ISAS runs here."""
    return next(iter(runs_here()), None)


def attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: torch.Tensor, chunk: int = CHUNK,
                  most: int = MOST_CHUNKS) -> torch.Tensor:
    """`attend` where every query row of batch row b sees slots 0..last[b] (last int64 [B]: a static decode
    step's `Mask.last`): no mask tensor made or read. The same bits as `attend` with that mask."""
    if "prefix" not in _state:
        raise RuntimeError("llmstep's CPU attention kernel has no attention_prefix here" if "op" in _state else
                           f"llmstep's CPU attention kernel is not installed (install(): {why() or 'not called'})")
    return _state["prefix"](q, k, v, last, q.shape[-1] ** -0.5, chunk, most)


def op_name(isa: str) -> str:
    """The qualified name of `isa`'s op ("llmstep_cpu_avx2::attention"): each ISA's build its own namespace, so
    both can load in one process, and a profile or a record names which one ran."""
    return f"llmstep_cpu_{isa}::attention"


def build(isa: str):
    """Build (once per machine) and load the kernel for `isa` (a key of ISAS), and return its op,
    `torch.ops.llmstep_cpu_<isa>.attention(q, k, v, mask, scale)`. An ISA this CPU does not run is refused before
    anything is built (its code would be an illegal instruction here); `install` builds `isa_here()`'s."""
    if isa not in ISAS:
        raise ValueError(f"no attention kernel for the ISA {isa!r}: one of {', '.join(ISAS)}")
    if isa not in runs_here():
        raise RuntimeError(f"this CPU does not run the {isa} kernel ({why_not(isa, _NEEDS)})")
    namespace = op_name(isa).partition("::")[0]
    return load_library(namespace, "attention", SOURCE, ISAS[isa], "cpu_attention.cpp").attention


def install() -> bool:
    """Build (once per machine) and load the kernel for this CPU's ISA, and register it for static CPU steps of one
    sequence (`attention_backend.use_cpu_step_kernel`). Returns whether it is registered; `why()` says what stopped
    it."""
    with _installing:  # one build, whichever thread asks first
        if not _state:
            try:
                if (isa := isa_here()) is None:
                    raise RuntimeError(f"it is written for AVX-512 or AVX2, and this CPU runs neither "
                                       f"({why_not('avx2', _NEEDS)})")
                _state["op"], _state["isa"] = build(isa), isa
            except Exception as e:  # no compiler, no ninja, a build error: SDPA's kernel stays
                _state["why"] = f"{type(e).__name__}: {first_error(str(e))}"
            if "op" in _state and callable(_state["op"]):  # the build's decode-step form, beside its `attention`
                namespace = op_name(str(_state["isa"])).partition("::")[0]
                if (prefix := getattr(getattr(torch.ops, namespace), "attention_prefix", None)) is not None:
                    _state["prefix"] = prefix
    if "op" in _state:
        prefix = attend_prefix if "prefix" in _state else None  # a decode step's: named in records (`describe`)
        attention_backend.use_cpu_step_kernel(attend, op=op_name(str(_state["isa"])) + ("_prefix" if prefix else ""),
                                              prefix=prefix)
        return True
    return False


def installed() -> bool:
    return "op" in _state


def why() -> str | None:
    """What stopped `install` (None: installed, or not yet tried)."""
    return _state.get("why")  # type: ignore[return-value]

"""llmstep's micro-kernels for inductor's C++ GEMM templates: a bf16 dot product for one-row decode on CPUs with
AVX-512 BF16, and one for CPUs with AVX2 alone, int4 kernels for CPUs with AVX2 alone and for one-row decode with
AVX-512 BF16, and int8 ones for both.

A decode step's matmuls are GEMVs. On a CPU without AMX, the micro-kernel of inductor's tuned C++ GEMM template
widens every bf16 weight to float32 before its FMA (`CppMicroGemmFP32Vec`), where llama.cpp multiplies bf16 pairs
directly with AVX-512 BF16's `vdpbf16ps`. On a CPU with AMX, inductor's AMX kernel multiplies tiles of many rows;
on a decode step's one-row matmuls it measured slower than a dot product (results/README.md, claim 12). This module
gives the template that dot product: weights packed in pairs along k (the template's VNNI2 layout, as for AMX), each
activation pair broadcast, float32 accumulators. bf16 products are exact in float32 and the sums float32, as the
widening kernel's; only the order of the additions differs (and `vdpbf16ps` treats subnormal inputs as zero), so
the step is the same function to within float32 rounding (tests/kernels/test_cpu_gemm.py holds it to a float64
matmul).

Each matmul takes the kernel 64 or 32 columns wide, whichever keeps the threads evenly busy (`balanced_width`):
inductor gives each thread whole blocks, so SmolLM2's 576-wide matmuls at 64 columns left one of two threads
waiting for a ninth block (results/README.md, the balanced-width A/B on SmolLM2's bf16 step: 1.03x over 7 paired
rounds, inside a shared VM's noise).

A step whose weights outgrow the last-level cache (SmolLM2's 270 MB against a Zen 4 EPYC's 32 MiB L3) reads each
weight once and has evicted it before the next step comes back. There each one-row call of the kernel (a decode
step's matmuls; in a prefill, at most a last block of one row) prefetches the weights `STREAM_AHEAD` bytes ahead
with the non-temporal hint (`_MM_HINT_NTA`: read once, kept out of the outer caches where the CPU honours it;
`streams_weights`, decided per compiled graph from its constants; scripts/ab_cpu.py's `&nostream` is the A/B): on
SmolLM2's bf16 step, 1.17x and 1.06x in two paired runs of 9 rounds on a Zen 4 EPYC (results/README.md, claim 2); in
its profile the matmuls' time a step held and the host code's between kernels fell by a quarter (as we read it, the
tensor handles, malloc and Python it touches were no longer evicted by weights). Where the weights fit, the next
step finds them in the L3, and streaming them past it lost (0.92x on the shipped model, 9 paired rounds): the rule
keeps them cached there. Streaming only hints; the arithmetic is unchanged, the same bits
(tests/kernels/test_cpu_gemm.py).

`BF16.install()` registers it once per process (compile.compile_step calls it for a CPU step) where the CPU has
AVX-512 BF16: without AMX for every matmul, with AMX ranked with inductor's AMX kernels for matmuls of up to
`AMX_ROWS` rows (results/README.md, claim 12, measures both). Inductor's registry is internal to torch
(llmstep.core.torch_compat's `micro_gemm`): outside the tested torch range, or with a registry of another shape,
`install` registers nothing and says why (`BF16.why`).

The second kernel, `INT4`, is for CPUs with AVX2 and no AVX-512: there inductor has no micro-kernel for its
weight-only int4 template, so an int4 step calls torch's own `_weight_int4pack_mm_for_cpu` for every matmul
(from the C++ wrapper, through the dispatcher), far behind llama.cpp's Q4_0 on such a CPU (results/README.md,
claim 2, measures both). This one reads the weights as torch packed them for that kernel, widens each 4-bit
code to float32 and multiplies-and-adds it with the activation, applying each group's scale and zero once per group:
the same function as dequantise + matmul to within float32 sums (tests/kernels/test_cpu_int4.py holds it to a
float64 matmul in a process where torch and inductor are held to AVX2). With it the template joins the tuned
choices of every int4 matmul; a bf16 step whose int4 matmuls it all takes (`int4_takes`) tunes among the template
alone (engines/compile.py's `gemm_backends`): timed hot in the cache, torch's kernel can win and then lose the step.
A step with an int4 matmul no micro-kernel takes keeps torch's kernel a choice, on every CPU.

`INT4_AVX512` is its counterpart for CPUs with AVX-512 BF16 and no AMX, for one-row matmuls (a decode step's):
there inductor's own int4 micro-kernel widens each code to float32 and spends two float32 multiply-adds a weight
(one to dequantise, one with the activation). This one reads torch's AVX-512 layout (64-column blocks), turns the
codes of two k-rows into bf16 pairs with a table lookup (the codes 0..15 are exact in bf16) and multiplies them
with the activations' pairs by `vdpbf16ps`, applying each group's scale and zero once per group as the AVX2 kernel
does: one dot-product instruction per two weights and sixteen columns, the same function to within float32 sums
(tests/kernels/test_cpu_int4.py holds it to a float64 matmul; `vdpbf16ps` treats subnormal activations as zero).
It streams its codes past the caches by the same rule as the bf16 kernel, and each group's row of scales and zeros
(a quarter of the codes' bytes at 32 inputs a group), four groups ahead (results/README.md, claim 2, sessions 28-29).

The third, `INT8`, is no kernel of llmstep's: inductor's own float32-vector micro-kernel registered once more for
a weight-only int8 matmul of one row on AVX2, at 64 columns (where 64 divide the matmul). Inductor files it at
16 columns for small m: two vectors, so a one-row decode waits on two chains of multiply-adds; at 64 there
are eight, as many as the FMA units keep busy. The same arithmetic in the same order per output, so the same
function (tests/kernels/test_cpu_int8.py: the same bits as inductor's blockings). On a Zen 1 its weights streamed
past the caches (llmstep's C++ of the same arithmetic) lost, 0.79-0.88x, and 48-column blocks that split SmolLM2's
matmuls evenly over two threads measured level: its widening, not memory, looks to bound it there (results/README.md,
claim 2, session 39).

`BF16_AVX2` is llmstep's bf16 kernel for one-row matmuls on CPUs with AVX2 and no AVX-512 (kernels/cpu_bf16.py),
where no bf16 instruction exists and inductor's float32-vector kernel widens each weight after loading it through
the stack (at::vec's partial loads): inductor's arithmetic in its order, so the same bits as inductor's kernel
(tests/kernels/test_cpu_bf16.py), one load per 16 weights, at the balanced width of those that divide the matmul
into a block of columns for every thread (`_one_row_balanced`; results/README.md, claim 2, session 32, measures
it).

`INT8_AVX512` is llmstep's own kernel for weight-only int8 matmuls of one row with AVX-512 BF16 and no AMX, where it
was measured (kernels/cpu_int8.py): inductor's arithmetic in inductor's order, so the same bits as inductor's kernel
(tests/kernels/test_cpu_int8.py), its weights streamed by the same rule as the others, which is what it is for: a
SmolLM2 int8 step, and the int8 LM head of an int4 one, gained by it, and not by its blocks (64 columns or 32,
`balanced_width` among the widths that divide the matmul into a block for every thread, the rule `BF16_AVX2` takes,
where inductor's are 32), which alone measured level (results/README.md, claim 2, session 29).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core import torch_compat
from ..core.device import last_level_cache
from . import cpu_bf16, cpu_int4, cpu_int8

__all__ = ["BF16", "BF16_AVX2", "INT4", "INT4_AVX512", "INT8", "INT8_AVX512", "kernels", "withheld", "streams_weights",
           "streaming", "int4_takes", "KERNEL_NAME", "BF16_AVX2_KERNEL_NAME", "INT4_KERNEL_NAME",
           "INT4_AVX512_KERNEL_NAME", "INT8_KERNEL_NAME", "INT8_AVX512_KERNEL_NAME"]

KERNEL_NAME = "llmstep_bf16_dot"  # appears in the generated C++ of a step that uses it
BF16_AVX2_KERNEL_NAME = "llmstep_bf16_avx2"
INT4_KERNEL_NAME = "llmstep_int4_avx2"
INT4_AVX512_KERNEL_NAME = "llmstep_int4_avx512"
INT8_KERNEL_NAME = "llmstep_int8_avx2"
INT8_AVX512_KERNEL_NAME = "llmstep_int8_avx512"
# int8 at one row on AVX2: inductor's own kernel at 64 columns, 8 chains of multiply-adds (a matmul 64 does not
# divide keeps inductor's blockings)
INT8_BLOCKINGS = [(1, 64, 64)]
WIDTHS = (64, 32)  # the bf16 dot kernel's block widths: 4 or 2 vectors of 16 columns (balanced_width picks)
# int8 at one row on AVX-512 (kernels/cpu_int8.py): the same widths, the same choice
INT8_AVX512_BLOCKINGS = [(1, width, 64) for width in WIDTHS]
# bf16 at one row on AVX2 (kernels/cpu_bf16.py): the same widths, the same choice; k in blocks of 16
BF16_AVX2_BLOCKINGS = [(1, width, 16) for width in WIDTHS]
# int4 at one row on AVX-512 BF16 (a decode step): inductor's own (4, 64, k) blockings keep the prefill's matmuls;
# the group sizes inductor's own int4 kernel takes
INT4_AVX512_BLOCKINGS = [(1, 64, 32)]
INT4_AVX512_GROUPS = (32, 64, 128)
AMX_ROWS = 1  # with AMX, the matmuls of up to this many rows run here (a decode step's); the rest on AMX tiles
# A one-row matmul of a step whose weights outgrow the last-level cache prefetches them this many bytes ahead of its
# loads, non-temporally (`streams_weights`), on the vector ISAs where that was measured to win: AVX-512 BF16 (a Zen 4,
# 1.06-1.17x SmolLM2's bf16 step) and AVX2 (the bf16 kernel on a Zen 1 with an 8 MiB L3: 1.14x SmolLM2's step, 1.28x the
# shipped model's; a Zen 3 with 32 MiB: 1.02x SmolLM2's, its shipped model cached; results/README.md, claim 2)
STREAM_AHEAD = 4096
STREAM_ISAS = ("avx512_bf16", "avx2")
_STREAM: bool | None = None  # `streaming` sets it: None decides by `streams_weights`' rule, True / False always / never
_WITHHELD: set[str] = set()  # the kernels `withheld` holds out of inductor's registry now, by name

@dataclass
class _Kernel:
    """One micro-kernel: registered with inductor at most once per process (`install`), or the reason it was not."""

    name: str  # appears in the generated C++ of a step that uses it
    register: Callable[[], object]  # registers it and returns its class; raises _NotHere(why) where it does not fit
    source: Callable[[], str]  # what selects its code (its C++, its rules): hashed into the cache tag
    cls: object = None  # the registered class, once installed
    why: str | None = None  # why it was not

    @property
    def installed(self) -> bool:
        return self.cls is not None

    def active(self) -> bool:
        """Installed and in inductor's registry now (`withheld` takes it out for a while)."""
        return self.install() and self.name not in _WITHHELD

    def install(self) -> bool:
        if self.cls is None and self.why is None:
            try:
                if why := torch_compat.missing("micro_gemm"):  # inductor's registry is internal: where it was tested
                    raise _NotHere(f"inductor's C++ GEMM micro-kernel registry is not used: {why}")
                cls = self.register()
                _tag(self.name, self.tag(), True)
                self.cls = cls  # registered and named in the cache keys: only now installed
            except _NotHere as e:
                self.why = str(e)
            except (AttributeError, TypeError, AssertionError) as e:
                self.why = f"this torch's inductor registers micro-kernels differently ({type(e).__name__}: {e})"
        return self.installed

    def tag(self) -> str:
        """The kernel's name and a hash of what selects its code: its source and the code that chooses and wraps
        it (`_rules_text`): a changed kernel or rule is compiled anew, not read from a cache."""
        return f"{self.name}-{hashlib.sha256((self.source() + _rules_text()).encode()).hexdigest()[:16]}"


@functools.cache
def _rules_text() -> str:
    """The text of the code that chooses which matmuls a kernel takes and writes the class around its C++: this
    module (the registering functions, the helpers their rules call, their constants) and torch_compat (the
    registration). A change to any of it retags every kernel: a rule's helper edited alone must not leave steps
    compiled under the old rule in the cache. Empty where the files are not installed."""
    try:
        return inspect.getsource(sys.modules[__name__]) + inspect.getsource(torch_compat)
    except (OSError, TypeError):  # no source files (an installation without .py files)
        return ""


class _NotHere(Exception):
    """A kernel that does not fit this CPU or this torch; the message says why."""


def streams_weights(weight_bytes: int | None, cache_bytes: int | None, isa: str) -> bool:
    """Whether a step's one-row matmuls stream its weights past the caches (`_MM_HINT_NTA` prefetches
    `STREAM_AHEAD` bytes ahead): where the step's weights (`weight_bytes`, its frozen constants) are more than the
    last-level cache holds (`cache_bytes`), on a vector ISA of `STREAM_ISAS`; `streaming(on)` overrides it.

    Such a step reads every weight once and has evicted it before the next step comes back to it: kept in the
    caches, the weights push out what the step reads again (activations, the KV cache, the C++ wrapper's tensor
    handles) to no gain. Where they fit in the cache, the next step finds them there, and streaming them past it
    loses that (results/README.md, claim 2, measures both)."""
    if _STREAM is not None:
        return _STREAM
    return (isa in STREAM_ISAS and weight_bytes is not None and cache_bytes is not None
            and weight_bytes > cache_bytes)


def _stream_options() -> dict:
    """The streaming variables of a kernel's template, for the graph inductor is generating code for."""
    stream = streams_weights(torch_compat.compiling_constant_bytes(), last_level_cache(),
                             torch_compat.cpu_vector_isa())
    return {"stream_weights": stream, "stream_ahead": STREAM_AHEAD}


@contextlib.contextmanager
def streaming(on: bool | None):
    """Steps compiled inside stream their weights (`on` True), never do (False) or follow `streams_weights`' rule
    (None): an A/B of it (scripts/ab_cpu.py's `&stream` / `&nostream`). Named in the compile cache keys."""
    global _STREAM
    before, _STREAM = _STREAM, on
    try:
        _retag()
        yield
    finally:
        _STREAM = before
        _retag()


def _retag() -> None:
    """The kernels' tags in the cache keys brought up to date (the streaming ones' change); a kernel `withheld`
    stays untagged."""
    tags = torch.compiler.config.cache_key_tag.split("+")
    for kernel in kernels():
        if kernel.installed and any(t.startswith(f"{kernel.name}-") for t in tags):
            _tag(kernel.name, kernel.tag(), True)


def _streamed() -> str:
    """What selects the streaming code, for the cache tags: a step compiled here under one rule is not served to
    another (another cache size, `streaming` held)."""
    return f"{STREAM_AHEAD}{STREAM_ISAS}{_STREAM}{last_level_cache()}"


def _register_bf16():
    isa = torch_compat.cpu_vector_isa()
    if isa not in ("amx", "avx512_bf16"):
        raise _NotHere(f"the CPU's vector ISA ({isa}) has no AVX-512 BF16")
    amx = isa == "amx"

    def fits(config, m, n, k, alpha, num_threads, **kwargs) -> bool:
        return (alpha == 1 and k % 2 == 0 and (not amx or m <= AMX_ROWS)  # AMX_ROWS read at each compile
                and config.register_blocking.block_n == balanced_width(n, num_threads))

    # (block_m, block_n, block_k): 4 rows share each weight load; 1 row (a decode step) ranks first at m = 1
    blockings = [(rows, width, 32) for width in WIDTHS for rows in (4, 1)]
    return torch_compat.register_micro_gemm("BF16Dot", cpu_bf16.AVX512, blockings, fits, rank=isa,
                                            options=_stream_options)


def balanced_width(n: int, threads: int, widths: tuple[int, ...] = WIDTHS) -> int | None:
    """The block width (of `widths`) whose busiest thread gets the fewest columns of an n-column matmul, the widest
    on a tie (None of none). Inductor hands each thread ceil(blocks / threads) blocks of columns: at 64 columns
    SmolLM2's 576-wide o and down matmuls are 9 blocks, 5 for one thread and 4 for the other, which then waits; at
    32, 9 and 9."""
    busiest = {w: math.ceil(math.ceil(n / w) / threads) * w for w in widths}  # columns of its busiest thread
    return min(widths, key=lambda w: (busiest[w], -w), default=None)


def _one_row_balanced(config, m: int, n: int, k: int, alpha, num_threads: int, dynamic_M: bool) -> bool:
    """Whether a float32-vector kernel of llmstep's (`BF16_AVX2`, `INT8_AVX512`) takes a matmul at `config`'s
    blocking: one row (a decode step's), k in whole blocks, and the block width `balanced_width` picks among those
    that divide n (the kernels have no column tail) into a block for every thread. With fewer blocks than threads
    inductor's template leaves a thread idle, or, where k-slicing is allowed (`cpp.gemm_max_k_slices` other than
    its default 1), splits k between threads: another order of the sums than inductor's own kernel takes. So these
    kernels' "the same bits as inductor's" holds under any k-slicing setting (not under thread factors that force
    a split of k, `cpp.gemm_thread_factors`)."""
    b = config.register_blocking
    whole = tuple(w for w in WIDTHS if n % w == 0 and n // w >= num_threads)
    return (alpha == 1 and m == 1 and not dynamic_M and k % b.block_k == 0
            and b.block_n == balanced_width(n, num_threads, whole))


def _register_int4():
    if (isa := torch_compat.cpu_vector_isa()) != "avx2":
        raise _NotHere(f"inductor compiles for {isa}, not AVX2 alone")
    if torch_compat.missing("int4_mm_cpu") or not _int4_layout(32):
        raise _NotHere("torch's CPU int4 weights are not packed in 32-column blocks (its AVX2 layout) here")

    def fits(config, m, n, k, alpha, num_threads, q_group_size=None, **kwargs) -> bool:
        return (alpha == 1 and q_group_size is not None and _int4_avx2_shape(n, k, q_group_size)
                and k % config.register_blocking.block_k == 0)

    # (block_m, block_n, block_k): 4 rows share each widened weight; 1 row (a decode step) ranks first at m = 1
    return torch_compat.register_int4_micro_gemm("Int4AVX2", cpu_int4.AVX2, [(4, 32, 32), (1, 32, 32)], fits)


def _int4_avx2_shape(n: int, k: int, group_size: int) -> bool:
    """`INT4`'s shapes: whole blocks of 32 columns, k in steps of 32 (its blockings' block_k), whole groups."""
    return n % 32 == 0 and k % 32 == 0 and k % group_size == 0


def _int4_avx512_shape(n: int, k: int, group_size: int | None) -> bool:
    """The AVX-512 int4 kernels' shapes (inductor's own and `INT4_AVX512`): 64 columns a block, groups of 32, 64 or
    128, whole groups."""
    return n % 64 == 0 and group_size in INT4_AVX512_GROUPS and k % group_size == 0


def int4_takes(n: int, k: int, group_size: int) -> bool:
    """Whether inductor's int4 template has a micro-kernel for a one-row int4 matmul of n outputs and k inputs in
    groups of `group_size` on this CPU (with the template alone, a matmul none takes has no choice at all): on AVX2
    alone `INT4`, while it is registered (`withheld` takes it out); with AVX-512 BF16 or AMX inductor's own AVX-512
    kernel (and `INT4_AVX512`), 64 columns a block and groups of 32, 64 or 128; elsewhere none."""
    try:
        isa = torch_compat.cpu_vector_isa()
    except RuntimeError:  # no inductor vector ISA to read: no micro-kernel to count on
        return False
    if isa == "avx2":
        return _int4_avx2_shape(n, k, group_size) and INT4.active()
    if isa in ("avx512_bf16", "amx"):
        return _int4_avx512_shape(n, k, group_size)
    return False


def _register_int4_avx512():
    if (isa := torch_compat.cpu_vector_isa()) != "avx512_bf16":
        raise _NotHere(f"the CPU's vector ISA ({isa}) is not AVX-512 with BF16 and without AMX")
    if torch_compat.missing("int4_mm_cpu") or not _int4_layout(64):
        raise _NotHere("torch's CPU int4 weights are not packed in 64-column blocks (its AVX-512 layout) here")

    def fits(config, m, n, k, alpha, num_threads, q_group_size=None, dynamic_M=False, **kwargs) -> bool:
        return (alpha == 1 and m == 1 and not dynamic_M and _int4_avx512_shape(n, k, q_group_size)
                and k % config.register_blocking.block_k == 0)

    return torch_compat.register_int4_micro_gemm("Int4AVX512", cpu_int4.AVX512, INT4_AVX512_BLOCKINGS, fits,
                                                 isa="avx512", options=_stream_options)


def _register_int8():
    if (isa := torch_compat.cpu_vector_isa()) != "avx2":
        raise _NotHere(f"inductor compiles for {isa}, not AVX2 alone")

    def fits(config, m, n, k, alpha, num_threads, dynamic_M=False, **kwargs) -> bool:
        b = config.register_blocking
        return alpha == 1 and m == 1 and not dynamic_M and n % b.block_n == 0 and k % b.block_k == 0

    return torch_compat.register_vec_micro_gemm(INT8_KERNEL_NAME, INT8_BLOCKINGS, fits, torch.int8)


def _register_bf16_avx2():
    if (isa := torch_compat.cpu_vector_isa()) != "avx2":  # where it was measured: AVX2 without AVX-512
        raise _NotHere(f"inductor compiles for {isa}, not AVX2 alone")

    def fits(config, m, n, k, alpha, num_threads, dynamic_M=False, **kwargs) -> bool:
        return _one_row_balanced(config, m, n, k, alpha, num_threads, dynamic_M)

    return torch_compat.register_vec_micro_gemm(BF16_AVX2_KERNEL_NAME, BF16_AVX2_BLOCKINGS, fits, torch.bfloat16,
                                                source=cpu_bf16.AVX2, options=_stream_options)


def _register_int8_avx512():
    if (isa := torch_compat.cpu_vector_isa()) != "avx512_bf16":  # where it was measured: AVX-512 BF16, no AMX
        raise _NotHere(f"the CPU's vector ISA ({isa}) is not AVX-512 with BF16 and without AMX")

    def fits(config, m, n, k, alpha, num_threads, dynamic_M=False, **kwargs) -> bool:
        return _one_row_balanced(config, m, n, k, alpha, num_threads, dynamic_M)

    return torch_compat.register_vec_micro_gemm(INT8_AVX512_KERNEL_NAME, INT8_AVX512_BLOCKINGS, fits, torch.int8,
                                                 source=cpu_int8.AVX512, isa="avx512", options=_stream_options)


# compile.compile_step installs them all
BF16 = _Kernel(KERNEL_NAME, _register_bf16, lambda: f"{cpu_bf16.AVX512}{AMX_ROWS}{WIDTHS}{_streamed()}")
BF16_AVX2 = _Kernel(BF16_AVX2_KERNEL_NAME, _register_bf16_avx2,
                    lambda: f"{cpu_bf16.AVX2}{BF16_AVX2_BLOCKINGS}{_streamed()}")
INT4 = _Kernel(INT4_KERNEL_NAME, _register_int4, lambda: cpu_int4.AVX2)
INT4_AVX512 = _Kernel(INT4_AVX512_KERNEL_NAME, _register_int4_avx512,
                      lambda: f"{cpu_int4.AVX512}{INT4_AVX512_BLOCKINGS}{INT4_AVX512_GROUPS}{_streamed()}")
INT8 = _Kernel(INT8_KERNEL_NAME, _register_int8, lambda: repr(INT8_BLOCKINGS))
INT8_AVX512 = _Kernel(INT8_AVX512_KERNEL_NAME, _register_int8_avx512,
                      lambda: f"{cpu_int8.AVX512}{INT8_AVX512_BLOCKINGS}{_streamed()}")


def kernels() -> tuple[_Kernel, ...]:
    """Every micro-kernel of this module (read when called: a test may stand one in for another)."""
    return BF16, BF16_AVX2, INT4, INT4_AVX512, INT8, INT8_AVX512


def _int4_layout(block: int) -> bool:
    """Whether torch packs CPU int4 weights as the int4 kernel for `block`-column blocks reads them: [N / block, K,
    block / 2] bytes, byte j of a block's k-row holding column j's code in its low nibble and column j + block / 2's
    in its high one (torch's layout: 32-column blocks where it runs its AVX2 kernels, 64 with AVX-512). Checked by
    packing known codes."""
    half = block // 2
    codes = torch.arange(128 * 4, dtype=torch.int32).view(128, 4) * 7 % 16  # [N=128, K=4], every code in use
    blocks = codes.view(128 // block, 2, half, 4).permute(0, 3, 2, 1)  # [N / block, K, half, 2]: columns j, j + half
    want = (blocks[..., 0] | blocks[..., 1] << 4).to(torch.uint8).flatten()
    try:
        return torch.equal(torch_compat.int4_pack_cpu(codes).flatten(), want)
    except (RuntimeError, NotImplementedError):
        return False


def _tag(name: str, tag: str, on: bool) -> None:
    """Name a kernel in torch.compile's cache keys (`cache_key_tag`): the registry is not part of them, so
    without the tag a step compiled with the kernel and one compiled without could be served from each other's
    cache entries (across processes, or either side of `withheld`)."""
    tags = [t for t in torch.compiler.config.cache_key_tag.split("+") if t and not t.startswith(f"{name}-")]
    torch.compiler.config.cache_key_tag = "+".join(tags + [tag] * on)


@contextlib.contextmanager
def withheld(when: bool = True, only: tuple[_Kernel, ...] | None = None):
    """Steps compiled inside run inductor's own kernels, none of these (an A/B of them: scripts/ab_cpu.py's
    `~nodot`), or none of `only` (`~llmstep_int8_avx512`); `when` False: a no-op, for callers that withhold them
    in some runs only."""
    if not when:
        yield
        return
    installed = [k for k in kernels() if k.install() and (only is None or k in only)]  # installing adds a tag
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, torch.compiler.config, "cache_key_tag", torch.compiler.config.cache_key_tag)
        for kernel in installed:
            _tag(kernel.name, kernel.tag(), False)
            stack.enter_context(torch_compat.micro_gemm_withheld(kernel.cls))
            _WITHHELD.add(kernel.name)
            stack.callback(_WITHHELD.discard, kernel.name)
        yield

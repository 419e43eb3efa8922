"""Which kernel computes scaled_dot_product_attention: PyTorch's choice, or the one the caller names.

SDPA (attention.py's `sdpa`, the model's one call site) has several kernels: on CUDA flash (FlashAttention-2),
memory-efficient (xFormers' cutlass kernels), cuDNN's fused attention and the math path (plain matmuls and a
softmax in float32); on a CPU flash and math. PyTorch picks the first that takes the arguments, in its own
order of preference (on a Hopper GPU with a recent cuDNN, cuDNN first). Which one ran matters on a GPU: their
speeds differ, and not every one survives CUDA-graph capture equally well. So:

    with attention_backend("flash"):   # or "math", "efficient", "cudnn"; "auto" is PyTorch's choice
        decoder.generate(...)

restricts every SDPA call inside to that kernel (torch.nn.attention.sdpa_kernel, entered at the call site).
A kernel that cannot take the call (one the device lacks: "efficient" on a CPU) is PyTorch's error, not a
silent fallback. The choice is process-wide while the block runs (a server's engine thread sees it too);
a compiled step traced under one choice bakes it in, and Dynamo guards on it, so a step called under another
choice compiles again. "math" computes what `attention.attention` (the textbook formula) does, to rounding.

One more name is llmstep's own, "flex": the decode step of a compiled loop (one query a sequence over a static
cache, where the keys visible are exactly the slots filled so far) runs FlexAttention (torch.nn.attention.
flex_attention) with a block mask built from the positions in the step itself, so the kernel visits only the
128-slot blocks that hold tokens instead of reading every slot of the cache and masking most of them. "auto"
takes it on CUDA (`flex_decode`), where the rest of the cache is memory a decode step would read for nothing;
on a CPU the compiled step of one sequence takes llmstep's own kernel where it is installed (`cpu_step_kernel`,
llmstep.kernels.cpu_attention), unless another choice is asked for. Every other call is SDPA's.

`describe(device)` is what a record says about it: what was asked, what a compiled one-sequence step attends with
(and for llmstep's CPU kernel, which ISA's build), and on CUDA which kernels PyTorch may use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["BACKENDS", "attention_backend", "check_backend", "current", "kernels", "flex_decode", "cpu_step_kernel",
           "cpu_step_prefix_kernel", "use_cpu_step_kernel", "describe"]

# The names a caller (and the --attention flag) may give, and PyTorch's kernel for each; "auto": no restriction.
_KERNELS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
BACKENDS = ("auto", *_KERNELS, "flex")

_chosen = "auto"  # read at every SDPA call (`kernels`), and by Dynamo when it traces one, which guards on it
_cpu_step: Callable | None = None  # llmstep.kernels.cpu_attention's `attend`, once installed (a layer above core)
_cpu_step_prefix: tuple[Callable, Callable] | None = None  # (that kernel, its decode steps' prefix form)
_cpu_step_op: tuple[Callable, str] | None = None  # (that kernel, its decode step's op: "...::attention_prefix")


def check_backend(name: str) -> str:
    """name if it is one of BACKENDS, else a ValueError listing them."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return name


def current() -> str:
    """The attention backend SDPA calls run with now ("auto" outside any `attention_backend` block)."""
    return _chosen


_open: list[tuple[int, str]] = []  # (thread, name) of each block open now, in the order they were entered
_opening = threading.Lock()


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[str]:
    """Inside, every SDPA call of llmstep's model runs with kernel `name` ("auto": PyTorch's choice). The choice is
    the process's (Dynamo guards on it): blocks nest within a thread, and another thread's block may overlap with
    the same choice only (a RuntimeError otherwise); once the last block is left, the choice is "auto" again."""
    global _chosen
    check_backend(name)
    block = (threading.get_ident(), name)
    with _opening:
        other = next((n for thread, n in _open if thread != block[0] and n != name), None)
        if other is not None:
            raise RuntimeError(f"attention_backend({name!r}) while another thread's block runs with {other!r}: the "
                               "choice is the process's, so threads running at once share one")
        _open.append(block)
        _chosen = name
    try:
        yield name
    finally:
        with _opening:
            _open.remove(block)
            _chosen = _open[-1][1] if _open else "auto"


def kernels() -> contextlib.AbstractContextManager:
    """The context the SDPA call site enters: nothing for "auto", else sdpa_kernel restricted to the chosen kernel."""
    if _chosen in ("auto", "flex"):
        return contextlib.nullcontext()
    return sdpa_kernel([_KERNELS[_chosen]])


def use_cpu_step_kernel(kernel: Callable | None, op: str | None = None, prefix: Callable | None = None) -> None:
    """Register the kernel a static CPU step of one sequence attends with (None: SDPA's); `cpu_step_kernel`. `op`
    names the operator a decode step calls, for records (`describe`); `prefix`, the kernel's form for a decode step
    whose rows see slots 0..last (`cpu_step_prefix_kernel`)."""
    global _cpu_step, _cpu_step_op, _cpu_step_prefix
    _cpu_step = kernel
    _cpu_step_prefix = (kernel, prefix) if kernel is not None and prefix is not None else None
    _cpu_step_op = (kernel, op) if kernel is not None and op is not None else None


def cpu_step_kernel(q: torch.Tensor) -> Callable | None:
    """The kernel for the masked attention of a static step (traced for torch.compile) of one sequence with queries
    q: llmstep's CPU kernel (llmstep.kernels.cpu_attention) where it is registered, the choice is "auto" and q is
    float32 or bf16 on a CPU with a head_dim that is a multiple of 16; else None, SDPA's. Its arguments are
    SDPA's with the query heads stacked per KV head: q [1, n_kv, rows, hd], k/v [1, n_kv, S, hd], mask
    [1, 1, rows, S]."""
    if _cpu_step is None or _chosen != "auto" or q.device.type != "cpu" or q.shape[-1] % 16:
        return None
    return _cpu_step if q.dtype in (torch.float32, torch.bfloat16) else None


def cpu_step_prefix_kernel(q: torch.Tensor) -> Callable | None:
    """`cpu_step_kernel`'s form for a static decode step, where every query row of batch row b sees slots
    0..last[b] (`Mask.last`): kernel(q, k, v, last [B] int64), no mask tensor; None where there is none (then
    `cpu_step_kernel` with the mask). Only the form registered with the kernel registered now."""
    if cpu_step_kernel(q) is None or _cpu_step_prefix is None or _cpu_step_prefix[0] is not _cpu_step:
        return None
    return _cpu_step_prefix[1]


def flex_decode(device: torch.device) -> bool:
    """Whether a static decode step on `device` attends with FlexAttention over the filled blocks: asked ("flex"),
    or by default ("auto") on CUDA."""
    return _chosen == "flex" or (_chosen == "auto" and device.type == "cuda")


def describe(device: str | torch.device) -> dict:
    """What a record says about attention: the backend asked for, what a compiled decode step of one sequence
    attends with ("flex", "llmstep_cpu": llmstep.kernels.cpu_attention's, registered in this process, or "sdpa";
    for "llmstep_cpu", "decode_step_op" names the operator a decode step calls, whose namespace says which ISA's
    build it is; a static step of several tokens calls that build's masked `attention`),
    and on CUDA the kernels PyTorch may pick from (its global switches, torch.backends.cuda.*_sdp_enabled, narrowed
    to the one asked for) and which are built in. Which kernel did run only a profile shows
    (llmstep.lab.probe.attention_kernels)."""
    device = torch.device(device)
    own = _cpu_step is not None and _chosen == "auto" and device.type == "cpu"
    out: dict = {"asked": _chosen, "decode_step": "flex" if flex_decode(device) else "llmstep_cpu" if own else "sdpa"}
    if out["decode_step"] == "llmstep_cpu" and _cpu_step_op is not None and _cpu_step_op[0] is _cpu_step:
        out["decode_step_op"] = _cpu_step_op[1]  # named with the kernel registered now, never another's
    if device.type == "cuda":
        enabled = {"math": torch.backends.cuda.math_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
                   "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                   "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
        out["allowed"] = [k for k, on in enabled.items() if on and _chosen in ("auto", k)]
        out["flash_built"] = torch.backends.cuda.is_flash_attention_available()
        out["cudnn_version"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return out

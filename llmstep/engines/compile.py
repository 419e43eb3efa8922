"""How a decode step is compiled for a device, and warmed up before anything is timed.

FastDecoder, FastSpeculator and the batcher each run a small step (one token through the model, a
speculative round, one token for every slot) thousands of times with the same shapes. `Step` is that
function, eager or compiled whole with torch.compile (`compile_step`):

- on CUDA with mode "reduce-overhead", which records it once as a CUDA graph and replays it with one
  launch per token;
- on a CPU with the weights frozen into the compiled code (packed for oneDNN, q/k/v and gate/up each
  concatenated into one matmul) and a C++ wrapper between the kernels instead of Python. Frozen means
  frozen: change the model's weights and you need a new step.

`warm_up` runs the steps before timing: compiling takes seconds (tens on a CPU), and a CUDA graph is
recorded on the second or third call.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterable

import torch

from ..core import torch_compat
from ..core.device import synchronize
from . import cpu_gemm

__all__ = ["compile_options", "tunes_matmuls", "uses_cuda_graphs", "compiles", "compile_step", "Step", "warm_up"]


def compile_options(device: torch.device, mode: str | None = None, tune_matmuls: bool = True) -> dict:
    """torch.compile's inductor options for a decode step on `device` (mode None: this device's best).

    CUDA: mode "reduce-overhead", i.e. CUDA graphs, plus gpt-fast's `coordinate_descent_tuning`: with it
    inductor turns every 1-row matmul (a decode step's) into a fused multiply-and-sum that it tunes to
    bandwidth, int8's widening fused in; without it, 1-row bf16 matmuls go to cuBLAS and int8's
    `F.linear(x, w.to(x.dtype)) * scales` is rewritten to the extern int8 weight-only kernel, slow at one
    row (tests/cuda_proofs/test_compile_trace.py traces both with fake CUDA tensors).
    CPU: freeze the weights into the compiled code (`freezing`: packed layouts, constant folding),
    concatenate the linears that read one input (`cpp.enable_concat_linear`: wq|wk|wv and w1|w3 become
    one matmul each, so a step makes 4 weight passes per layer instead of 7), and call the kernels from
    C++ (`cpp_wrapper`), not from Python; by default (mode None) tune the matmuls (below).
    "max-autotune" also times inductor's own C++ GEMM templates against oneDNN for every matmul shape. A CPU step
    does that for its matmuls by default too (mode None: `max_autotune_gemm`, a few seconds more compile) when
    `tune_matmuls` (`tunes_matmuls(model)`): on a CPU without AMX the templates beat oneDNN's matmuls for float32
    and int4 weights, and did nothing for int8 (which keeps its packed kernel). For bf16 weights the template
    runs `cpu_gemm`'s dot-product kernel where the CPU has AVX-512 BF16; elsewhere the template's widening kernel
    helped with 2 threads but lost to oneDNN with 1, so a f16 model, or a bf16 one without the kernel, on one
    thread keeps oneDNN (the A/B behind each choice: scripts/ab_cpu.py). `compile_step` registers the kernel
    with inductor (`cpu_gemm.install`) before it compiles a CPU step.
    Options this torch's inductor does not know are left out (`torch_compat.known_options`): the step compiles
    without them.
    """
    best = mode is None
    if mode is None:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
    options = torch_compat.mode_options(mode)  # ValueError for an unknown mode
    if device.type == "cuda":
        options |= {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True}
    if device.type == "cpu":
        options |= {"freezing": not torch_compat.missing("freezing"), "cpp.enable_concat_linear": True,
                    "cpp_wrapper": True}
        if best and tune_matmuls:  # tuned quietly: inductor prints every shape's timings to stderr by default
            options |= {"max_autotune_gemm": True, "autotune_num_choices_displayed": 0,
                        "max_autotune_report_choices_stats": False}
    return torch_compat.known_options(options)


def compiles(device: torch.device, compile: bool | None) -> bool:
    """Whether a loop's step is compiled: `compile` as given; None compiles on CUDA only (see `Step`)."""
    return device.type == "cuda" if compile is None else bool(compile)


def tunes_matmuls(model: torch.nn.Module) -> bool:
    """Whether a CPU step of `model` tunes its matmuls by default (`compile_options`): float32 weights and
    quantised ones always; bf16 ones where the CPU runs the template's bf16 dot-product kernel (`cpu_gemm`) or
    torch runs more than one thread; f16 ones with more than one thread (decided when the step is made)."""
    from ..core.quantize import QuantLinear

    weight = next(model.parameters())
    return (weight.dtype == torch.float32 or torch.get_num_threads() > 1
            or any(isinstance(m, QuantLinear) for m in model.modules())
            or (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and cpu_gemm.install()))


def uses_cuda_graphs(device: torch.device, mode: str | None = None) -> bool:
    """Whether `compile_step` records the step as a CUDA graph on `device` in `mode`."""
    return device.type == "cuda" and bool(compile_options(device, mode).get("triton.cudagraphs"))


def own_code(fn: Callable) -> types.FunctionType:
    """fn behind a function whose code object is its own: Dynamo keeps its compiled versions per code object,
    so a step compiled from this holds its one entry there, not one among every decoder's of the process
    (a bound method or a partial of one class all share one code object)."""
    def step(*args):
        return fn(*args)

    return types.FunctionType(step.__code__.replace(), step.__globals__, "step", None, step.__closure__)


def compile_step(fn, device: torch.device, mode: str | None = None, static: Iterable[torch.Tensor] = (),
                 refilled: Iterable[torch.Tensor] = (), tune_matmuls: bool = True):
    """fn compiled whole for `device` (see `compile_options`), fixed shapes; `static` are tensors it
    updates in place every call (a KV cache): fixed addresses let a CUDA graph write them directly.
    `refilled` are tensors fn only reads and the caller refills in place between calls (random numbers):
    fixed addresses too where nothing is frozen (CUDA: the graph reads them where they are), left unmarked
    where the weights are frozen, since freezing folds every fixed-address tensor fn does not write into a
    constant of the compiled code.
    With CUDA graphs, each call first tells PyTorch that the last call's outputs are consumed, so the
    graph may reuse their memory: use what a step returns before calling it again."""
    options = compile_options(device, mode, tune_matmuls)
    if device.type == "cpu":
        cpu_gemm.install()  # here, not in compile_options: it imports inductor and probes the compiler (seconds)
    for t in (*static, *(() if options.get("freezing") else refilled)):
        torch_compat.mark_static_address(t)
    traced = own_code(fn)  # its own code object: Dynamo's limit of compiled versions counts this step's alone
    compiled = torch.compile(traced, options=options, fullgraph=True, dynamic=False)
    if uses_cuda_graphs(device, mode):

        def graphed_step(*args):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)

        return graphed_step
    if not options.get("freezing"):
        return compiled
    frozen_step = torch_compat.holding_freezing(compiled)  # the flag Dynamo reads when it traces, held set
    frozen_step.traced = traced  # the function Dynamo compiles: Step.unguarded finds its compiled code there
    return frozen_step


class Step:
    """A loop's step: `fn` itself, or fn compiled for `device` (`compile_step`).

    compile: None compiles on CUDA only (a CPU compile takes tens of seconds: worth it for a benchmark or a
    long run, not for one short generation). mode: torch.compile's mode; None is "reduce-overhead" (CUDA
    graphs) on CUDA, the default with tuned matmuls on a CPU; "max-autotune" tunes more. static: the tensors fn
    writes in place (`KVCache.buffers`); refilled: those it only reads and the caller refills (`compile_step`);
    tune_matmuls: `tunes_matmuls(model)` of the model the step runs (`compile_options`).
    """

    def __init__(self, fn: Callable, device: torch.device, compile: bool | None = None, mode: str | None = None,
                 static: Iterable[torch.Tensor] = (), refilled: Iterable[torch.Tensor] = (),
                 tune_matmuls: bool = True):
        compile_options(device, mode)  # an unknown mode is refused whether or not this step compiles
        self.compiled = compiles(device, compile)
        self.cuda_graphs = self.compiled and uses_cuda_graphs(device, mode)
        self.fn = compile_step(fn, device, mode, static, refilled, tune_matmuls) if self.compiled else fn

    def __call__(self, *args):
        return self.fn(*args)

    def unguarded(self) -> Callable[[], object]:
        """This step (it takes no arguments) as a plain call for a loop that makes it many times while nothing
        it reads changes but the values in its tensors (FastDecoder's decode loop).

        A compiled call first runs torch.compile's Python wrapper and Dynamo's frame hook, which evaluates
        every guard of the compiled code (hundreds of checks of the model, cache and global state: a visible
        share of a small CPU step; scripts/overhead_cpu.py times it). Here the guards are evaluated once, now,
        and the call returned is Dynamo's compiled code itself. A state the guards refuse (a new shape, thread
        count, grad mode) gets the step as it is, which recompiles. Eager steps, CUDA graphs and a torch whose
        Dynamo cannot be asked (`torch_compat.FEATURES["unguarded"]`) also get the step as it is. The public
        switch, `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`, checks only the guards that tell a
        step's compiled versions apart (none, for a step compiled once), for every compiled call made under it,
        and still runs the wrapper and the frame hook each call."""
        traced = getattr(self.fn, "traced", None)
        if traced is None:
            return self
        code, closure = traced.__code__, traced.__closure__
        f_locals = {"args": ()} | {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure,
                                                                                    strict=True)}
        compiled = torch_compat.unguarded_code(traced, f_locals)  # the frame Dynamo would see
        if compiled is None:
            return self
        return types.FunctionType(compiled, traced.__globals__, "step", None, closure)


def warm_up(device: torch.device, *calls: Callable[[], object], steps: int = 3) -> float:
    """Run every call `steps` times and wait for the device: each step it calls is compiled (and on CUDA
    its graph recorded: reduce-overhead records on the second or third call) before anything is timed.
    Returns the seconds it took. A call writes dummy tokens into its cache: reset the cache afterwards."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        for call in calls:
            call()
    synchronize(device)
    return time.perf_counter() - start

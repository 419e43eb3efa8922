"""How a decode step is compiled for a device, and warmed up before anything is timed.

FastDecoder, FastSpeculator and the batcher each run a small step (one token through the model, a speculative
round, one token for every slot) thousands of times with the same shapes. `Step` is that function, eager or
compiled whole with torch.compile (`compile_step`): on CUDA as a CUDA graph, replayed with one launch per token;
on a CPU with the weights frozen into the compiled code (change the model's weights and you need a new step), named
in torch.compile's cache by their digest (`weights_digest`: another model of the same shapes compiles anew).
`warm_up` runs the steps before timing: compiling takes seconds (tens on a CPU).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterable, Sequence

import torch

from ..core import int4a8, torch_compat
from ..core.checks import check_flag
from ..core.device import last_level_cache, synchronize
from ..kernels import cpu_attention, cpu_gemm, cpu_int4a8

__all__ = ["compile_options", "tunes_matmuls", "gemm_backends", "uses_cuda_graphs", "compiles", "compile_step", "Step",
           "weights_digest", "warm_up"]


def compile_options(device: torch.device, mode: str | None = None, gemm_backends: str | bool | None = "ATEN,CPP", *,
                    tune_matmuls: bool | None = None) -> dict:
    """torch.compile's inductor options for a decode step on `device` (mode None: this device's best).

    CUDA: "reduce-overhead" (CUDA graphs) plus gpt-fast's `coordinate_descent_tuning`, with which inductor turns
    every 1-row matmul into a fused multiply-and-sum tuned to bandwidth, int8's widening fused in
    (tests/cuda_proofs/test_compile_trace.py traces both with fake CUDA tensors).
    CPU: the weights frozen into the code (`freezing`: packed layouts, constant folding), the linears that read one
    input concatenated (`cpp.enable_concat_linear`: wq|wk|wv and w1|w3 one matmul each), the kernels called from
    C++ (`cpp_wrapper`); with mode None every matmul shape also tuned among `gemm_backends` (`gemm_backends(model)`;
    None: not tuned): "ATEN,CPP" times oneDNN/MKL against inductor's C++ GEMM templates, "CPP" takes the template
    alone (`max_autotune_gemm`; "max-autotune" tunes the rest too), whose bf16 kernel is `cpu_gemm`'s where the CPU
    has AVX-512 BF16 (scripts/ab_cpu.py is the A/B behind each default); on one without AMX, a step whose weights
    outgrow the last-level cache streams them past it (`cpu_gemm.streams_weights`). A CPU step of one sequence
    attends with llmstep's kernel (`cpu_attention`), installed by `compile_step`.
    Options this torch's inductor does not know are left out (`torch_compat.known_options`). The earlier switch,
    `tune_matmuls` (or a bool in gemm_backends' place), still works: True is "ATEN,CPP", False is None.
    """
    if tune_matmuls is not None:
        gemm_backends = tune_matmuls
    if isinstance(gemm_backends, bool):
        gemm_backends = "ATEN,CPP" if gemm_backends else None
    best = mode is None
    if mode is None:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
    options = torch_compat.mode_options(mode)  # ValueError for an unknown mode
    if device.type == "cuda":
        options |= {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True}
    if device.type == "cpu":
        options |= {"freezing": not torch_compat.missing("freezing"), "cpp.enable_concat_linear": True,
                    "cpp_wrapper": True}
        if best and gemm_backends:  # tuned quietly: inductor prints every shape's timings to stderr by default
            options |= {"max_autotune_gemm": True, "max_autotune_gemm_backends": gemm_backends,
                        "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    return torch_compat.known_options(options)


def compiles(device: torch.device, compile: bool | None) -> bool:
    """Whether a loop's step is compiled: `compile` as given; None compiles on CUDA only (see `Step`)."""
    check_flag(compile, "compile")
    return device.type == "cuda" if compile is None else bool(compile)


def tunes_matmuls(model: torch.nn.Module) -> bool:
    """Whether a CPU step of `model` tunes its matmuls by default (`compile_options`): float32 weights and
    quantised ones always; bf16 ones where the CPU runs the template's bf16 dot-product kernel (`cpu_gemm`: AVX-512
    BF16, with AMX or without), where it has no bf16 instructions (AVX2 alone: oneDNN's untuned matmul emulates
    bf16, the template widens it), or where torch runs more than one thread; f16 ones with more than one thread
    (decided when the step is made). Untuned, then, only a bf16 step at one thread on a CPU with bf16 instructions
    whose torch cannot take the kernel, where oneDNN's own bf16 matmul beat the template (results/README.md, claims
    2 and 12)."""
    from ..core.quantize import QuantLinear

    weight = next(model.parameters())
    return (weight.dtype == torch.float32 or torch.get_num_threads() > 1
            or any(isinstance(m, QuantLinear) for m in model.modules())
            or (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and (cpu_gemm.BF16.install() or not _bf16_instructions())))


def _bf16_instructions() -> bool:
    """Whether the CPU multiplies bf16 with instructions of its own (AMX or AVX-512 BF16); True where inductor's
    vector ISA cannot be read (the earlier rule: untuned)."""
    try:
        return torch_compat.cpu_vector_isa() in ("amx", "avx512_bf16")
    except RuntimeError:
        return True


def gemm_backends(*models: torch.nn.Module) -> str | None:
    """What a CPU step running `models` tunes its matmuls among by default (`compile_options`): None (not tuned)
    unless every model's are (`tunes_matmuls`); "CPP", inductor's C++ GEMM template alone, where every model is
    bf16 (its linears quantised or not) and either `cpu_gemm`'s bf16 kernel is installed or `cpu_gemm.INT4` (AVX2)
    is, and the template has an int4 micro-kernel for every int4 matmul of torch's packed kernel the models hold
    (`cpu_gemm.int4_takes`; none: none needed); else "ATEN,CPP".

    Inductor times each candidate on one weight, again and again: hot in the cache. A decode step whose weights do
    not fit in the cache streams them from memory, where the template's kernel is the faster one; on weights hot in
    the cache oneDNN's (or torch's int4 kernel) can win the timing and then lose the step (scripts/ab_cpu.py's
    `|max_autotune_gemm_backends=` variants measure both; results/README.md, claim 2). The template alone must take
    every matmul (inductor has no other choice then): its float and int8 kernels take any shape, its int4 ones not."""
    if not all(tunes_matmuls(m) for m in models):
        return None
    bf16 = all(next(m.parameters()).dtype == torch.bfloat16 for m in models)
    if not bf16 or next(models[0].parameters()).device.type != "cpu":
        return "ATEN,CPP"
    from ..core.quantize import Int4Linear

    int4 = [m for model in models for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == "packed"]
    if not all(cpu_gemm.int4_takes(m.out_features, m.in_features, m.group_size) for m in int4):
        return "ATEN,CPP"  # an int4 matmul no micro-kernel takes: torch's kernel stays its choice
    return "CPP" if cpu_gemm.BF16.install() or (int4 and cpu_gemm.INT4.install()) else "ATEN,CPP"


def uses_cuda_graphs(device: torch.device, mode: str | None = None) -> bool:
    """Whether `compile_step` records the step as a CUDA graph on `device` in `mode`."""
    return device.type == "cuda" and bool(compile_options(device, mode).get("triton.cudagraphs"))


def own_code(fn: Callable) -> types.FunctionType:
    """fn behind a function whose code object is its own: Dynamo keeps compiled versions per code object, so this
    step's entry is its own, not one among every decoder's of the process (a bound method shares its class's)."""
    def step(*args):
        return fn(*args)

    return types.FunctionType(step.__code__.replace(), step.__globals__, "step", None, step.__closure__)


_NAMING = threading.RLock()  # a frozen step's call, which holds process-wide settings (compile_step)


def weights_digest(*models: torch.nn.Module) -> str:
    """A sha256 of the values of every parameter and buffer of `models` (each tensor once: a tied head is the
    embedding), with their dtypes and shapes: the name of a frozen step's weights in torch.compile's cache keys.

    Inductor's FX graph cache keys a graph whose weights are frozen by their shapes and dtypes alone, and keeps with
    the compiled code, by value, the weights its C++ GEMM template packed for its kernels (a tuned step's matmuls):
    a second model of the same shapes, compiled in another process that shares the cache (inductor's default folder,
    one per user) or in the same one, ran the first model's weights, silently (tests/engines/test_compile_cache.py).
    With the digest in the key such a step compiles anew; the same weights still find their cached code.

    ~1.6 GB/s on one core, read anew at every call (`compile_step` calls it once a step, as the step compiles): no
    digest is remembered, since no mark on a tensor says reliably that its values are unchanged (a write through
    `.data` leaves its address and in-place version as they were), and a stale digest would serve a step the old
    weights frozen into its cached code. Weights that cannot be read as bytes here (meta, sparse or quantized
    tensors, tensor subclasses) get a name of their own: their step is never found in the cache.
    """
    try:
        hashed = hashlib.sha256()
        for t in _tensors(models):
            t = t.detach()
            if type(t) is not torch.Tensor or t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
                raise TypeError(f"a {type(t).__name__} ({t.layout}, {t.device}) is not read as bytes here")
            hashed.update(f"{t.dtype}{tuple(t.shape)};".encode())
            hashed.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        return f"weights-{hashed.hexdigest()[:32]}"
    except (RuntimeError, TypeError, ValueError):
        return f"weights-unread-{uuid.uuid4().hex}"


def compile_step(fn, device: torch.device, mode: str | None = None, static: Iterable[torch.Tensor] = (),
                 refilled: Iterable[torch.Tensor] = (), gemm_backends: str | None = "ATEN,CPP",
                 models: Sequence[torch.nn.Module] = ()):
    """fn compiled whole for `device` (see `compile_options`), fixed shapes. static: tensors it updates in place
    every call (a KV cache), at fixed addresses a CUDA graph writes directly. refilled: tensors it only reads and
    the caller refills in place (random numbers), at fixed addresses too unless the weights are frozen (freezing
    would fold them into constants). models: the modules whose weights it reads; where they are frozen into the code
    (a CPU step), their `weights_digest`, taken at the first call, is in the compile cache's keys, and a frozen step
    given none is not cached across compiles at all (inductor's FX graph cache off for it). With CUDA graphs a call
    reuses the last call's outputs' memory: use what a step returns before calling it again."""
    options = compile_options(device, mode, gemm_backends)
    if options.get("freezing") and not models:  # its weights cannot be named: never served another's
        options["fx_graph_cache"] = False
    if device.type == "cpu":
        for kernel in cpu_gemm.kernels():  # here, not in compile_options: inductor imported, the compiler probed (s)
            kernel.install()
        cpu_attention.install()  # a step of one sequence attends with it (attention_backend.cpu_step_kernel)
        if any(getattr(m, "activations", None) for model in models for m in model.modules()):
            cpu_int4a8.install()  # int4-a8's and int8-a8's matmuls (core.int4a8, int8a8; prepare() has installed them)
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
    digest: list = []  # the weights' name and whether the kernels stream them, decided at the first call

    def named_step(*args):
        """frozen_step with the weights' digest and the vector ISA inductor writes for held in torch.compile's cache
        keys (`cache_key_tag`; inductor's own keys name neither: a cache shared by an AMX Xeon and a Zen 4, a Docker
        image's, would serve the Xeon's AMX tiles to the Zen 4, an illegal instruction there), and the 8-bit-
        activation kernels' streaming (`int4a8.streaming`, by `streams_weights`' rule) held while it is traced. The
        tag and freezing's flag are process-wide settings: one such call runs at a time, so a step in another thread
        never compiles under this one's."""
        with _NAMING:
            if not digest:  # the CPU's vector ISA too (unread, a name never reused: the step is never found)
                isa = _vector_isa() or f"unread-{uuid.uuid4().hex}"
                digest.extend((f"{weights_digest(*models)}-isa-{isa}", streams_weights(models)))
            before = torch.compiler.config.cache_key_tag
            torch.compiler.config.cache_key_tag = "+".join(t for t in (before, digest[0]) if t)
            try:
                with int4a8.streaming(digest[1]):
                    return frozen_step(*args)
            finally:
                torch.compiler.config.cache_key_tag = before

    named_step.traced = traced  # the function Dynamo compiles: Step.unguarded finds its compiled code there
    return named_step


def streams_weights(models: Sequence[torch.nn.Module]) -> bool:
    """Whether a CPU step running `models` streams their weights past the outer caches in its 8-bit-activation
    kernels' one-row calls (int4a8.streaming): `cpu_gemm.streams_weights`' rule (the bf16 and int4 templates'), on
    the bytes of every parameter and buffer of the models (each tensor once) against the last-level cache;
    `cpu_gemm.streaming(on)` overrides it (scripts/ab_cpu.py's `&stream` / `&nostream`). Decided before the step is
    traced, it counts what the models hold, where the templates count the step's frozen constants: an int4-a8
    layer's plain scales and zeros beside its kernel's copy of them (about a fifth more at g=32 in bf16), so within
    that margin of the cache's size the two may decide apart."""
    return cpu_gemm.streams_weights(sum(t.nbytes for t in _tensors(models)), last_level_cache(), _vector_isa())


def _tensors(models: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of `models`, each tensor once (a tied head is the embedding), in order."""
    return list({id(t): t for m in models for t in itertools.chain(m.parameters(), m.buffers())}.values())


def _vector_isa() -> str:
    try:
        return torch_compat.cpu_vector_isa()
    except RuntimeError:
        return ""


class Step:
    """A loop's step: `fn` itself, or fn compiled for `device` (`compile_step`; compile None: on CUDA only, since a
    CPU compile takes tens of seconds). mode: torch.compile's (None: this device's best, `compile_options`);
    static, refilled, models: `compile_step`'s; gemm_backends: `gemm_backends(models)` of the models the step runs.
    """

    def __init__(self, fn: Callable, device: torch.device, compile: bool | None = None, mode: str | None = None,
                 static: Iterable[torch.Tensor] = (), refilled: Iterable[torch.Tensor] = (),
                 gemm_backends: str | None = "ATEN,CPP", models: Sequence[torch.nn.Module] = ()):
        compile_options(device, mode)  # an unknown mode is refused whether or not this step compiles
        self.compiled = compiles(device, compile)
        self.cuda_graphs = self.compiled and uses_cuda_graphs(device, mode)
        self.fn = compile_step(fn, device, mode, static, refilled, gemm_backends, models) if self.compiled else fn

    def __call__(self, *args):
        return self.fn(*args)

    def unguarded(self) -> Callable[[], object]:
        """This step (it takes no arguments) as a plain call for a loop that makes it many times while nothing it
        reads changes but the values in its tensors (FastDecoder's decode loop).

        A compiled call first runs torch.compile's wrapper and Dynamo's frame hook, which evaluates every guard
        (hundreds of checks of the model, cache and global state; scripts/overhead_cpu.py times them). Here the
        guards are evaluated once, now, and the call returned is Dynamo's compiled code itself. A state the guards
        refuse gets the step as it is (which recompiles); so do eager steps, CUDA graphs and a torch whose Dynamo
        cannot be asked (`torch_compat.FEATURES["unguarded"]`). The public switch,
        `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`, still runs the wrapper and the hook each call."""
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

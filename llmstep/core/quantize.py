"""Quantization: fewer bytes per weight, so fewer bytes per token at the memory wall.

Decode at batch 1 reads every weight once per token, so its speed is set by bytes, not FLOPs. Storing the matrices
in 8 or 4 bits and widening them back inside the matmul cuts those bytes 2-4x (from bf16) while activations, norms
and the KV cache stay in the model's dtype (int8-a8 and int4-a8, activations=8, round them too: core.int8a8, int4a8).

The formats (int8 per output channel, int4 per group of inputs with a scale and a zero, two codes a byte)
and their pure arithmetic are in llmstep.core.quant_formats; this module holds the layers that compute with them.

`quantize(model, "int8")` swaps the blocks' nn.Linear (and the LM head: lm_head=True, or "int8" / "int8-a8")
for `Int8Linear` / `Int4Linear`; the forward is untouched. No file I/O: `llmstep.save` / `llmstep.load` do that.

The matmul calls PyTorch's packed kernels (int8's, int4's tinygemm on CUDA and its CPU kernel: private torch ops,
through llmstep.core.torch_compat) or dequantises and multiplies, which torch.compile fuses (gpt-fast's int8 path).
int4's third way, `kernel="reduce"`: the codes as [N, K/g, g/2] bytes, each byte's nibbles against the even and odd
inputs, scale and zero per group, one sum: compiled, one reduction kernel reading half a byte a weight (to beat
tinygemm at one row on a GPU). A tuned compiled CPU step may run inductor's int4 template on the same packed weights
(llmstep.kernels.cpu_gemm gives it an AVX2 kernel). `kernel="auto"` picks per mode and device
(llmstep.core.quant_kernels; int4 on CUDA: what `prefer_int4_kernel` recorded for this GPU); `llmstep bench
--quantize none int8 int4` and scripts/gpu_probe.py measure what each costs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from . import int4a8, int8a8, quant_layouts, torch_compat
from .config import LlamaConfig
from .linear import linear, widened, widens_rows
from .model import Llama, materialize
from .quant_formats import (
    DEFAULT_GROUP_SIZE,
    HEADS,
    MODES,
    QuantConfig,
    QuantizationError,
    agrees,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    reduce_matmul,
    unpack_int4,
)
from .quant_kernels import auto_kernel, choose_int4_kernel, int8_mm_fits, prefer_int4_kernel

__all__ = ["QuantConfig", "QuantizationError", "MODES", "quantize_int8", "dequantize_int8", "quantize_int4",
           "dequantize_int4", "pack_int4", "unpack_int4", "Int8Linear", "Int4Linear", "quantize", "check_config",
           "linear_names", "swap_linears", "quantize_lm_head", "empty_quantized", "layer_errors", "choose_int4_kernel",
           "prefer_int4_kernel", "DEFAULT_GROUP_SIZE"]

KERNELS = ("auto", "packed", "dequant", "reduce")  # "reduce": int4 only
# The packed kernels are matrix-vector kernels: at more rows than this (a prompt, an eval batch) widening the
# weights once and calling the ordinary matmul is far faster (the packed kernel repeats its work per row).
PACKED_MAX_ROWS = 16


def _check_kernel(kernel: str, mode: str, activations: int | None = None) -> None:
    if activations and kernel not in ("auto", "a8", "dequant"):  # "a8": the 8-bit activation layers' integer kernel
        raise QuantizationError(f"{mode} with 8-bit activations has its own kernel (auto), not {kernel!r}")
    if kernel not in KERNELS and not (activations and kernel == "a8"):
        raise QuantizationError(f"unknown kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel == "reduce" and mode != "int4":
        raise QuantizationError("kernel 'reduce' is int4's single-reduction path; int8 has 'packed' and 'dequant'")


CHECK_ROWS = 64  # rows prepare() checks a packed kernel on (all rows: a layer's weights in float while loading)


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T: an nn.Linear (no bias) whose weight is stored as int8 rows and their scales."""

    mode = "int8"

    def __init__(self, in_features: int, out_features: int, device=None, dtype=torch.float32, kernel: str = "auto",
                 activations: int | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activations = activations  # 8: 8-bit activations (llmstep.core.int8a8), None: as they come
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=dtype, device=device))  # [N]
        _check_kernel(kernel, "int8", activations)
        if activations is not None:
            QuantConfig("int8", activations=activations)  # 8 or None, else refused by name
            if why := int8a8.width_problem(in_features):
                raise QuantizationError(f"int8 with 8-bit activations: {why}")
        self.kernel = self.asked = kernel  # asked: what prepare() settles from, each time it runs
        self.eager_packed = False  # set by prepare(): "auto" in bf16 on a CPU, the packed op outside a compiled graph

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str = "auto", activations: int | None = None) -> Int8Linear:
        w = linear.weight
        m = cls(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype, kernel=kernel, activations=activations)
        m.weight, m.scales = quantize_int8(w, scale_dtype=w.dtype)
        m.prepare()
        return m

    def prepare(self) -> Int8Linear:
        """Settle the kernel for the weights' device, checking the packed op once. "auto" in bf16 on a CPU also runs
        the packed op at a few rows outside a compiled graph (dequantising widens the whole matrix every call: 3-11x
        slower at one row; not so in float32 or f16); compiled, the dequant pattern, which inductor rewrites.
        int8-a8: its integer kernel on a CPU, else torch's ops (llmstep.core.int8a8)."""
        if self.activations:
            return int8a8.prepare(self)
        auto, bf16_cpu = self.asked == "auto", self.weight.device.type == "cpu" and self.scales.dtype == torch.bfloat16
        self.kernel = auto_kernel("int8") if auto else self.asked
        packed = (self.kernel == "packed" or auto and bf16_cpu) and self._packed_agrees()
        if self.kernel == "packed" and not packed:
            self.kernel = "dequant"  # this torch, device, dtype or shape has no packed int8 kernel
        self.eager_packed = auto and packed
        return self

    def _packed_agrees(self) -> bool:
        """Whether torch's packed int8 op runs here and matches dequantise + matmul (on CHECK_ROWS rows)."""
        if not int8_mm_fits(self.in_features, self.scales.dtype):
            return False  # it would crash the process
        x, r = torch.randn(2, self.in_features, device=self.weight.device, dtype=self.scales.dtype), CHECK_ROWS
        try:  # (on the meta device `agrees` has no values to compare and raises: no packed kernel there)
            got = None if torch_compat.missing("int8_mm") else torch_compat.int8_mm(x, self.weight, self.scales)
            return got is not None and agrees(got[:, :r], linear(x, self.weight[:r].to(x.dtype)) * self.scales[:r])
        except (RuntimeError, NotImplementedError):  # not for this device, dtype or shape
            return False

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(), ...: prepare()d again where it moves
        return quant_layouts.moved(self, fn, partial(super()._apply, fn, recurse))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.activations:
            return int8a8.matmul(self, x.reshape(-1, self.in_features)).unflatten(0, x.shape[:-1]).to(x.dtype)
        eager = self.eager_packed and x.dtype == self.scales.dtype and not torch.compiler.is_compiling()
        packed = self.kernel == "packed" or eager
        if packed and x.numel() <= PACKED_MAX_ROWS * self.in_features:
            y = torch_compat.int8_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
            return y.view(*x.shape[:-1], self.out_features)
        if x.dtype is torch.float16 and widens_rows(x):  # x @ q^T unscaled (codes to 127: ~127 / max|w| times y)
            return widened(x, lambda r: self.weight[r].float() * self.scales[r, None].float(), self.out_features)
        if x.dtype is torch.float16:  # would pass float16's 65504: the weights scaled first (`is`: fx-traceable)
            return linear(x, self.weight.to(x.dtype) * self.scales[:, None])
        if widens_rows(x):  # a prompt on a CPU without a half-precision GEMM: int8 is exact in float32 (core.linear)
            return widened(x, lambda rows: self.weight[rows].float(), self.out_features) * self.scales
        if not int8_mm_fits(self.in_features, x.dtype):  # scaled first: inductor's pattern for the
            return linear(x, self.weight.to(x.dtype) * self.scales[:, None])  # line below is torch's packed kernel
        return linear(x, self.weight.to(x.dtype)) * self.scales  # compiled: the int8 -> dtype cast fuses into it

    @property
    def nbytes(self) -> int:
        """Bytes streamed per matmul: the int8 weights and one scale per row."""
        return self.weight.nbytes + self.scales.nbytes

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # in the scales' dtype by default
        return dequantize_int8(self.weight, self.scales, dtype or self.scales.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"
                + (", activations=8" if self.activations else ""))


class Int4Linear(nn.Module):
    """y = x @ W^T with W stored as 4-bit codes, two per byte, and a scale and zero per group of inputs."""

    mode = "int4"

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_GROUP_SIZE, device=None,
                 dtype=torch.float32, kernel: str = "auto", activations: int | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.activations = activations  # 8: 8-bit activations (llmstep.core.int4a8), None: as they come
        QuantConfig("int4", group_size)  # an even integer >= 2, else refused by name
        if in_features % group_size:
            raise QuantizationError(f"group_size {group_size} does not divide in_features {in_features}")
        groups = in_features // group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=dtype, device=device))  # [N, K/g]
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=dtype, device=device))  # [N, K/g]
        _check_kernel(kernel, "int4", activations)
        self.kernel = self.asked = kernel  # asked: what prepare() settles from, each time it runs
        # The packed kernels want their own layouts: built by prepare(), never saved.
        self.register_buffer("kernel_weight", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)  # [K/g, N, 2] (int4-a8: int4a8.layout's)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE, kernel: str = "auto",
                    activations: int | None = None) -> Int4Linear:
        w = linear.weight
        m = cls(w.shape[1], w.shape[0], group_size, w.device, w.dtype, kernel, activations)
        m.weight, m.scales, m.zeros = quantize_int4(w, group_size, scale_dtype=w.dtype)
        m.prepare()
        return m

    def prepare(self) -> Int4Linear:
        """The packed kernel's layout for the weights' device, checked once, else a fallback; the kernel settled from
        the one asked for, each time (a move runs it again: quant_layouts.moved). Where it serves every row count
        (tinygemm, int4-a8's) the codes are dropped (`codes` recovers them); the CPU kernel keeps them."""
        codes = self.codes()
        device = codes.device
        if self.activations:  # int4-a8: the integer kernel's layout on a CPU, where its shapes fit; else torch's ops
            return int4a8.prepare(self, codes)
        self.kernel = auto_kernel("int4", device) if self.asked == "auto" else self.asked
        self.kernel_weight = self.scales_and_zeros = None
        if self.kernel == "packed" and torch_compat.missing("int4_mm_cuda" if device.type == "cuda" else "int4_mm_cpu"):
            self.kernel = "dequant"  # this torch has no int4 kernel for the device
        if self.kernel != "packed":  # dequant, reduce: the plain codes are all they read
            self.weight = codes
            return self
        try:
            kind = "tinygemm" if device.type == "cuda" else "cpu"
            self.kernel_weight = quant_layouts.int4_pack(unpack_int4(codes), kind, self.in_features)
            sz = torch.stack([self.scales, self.zeros], dim=-1)  # [N, K/g, 2]
            self.scales_and_zeros = sz.transpose(0, 1).contiguous()  # [K/g, N, 2]
            x = torch.randn(2, self.in_features, device=device, dtype=self.scales.dtype)
            r = min(CHECK_ROWS, self.out_features)
            want = linear(x, dequantize_int4(codes[:r], self.scales[:r], self.zeros[:r], x.dtype))
            ok = agrees(self._packed_mm(x)[:, :r], want)
        except (RuntimeError, NotImplementedError):
            ok = False
        if not ok:  # this device, dtype or shape has no packed kernel: dequantise + matmul
            self.kernel, self.kernel_weight, self.scales_and_zeros, self.weight = "dequant", None, None, codes
            return self
        # scales and zeros held once: views of the kernel's [K/g, N, 2] table
        self.scales, self.zeros = self.scales_and_zeros[..., 0].t(), self.scales_and_zeros[..., 1].t()  # [N, K/g]
        self.weight = codes if device.type == "cpu" else None
        return self

    def codes(self) -> torch.Tensor:
        """The plain codes [N, K/2] (pack_int4's layout): held, or read back from the kernel's layout
        (quant_layouts.int4_codes: a few blocks of rows at a time, each checked by packing it again)."""
        return self.weight if self.weight is not None else quant_layouts.int4_codes(self)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(), ...: its layouts built again where it moves
        return quant_layouts.moved(self, fn, partial(super()._apply, fn, recurse))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.codes()  # a checkpoint holds the plain codes, whatever is held

    def _packed_mm(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is None or (self.kernel_weight.dim() == 4) != (x2d.device.type == "cuda"):
            held = ("no layout (a move failed part-way)" if self.kernel_weight is None else
                    f"a layout built for another device than {x2d.device} (moved, but not by .to())")
            raise QuantizationError(f"Int4Linear [{self.out_features}, {self.in_features}] holds {held}: move a "
                                    "quantised model with .to(), which builds it")
        sz = self.scales_and_zeros
        if sz is None:  # a layer whose scales are views of a fused layer's table (llmstep.core.fuse): its own, now
            sz = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        return torch_compat.int4_mm(x2d, self.kernel_weight, self.group_size, sz)

    def reduce_mm(self, x2d: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N], kernel="reduce": one multiply-and-sum over the plain codes (`reduce_matmul`)."""
        return reduce_matmul(x2d, self.weight, self.scales, self.zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.activations:
            return int4a8.matmul(self, x.reshape(-1, self.in_features)).unflatten(0, x.shape[:-1]).to(x.dtype)
        if self.kernel == "reduce" and x.numel() <= PACKED_MAX_ROWS * self.in_features:
            y = self.reduce_mm(x.reshape(-1, self.in_features))
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.kernel == "packed" and (self.weight is None or x.numel() <= PACKED_MAX_ROWS * self.in_features):
            y = self._packed_mm(x.reshape(-1, self.in_features).to(self.scales.dtype))
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if widens_rows(x):  # a prompt on a CPU without a half-precision GEMM: dequantized in float32, as the kernels do
            return widened(x, partial(self.dequantized, torch.float32), self.out_features)
        return linear(x, self.dequantized().to(x.dtype))

    @property
    def nbytes(self) -> int:
        """Bytes streamed per matmul: half a byte per weight plus a scale and a zero per group."""
        return self.in_features * self.out_features // 2 + self.scales.nbytes + self.zeros.nbytes

    def dequantized(self, dtype: torch.dtype | None = None, rows: slice = slice(None)) -> torch.Tensor:  # [rows, K]
        return dequantize_int4(self.codes()[rows], self.scales[rows], self.zeros[rows], dtype or self.scales.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, kernel={self.kernel}" + (", activations=8" if self.activations else ""))


QuantLinear = (Int8Linear, Int4Linear)


# ---- swapping the layers -------------------------------------------------------------------------

def linear_names(model: Llama, lm_head: bool | str = False) -> list[str]:
    """The nn.Linear layers that quantisation replaces, in model order: wq, wk, wv, wo, w1, w3, w2 per block
    (and "output", the LM head, where lm_head is True or a mode: QuantConfig.lm_head)."""
    names = [name for name, m in model.layers.named_modules(prefix="layers")
             if isinstance(m, (nn.Linear, *QuantLinear))]
    return names + (["output"] if lm_head is not False else [])


def _check(model: Llama, qc: QuantConfig, weights: bool = True, names: list[str] | None = None) -> None:
    """Every reason this model cannot take these settings, each naming its layer, before anything changes
    (weights=False: its shapes only, for a model on the meta device; names: these layers only)."""
    if getattr(model, "rank_config", None) is not None:  # core.parallel's shard (or a layer-skip draft of one)
        raise QuantizationError("this model is one rank's shard of a tensor-parallel model, whose layers' all-reduce "
                                "a quantised layer would drop: quantise a whole model")
    problems = []
    for name in linear_names(model, qc.lm_head) if names is None else names:
        m = model.get_submodule(name)
        if isinstance(m, QuantLinear):
            problems.append(f"{name} is already quantised ({type(m).__name__}); start from the float model")
            continue
        if m.bias is not None:
            problems.append(f"{name} has a bias; LLaMA's linear layers have none")
        if weights and (not m.weight.dtype.is_floating_point or m.weight.device.type == "meta"):
            problems.append(f"{name}: needs float weights in memory, has {m.weight.dtype} on {m.weight.device}")
        elif weights and not torch.isfinite(m.weight).all():  # a NaN would take its row's (group's) scale with it
            problems.append(f"{name}: its weights hold NaN or Inf")
        K, layer = m.in_features, qc.layer(name)
        if layer.mode == "int4":
            if K % 2:
                problems.append(f"{name}: in_features {K} is odd; int4 packs two weights per byte along it")
            elif K % layer.group_size:
                problems.append(f"{name}: group_size {layer.group_size} does not divide in_features {K}")
        elif layer.activations and (why := int8a8.width_problem(K)):
            problems.append(f"{name}: {why}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise QuantizationError(f"cannot quantise to {qc}: " + "; ".join(problems[:3]) + more)


def swap_linears(model: Llama, names: list[str], make: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace each named nn.Linear of `model` by make(linear), in place."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, make(owner.get_submodule(child)))


def _swap_per_layer(model: Llama, qc: QuantConfig, make: Callable[[nn.Linear, QuantConfig], nn.Module]) -> None:
    """swap_linears over the matmuls `qc` quantises, each made with its own settings (the head's may differ)."""
    for name in linear_names(model, qc.lm_head):
        swap_linears(model, [name], partial(make, layer=qc.layer(name)))


def _layer_kernel(kernel: str, layer: QuantConfig) -> str:
    """The kernel a layer of `layer`'s settings takes in a model quantised with `kernel` (the blocks' choice): that
    one where the layer takes it (`_check_kernel`'s rule), else "auto" (int4's "reduce" for an int8 head; "a8" for a
    weight-only head, "packed" for an 8-bit-activation one)."""
    try:
        _check_kernel(kernel, layer.mode, layer.activations)
    except QuantizationError:
        return "auto"
    return kernel


def _make(linear: nn.Linear, qc: QuantConfig, kernel: str) -> nn.Module:
    kernel = _layer_kernel(kernel, qc)
    if qc.mode == "int8":
        return Int8Linear.from_linear(linear, kernel, qc.activations)
    return Int4Linear.from_linear(linear, qc.group_size, kernel, qc.activations)


def empty_quantized(model: Llama, qc: QuantConfig, dtype: torch.dtype) -> None:
    """Swap the linears `qc` quantises for quantised modules of the same shape on the meta device, to be
    filled from a checkpoint (llmstep.core.checkpoint) and then `prepare()`d on their device."""
    def make(lin: nn.Linear, layer: QuantConfig) -> nn.Module:
        if layer.mode == "int8":
            return Int8Linear(lin.in_features, lin.out_features, device="meta", dtype=dtype,
                              activations=layer.activations)
        return Int4Linear(lin.in_features, lin.out_features, layer.group_size, device="meta", dtype=dtype,
                          activations=layer.activations)

    _swap_per_layer(model, qc, make)


def _float_copy(model: Llama) -> Llama:
    """A second Llama that shares every tensor with `model` (no weights copied)."""
    twin = materialize(model.config, model.state_dict(), getattr(model, "generation_config", {}))
    return twin.train(model.training)


def quantize(model: Llama, spec: QuantConfig | str | dict = "int8", group_size: int | None = None,
             lm_head: bool | str | None = None, kernel: str = "auto", inplace: bool = True) -> Llama:
    """Replace the block matmuls (and the LM head with lm_head=True, or lm_head="int8" / "int8-a8" for an int8 head
    under other blocks) by int8/int4 modules (weight-only, or with 8-bit activations: "int8-a8", "int4-g32-a8").

    inplace=False quantises a twin that shares the float model's other tensors, leaving `model` as it
    was (to compare float and quantised side by side without a second copy of the embeddings).
    The packed kernels' layouts are device-specific: quantise on the device the model will run on, or move it with
    .to(), which builds them again there (llmstep.core.quant_layouts.moved).
    """
    qc = QuantConfig.of(spec, group_size, lm_head)
    _check_kernel(kernel, qc.mode, qc.activations)
    _check(model, qc)
    target = model if inplace else _float_copy(model)
    with torch.no_grad():
        _swap_per_layer(target, qc, lambda linear, layer: _make(linear, layer, kernel))
    target.quantization = qc
    return target


def quantize_lm_head(model: Llama, head: str | bool = "int8", kernel: str = "auto") -> Llama:
    """Quantise the float LM head of a model whose blocks are quantised already (a GGUF file's blocks kept as
    int4, a quantised checkpoint), in place, as QuantConfig.lm_head names it: True as the blocks are (their mode and
    activations; "int4" under int4 blocks, "int8" under weight-only int8 say the same), "int8" a weight-only int8
    head, "int8-a8" an int8 head with 8-bit activations. `model.quantization` then says so (its lm_head)."""
    qc = getattr(model, "quantization", None)
    if qc is None or qc.lm_head is not False:
        raise QuantizationError("quantize_lm_head takes a model with quantised blocks and a float LM head; this one "
                                + ("is not quantised: use quantize(model, mode, lm_head=...)" if qc is None
                                   else f"is {qc}"))
    if head is not True and head not in (*HEADS, qc.mode):
        raise QuantizationError(f"quantize_lm_head: head must be True, {', '.join(map(repr, HEADS))} or the blocks' "
                                f"mode {qc.mode!r}, got {head!r}")
    qc = QuantConfig(qc.mode, qc.group_size, head, qc.activations)
    _check_kernel(kernel, qc.head.mode, qc.head.activations)  # the head's own: no blocks' choice to map
    _check(model, qc, names=["output"])
    with torch.no_grad():
        swap_linears(model, ["output"], lambda linear: _make(linear, qc.head, kernel))
    model.quantization = qc
    return model


def check_config(config: LlamaConfig, spec: QuantConfig | str | dict = "int8", group_size: int | None = None,
                 lm_head: bool | str | None = None) -> None:
    """What `quantize` would refuse for a float model of `config`'s shapes (int4's group size, odd widths),
    checked on the meta device: no weight is read or allocated."""
    qc = QuantConfig.of(spec, group_size, lm_head)
    with torch.device("meta"):
        model = Llama(config)
    _check(model, qc, weights=False)


# ---- what it costs and what it changes -----------------------------------------------------------

@torch.no_grad()
def layer_errors(model: Llama, quantized: Llama) -> dict[str, float]:
    """Relative weight error ||W_q - W|| / ||W|| of each quantised layer (Frobenius norms)."""
    errors = {}
    for name in linear_names(quantized, lm_head=isinstance(quantized.output, QuantLinear)):
        q = quantized.get_submodule(name)
        if isinstance(q, QuantLinear):
            w = model.get_submodule(name).weight.float()
            errors[name] = float((q.dequantized().float() - w).norm() / w.norm())
    return errors

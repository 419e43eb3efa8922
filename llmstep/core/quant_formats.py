"""The int8 and int4 number formats: a float matrix as codes and scales, and back (pure functions).

- int8, per output channel (row): w[n, :] ~= q[n, :] * scale[n], q in [-128, 127], symmetric,
  scale = max|w[n, :]| / 127. Rounding to the nearest step errs by at most scale / 2 per element.
- int4, per group of `group_size` consecutive inputs in a row (asymmetric, as in gpt-fast and
  PyTorch's tinygemm kernels): w ~= (q - 8) * scale + zero, q in [0, 15], scale = (max - min) / 15,
  zero = min + 8 * scale. Error at most scale / 2 per element of the group. Two q values share one
  byte: even input index in the high nibble, odd in the low one (the layout
  tinygemm's packing reads on CUDA, `torch_compat.int4_pack_cuda`, and the one a checkpoint holds).

`QuantConfig` names a format (a checkpoint records it); the layers that compute with them are in
llmstep.core.quantize.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .checks import is_int

__all__ = ["QuantConfig", "MODES", "HEADS", "QuantizationError", "DEFAULT_GROUP_SIZE", "quantize_int8",
           "dequantize_int8", "pack_int4", "unpack_int4", "quantize_int4", "dequantize_int4", "nibbles",
           "reduce_matmul", "agrees"]

MODES = ("int8", "int4")
HEADS = ("int8", "int8-a8")  # the LM head's own modes under other blocks (QuantConfig.lm_head)
DEFAULT_GROUP_SIZE = 64  # int4: 64 inputs per scale/zero pair; gpt-fast and torchao's common default


class QuantizationError(ValueError):
    """Settings that cannot quantise a model; the message names the layer."""


@dataclass(frozen=True)
class QuantConfig:
    mode: str  # "int8" (per output channel) or "int4" (per group, two values per byte)
    group_size: int | None = None  # int4 only: inputs sharing one scale/zero; None -> DEFAULT_GROUP_SIZE
    # The LM head (tied or not; the embedding lookup stays float): False keeps it float, True quantises it as the
    # blocks are (their mode, their activations), "int8" in weight-only int8 under other blocks (the head is the
    # largest matmul of a small model, and its row scales cost little: llama.cpp's 4-bit files keep theirs at 8 or 6
    # bits), "int8-a8" in int8 with 8-bit activations (the arithmetic of llama.cpp's Q8_0 head under its 4-bit
    # blocks). A head spelled as the blocks are ("int8" under weight-only int8, "int8-a8" under int8-a8, "int4"
    # under int4 blocks) is True.
    lm_head: bool | str = False
    # 8 rounds each row of activations to 8 bits per block of 32 before the matmuls (llama.cpp's arithmetic for its
    # 4-bit and Q8_0 files: llmstep.core.int4a8, int8a8); None keeps them in the model's dtype (weight-only)
    activations: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise QuantizationError(f"unknown quantization mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.mode == "int4":
            if self.group_size is None:
                object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE)
            g = self.group_size
            if not is_int(g) or g < 2 or g % 2:
                raise QuantizationError(f"int4 group_size must be an even integer >= 2, got {g!r}")
            object.__setattr__(self, "group_size", int(g))  # a numpy integer as Python's (saved as JSON)
        elif self.group_size is not None:
            raise QuantizationError(f"group_size applies to int4 only (int8 scales whole rows), got {self.group_size}")
        if self.activations is not None:
            if self.activations != 8:
                raise QuantizationError(f"activations=8 (8-bit activations) or None (weight-only), got activations="
                                        f"{self.activations!r}")
            if self.mode == "int4" and self.group_size % 32:
                raise QuantizationError(f"int4 with 8-bit activations takes whole blocks of 32 inputs a group: group "
                                        f"size {self.group_size} is not a multiple of 32")
        head = self.lm_head
        own = self.mode + ("-a8" if self.activations and self.mode == "int8" else "")  # int4 blocks: any int4 head
        if head == own or head == "int4" == self.mode:
            object.__setattr__(self, "lm_head", True)  # one spelling of "the head as the blocks are"
        elif not isinstance(head, bool) and head not in HEADS:
            raise QuantizationError(f"lm_head must be True, False, 'int8' or 'int8-a8' (an int8 head, weight-only "
                                    f"or with 8-bit activations, under other blocks), got {head!r}"
                                    + (": an int4 head takes int4 blocks" if head == "int4" else ""))

    @property
    def head(self) -> QuantConfig | None:
        """The settings the LM head is quantised with; None where it stays float."""
        if self.lm_head is False:
            return None
        if self.lm_head is True:
            return QuantConfig(self.mode, self.group_size, activations=self.activations)
        return QuantConfig.of(self.lm_head)  # "int8" or "int8-a8"

    def layer(self, name: str) -> QuantConfig | None:
        """The settings of one matmul: the head's for "output" (None: float), the blocks' for any other."""
        return self.head if name == "output" else QuantConfig(self.mode, self.group_size, activations=self.activations)

    @classmethod
    def of(cls, spec: QuantConfig | str | dict, group_size: int | None = None, lm_head: bool | str | None = None
           ) -> QuantConfig:
        """A QuantConfig from itself, its name ("int8", "int8-a8", "int4", "int4-g32", "int4-g32-a8",
        "int4-g32+lm_head-int8": what str() gives) or a dict; a group_size or lm_head given overrides the spec's."""
        if isinstance(spec, dict):
            spec = cls(**{k: v for k, v in spec.items() if k in ("mode", "group_size", "lm_head", "activations")})
        elif not isinstance(spec, QuantConfig):
            spec = cls._parse(str(spec))
        if group_size is None and lm_head is None:
            return spec
        return cls(spec.mode, spec.group_size if group_size is None else group_size,
                   spec.lm_head if lm_head is None else lm_head, spec.activations)

    @classmethod
    def _parse(cls, name: str) -> QuantConfig:
        base, plus, head = name.partition("+lm_head")
        if plus and head not in ("", *(f"-{h}" for h in HEADS)):
            raise QuantizationError(f"unknown quantization {name!r}: after '+lm_head' only '-int8' or '-int8-a8' may "
                                    "follow (the head in the blocks' own mode is plain '+lm_head')")
        lm_head = head.removeprefix("-") or bool(plus)
        activations = 8 if base.endswith("-a8") else None
        base = base.removesuffix("-a8") if activations else base
        if base.startswith("int4-g") and base[6:].isascii() and base[6:].isdigit():
            return cls("int4", int(base[6:]), lm_head, activations)
        return cls(base, None, lm_head, activations)

    def to_dict(self) -> dict:  # what a checkpoint records (no activations key for weight-only: as before them)
        d = asdict(self)
        return d if self.activations else {k: v for k, v in d.items() if k != "activations"}

    def __str__(self) -> str:
        name = (self.mode if self.mode == "int8" else f"int4-g{self.group_size}") + ("-a8" if self.activations else "")
        head = self.lm_head
        return name + ("" if head is False else "+lm_head" if head is True else f"+lm_head-{head}")


# ---- the modules ---------------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> q int8 [N, K], scales [N] (in scale_dtype), with w ~= q * scales[:, None].

    The scale is rounded to scale_dtype first and q computed from the rounded scale, so the bound
    |w - q * scale| <= scale / 2 holds for the scale that is stored.
    """
    if w.dim() != 2:
        raise QuantizationError(f"int8 quantizes a matrix [out, in], got a tensor of shape {list(w.shape)}")
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1)  # [N]
    scales = (amax / 127).clamp_min(1e-12).to(scale_dtype)  # [N]; an all-zero row keeps 1e-12 (float16: 0)
    # A subnormal scale (float16 below 6.1e-5) rounds by far more than its half step: taken one step up where the
    # row's largest weight would need a code past 127.5, as the bound needs (a normal scale never is).
    low = scales.float() * 127.5 < amax
    scales = torch.where(low, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)
    q = torch.round(w32 / scales.float().where(scales > 0, 1.0)[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 [N, K], scales [N] -> w [N, K] in dtype."""
    return (q.float() * scales.float()[:, None]).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values 0..15 -> [N, K/2] uint8: even index in the high nibble, odd in the low."""
    pairs = q.to(torch.uint8).contiguous().view(torch.int16)  # [N, K/2]: (even, odd) as one little-endian int16
    return (((pairs << 4) | (pairs >> 8)) & 0xFF).to(torch.uint8)  # one pass; strided uint8 ops are slow on CPUs


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> q [N, K] uint8 with values 0..15 (inverse of pack_int4)."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2)  # [N, K/2, 2] -> [N, K]


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> packed uint8 [N, K/2], scales [N, K/g], zeros [N, K/g] with w ~= (q - 8) * scale + zero.

    Per group of g inputs: scale = (max - min) / 15 and zero = min + 8 * scale, so q = 0 is the group's
    minimum and q = 15 its maximum. Rounded to scale_dtype before q is computed, as for int8: every weight is then
    within scale / 2 of its dequantised value. Where the rounded zero has moved so far (a group far from 0, a
    bf16 zero) that an end of the group lies beyond q = 0 or 15 by more than that, the scale is widened to reach it.
    """
    if w.dim() != 2:
        raise QuantizationError(f"int4 quantizes a matrix [out, in], got a tensor of shape {list(w.shape)}")
    QuantConfig("int4", group_size)  # an even integer >= 2, else refused by name
    N, K = w.shape
    if K % group_size:
        raise QuantizationError(f"group_size {group_size} does not divide the input dimension {K}")
    if K % 2:
        raise QuantizationError(f"the input dimension {K} is odd; int4 packs two weights per byte along it")
    wg = w.detach().float().view(N, K // group_size, group_size)  # [N, groups, g]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, groups]
    scales = ((hi - lo) / 15).clamp_min(1e-12).to(scale_dtype)
    zeros = (lo + 8 * scales.float()).to(scale_dtype)
    z, s = zeros.float(), scales.float()
    short = (z - lo > 8.5 * s) | (hi - z > 7.5 * s)  # the rounded zero leaves an end past q = 0 or 15 by > s / 2
    if short.any():  # cover [lo, hi] from the rounded zero, rounded up past scale_dtype's own rounding
        wide = (torch.maximum((z - lo) / 8, (hi - z) / 7) * (1 + 2**-7)).to(scale_dtype)
        scales = torch.where(short, wide, scales)
    q = torch.round((wg - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp_(0, 15)
    return pack_int4(q.view(N, K)), scales, zeros


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [N, K/2], scales/zeros [N, K/g] -> w [N, K] in dtype."""
    N, groups = scales.shape
    q = unpack_int4(packed).view(N, groups, -1).float()  # [N, groups, g]
    return ((q - 8) * scales.float()[..., None] + zeros.float()[..., None]).view(N, -1).to(dtype)


def nibbles(t: torch.Tensor) -> torch.Tensor:
    """Any tensor's bytes as a flat stream of 4-bit values, low nibble first."""
    b = t.contiguous().view(torch.uint8).flatten()
    return torch.stack([b & 15, b >> 4], dim=-1).flatten()


def reduce_matmul(x2d: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] as one multiply-and-sum over the plain codes [N, K/2] (int4's kernel="reduce"): each
    byte's high nibble weighs the even input, its low nibble the odd one, the group's scale and zero broadcast over
    it. Eager, it widens the weights like dequantise + matmul; compiled, it is one reduction kernel that reads each
    byte once (half a byte a weight), with no extern matmul (tests/cuda_proofs)."""
    N, G = scales.shape
    dtype = torch.promote_types(x2d.dtype, torch.float32)  # accumulate in float32 at least
    codes = codes.view(N, G, -1)  # [N, K/g, g/2] uint8
    scale, zero = scales.to(dtype).unsqueeze(-1), zeros.to(dtype).unsqueeze(-1)  # [N, K/g, 1]
    w_even = ((codes >> 4).to(dtype) - 8) * scale + zero  # [N, K/g, g/2]: inputs 0, 2, 4, ... of each group
    w_odd = ((codes & 15).to(dtype) - 8) * scale + zero  # inputs 1, 3, 5, ...
    x_even, x_odd = x2d.to(dtype).view(-1, 1, G, codes.shape[-1], 2).unbind(-1)  # [M, 1, K/g, g/2] each
    return (w_even * x_even + w_odd * x_odd).sum(dim=(-2, -1))  # [M, N]


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A tolerance: got within 1% of want's norm (a dtype's rounding), e.g. a packed kernel's output against
    dequantise + matmul's."""
    got, want = got.float(), want.float()
    return got.shape == want.shape and bool((got - want).norm() <= 1e-2 * want.norm() + 1e-6)

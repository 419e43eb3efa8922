"""The two ceilings of this machine, and the article's decode arithmetic on any chip.

Generating one token at batch 1 reads every weight once and does about two FLOPs per weight. So a
chip has two limits that matter: how many bytes per second its memory delivers (the bandwidth) and
how many FLOPs per second its math units do (the matmul throughput). `measure_bandwidth` and
`measure_matmul` measure both here; `DATASHEETS` holds the published figures of four GPUs; and
`decode_ceiling` turns either into the article's table: milliseconds per token, tokens per second,
TFLOP/s achieved, and the share of the math units that this keeps busy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.checks import check_step_context
from ..core.config import LlamaConfig
from ..core.cost import check_fits, decode_step_cost, model_bytes, n_params
from ..core.device import half_dtype, resolve_device, resolve_dtype
from ..core.model import Llama, materialize
from ..engines.decoding import check_int
from .runinfo import cpu_flags, describe, time_repeats

__all__ = ["Chip", "DATASHEETS", "DecodeCeiling", "describe", "check_bandwidth_bytes", "measure_bandwidth", "Bandwidth",
           "matmul_size", "measure_matmul",
           "measured_chip", "as_chip", "decode_ceiling", "article_ceiling", "ceiling_table", "ARTICLE_PARAMS",
           "random_model"]


def check_bandwidth_bytes(nbytes: int, device: str | torch.device | None = None, kind: str = "copy",
                          name: str = "nbytes") -> None:
    """Refuse, by its name, a bandwidth buffer of nbytes that is not a positive integer or that the device's free
    memory cannot hold: a copy holds two (the buffer and its copy), a read one. Before anything is allocated."""
    check_int(nbytes, name, low=1)
    buffers = 2 if kind == "copy" else 1
    check_fits(buffers * nbytes, resolve_device(device),
               f"{name} {nbytes:,} (the bandwidth {kind}'s {buffers} buffer{'s' * (buffers > 1)} of that size)")


def measure_bandwidth(device: str | torch.device | None = None, nbytes: int | None = None,
                      repeats: int = 3, kind: str = "copy") -> float:
    """Memory bandwidth in GB/s (1e9 bytes/s) over one nbytes buffer on the device.

    kind "copy": copy it into another; a copy reads nbytes and writes nbytes, so 2 * nbytes move.
    kind "read": sum it; nbytes are read and nothing is written, which is what a decode step does to
    its weights. On a GPU the two agree closely; on a CPU reading is often faster than copying, and a
    buffer that fits in the last-level cache reads faster still (a small model's weights can).
    The default size, 1 GiB, is far above any cache (a GPU's L2 is at most ~100 MiB; a server CPU's
    last-level cache can reach hundreds of MiB), so it measures DRAM/HBM: the ceiling a decode step hits
    once the weights are larger than every cache. The fastest of `repeats` runs counts, after one warm-up
    (runinfo.time_repeats; STREAM's convention: the best run is the one least disturbed by everything else
    the machine is doing).
    """
    check_int(repeats, "repeats", low=1)
    probe = Bandwidth(device, nbytes, kind)
    try:
        return probe(repeats)
    finally:
        probe.close()


class Bandwidth:
    """`measure_bandwidth` measured again and again on one pair of buffers (one for "read"), allocated here once,
    after the check that free memory holds them: the bandwidth beside each of many timed runs (llmstep.lab.peers),
    without allocating and faulting in 2 x nbytes each time, or finding the memory gone midway. `close()` frees them.
    """

    def __init__(self, device: str | torch.device | None = None, nbytes: int | None = None, kind: str = "copy"):
        if kind not in ("copy", "read"):
            raise ValueError(f"kind must be 'copy' or 'read', got {kind!r}")
        self.device = resolve_device(device)
        nbytes = 2**30 if nbytes is None else nbytes
        check_bandwidth_bytes(nbytes, self.device, kind)
        n = max(nbytes // 4, 1)  # float32 elements
        self.src = torch.ones(n, dtype=torch.float32, device=self.device)  # written once: its pages really exist
        self.dst = torch.zeros_like(self.src) if kind == "copy" else None

    def __call__(self, repeats: int = 3) -> float:
        """GB/s (1e9 bytes/s): the fastest of `repeats` runs after one warm-up (measure_bandwidth)."""
        if self.src is None:
            raise RuntimeError("this bandwidth probe is closed: its buffers are freed")
        if self.dst is None:
            return self.src.numel() * 4 / min(time_repeats(self.src.sum, self.device, repeats)) / 1e9
        seconds = min(time_repeats(lambda: self.dst.copy_(self.src), self.device, repeats))
        return 2 * self.src.numel() * 4 / seconds / 1e9

    def close(self) -> None:
        self.src = self.dst = None


def matmul_size(device: torch.device, dtype: torch.dtype) -> int:
    """measure_matmul's default n: 8192 on a CUDA GPU, else 2048, but 512 for a 16-bit product on a CPU with no
    instruction for it (bfloat16 without avx512_bf16 or amx_bf16; float16): emulated there, far slower than
    float32 on an AVX2-only CPU, its rate shows at 512 in a second where 2048 takes minutes."""
    if device.type == "cuda":
        return 8192
    emulated = device.type == "cpu" and (dtype == torch.float16 or (
        dtype == torch.bfloat16 and not {"avx512_bf16", "amx_bf16"} & set(cpu_flags())))
    return 512 if emulated else 2048


def measure_matmul(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                   n: int | None = None, repeats: int = 3, shape: tuple[int, int, int] | None = None) -> float:
    """Matrix-multiply throughput in TFLOP/s: an [n x n] @ [n x n] product is 2 n^3 FLOPs.

    dtype None: float32 on the CPU (bf16/fp16 matmuls there are often emulated and slow), bfloat16 on
    a CUDA GPU that has it (else float16), float16 on MPS. The default n (`matmul_size`: 2048 on a CPU, 8192
    on a GPU) is large enough to keep the math units busy: this is the compute ceiling. The fastest of `repeats`
    runs counts, after one warm-up (as for measure_bandwidth).
    shape (m, k, n'): time [m x k] @ [k x n'] instead (2 m k n' FLOPs), laid out as nn.Linear multiplies, the
    input by a transposed [n' x k] weight: the roof of a roofline whose points are products of that shape and
    dtype. A roof measured on another shape can sit below such points: the matmul library picks its kernel
    and blocking by shape, so one square product is not every product's ceiling.
    """
    dev = resolve_device(device)
    if dtype is None:
        if dev.type == "cuda":
            dtype = half_dtype(dev)  # float16 where the GPU only emulates bfloat16 (T4, V100), as the model runs
        else:
            dtype = torch.float16 if dev.type == "mps" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    check_int(repeats, "repeats", low=1)
    g = torch.Generator(device=dev).manual_seed(0)
    if shape is not None:
        if n is not None:
            raise ValueError(f"measure_matmul: give n (a square product) or shape, not both (n={n}, shape={shape})")
        if not isinstance(shape, tuple) or len(shape) != 3:
            raise ValueError(f"measure_matmul: shape must be a tuple (m, k, n), got {shape!r}")
        for name, value in zip(("m", "k", "n"), shape, strict=True):
            check_int(value, f"shape's {name}", low=1)
        rows, inner, cols = shape
        size = dtype.itemsize * (rows * inner + cols * inner + rows * cols)
        check_fits(size, dev, f"measure_matmul's shape {shape} in {dtype} (its input, weight and output)")
        x = torch.randn(rows, inner, device=dev, dtype=dtype, generator=g)  # [m, k]: the input rows
        w = torch.randn(cols, inner, device=dev, dtype=dtype, generator=g)  # [n, k]: a weight, as nn.Linear holds it
        out = torch.empty(rows, cols, device=dev, dtype=dtype)  # [m, n]
        seconds = min(time_repeats(lambda: torch.matmul(x, w.T, out=out), dev, repeats))
        return 2 * rows * inner * cols / seconds / 1e12
    if n is None:
        n = matmul_size(dev, dtype)
    check_int(n, "n", low=1)
    check_fits(3 * n * n * dtype.itemsize, dev, f"measure_matmul's n = {n:,} in {dtype} (three {n} x {n} matrices)")
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    seconds = min(time_repeats(lambda: torch.matmul(a, b, out=c), dev, repeats))
    return 2 * n**3 / seconds / 1e12


def random_model(config: LlamaConfig, device: str | torch.device | None = None,
                 dtype: torch.dtype | str | None = None, seed: int = 0, std: float = 0.02) -> Llama:
    """A model of `config`'s shape with random weights, allocated directly on the device in `dtype` (an
    8B model in bf16 needs 16 GB, never a float32 copy): for measuring speed, not for reading its text.

    Matrices are drawn from N(0, std^2) (GPT-2's init), norm gains are 1."""
    dev = resolve_device(device)
    dtype = resolve_dtype(dtype, dev, config.torch_dtype)
    check_fits(model_bytes(config, dtype), dev, f"a random model of {n_params(config) / 1e9:,.2f}B parameters "
               f"in {str(dtype).removeprefix('torch.')}")  # refused here, not killed by the OS mid-allocation
    with torch.device("meta"):
        shapes = Llama(config)  # names and shapes only, no memory; a tied head is named once
    g = torch.Generator(device=dev).manual_seed(seed)
    state = {}
    for name, p in shapes.named_parameters():
        w = torch.empty(p.shape, device=dev, dtype=dtype)
        state[name] = w.fill_(1.0) if name.endswith("norm.weight") else w.normal_(0.0, std, generator=g)
    return materialize(config, state)


# ---- the chips -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chip:
    name: str
    memory_gb_per_s: float  # memory bandwidth, 1e9 bytes/s
    tensor_tflops: float  # dense FP16/BF16 matrix rate with FP32 accumulate (no 2:4 sparsity)
    non_tensor_tflops: float | None = None  # FP16 on the ordinary (non-tensor) cores, where published
    memory_gb: float | None = None
    source: str = ""

    def ridge_point(self) -> float:
        """FLOPs per byte at which the two ceilings meet: below it a kernel is memory-bound."""
        return self.tensor_tflops * 1e12 / (self.memory_gb_per_s * 1e9)


# Published figures. "Dense" means without 2:4 structured sparsity; NVIDIA's headline numbers for
# A100/H100/H200 are the sparse ones, twice these.
DATASHEETS: dict[str, Chip] = {
    # NVIDIA Ada GPU Architecture whitepaper (v2.1), Appendix A, GeForce RTX 4090: 1,008 GB/s GDDR6X;
    # "Peak FP16 Tensor TFLOPS with FP32 Accumulate" 165.2 (330.4 sparse); "Peak FP16 (non-Tensor)
    # TFLOPS" 82.6 - the figure the article used as "available compute".
    "RTX 4090": Chip("RTX 4090", 1008.0, 165.2, 82.6, 24.0,
                     "NVIDIA Ada GPU Architecture whitepaper v2.1, Appendix A"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 2,039 GB/s HBM2e; BF16/FP16 Tensor Core
    # 312 TFLOPS (624 sparse). A100 whitepaper: peak FP16 non-tensor 78 TFLOPS.
    "A100 80GB SXM": Chip("A100 80GB SXM", 2039.0, 312.0, 78.0, 80.0,
                          "NVIDIA A100 datasheet; A100 (Ampere) architecture whitepaper"),
    # NVIDIA H100 datasheet, H100 SXM: 3.35 TB/s HBM3; BF16/FP16 Tensor Core 1,979 TFLOPS *with
    # sparsity*, so 989.4 dense. H100 (Hopper) whitepaper: peak FP16 non-tensor 133.8 TFLOPS (SXM5).
    "H100 SXM": Chip("H100 SXM", 3350.0, 989.4, 133.8, 80.0,
                     "NVIDIA H100 datasheet; NVIDIA H100 Tensor Core GPU architecture whitepaper"),
    # NVIDIA H200 datasheet, H200 SXM: 4.8 TB/s HBM3e, 141 GB; BF16/FP16 Tensor Core 1,979 TFLOPS with
    # sparsity (989.4 dense), the same compute as H100 SXM with more, faster memory.
    "H200 SXM": Chip("H200 SXM", 4800.0, 989.4, None, 141.0, "NVIDIA H200 datasheet"),
}


def measured_chip(device: str | torch.device | None = None, name: str | None = None,
                  bandwidth_gb_per_s: float | None = None, matmul_tflops: float | None = None) -> Chip:
    """This machine as a `Chip`, from measurements (taken now unless given)."""
    dev = resolve_device(device)
    bw = measure_bandwidth(dev) if bandwidth_gb_per_s is None else bandwidth_gb_per_s
    tf = measure_matmul(dev) if matmul_tflops is None else matmul_tflops
    if not bw > 0 or not tf > 0:
        raise ValueError(f"bandwidth and throughput must be positive, got {bw} GB/s and {tf} TFLOP/s")
    return Chip(name or f"this machine ({describe(dev)['name']})", bw, tf, None, None, "measured")


# ---- the article's arithmetic -------------------------------------------------------------------

# The article's round figures for Llama 3 8B: "8B parameters", "16 GB" in FP16 (2 bytes each).
ARTICLE_PARAMS = 8e9


@dataclass(frozen=True)
class DecodeCeiling:
    """The best a chip can do for one decode step at batch 1, if memory were the only limit."""

    chip: str
    bytes_per_token: float  # bytes that must stream from memory per token
    flops_per_token: float
    memory_gb_per_s: float
    peak_tflops: float  # the compute ceiling utilisation is measured against
    basis: str = ""  # "article" (round figures) or the config's name

    @property
    def seconds_per_token(self) -> float:
        return self.bytes_per_token / (self.memory_gb_per_s * 1e9)

    @property
    def ms_per_token(self) -> float:
        return self.seconds_per_token * 1e3

    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.seconds_per_token

    @property
    def achieved_tflops(self) -> float:
        """The math actually done per second at that token rate."""
        return self.flops_per_token * self.tokens_per_second / 1e12

    @property
    def utilisation(self) -> float:
        """achieved / peak: the share of the time the math units are busy (0..1)."""
        return self.achieved_tflops / self.peak_tflops

    def row(self) -> dict[str, float | str]:
        return {"chip": self.chip, "GB/token": self.bytes_per_token / 1e9, "GB/s": self.memory_gb_per_s,
                "ms/token": self.ms_per_token, "tokens/s": self.tokens_per_second,
                "TFLOP/s done": self.achieved_tflops, "TFLOP/s peak": self.peak_tflops,
                "utilisation %": 100 * self.utilisation}


def _peak(chip: Chip, peak: str) -> float:
    if peak == "tensor":
        return chip.tensor_tflops
    if peak == "non_tensor":
        if chip.non_tensor_tflops is None:
            raise ValueError(f"{chip.name} has no published non-tensor rate; use peak='tensor'")
        return chip.non_tensor_tflops
    raise ValueError(f"peak must be 'tensor' or 'non_tensor', got {peak!r}")


def as_chip(chip: Chip | str) -> Chip:
    """A Chip as it is, or the datasheet chip of that name."""
    if isinstance(chip, Chip):
        return chip
    if chip not in DATASHEETS:
        raise KeyError(f"unknown chip {chip!r}; choose one of {', '.join(DATASHEETS)} or pass a Chip")
    return DATASHEETS[chip]


def article_ceiling(chip: Chip | str = "RTX 4090", params: float = ARTICLE_PARAMS, bytes_per_param: float = 2.0,
                    peak: str = "non_tensor") -> DecodeCeiling:
    """The article's back-of-envelope: every parameter read once (params * bytes_per_param bytes) and
    2 FLOPs per parameter. For the RTX 4090: 16 GB / 1,008 GB/s = 15.87 ms, 63 tokens/s, 1.008 TFLOP/s
    done of 82.6, 1.22%."""
    chip = as_chip(chip)
    if not params > 0 or not bytes_per_param > 0:
        raise ValueError(f"params and bytes_per_param must be positive, got {params} and {bytes_per_param}")
    return DecodeCeiling(chip.name, params * bytes_per_param, 2 * params, chip.memory_gb_per_s,
                         _peak(chip, peak), "article")


def decode_ceiling(config: LlamaConfig, chip: Chip | str, dtype: torch.dtype | str = torch.bfloat16,
                   context: int = 0, peak: str = "tensor", name: str = "") -> DecodeCeiling:
    """The same arithmetic with the exact figures of `config` (llmstep.core.cost): the weights actually
    streamed (the input embedding is gathered, one row, not streamed), the KV cache read at `context`,
    and the FLOPs of the matmuls and of attention."""
    check_step_context(context, config.max_seq_len)
    chip = as_chip(chip)
    cost = decode_step_cost(config, context=context, dtype=dtype)
    basis = name or f"{n_params(config) / 1e9:.2f}B params"
    return DecodeCeiling(chip.name, cost.bytes, cost.flops, chip.memory_gb_per_s, _peak(chip, peak), basis)


def ceiling_table(config: LlamaConfig, chips: list[Chip | str] | None = None,
                  dtype: torch.dtype | str = torch.bfloat16, context: int = 0,
                  peak: str = "tensor") -> list[DecodeCeiling]:
    """decode_ceiling for each chip (default: every datasheet chip)."""
    chips = list(DATASHEETS) if chips is None else chips
    return [decode_ceiling(config, c, dtype, context, peak) for c in chips]

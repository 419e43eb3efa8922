"""The one loader: a checked checkpoint's tensors read straight to their device and dtype through a slicer, each
checked finite as it arrives, and the model made from them.

A slicer says which part of each tensor this process holds. One process holds all of it (`WHOLE`); a rank of a
tensor-parallel run holds its rows or columns (llmstep.core.parallel.RankSlicer), read from the file without
reading the rest. Everything else is the same for both, in this order:

1. the checkpoint checked (llmstep.core.checkpoint_layout: config, every tensor's shape and dtype) and what this
   process will hold judged against the device's free memory (llmstep.core.cost.check_fits): before anything is
   allocated;
2. each tensor read (one at a time: no second copy of the model in memory), moved to the device and dtype, and
   checked finite (one NaN would otherwise turn every later token into the argmax of NaNs);
3. the model made from them (llmstep.core.model.materialize): a tied config whose file also holds a head is tied
   only when the head equals the embedding (on every rank), as transformers does; a quantised checkpoint comes
   back quantised, its kernels prepared for the device.

A GGUF file (llmstep.core.gguf_load) has its own reader; it shares the dtype rule, the finite check and the
quantised model's preparation.
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from .checkpoint_layout import Checkpoint, CheckpointError
from .config import LlamaConfig
from .cost import check_fits, checkpoint_bytes, n_params
from .device import resolve_dtype
from .model import Llama, all_finite, materialize
from .quantize import QuantConfig, QuantLinear, empty_quantized

__all__ = ["Slicer", "WHOLE", "load_dtype", "check_finite", "read_state", "build", "quantized", "dtype_name"]

BIG_CPU_PARAMS = 4e9  # above this, a float32 copy on the CPU would not fit most machines' memory
PROGRESS_BYTES = 2**30  # files larger than this show a progress bar unless told otherwise


class Slicer:
    """Which part of each tensor this process holds: all of it (one process). Tensor parallelism's slicer
    (llmstep.core.parallel.RankSlicer) holds a rank's rows or columns and answers for every rank."""

    direct = True  # a whole tensor may be read straight onto a CUDA device (safetensors does that)

    def shape(self, ours: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this process holds of `ours` (llmstep's name) whose file shape is `shape`."""
        return shape

    def need(self, ckpt: Checkpoint, dtype: torch.dtype) -> tuple[int, str]:
        """(bytes this process will hold, what they are, for the memory check's message): a tied config whose files
        also hold lm_head.weight reads it too (kept where it differs from the embedding: `build`)."""
        c, qc = ckpt.config, ckpt.quantization
        nbytes = checkpoint_bytes(c, dtype, qc)
        if qc is None and c.tie_embeddings and "lm_head.weight" in ckpt.tensors[1]:
            nbytes += c.vocab_size * c.dim * dtype.itemsize
        return nbytes, f"{ckpt.path.name} in {dtype_name(dtype)}"

    def read(self, file, name: str, ours: str) -> torch.Tensor:
        """This process's part of tensor `name` from an open safetensors file."""
        return file.get_tensor(name)

    def place(self, ours: str, t: torch.Tensor) -> torch.Tensor:
        """The tensor as the model holds it (the rank's vocabulary rows padded, for tensor parallelism)."""
        return t

    def all_ranks(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (one process: itself)."""
        return flag

    def materialize(self, config: LlamaConfig, state: dict[str, torch.Tensor], generation_config: dict) -> Llama:
        return materialize(config, state, generation_config)


WHOLE = Slicer()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_dtype(config: LlamaConfig, device: torch.device, dtype) -> torch.dtype:
    """The dtype a model loads in (llmstep.core.device.resolve_dtype), except that None on the CPU keeps the
    checkpoint's own dtype above BIG_CPU_PARAMS parameters."""
    if dtype is None and device.type == "cpu" and n_params(config) > BIG_CPU_PARAMS:
        dtype = config.torch_dtype
    return resolve_dtype(dtype, device, config.torch_dtype)


def check_finite(t: torch.Tensor, where: str, dtype: torch.dtype, error: type[Exception] = CheckpointError,
                 damaged: str = "the checkpoint") -> None:
    """Refuse a weight holding NaN or Inf in `dtype`, naming `where` (the file and the tensor)."""
    if not all_finite(t):
        raise error(f"{where} holds NaN or Inf values in {dtype_name(dtype)}; {damaged} is damaged"
                    + (" (or too large for float16)" if dtype == torch.float16 else ""))


def read_state(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, slicer: Slicer = WHOLE,
               progress: bool | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """(llmstep state name -> this process's part of each tensor on `device`, bytes taken from the files): the
    checkpoint checked and the memory judged first. Local work: no collective (see llmstep.core.parallel)."""
    found, expected = ckpt.tensors
    nbytes, what = slicer.need(ckpt, dtype)
    check_fits(nbytes, device, what)
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(found[name][0], []).append(name)
    path = ckpt.path
    show = sum((path / f).stat().st_size for f in by_file) > PROGRESS_BYTES if progress is None else progress
    bar = tqdm(total=len(expected), desc=f"loading {path.name}", unit="tensor", disable=not show)
    # Read to the CPU unless the device is CUDA and the slicer takes whole tensors; one tensor at a time.
    read_on = str(device) if device.type == "cuda" and slicer.direct else "cpu"
    state: dict[str, torch.Tensor] = {}
    taken, at = 0, path  # at: the file (then the tensor) being read, for an error to name
    try:
        for file, names in by_file.items():
            at = path / file
            with safe_open(at, framework="pt", device=read_on) as f:
                for name in names:
                    at = f"{path / file}: tensor {name}"
                    ours, _, kind = expected[name]
                    t = slicer.read(f, name, ours)
                    taken += t.nbytes
                    t = t.to(device=device, dtype=dtype if kind == "float" else t.dtype)  # codes keep their dtype
                    if kind == "float":  # before the model is built
                        check_finite(t, at, dtype)
                    state[ours] = slicer.place(ours, t)
                    bar.update()
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{at}: could not be read ({e})") from None
    finally:
        bar.close()
    return state, taken


def build(ckpt: Checkpoint, state: dict[str, torch.Tensor], dtype: torch.dtype, slicer: Slicer = WHOLE) -> Llama:
    """The model made from read_state's tensors (assigned, not copied)."""
    config, qc = ckpt.config, ckpt.quantization
    if qc is not None:
        model = materialize(config, state, ckpt.generation_config,
                            swap=lambda meta: empty_quantized(meta, qc, dtype))
        return quantized(model, qc)
    if config.tie_embeddings and "output.weight" in state:
        # A tied config whose checkpoint also holds lm_head.weight: transformers ties them only when the two are
        # equal, and otherwise keeps the head it was given. Do the same, so the model is the same function.
        if slicer.all_ranks(torch.equal(state["output.weight"], state["tok_embeddings.weight"])):
            del state["output.weight"]
        else:
            config = config.replace(tie_embeddings=False)
    return slicer.materialize(config, state, ckpt.generation_config)


def quantized(model: Llama, qc: QuantConfig) -> Llama:
    """A model whose quantised linears hold their codes: each prepares its kernel's layout for the device."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.prepare()
    model.quantization = qc
    return model

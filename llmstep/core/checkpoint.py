"""Read and write Hugging Face-layout checkpoints: config.json, safetensors (one file or shards),
tokenizer.json, generation_config.json. One loader reads float and quantised checkpoints alike.

Loading parses the directory once (llmstep.core.checkpoint_layout.read_checkpoint: config.json and
generation_config.json, checked) and hands that value on: the tokenizer reads its stop ids from it, and the one
loader (llmstep.core.loader) checks every tensor's name, shape and dtype and the memory before it allocates, then
reads each tensor straight to its device and dtype, checked finite as it arrives. Tensor parallelism
(llmstep.core.parallel) uses the same loader with a slicer that takes a rank's share of each tensor. A GGUF
file goes to llmstep.core.gguf_load.

A quantised checkpoint (`llmstep.save` of a model from llmstep.core.quantize) is the same layout with a
`quantization_config` in config.json (see checkpoint_layout); transformers cannot read it (the packing is
llmstep's), `llmstep.load` reads it back exactly.

Saving writes every file into a new folder beside the target, which then takes its place
(llmstep.core.files.replace_dir): an interrupted save leaves the old checkpoint or the new one, whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .checkpoint_layout import (
    QUANT_KEY,
    Checkpoint,
    CheckpointError,
    checkpoint_tokenizer,
    format_version,
    generation_config_of,
    hf_names,
    quant_config_of,
    read_checkpoint,
    tensor_table,
    with_stored_dtype,
)
from .checks import is_int
from .config import LlamaConfig, read_config_json, read_json_object
from .device import DTYPE_NAMES, resolve_device, resolve_dtype
from .files import default_mode, fsync_dir, replace_dir
from .gguf_load import load_gguf, read_gguf
from .loader import build, load_dtype, read_state
from .model import Llama, check_model
from .quantize import QuantConfig
from .registry import DATA_DIR, SHIPPED, resolve_model_path
from .tokens import Tokenizer

__all__ = ["CheckpointError", "Checkpoint", "load", "check_files", "read_config", "read_checkpoint", "load_model",
           "save", "resolve_model_path", "hf_names", "tensor_table", "read_quant_config", "read_generation_config",
           "DATA_DIR", "SHIPPED"]


def read_quant_config(path: str | os.PathLike) -> QuantConfig | None:
    """The quantisation settings a checkpoint directory records in config.json, or None for a float one (and for
    a GGUF file, whose quantized matrices are dequantized unless the loader is asked to keep them)."""
    if (path := resolve_model_path(path)).is_file():
        return None
    return quant_config_of(*read_config_json(path))


def load_model(path: str | os.PathLike | Checkpoint | None = None, device=None, dtype=None,
               progress: bool | None = None, keep_quantized: bool = False) -> Llama:
    """Build a Llama from a checkpoint directory (float or quantised; or one already read, a Checkpoint) or a
    GGUF file, straight onto `device` in `dtype`.

    A quantised checkpoint comes back quantised (`model.quantization` holds its settings); `dtype` is then
    that of its activations, scales, norms and embedding. A GGUF file is dequantized into `dtype`, or with
    `keep_quantized` its Q4_0/Q4_1 matrices held as llmstep int4 (llmstep.core.gguf_load)."""
    if not isinstance(path, Checkpoint) and (path := resolve_model_path(path)).is_file():
        return load_gguf(path, device=device, dtype=dtype, keep_quantized=keep_quantized, progress=progress)[0]
    if keep_quantized:
        raise CheckpointError(f"{getattr(path, 'path', path)}: keep_quantized applies to GGUF files; a quantised "
                              "checkpoint directory loads quantised anyway")
    ckpt = path if isinstance(path, Checkpoint) else read_checkpoint(path)
    device = resolve_device(device)
    dtype = load_dtype(ckpt.config, device, dtype)
    state, _ = read_state(ckpt, device, dtype, progress=progress)
    return build(ckpt, state, dtype)


def load(path: str | os.PathLike | None = None, device=None, dtype=None,
         progress: bool | None = None, keep_quantized: bool = False) -> tuple[Llama, Tokenizer]:
    """Load (model, tokenizer) from a Hugging Face-layout directory (float or quantised) or a GGUF file; None
    loads the shipped default.

    `device`: "cuda", "mps", "cpu" or None for the best available. `dtype`: None keeps the checkpoint's
    dtype on a GPU and uses float32 on the CPU (the checkpoint's dtype there too above 4B parameters).
    `keep_quantized` (GGUF only): Q4_0/Q4_1 matrices stay 4-bit, as llmstep int4 with groups of 32.
    """
    if (path := resolve_model_path(path)).is_file():
        return load_gguf(path, device=device, dtype=dtype, keep_quantized=keep_quantized, progress=progress)
    ckpt = read_checkpoint(path)  # fail fast on the config and the tokenizer, before any weight is read
    tokenizer = checkpoint_tokenizer(ckpt)
    return load_model(ckpt, device=device, dtype=dtype, progress=progress, keep_quantized=keep_quantized), tokenizer


def read_config(path: str | os.PathLike | None) -> LlamaConfig:
    """The shape of the model at `path` (a directory's config.json, a GGUF file's metadata), no weight read."""
    path = resolve_model_path(path)
    if path.is_file():
        return read_gguf(path).config
    raw, file = read_config_json(path)
    return with_stored_dtype(LlamaConfig.from_hf(raw, where=str(file)), raw, path)  # as `load` reads it


def check_files(path: str | os.PathLike | None) -> tuple[Path, LlamaConfig, Tokenizer]:
    """(directory, config, tokenizer) of a checkpoint, its config files and tokenizer read and checked without
    reading a weight: what `load` refuses before it allocates anything."""
    path = resolve_model_path(path)
    if path.is_file():
        g = read_gguf(path)
        return path, g.config, g.tokenizer
    ckpt = read_checkpoint(path)
    return path, ckpt.config, checkpoint_tokenizer(ckpt)


def read_generation_config(path: Path) -> dict:
    """A checkpoint directory's generation_config.json, checked ({} where there is none); a GGUF file's sampling
    defaults (general.sampling.*)."""
    if path.is_file():
        return read_gguf(path).generation_config
    file = path / "generation_config.json"
    return generation_config_of(read_json_object(file, CheckpointError) if file.is_file() else {}, file)


def check_save_folder(path: str | os.PathLike) -> Path:
    """The folder `save` writes, absolute (a link's target; "." the folder it names, whose parent is not "."), or a
    ValueError where it is the current folder or holds it (a save replaces the folder whole, which would leave the
    process in a deleted folder), an OSError where it is a file, lies under one, or its nearest existing folder
    above it is not writable. For commands that save at their end (training's --export), to ask first."""
    path = Path(path).resolve() if Path(path).is_symlink() else Path(os.path.abspath(path))
    if Path.cwd().resolve().is_relative_to(path.resolve()):
        raise ValueError(f"cannot save into {path}: it is the current folder or holds it, and a save replaces the "
                         "folder whole (the process would be left in a deleted folder); give another folder")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; give a directory to write the checkpoint into")
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise NotADirectoryError(f"cannot write the checkpoint {path}: {above} is a file, not a directory")
    if above is not None and not os.access(above, os.W_OK | os.X_OK):  # the new folder is made beside the target
        raise PermissionError(f"cannot write the checkpoint {path}: {above} is not writable (the checkpoint is "
                              "written in a folder beside it, then swapped in)")
    return path


def save(model: Llama, path: str | os.PathLike, tokenizer: Tokenizer | None = None,
         generation_config: dict | None = None, dtype: torch.dtype | None = None,
         max_shard_bytes: int | None = None) -> Path:
    """Write `model` in Hugging Face layout, loadable by llmstep (and by transformers, unless quantised).

    A quantised model is written in its packed form (see the module's docstring); `dtype` then applies to
    its float tensors only. `generation_config` defaults to the model's own. Every file is written to a
    temporary folder beside `path`, which then takes `path`'s place (llmstep.core.files.replace_dir, carrying
    over the files this save does not write, but not an earlier save's weights): at every instant `path`
    holds the complete old checkpoint or the complete new one.
    """
    check_model(model, "save(model, path, tokenizer)")
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"save(model, path, tokenizer): path must be a folder's path, got {type(path).__name__}")
    for name, value, kind in (("tokenizer", tokenizer, Tokenizer), ("generation_config", generation_config, Mapping)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"save: {name} must be a {kind.__name__} or None, got {type(value).__name__}")
    path = check_save_folder(path)
    if max_shard_bytes is not None and not (is_int(max_shard_bytes) and max_shard_bytes >= 1):
        raise ValueError(f"max_shard_bytes must be a whole number of bytes >= 1, or None for one file; got "
                         f"{max_shard_bytes!r}")
    config = model.config
    qc = getattr(model, "quantization", None)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point
                                  or isinstance(dtype, str) and dtype != "auto" and dtype in DTYPE_NAMES):
        raise ValueError(f"dtype must be a float dtype (float32, bfloat16, float16 or float64), got {dtype!r}")
    # a name ("bfloat16", "bf16": load's names) as a torch dtype; int8 and the like refused (quantize() quantises)
    dtype = model.dtype if dtype is None else resolve_dtype(dtype, torch.device("cpu"))
    config_json = config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    metadata = {"format": "pt"}
    if qc is not None:
        config_json["quantization_config"] = {
            "quant_method": "llmstep", "format_version": format_version(qc), **qc.to_dict(),
            "int4_layout": "w = (q - 8) * scale + zero; two q per byte, even index in the high nibble"}
        metadata[QUANT_KEY] = json.dumps(qc.to_dict(), sort_keys=True)
    state = model.state_dict()
    for name, (ours, shape, _) in tensor_table(config, qc).items():  # before anything is converted or written
        if ours not in state or tuple(state[ours].shape) != shape:
            got = "no such tensor" if ours not in state else f"shape {list(state[ours].shape)}"
            raise CheckpointError(f"cannot save {path}: {ours} ({name}) has {got}, its config makes {list(shape)}"
                                  + (" (a tensor-parallel rank's shard: save the whole model, before sharding)"
                                     if ours in state else ""))
    tensors = {name: state[ours].detach().to("cpu", dtype if kind == "float" else state[ours].dtype).contiguous()
               for name, (ours, _, kind) in tensor_table(config, qc).items()}
    bad = next((name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:  # a checkpoint that load would refuse: refuse it here, before anything is written
        raise CheckpointError(f"cannot save {path}: tensor {bad} holds NaN or Inf"
                              + (f" (in {str(dtype).removeprefix('torch.')})" if dtype != model.dtype else ""))

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        gen = dict(getattr(model, "generation_config", {}) if generation_config is None else generation_config)
        gen.setdefault("bos_token_id", config.bos_token_id if tokenizer is None else tokenizer.bos_id)
        eos = config.eos_token_id if tokenizer is None else tokenizer.eos_ids
        gen.setdefault("eos_token_id", eos[0] if len(eos) == 1 else eos)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_dir(tmp)  # tokenizer.json, tokenizer_config.json (its chat template)
        try:
            _write_weights(tmp, tensors, max_shard_bytes, metadata)
        except SafetensorError as e:  # safetensors reports its write errors (ENOSPC, EFBIG) as its own type
            raise OSError(f"cannot save {path}: the weights could not be written ({e}); {path} is as it was") \
                from None
        for f in tmp.iterdir():
            f.chmod(default_mode())  # files made in a private temporary folder start out private (0600)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())  # on the disk before the folder is swapped in
        fsync_dir(tmp)
        # never carried: an earlier save's weights (sharded or not) and, when a tokenizer is saved, its template file
        stale = re.compile(r"model.*\.safetensors.*" + (r"|chat_template\.jinja" if tokenizer is not None else ""))
        replace_dir(tmp, path, carry=lambda name: not stale.fullmatch(name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _save_file(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, then its header's JSON written again with sorted keys, padded to its length: the
    library writes `__metadata__` in a hash map's order (safetensors issue 584), so two saves of one model made
    different files. The tensors' offsets, the header's length and its content are unchanged."""
    save_file(tensors, file, metadata=metadata)
    with open(file, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= n:  # the same keys and values as serde wrote them: never longer (else left as written)
            f.seek(8)
            f.write(text.ljust(n, b" "))  # the format pads a header with spaces


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None,
                   metadata: dict[str, str]) -> None:
    total = sum(t.nbytes for t in tensors.values())  # the files' size, for the index (not a cost: see cost.py)
    if max_shard_bytes is None or total <= max_shard_bytes:
        _save_file(tensors, folder / "model.safetensors", metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_file(shard, folder / file, metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

"""Read and write Hugging Face-layout checkpoints: config.json, safetensors (one file or shards),
tokenizer.json, generation_config.json.

Loading validates before it allocates: the config, every expected tensor present with the right shape
and a floating dtype, nothing unexpected. Only then is the model built on the meta device and each
tensor read straight to its device and dtype (no second copy of the model in memory).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .config import LlamaConfig, read_json_object
from .cost import n_params
from .device import resolve_device, resolve_dtype
from .model import Llama
from .rope import config_inv_frequencies
from .tokens import Tokenizer

__all__ = ["CheckpointError", "load", "load_model", "save", "resolve_model_path", "hf_names", "DATA_DIR"]

# The shipped models live in the repository's data/ folder (override with LLMSTEP_DATA).
DATA_DIR = Path(os.environ.get("LLMSTEP_DATA", Path(__file__).resolve().parents[2] / "data"))
SHIPPED = {"target": "shakespeare-target", "draft": "shakespeare-draft"}

_LAYER_NAMES = {  # llmstep name -> Hugging Face name, inside model.layers.{i}.
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_FLOATS = ("F64", "F32", "F16", "BF16")  # safetensors dtypes that load_model converts to the dtype asked for
_OPTIONAL = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed from the config


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


def hf_names(config: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Hugging Face tensor name -> (llmstep parameter name, expected shape)."""
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"attention.wq": (q, c.dim), "attention.wk": (kv, c.dim), "attention.wv": (kv, c.dim),
              "attention.wo": (c.dim, q), "feed_forward.w1": (c.hidden_dim, c.dim),
              "feed_forward.w3": (c.hidden_dim, c.dim), "feed_forward.w2": (c.dim, c.hidden_dim),
              "attention_norm": (c.dim,), "ffn_norm": (c.dim,)}
    names = {"model.embed_tokens.weight": ("tok_embeddings.weight", (c.vocab_size, c.dim)),
             "model.norm.weight": ("norm.weight", (c.dim,))}
    for i in range(c.n_layers):
        for ours, theirs in _LAYER_NAMES.items():
            names[f"model.layers.{i}.{theirs}.weight"] = (f"layers.{i}.{ours}.weight", shapes[ours])
    if not c.tie_embeddings:
        names["lm_head.weight"] = ("output.weight", (c.vocab_size, c.dim))
    return names


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """None -> the shipped target; "target"/"draft" -> the shipped models; else the directory given."""
    if path is None:
        path = "target"
    p = Path(path)
    if not p.exists() and str(path) in SHIPPED:
        p = DATA_DIR / "models" / SHIPPED[str(path)]
        if not p.is_dir():
            raise FileNotFoundError(f"the shipped {path} model is missing: expected it at {p}")
    if not p.exists():
        raise FileNotFoundError(f"no model directory at {p}")
    if not p.is_dir():
        raise NotADirectoryError(f"{p} is a file; give the checkpoint's directory (config.json, *.safetensors)")
    return p


def _weight_files(path: Path) -> dict[str, list[str]]:
    """Shard file -> the tensor names it should hold (from the index), or {file: []} for a single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard files")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file:
                raise CheckpointError(f"{index}: tensor {name} is mapped to {file!r}, not a shard file name")
            files.setdefault(file, []).append(name)
        for file in files:
            if not (path / file).is_file():
                raise CheckpointError(f"{index} lists shard {file}, which is missing from {path}")
        return files
    if (path / "model.safetensors").is_file():
        return {"model.safetensors": []}
    found = sorted(p.name for p in path.iterdir())
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {path} (found: {', '.join(found) or 'nothing'}); "
        "llmstep reads the Hugging Face safetensors layout"
    )


def _read_headers(path: Path, files: dict[str, list[str]]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Tensor name -> (file, shape, dtype), checking each file's header and size without reading data."""
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for file, listed in files.items():
        fpath = path / file
        size = fpath.stat().st_size
        try:
            with open(fpath, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                if size < 8 or header_len > size - 8:
                    raise CheckpointError(f"{fpath}: truncated or not a safetensors file (header runs past the end)")
                header = json.loads(fh.read(header_len))
            tensors = {k: (tuple(v["shape"]), v["dtype"], v["data_offsets"][1])
                       for k, v in header.items() if k != "__metadata__"}  # a non-object header fails here too
            data_end = max((end for _, _, end in tensors.values()), default=0)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise CheckpointError(f"{fpath}: corrupt safetensors header ({type(e).__name__}: {e})") from None
        if size != 8 + header_len + data_end:
            raise CheckpointError(
                f"{fpath}: truncated or corrupt: header describes {8 + header_len + data_end} bytes, file has {size}"
            )
        for name, (shape, dtype, _) in tensors.items():
            if name in found:
                raise CheckpointError(f"tensor {name} appears in both {found[name][0]} and {file}")
            found[name] = (file, shape, dtype)
        missing_listed = [n for n in listed if n not in header]
        if missing_listed:
            raise CheckpointError(f"{fpath}: the index says it holds {missing_listed[0]}, but it does not")
    return found


def validate(path: Path, config: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Check every tensor before anything is allocated; raise one error listing what is wrong."""
    found = _read_headers(path, _weight_files(path))
    expected = _expected(config, found)
    problems = []
    for name, (_, shape) in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif found[name][1] != shape:
            problems.append(f"tensor {name} in {found[name][0]} has shape {list(found[name][1])}, "
                            f"config.json implies {list(shape)}")
        elif found[name][2] not in _FLOATS:
            problems.append(f"tensor {name} in {found[name][0]} has dtype {found[name][2]}, expected a float")
    for name in found:
        if name not in expected and not name.endswith(_OPTIONAL):
            problems.append(f"unexpected tensor {name} in {found[name][0]}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{path}: " + "; ".join(problems[:5]) + more)
    return found


def _expected(config: LlamaConfig, found: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """hf_names, plus lm_head.weight when a tied checkpoint carries one anyway (load_model decides what it means)."""
    names = hf_names(config)
    if config.tie_embeddings and "lm_head.weight" in found:
        names["lm_head.weight"] = ("output.weight", (config.vocab_size, config.dim))
    return names


def read_config(path: Path) -> LlamaConfig:
    """The checkpoint's config.json, refusing quantised checkpoints (they have their own loader)."""
    config = LlamaConfig.from_hf(path)
    quantized = _read_json(path / "config.json").get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
        raise CheckpointError(f"{path} holds a quantised checkpoint ({method}): "
                              "load it with llmstep.quantize.load_quantized")
    return config


def load_model(path: str | os.PathLike | None = None, device=None, dtype=None, progress: bool | None = None) -> Llama:
    """Build a Llama from a checkpoint directory, straight onto `device` in `dtype`."""
    path = resolve_model_path(path)
    config = read_config(path)
    device = resolve_device(device)
    if dtype is None and device.type == "cpu" and n_params(config) > 4e9:
        dtype = config.torch_dtype  # a float32 copy of a big model would not fit most machines' memory
    dtype = resolve_dtype(dtype, device, config.torch_dtype)
    found = validate(path, config)

    expected = _expected(config, found)
    total_bytes = sum(torch.Size(shape).numel() for _, shape in expected.values()) * torch.finfo(dtype).bits // 8
    show = total_bytes > 2**30 if progress is None else progress
    state: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(found[name][0], []).append(name)
    bar = tqdm(total=len(expected), desc=f"loading {path.name}", unit="tensor", disable=not show)
    # Read to the CPU unless the device is CUDA (safetensors reads straight to a GPU); one tensor at a time.
    read_on = str(device) if device.type == "cuda" else "cpu"
    try:
        for file, names in by_file.items():
            with safe_open(path / file, framework="pt", device=read_on) as f:
                for name in names:
                    state[expected[name][0]] = f.get_tensor(name).to(device=device, dtype=dtype)
                    bar.update()
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: could not read the weights ({e})") from None
    finally:
        bar.close()

    if config.tie_embeddings and "output.weight" in state:
        # A tied config whose checkpoint also holds lm_head.weight: transformers ties them only when the two are
        # equal, and otherwise keeps the head it was given. Do the same, so the model is the same function.
        if torch.equal(state["output.weight"], state["tok_embeddings.weight"]):
            del state["output.weight"]
        else:
            config = config.replace(tie_embeddings=False)
    with torch.device("meta"):
        model = Llama(config)
    if config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = config_inv_frequencies(config).to(device)
    model.generation_config = _read_json(path / "generation_config.json")
    return model.eval()


def load(path: str | os.PathLike | None = None, device=None, dtype=None,
         progress: bool | None = None) -> tuple[Llama, Tokenizer]:
    """Load (model, tokenizer) from a Hugging Face-layout directory; None loads the shipped default.

    `device`: "cuda", "mps", "cpu" or None for the best available. `dtype`: None keeps the checkpoint's
    dtype on a GPU and uses float32 on the CPU (the checkpoint's dtype there too above 4B parameters).
    """
    path = resolve_model_path(path)
    read_config(path)  # fail fast on the config and the tokenizer, before any weight is read
    _read_json(path / "generation_config.json")
    tokenizer = Tokenizer.from_dir(path)
    model = load_model(path, device=device, dtype=dtype, progress=progress)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer.json has {tokenizer.vocab_size} tokens, "
                              f"but the model's vocabulary is {model.config.vocab_size}")
    return model, tokenizer


def _read_json(path: Path) -> dict:
    return read_json_object(path, CheckpointError) if path.is_file() else {}


def save(model: Llama, path: str | os.PathLike, tokenizer: Tokenizer | None = None,
         generation_config: dict | None = None, dtype: torch.dtype | None = None,
         max_shard_bytes: int | None = None) -> Path:
    """Write `model` in Hugging Face layout, loadable by llmstep and by transformers.

    Files are written to a temporary folder beside `path` and moved in only when all are complete.
    """
    path = Path(path)
    config = model.config
    dtype = dtype or model.dtype
    config_json = config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = {hf: params[ours].detach().to("cpu", dtype).contiguous() for hf, (ours, _) in hf_names(config).items()}

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        gen = dict(generation_config or {})
        gen.setdefault("bos_token_id", config.bos_token_id if tokenizer is None else tokenizer.bos_id)
        eos = config.eos_token_id if tokenizer is None else tokenizer.eos_ids
        gen.setdefault("eos_token_id", eos[0] if len(eos) == 1 else eos)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")
        _write_weights(tmp, tensors, max_shard_bytes)
        path.mkdir(exist_ok=True)
        for stale in path.glob("model*.safetensors*"):  # weights of an earlier save, sharded or not
            stale.unlink()
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)  # files made in a private temporary folder start out private (0600)
            os.replace(f, path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
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
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

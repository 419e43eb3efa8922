"""Read and write Hugging Face-layout checkpoints: config.json, safetensors (one file or shards),
tokenizer.json, generation_config.json. One loader reads float and quantised checkpoints alike.

A quantised checkpoint (`llmstep.save` of a model from llmstep.core.quantize) is the same layout with
a `quantization_config` in config.json, repeated in each safetensors header. Each quantised matmul is
stored as `<name>.qweight` (int8, or uint8 holding two int4 codes), `<name>.scales` (and `.zeros`);
transformers cannot read it (the packing is llmstep's), `llmstep.load` reads it back exactly.

Loading validates before it allocates: the config (its sizes bounded, its numbers finite), every expected
tensor present with the right shape and dtype, nothing unexpected, and the whole estimate against the
device's free memory (llmstep.core.cost.check_fits). Only then is each tensor read straight to its device
and dtype (no second copy of the model in memory), checked finite as it arrives (one NaN would otherwise
turn every later token into the argmax of NaNs), and the model made from them by `materialize`.

Saving writes every file into a new folder beside the target, which then takes its place
(llmstep.core.files.replace_dir): an interrupted save leaves the old checkpoint or the new one, whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .config import ConfigError, LlamaConfig, check_generation_config, parse_json, read_json_object
from .cost import check_fits, checkpoint_bytes, n_params
from .device import resolve_device, resolve_dtype
from .files import default_mode, fsync_dir, replace_dir
from .gguf_load import load_gguf, read_gguf
from .model import Llama, all_finite, materialize
from .quantize import QuantConfig, QuantizationError, QuantLinear, empty_quantized, linear_names
from .registry import DATA_DIR, SHIPPED, resolve_model_path
from .tokens import Tokenizer

__all__ = ["CheckpointError", "load", "check_files", "read_config", "load_model", "save", "resolve_model_path",
           "hf_names", "tensor_table", "read_quant_config", "read_generation_config", "DATA_DIR", "SHIPPED"]


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
# Buffers some old checkpoints carry, recomputed from the config: only these exact names may be skipped.
_OPTIONAL = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
FORMAT_VERSION = 1  # of the quantised layout; bump when it changes
_QUANT_KEY = "llmstep_quantization"  # the safetensors header's copy of the quantisation settings


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


def tensor_table(config: LlamaConfig, qc: QuantConfig | None = None) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Tensor name in the file -> (llmstep state name, shape, safetensors dtype: "float", "I8" or "U8").

    Float checkpoints: hf_names. Quantised ones: each matmul `qc` quantises is stored as
    `<hf>.qweight` [N, K] int8 (int4: [N, K/2] uint8) and `<hf>.scales` [N] (int4: [N, K/g], and `.zeros`).
    """
    table = {hf: (ours, shape, "float") for hf, (ours, shape) in hf_names(config).items()}
    if qc is None:
        return table
    with torch.device("meta"):
        meta = Llama(config)
    prefix = {ours.removesuffix(".weight"): hf.removesuffix(".weight") for hf, (ours, _) in hf_names(config).items()}
    prefix["output"] = "lm_head"  # also when tied: a quantised head has its own tensors
    for module in linear_names(meta, qc.lm_head):
        p = prefix[module]
        table.pop(f"{p}.weight", None)
        n, k = meta.get_submodule(module).weight.shape
        if qc.mode == "int8":
            table[f"{p}.qweight"] = (f"{module}.weight", (n, k), "I8")
            table[f"{p}.scales"] = (f"{module}.scales", (n,), "float")
        else:
            table[f"{p}.qweight"] = (f"{module}.weight", (n, k // 2), "U8")
            table[f"{p}.scales"] = (f"{module}.scales", (n, k // qc.group_size), "float")
            table[f"{p}.zeros"] = (f"{module}.zeros", (n, k // qc.group_size), "float")
    return table


def _weight_files(path: Path) -> dict[str, list[str]]:
    """Shard file -> the tensor names it should hold (from the index), or {file: []} for a single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = parse_json(index.read_text(), str(index), CheckpointError)["weight_map"]
        except (KeyError, TypeError) as e:
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
    if (path / "model.safetensors").is_dir():
        raise CheckpointError(f"{path / 'model.safetensors'} is a directory, not a safetensors file")
    if (path / "model.safetensors").is_file():
        return {"model.safetensors": []}
    found = sorted(p.name for p in path.iterdir())
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {path} (found: {', '.join(found) or 'nothing'}); "
        "llmstep reads the Hugging Face safetensors layout"
    )


def _read_headers(path: Path, files: dict[str, list[str]]
                  ) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], dict[str, dict]]:
    """Tensor name -> (file, shape, dtype), and file -> its header's metadata, checking each file's header and
    size without reading data."""
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    metadata: dict[str, dict] = {}
    for file, listed in files.items():
        fpath = path / file
        size = fpath.stat().st_size
        try:
            with open(fpath, "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                if size < 8 or header_len > size - 8:
                    raise CheckpointError(f"{fpath}: truncated or not a safetensors file (header runs past the end)")
                header = parse_json(fh.read(header_len), f"{fpath}'s header", CheckpointError)
            tensors = {k: (tuple(v["shape"]), v["dtype"], v["data_offsets"][1])
                       for k, v in header.items() if k != "__metadata__"}  # a non-object header fails here too
            data_end = max((end for _, _, end in tensors.values()), default=0)
            meta = header.get("__metadata__")
            metadata[file] = meta if isinstance(meta, dict) else {}
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
    return found, metadata


def validate(path: Path, config: LlamaConfig, qc: QuantConfig | None = None
             ) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], dict[str, tuple[str, tuple[int, ...], str]]]:
    """Check every tensor before anything is allocated; raise one error listing what is wrong.

    Returns what the headers hold (name -> (file, shape, dtype)) and what to load (tensor_table's rows)."""
    found, metadata = _read_headers(path, _weight_files(path))
    for file, meta in metadata.items():  # each file's header must record the settings config.json gives
        recorded = meta.get(_QUANT_KEY)
        try:
            theirs = None if recorded is None else QuantConfig.of(parse_json(recorded, _QUANT_KEY))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path / file}: bad {_QUANT_KEY} in its header ({e})") from None
        if theirs != qc:
            raise CheckpointError(f"{path / file}: its header records quantisation {theirs or 'none'}, but "
                                  f"config.json says {qc or 'none'}; the files do not belong together")
    expected = tensor_table(config, qc)
    if qc is None and config.tie_embeddings and "lm_head.weight" in found:
        expected["lm_head.weight"] = ("output.weight", (config.vocab_size, config.dim), "float")  # see load_model
    problems = []
    for name, (_, shape, kind) in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif found[name][1] != shape:
            problems.append(f"tensor {name} in {found[name][0]} has shape {list(found[name][1])}, "
                            f"{'config.json' if qc is None else qc} implies {list(shape)}")
        elif found[name][2] not in (_FLOATS if kind == "float" else (kind,)):
            problems.append(f"tensor {name} in {found[name][0]} has dtype {found[name][2]}, "
                            f"expected {'a float' if kind == 'float' else kind}")
    for name in found:
        if name not in expected and not _OPTIONAL.fullmatch(name):
            problems.append(f"unexpected tensor {name} in {found[name][0]}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{path}: " + "; ".join(problems[:5]) + more)
    return found, expected


def read_quant_config(path: str | os.PathLike) -> QuantConfig | None:
    """The quantisation settings a checkpoint directory records in config.json, or None for a float one (and for
    a GGUF file, whose quantized matrices are dequantized unless the loader is asked to keep them)."""
    if resolve_model_path(path).is_file():
        return None
    file = resolve_model_path(path) / "config.json"
    settings = _read_json(file).get("quantization_config")
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{file}: quantization_config must be an object, got {settings!r}")
    method = settings.get("quant_method")
    if method != "llmstep":
        raise CheckpointError(f"{file}: quantization_config is for {method!r}; llmstep reads only its own ('llmstep')")
    if settings.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: quantised format version {settings.get('format_version')}, "
                              f"this llmstep reads version {FORMAT_VERSION}")
    try:
        return QuantConfig.of(settings)
    except (QuantizationError, TypeError) as e:
        raise CheckpointError(f"{file}: bad quantization_config: {e}") from None


def load_model(path: str | os.PathLike | None = None, device=None, dtype=None, progress: bool | None = None,
               keep_quantized: bool = False) -> Llama:
    """Build a Llama from a checkpoint directory (float or quantised) or a GGUF file, straight onto `device` in
    `dtype`.

    A quantised checkpoint comes back quantised (`model.quantization` holds its settings); `dtype` is then
    that of its activations, scales, norms and embedding. A GGUF file is dequantized into `dtype`, or with
    `keep_quantized` its Q4_0/Q4_1 matrices held as llmstep int4 (llmstep.core.gguf_load)."""
    path = resolve_model_path(path)
    if path.is_file():
        return load_gguf(path, device=device, dtype=dtype, keep_quantized=keep_quantized, progress=progress)[0]
    if keep_quantized:
        raise CheckpointError(f"{path}: keep_quantized applies to GGUF files; a quantised checkpoint directory "
                              "loads quantised anyway")
    config = LlamaConfig.from_hf(path)
    qc = read_quant_config(path)
    device = resolve_device(device)
    if dtype is None and device.type == "cpu" and n_params(config) > 4e9:
        dtype = config.torch_dtype  # a float32 copy of a big model would not fit most machines' memory
    dtype = resolve_dtype(dtype, device, config.torch_dtype)
    found, expected = validate(path, config, qc)
    generation_config = read_generation_config(path)
    check_fits(checkpoint_bytes(config, dtype, qc), device, f"{path.name} in {str(dtype).removeprefix('torch.')}")

    files = {file for file, _, _ in found.values()}
    show = sum((path / f).stat().st_size for f in files) > 2**30 if progress is None else progress
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
                    ours, _, kind = expected[name]
                    t = f.get_tensor(name)  # quantised codes keep their integer dtype
                    t = t.to(device=device, dtype=dtype if kind == "float" else t.dtype)
                    if kind == "float" and not all_finite(t):  # before the model is built
                        raise CheckpointError(f"{path / file}: tensor {name} holds NaN or Inf values in "
                                              f"{str(dtype).removeprefix('torch.')}; the checkpoint is damaged"
                                              + (" (or too large for float16)" if dtype == torch.float16 else ""))
                    state[ours] = t
                    bar.update()
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: could not read the weights ({e})") from None
    finally:
        bar.close()

    if qc is not None:
        model = materialize(config, state, generation_config, swap=lambda meta: empty_quantized(meta, qc, dtype))
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.prepare()  # the packed kernels' layouts for this device
        model.quantization = qc
        return model
    if config.tie_embeddings and "output.weight" in state:
        # A tied config whose checkpoint also holds lm_head.weight: transformers ties them only when the two are
        # equal, and otherwise keeps the head it was given. Do the same, so the model is the same function.
        if torch.equal(state["output.weight"], state["tok_embeddings.weight"]):
            del state["output.weight"]
        else:
            config = config.replace(tie_embeddings=False)
    return materialize(config, state, generation_config)


def load(path: str | os.PathLike | None = None, device=None, dtype=None,
         progress: bool | None = None, keep_quantized: bool = False) -> tuple[Llama, Tokenizer]:
    """Load (model, tokenizer) from a Hugging Face-layout directory (float or quantised) or a GGUF file; None
    loads the shipped default.

    `device`: "cuda", "mps", "cpu" or None for the best available. `dtype`: None keeps the checkpoint's
    dtype on a GPU and uses float32 on the CPU (the checkpoint's dtype there too above 4B parameters).
    `keep_quantized` (GGUF only): Q4_0/Q4_1 matrices stay 4-bit, as llmstep int4 with groups of 32.
    """
    resolved = resolve_model_path(path)
    if resolved.is_file():
        return load_gguf(resolved, device=device, dtype=dtype, keep_quantized=keep_quantized, progress=progress)
    path, _, tokenizer = check_files(path)  # fail fast on the config and the tokenizer, before any weight is read
    model = load_model(path, device=device, dtype=dtype, progress=progress, keep_quantized=keep_quantized)
    return model, tokenizer


def read_config(path: str | os.PathLike | None) -> LlamaConfig:
    """The shape of the model at `path` (a directory's config.json, a GGUF file's metadata), no weight read."""
    path = resolve_model_path(path)
    return read_gguf(path).config if path.is_file() else LlamaConfig.from_hf(path)


def check_files(path: str | os.PathLike | None) -> tuple[Path, LlamaConfig, Tokenizer]:
    """(directory, config, tokenizer) of a checkpoint, its config files and tokenizer read and checked without
    reading a weight: what `load` refuses before it allocates anything."""
    path = resolve_model_path(path)
    if path.is_file():
        g = read_gguf(path)
        return path, g.config, g.tokenizer
    config = LlamaConfig.from_hf(path)
    read_quant_config(path)
    read_generation_config(path)
    tokenizer = Tokenizer.from_dir(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer.json has {tokenizer.vocab_size} tokens, "
                              f"but the model's vocabulary is {config.vocab_size}")
    return path, config, tokenizer


def _read_json(path: Path) -> dict:
    return read_json_object(path, CheckpointError) if path.is_file() else {}


def read_generation_config(path: Path) -> dict:
    """A checkpoint directory's generation_config.json, checked ({} where there is none); a GGUF file's sampling
    defaults (general.sampling.*)."""
    if path.is_file():
        return read_gguf(path).generation_config
    gen = _read_json(path / "generation_config.json")
    try:
        return check_generation_config(gen, str(path / "generation_config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


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
    path = Path(path).resolve() if Path(path).is_symlink() else Path(path)  # the folder is made beside the target
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; give a directory to write the checkpoint into")
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise NotADirectoryError(f"cannot write the checkpoint {path}: {above} is a file, not a directory")
    config = model.config
    qc = getattr(model, "quantization", None)
    dtype = dtype or model.dtype
    config_json = config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    metadata = {"format": "pt"}
    if qc is not None:
        config_json["quantization_config"] = {
            "quant_method": "llmstep", "format_version": FORMAT_VERSION, **qc.to_dict(),
            "int4_layout": "w = (q - 8) * scale + zero; two q per byte, even index in the high nibble"}
        metadata[_QUANT_KEY] = json.dumps(qc.to_dict(), sort_keys=True)
    state = model.state_dict()
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
        _write_weights(tmp, tensors, max_shard_bytes, metadata)
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


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None,
                   metadata: dict[str, str]) -> None:
    total = sum(t.nbytes for t in tensors.values())  # the files' size, for the index (not a cost: see cost.py)
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, folder / "model.safetensors", metadata=metadata)
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
        save_file(shard, folder / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

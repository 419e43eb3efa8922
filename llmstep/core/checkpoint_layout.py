"""What a Hugging Face-layout checkpoint directory holds, read and checked without reading a weight.

`read_checkpoint(dir)` parses config.json and generation_config.json once into a `Checkpoint`: the model's shape
(llmstep.core.config), its quantisation settings, its sampling defaults, and the parsed files themselves (the
tokenizer reads its stop ids from them). Everything that loads a directory, in one process or tensor-parallel,
takes that one value. `Checkpoint.tensors` then reads the safetensors index and every file's header (no tensor
data) and checks them against the config: every expected tensor present with the right shape and dtype, nothing
unexpected, each file's size what its header says. Errors name the file and the tensor.

A quantised checkpoint (`llmstep.save` of a model from llmstep.core.quantize) is the same layout with a
`quantization_config` in config.json, repeated in each safetensors header. Each quantised matmul is stored as
`<name>.qweight` (int8, or uint8 holding two int4 codes), `<name>.scales` (and `.zeros`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .checks import commonest, is_int
from .config import ConfigError, LlamaConfig, check_generation_config, parse_json, read_config_json, read_json_object
from .model import Llama
from .quantize import QuantConfig, QuantizationError, linear_names
from .tokens import Tokenizer

__all__ = ["CheckpointError", "Checkpoint", "read_checkpoint", "hf_names", "tensor_table", "quant_config_of",
           "generation_config_of", "checkpoint_tokenizer", "FORMAT_VERSION", "QUANT_KEY",
           "format_version"]

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
_FLOATS = ("F64", "F32", "F16", "BF16")  # safetensors dtypes that loading converts to the dtype asked for
# Buffers some old checkpoints carry, recomputed from the config: only these exact names may be skipped.
_OPTIONAL = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
# Of the quantised layout: 2 adds an LM head in a mode of its own (QuantConfig.lm_head "int8"), which a reader of
# version 1 would take for a head in the blocks' mode; 3 adds 8-bit activations (QuantConfig.activations, or an
# "int8-a8" head's), which a reader of 1 or 2 would drop. Every other checkpoint is still written as version 1.
FORMAT_VERSION = 3
QUANT_KEY = "llmstep_quantization"  # the safetensors header's copy of the quantisation settings
# A table row: tensor name in the file -> (llmstep state name, shape, safetensors dtype: "float", "I8" or "U8").
Table = dict[str, tuple[str, tuple[int, ...], str]]


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


def tensor_table(config: LlamaConfig, qc: QuantConfig | None = None) -> Table:
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
        layer = qc.layer(module)  # the head's own mode where it has one (QuantConfig.lm_head)
        if layer.mode == "int8":
            table[f"{p}.qweight"] = (f"{module}.weight", (n, k), "I8")
            table[f"{p}.scales"] = (f"{module}.scales", (n,), "float")
        else:
            table[f"{p}.qweight"] = (f"{module}.weight", (n, k // 2), "U8")
            table[f"{p}.scales"] = (f"{module}.scales", (n, k // layer.group_size), "float")
            table[f"{p}.zeros"] = (f"{module}.zeros", (n, k // layer.group_size), "float")
    return table


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory, its JSON files parsed once and checked; no weight read.

    `parsed` holds config.json and generation_config.json as read (a file the folder lacks is absent), for the
    tokenizer's stop ids. `tensors` reads the index and the headers on first use."""

    path: Path
    config: LlamaConfig
    quantization: QuantConfig | None  # config.json's quantization_config; None for a float checkpoint
    generation_config: dict  # generation_config.json, checked ({} where there is none)
    parsed: dict[str, dict]

    @cached_property
    def tensors(self) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], Table]:
        """(what the headers hold: name -> (file, shape, dtype), what to load: tensor_table's rows), checked
        before anything is allocated; one CheckpointError lists what is wrong."""
        return _validate(self)


def read_checkpoint(path: Path) -> Checkpoint:
    """Parse and check a checkpoint directory's config.json and generation_config.json (each read once; the
    safetensors headers too where config.json names no dtype: `with_stored_dtype`)."""
    raw, file = read_config_json(path)
    parsed = {"config.json": raw}
    config = LlamaConfig.from_hf(raw, where=str(file))
    qc = quant_config_of(raw, file)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        parsed["generation_config.json"] = read_json_object(gen_file, CheckpointError)
    generation = generation_config_of(parsed.get("generation_config.json", {}), gen_file, config.vocab_size)
    return Checkpoint(path, with_stored_dtype(config, raw, path), qc, generation, parsed)


_STORED = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def with_stored_dtype(config: LlamaConfig, raw: dict, path: Path) -> LlamaConfig:
    """`config` (read from the config.json `raw` of checkpoint directory `path`) with, where the file names no dtype,
    the weights' own: the commonest among its matrices in the safetensors headers (`checks.commonest`), as transformers'
    dtype="auto" reads it; LlamaConfig's default would be bfloat16, a rounding on a GPU. Headers only."""
    if raw.get("torch_dtype") is not None or raw.get("dtype") is not None:
        return config
    try:
        found, _ = _read_headers(path, _weight_files(path))
    except (CheckpointError, OSError):  # a config.json alone (`llmstep info` on a shape), or weights `load` will
        return config  # name as broken: the config as it says, whatever the weights
    kinds = [dtype for _, shape, dtype in found.values() if len(shape) == 2 and dtype in _STORED]
    return dataclasses.replace(config, torch_dtype=_STORED[commonest(kinds)]) if kinds else config


def quant_config_of(config_json: dict, file: Path) -> QuantConfig | None:
    """The quantisation settings a config.json records, or None for a float checkpoint."""
    settings = config_json.get("quantization_config")
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{file}: quantization_config must be an object, got {settings!r}")
    method = settings.get("quant_method")
    if method != "llmstep":
        raise CheckpointError(f"{file}: quantization_config is for {method!r}; llmstep reads only its own ('llmstep')")
    version = settings.get("format_version")
    if version not in range(1, FORMAT_VERSION + 1) or isinstance(version, bool):
        raise CheckpointError(f"{file}: quantised format version {version!r}, this llmstep reads versions 1 to "
                              f"{FORMAT_VERSION}")
    try:
        qc = QuantConfig.of(settings)
    except (QuantizationError, TypeError) as e:
        raise CheckpointError(f"{file}: bad quantization_config: {e}") from None
    if format_version(qc) > version:
        raise CheckpointError(f"{file}: quantised format version {version} has no " + (
            "8-bit activations" if format_version(qc) == 3 and version < 3 else f"LM head of its own mode (lm_head "
            f"{qc.lm_head!r})") + "; the file is damaged")
    return qc


def format_version(qc: QuantConfig) -> int:
    """The oldest format that holds `qc`: what a checkpoint of it is written as, so older readers keep reading it
    (version 2: an LM head of its own mode; 3: 8-bit activations, the blocks' or the head's, which a reader of 1 or 2
    would drop silently)."""
    return 3 if qc.activations or qc.head and qc.head.activations else 2 if isinstance(qc.lm_head, str) else 1


def generation_config_of(gen: dict, file: Path, vocab_size: int | None = None) -> dict:
    """A generation_config.json's object, checked (llmstep.core.config.check_generation_config)."""
    try:
        return check_generation_config(gen, str(file), vocab_size)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def checkpoint_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """The checkpoint's tokenizer (tokenizer.json, its stop ids from the files already parsed), checked against
    the model's vocabulary; ids past the tokenizer's, up to the vocabulary's size, decode to nothing."""
    tokenizer = Tokenizer.from_dir(ckpt.path, ckpt.parsed)
    if tokenizer.vocab_size > ckpt.config.vocab_size:
        raise CheckpointError(f"{ckpt.path}: tokenizer.json has {tokenizer.vocab_size} tokens, "
                              f"but the model's vocabulary is {ckpt.config.vocab_size}")
    top = max(tokenizer.tok.get_vocab(with_added_tokens=True).values(), default=-1)  # ids may leave gaps
    if top >= ckpt.config.vocab_size:
        raise CheckpointError(f"{ckpt.path}: tokenizer.json has a token of id {top} ({tokenizer.id_to_token(top)!r}), "
                              f"past the model's vocabulary of {ckpt.config.vocab_size} ids")
    tokenizer.padded_vocab_size = ckpt.config.vocab_size
    return tokenizer


def _weight_files(path: Path) -> dict[str, list[str]]:
    """Shard file -> the tensor names it should hold (from the index), or {file: []} for a single file. A single
    model.safetensors is read before an index beside it, as transformers reads them (the same model from a folder
    holding both, a stale index's shards gone or not)."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_dir():
        raise CheckpointError(f"{path / 'model.safetensors'} is a directory, not a safetensors file")
    if (path / "model.safetensors").is_file():
        return {"model.safetensors": []}
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
    found = sorted(p.name for p in path.iterdir())
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {path} (found: {', '.join(found) or 'nothing'}); "
        "llmstep reads the Hugging Face safetensors layout"
    )


def _read_headers(path: Path, files: dict[str, list[str]]
                  ) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], dict[str, dict]]:
    """Tensor name -> (file, shape, dtype), and file -> its header's metadata, checking each file's header and
    size without reading data."""
    # The safetensors library's own bound on a header (MAX_HEADER_SIZE in its src/tensor.rs): no file it writes
    # or reads has a longer one, so a longer declared length is refused before it costs memory.
    max_header_bytes = 100_000_000
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
                if header_len > max_header_bytes:  # judged before a byte of it is read
                    raise CheckpointError(f"{fpath}: declares a {header_len:,}-byte header; safetensors allows at "
                                          f"most {max_header_bytes:,}: not a safetensors file, or a corrupt one")
                header = parse_json(fh.read(header_len), f"{fpath}'s header", CheckpointError)
            spans = {k: (tuple(v["shape"]), v["dtype"], v["data_offsets"][0], v["data_offsets"][1])
                     for k, v in header.items() if k != "__metadata__"}  # a non-object header fails here too
            tensors = {k: (shape, dtype, end) for k, (shape, dtype, _, end) in spans.items()}
            if not all(is_int(b) and is_int(e) and 0 <= b <= e for _, _, b, e in spans.values()):
                raise TypeError("a tensor's data_offsets are not whole numbers of bytes, begin <= end")
            _check_spans(fpath, spans)
            data_end = max((end for _, _, end in tensors.values()), default=0)
            meta = header.get("__metadata__")
            if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
                raise CheckpointError(f"{fpath}: its header's __metadata__ must map names to strings (safetensors "
                                      f"refuses it when it reads the file), got {str(meta)[:80]}")
            metadata[file] = meta or {}
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


# bytes per element of safetensors' dtypes (its Dtype enum)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_spans(fpath: Path, spans: dict[str, tuple[tuple[int, ...], str, int, int]]) -> None:
    """Each tensor's bytes [begin, end) as long as its shape and dtype make them, and the tensors laid end to end
    from the data's start, as safetensors itself requires: a header whose spans overlap or leave gaps is refused
    here, before any file's weights are read, rather than by safe_open once earlier files are loaded."""
    at = 0
    for name, (shape, dtype, begin, end) in sorted(spans.items(), key=lambda item: item[1][2:]):
        if not all(is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{fpath}: tensor {name} has shape {list(shape)}; a shape is whole numbers >= 0")
        size = _DTYPE_BYTES.get(dtype)
        if size is not None and end - begin != math.prod(shape) * size:
            raise CheckpointError(f"{fpath}: tensor {name} ({dtype} {list(shape)}) spans {end - begin} bytes "
                                  f"[{begin}, {end}), its shape and dtype make {math.prod(shape) * size}")
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves a gap of {begin - at} bytes before it"
            raise CheckpointError(f"{fpath}: tensor {name} starts at data byte {begin}: it {what} (the tensors "
                                  "must lie end to end); a corrupt safetensors file")
        at = end


def _validate(ckpt: Checkpoint) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], Table]:
    path, config, qc = ckpt.path, ckpt.config, ckpt.quantization
    found, metadata = _read_headers(path, _weight_files(path))
    for file, meta in metadata.items():  # each file's header must record the settings config.json gives
        recorded = meta.get(QUANT_KEY)
        try:
            theirs = None if recorded is None else QuantConfig.of(parse_json(recorded, QUANT_KEY))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path / file}: bad {QUANT_KEY} in its header ({e})") from None
        if theirs != qc:
            raise CheckpointError(f"{path / file}: its header records quantisation {theirs or 'none'}, but "
                                  f"config.json says {qc or 'none'}; the files do not belong together")
    expected = tensor_table(config, qc)
    if qc is None and config.tie_embeddings and "lm_head.weight" in found:
        # A tied config whose file also holds a head: loaded, then tied only if equal (llmstep.core.loader.build)
        expected["lm_head.weight"] = ("output.weight", (config.vocab_size, config.dim), "float")
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

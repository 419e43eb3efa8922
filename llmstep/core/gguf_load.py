"""Read a GGUF file (llama.cpp's format: ollama, LM Studio and llama.cpp keep models this way) into llmstep.

`llmstep.load("model.gguf")` comes here; everything is read through the `gguf` package, llama.cpp's own reader
(nothing here parses the format). What a llama-architecture file gives:

- the shape: `llama.*` keys -> LlamaConfig (llmstep.core.config); a `rope_freqs` tensor -> Llama 3.1's RoPE
  scaling, recovered from the per-pair factors and checked to give the same frequencies;
- the weights, every tensor type in TYPES, dequantized by `gguf.quants` into the dtype asked for. llama.cpp's
  converter reorders each q/k head's rows so that rotary pairs are neighbours; `from_interleaved` (the inverse of
  what `llmstep export --gguf` does) puts them back in llmstep's rotate-half order. No `output.weight` means the
  head is tied to the embedding;
- with `keep_quantized=True`, Q4_0 and Q4_1 matrices stay 4-bit as llmstep int4 with groups of 32 (GGUF's
  block): a Q4_1 block is w = d * q + m (q in 0..15), llmstep's w = (q - 8) * scale + zero, so scale = d and
  zero = m + 8d; Q4_0 is w = d * (q - 8): zero = 0. The codes and the scales move exactly; zero = m + 8d is one
  float32 addition (exact unless m and 8d are far apart in magnitude), so each weight equals the file's to one
  float32 rounding (Q4_0: exactly) in float32; a bfloat16 model rounds the scales to bfloat16;
- the tokenizer (llmstep.core.gguf_vocab), the chat template, bos/eos, and sampling defaults
  (`general.sampling.*`) as the model's generation_config.

Everything is checked before a weight is read: the architecture, every tensor's name, shape and type, where its
bytes lie (`check_layout`: llama.cpp's rule, each tensor right after the one before, aligned), the tokenizer and
its chat template, and the model's size against the device's memory. A file that is not GGUF, or ends early, is a
GGUFLoadError naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checks import commonest, is_finite_number, is_int
from .config import ConfigError, LlamaConfig, RopeScaling, check_generation_config
from .cost import check_fits, checkpoint_bytes
from .device import resolve_device
from .gguf import GGUF_NAMES, SAMPLING_KEYS, from_interleaved, qk_rows
from .gguf_header import PER_LAYER, check_header, check_types
from .gguf_rope import llama31_scaling_of
from .gguf_vocab import GGUFVocabError, build_tokenizer
from .loader import check_finite, dtype_name, load_dtype, quantized
from .model import Llama, all_finite, materialize
from .quantize import QuantConfig, empty_quantized, linear_names, pack_int4
from .tokens import Tokenizer

__all__ = ["GGUFLoadError", "TYPES", "KEEPS", "GGUFModel", "is_gguf", "read_gguf", "load_gguf", "rope_scaling_of"]

MAGIC = b"GGUF"
# The tensor types read here (each tested on files the tests write): floats, llama.cpp's legacy 4/5/8-bit blocks,
# and the K-quants that llama.cpp's mixes (Q4_K_M and the like) put in one file.
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
KEEPS = ("Q4_0", "Q4_1")  # types keep_quantized holds as llmstep int4, group size 32 (GGUF's block)
BLOCK = 32


class GGUFLoadError(ValueError):
    """A GGUF file llmstep cannot load; the message names the file and the key or tensor."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFLoadError("reading GGUF needs the gguf package (llama.cpp's reader): pip install gguf") from None
    return gguf


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


@dataclass
class GGUFModel:
    """What a GGUF file holds, read and checked, no weight read yet: `tensors` maps each llmstep state name to the
    reader's tensor (its bytes still on disk, memory-mapped)."""

    path: Path
    config: LlamaConfig
    tokenizer: Tokenizer
    generation_config: dict
    tensors: dict
    types: dict[str, str]  # llmstep state name -> GGML type name

    @property
    def head_type(self) -> str:
        """The GGML type of the LM head: output.weight's, or the token embedding's where the head is tied."""
        return self.types.get("output.weight", self.types["tok_embeddings.weight"])

    @property
    def dequantize_bytes(self) -> int:
        """What loading holds in the host's memory beside the model while one tensor is read: its values dequantized
        to float32 and their contiguous copy, 8 bytes an element of the largest tensor."""
        return 8 * max((int(np.prod(t.shape)) for t in self.tensors.values()), default=0)

    def quant_config(self, keep_quantized: bool) -> QuantConfig | None:
        """int4-g32 when keep_quantized and every matmul of the blocks is Q4_0/Q4_1; None to dequantize."""
        if not keep_quantized:
            return None
        with torch.device("meta"):
            names = linear_names(Llama(self.config))
        other = next((n for n in names if self.types[f"{n}.weight"] not in KEEPS), None)
        if other is not None:
            raise GGUFLoadError(f"{self.path}: keep_quantized holds Q4_0/Q4_1 matrices as llmstep int4, but "
                                f"{other} is {self.types[other + '.weight']}; load it dequantized instead")
        return QuantConfig("int4", BLOCK)


def _open(path: Path):
    gguf = _gguf()
    size = path.stat().st_size
    if not is_gguf(path):
        raise GGUFLoadError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    if size < 24:  # magic, version, tensor count, metadata count
        raise GGUFLoadError(f"{path}: truncated GGUF file ({size} bytes: the header alone takes 24)")
    # every count and length against the bytes left, and the keys' types, before the reader trusts them
    check_types(check_header(path, GGUFLoadError), path, GGUFLoadError)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError, ZeroDivisionError) as e:
        if "alignment" in str(e) or isinstance(e, ZeroDivisionError):  # the reader's own check of the key
            raise GGUFLoadError(f"{path}: metadata general.alignment must be a uint32 power of two ({e})") from None
        if "row size" in str(e):  # the reader's check that a quantized tensor's rows are whole blocks
            raise GGUFLoadError(f"{path}: a quantized tensor's rows are not whole blocks of its type, so its weights "
                                f"cannot be read (the gguf reader, which names no tensor: {e})") from None
        raise GGUFLoadError(f"{path}: truncated or corrupt GGUF file, or one of a version or tensor type the gguf "
                            f"package does not know (its reader: {type(e).__name__}: {e})") from None
    if reader.byte_order == "S":  # the reader reads the header either way; the weights' bytes it would not swap
        raise GGUFLoadError(f"{path} is a big-endian GGUF file; llmstep (as llama.cpp) reads little-endian ones")
    check_layout(reader, str(path))
    return reader


def check_layout(reader, where: str) -> None:
    """Refuse a tensor table that does not tile the data section, naming the tensor; no tensor's bytes are read.

    The table gives each tensor's type, shape and offset; its size follows from the type and shape (whole blocks
    for the quantized types). llama.cpp's gguf.cpp requires each offset to be exactly where the tensor before it
    ends, rounded up to general.alignment (a power of two, 32 when absent), and the last to end inside the file;
    so is it here. A wrong offset (misaligned, overlapping) or a wrong type would otherwise load as garbage."""
    gguf = _gguf()
    field = reader.fields.get("general.alignment")  # older readers do not check the key themselves
    align = int(field.parts[-1][0]) if field is not None and field.types == [gguf.GGUFValueType.UINT32] else 0
    if field is not None and (align <= 0 or align & (align - 1)):
        raise GGUFLoadError(f"{where}: metadata general.alignment must be a uint32 power of two")
    align = align or gguf.GGUF_DEFAULT_ALIGNMENT
    expected, before, room = 0, None, len(reader.data) - reader.data_offset
    for t in reader.tensors:
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        shape, kind = [int(d) for d in t.shape], t.tensor_type.name
        if not shape or min(shape) < 1:
            raise GGUFLoadError(f"{where}: tensor {t.name} has shape {shape}; every tensor has at least one "
                                "dimension, each at least 1")
        if shape[0] % block:
            raise GGUFLoadError(f"{where}: tensor {t.name} is {kind}, whose blocks hold {block} values, but its rows "
                                f"hold {shape[0]}")
        size, offset = t.n_elements // block * block_bytes, int(t.field.parts[-1][0])
        what = f"tensor {t.name} ({kind} {shape}, {size} bytes) starts at data offset {offset}"
        if offset != expected:
            if offset % align:
                why = f"not a multiple of general.alignment {align}"
            elif before is None:
                why = "the first tensor starts the data section"
            else:
                why = (("before the end of " if offset < expected else "leaving a gap after ")
                       + f"{before[0]} ({before[1]}, {before[2]} bytes from offset {before[3]})")
            raise GGUFLoadError(f"{where}: {what}, expected {expected} ({why}); the tensor table is damaged")
        if offset + size > room:
            raise GGUFLoadError(f"{where}: {what} and ends past the end of the file ({room} bytes of tensor data); "
                                "the file is truncated")
        before, expected = (t.name, kind, size, offset), offset + -(-size // align) * align


def _fields(reader) -> dict:
    """key -> value for every metadata field (strings, numbers, bools, lists of them)."""
    out = {}
    for key, field in reader.fields.items():
        try:
            value = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise GGUFLoadError(f"metadata {key} cannot be read ({e})") from None
        out[key] = value.tolist() if hasattr(value, "tolist") else value
    return out


def _int(fields: dict, key: str, where: str, default=None) -> int:
    value = fields.get(key, default)
    if value is None:
        raise GGUFLoadError(f"{where}: metadata {key} is missing")
    if isinstance(value, list) and key in PER_LAYER:  # llama.cpp's form for blocks of different sizes
        raise GGUFLoadError(f"{where}: metadata {key} gives one value per block "
                            f"({', '.join(map(str, value[:4]))}{', ...' if len(value) > 4 else ''}); llmstep's blocks "
                            "are all alike: one number")
    if not is_int(value) or value <= 0:
        raise GGUFLoadError(f"{where}: metadata {key} must be a positive integer, got {value!r}")
    return value


def _float(fields: dict, key: str, where: str, default: float | None = None) -> float:
    value = fields.get(key, default)
    if value is None:
        raise GGUFLoadError(f"{where}: metadata {key} is missing")
    if not is_finite_number(value):
        raise GGUFLoadError(f"{where}: metadata {key} must be a finite number, got {value!r}")
    return float(value)


def rope_scaling_of(factors: np.ndarray, head_dim: int, theta: float, where: str) -> RopeScaling | None:
    """A rope_freqs tensor -> the Llama 3.1 scaling that gives it (`gguf_rope.llama31_scaling_of`), or None."""
    try:
        return llama31_scaling_of(factors, head_dim, theta)
    except (ValueError, ArithmeticError) as e:  # a crafted tensor can overflow the fit
        raise GGUFLoadError(f"{where}: {e}") from None


def _shortest(value):
    """A float32 metadata number as the shortest decimal it is (0.8, not 0.800000011920929); others unchanged."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _config(fields: dict, tensors: dict, where: str) -> LlamaConfig:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise GGUFLoadError(f"{where}: general.architecture is {arch!r}; llmstep implements 'llama' only")
    if fields.get("llama.expert_count", 0):  # Mixtral is stored as 'llama' with experts
        raise GGUFLoadError(f"{where}: llama.expert_count is {fields['llama.expert_count']}: a mixture of experts, "
                            "which llmstep does not implement (one SwiGLU per block)")
    rope_kind = fields.get("llama.rope.scaling.type", "none")
    if rope_kind != "none":  # Llama 3.1's scaling travels as the rope_freqs tensor instead
        raise GGUFLoadError(f"{where}: llama.rope.scaling.type is {rope_kind!r}; llmstep implements plain RoPE and "
                            "Llama 3.1's scaling (a rope_freqs tensor) only")
    for key in ("llama.rope.scaling.factor", "llama.rope.scale_linear"):  # llama.cpp: a linear factor
        linear = _float(fields, key, where, 0.0)
        if linear not in (0.0, 1.0):
            raise GGUFLoadError(f"{where}: {key} is {_shortest(linear)}: positions scaled linearly, which llmstep "
                                "does not implement (plain RoPE and Llama 3.1's scaling, a rope_freqs tensor, only)")
    attn_factor = _float(fields, "llama.rope.scaling.attn_factor", where, 1.0)  # llama.cpp scales the rotation by it
    if attn_factor != 1.0:
        raise GGUFLoadError(f"{where}: llama.rope.scaling.attn_factor is {_shortest(attn_factor)}: llama.cpp scales "
                            "the rotated q and k by it, which llmstep does not implement (1, or no such key, only)")
    n_heads = _int(fields, "llama.attention.head_count", where)
    dim = _int(fields, "llama.embedding_length", where)
    if "llama.attention.key_length" not in fields and dim % n_heads:
        raise GGUFLoadError(f"{where}: llama.embedding_length {dim} is not a multiple of llama.attention.head_count "
                            f"{n_heads}, and there is no llama.attention.key_length to give the head size")
    head_dim = _int(fields, "llama.attention.key_length", where, dim // n_heads)
    if _int(fields, "llama.attention.value_length", where, head_dim) != head_dim:
        raise GGUFLoadError(f"{where}: llama.attention.value_length differs from key_length; LLaMA uses one head size")
    if _int(fields, "llama.rope.dimension_count", where, head_dim) != head_dim:
        raise GGUFLoadError(f"{where}: llama.rope.dimension_count is not the head size: LLaMA 3 rotates whole heads")
    if "token_embd.weight" not in tensors:
        raise GGUFLoadError(f"{where}: there is no token_embd.weight tensor")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF lists dimensions innermost first
    theta = _float(fields, "llama.rope.freq_base", where, 10000.0)
    scaling = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        if t.tensor_type.name != "F32":
            raise GGUFLoadError(f"{where}: rope_freqs.weight must be F32, it is {t.tensor_type.name}")
        if [int(d) for d in t.shape] != [head_dim // 2]:  # one factor per rotary pair, nothing else
            raise GGUFLoadError(f"{where}: rope_freqs.weight has shape {list(reversed(t.shape.tolist()))}; it must "
                                f"be 1-D with {head_dim // 2} factors (one per pair of the head size {head_dim})")
        scaling = rope_scaling_of(np.array(t.data), head_dim, theta, where)
    fields_ids = {"bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
                  "eos_token_id": fields.get("tokenizer.ggml.eos_token_id")}
    kinds = [t.tensor_type.name for name, t in tensors.items() if len(t.shape) == 2]
    stored = {"F32": "float32", "F16": "float16"}.get(commonest(kinds), "bfloat16")  # the matrices' commonest
    try:
        return LlamaConfig(
            vocab_size=_int(fields, "llama.vocab_size", where, vocab), dim=dim,
            n_layers=_int(fields, "llama.block_count", where), n_heads=n_heads,
            n_kv_heads=_int(fields, "llama.attention.head_count_kv", where, n_heads),
            hidden_dim=_int(fields, "llama.feed_forward_length", where),
            # both required, as llama.cpp requires them: a guessed epsilon or context would be another model
            norm_eps=_shortest(_float(fields, "llama.attention.layer_norm_rms_epsilon", where)),
            rope_theta=theta,
            rope_scaling=scaling, max_seq_len=_int(fields, "llama.context_length", where),
            tie_embeddings="output.weight" not in tensors, head_dim=head_dim, torch_dtype=stored, **fields_ids)
    except ConfigError as e:
        raise GGUFLoadError(f"{where}: {e}") from None


def _expected(config: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (llmstep state name, shape [out, in] as llmstep holds it), from the model itself."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Llama(config).state_dict().items()}
    out = {}
    for ours, theirs in GGUF_NAMES.items():
        if ours == "output" and config.tie_embeddings:
            continue  # no output.weight: llama.cpp reuses token_embd
        for i in range(config.n_layers) if "{i}" in ours else [None]:
            out[theirs.format(i=i) + ".weight"] = (f"{ours.format(i=i)}.weight", shapes[f"{ours.format(i=i)}.weight"])
    return out


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open and check a GGUF file without reading a weight: its config, tokenizer and tensor table."""
    path = Path(path)
    reader = _open(path)
    where = str(path)
    try:
        fields = _fields(reader)
    except GGUFLoadError as e:
        raise GGUFLoadError(f"{where}: {e}") from None
    count = fields.get("split.count", 1)
    if count != 1:  # llama-gguf-split's shards: the first holds the metadata, every one some tensors
        shard = fields.get("split.no")
        which = (f"shard {shard + 1} of {count}" if is_int(shard) and is_int(count)
                 else f"a shard (split.count {count!r})")
        raise GGUFLoadError(f"{where}: {which} of a model split over several files (llama-gguf-split); llmstep reads "
                            "a model from one file: merge the shards first (llama-gguf-split --merge)")
    tensors = {t.name: t for t in reader.tensors}
    config = _config(fields, tensors, where)
    try:
        tokenizer = build_tokenizer(fields, where)
    except GGUFVocabError as e:
        raise GGUFLoadError(str(e)) from None
    if tokenizer.vocab_size > config.vocab_size:
        raise GGUFLoadError(f"{where}: the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary "
                            f"{config.vocab_size}")
    tokenizer.padded_vocab_size = config.vocab_size  # as checkpoint.check_files: padding ids decode to nothing
    generation = {ours: _shortest(fields[key]) for ours, key in SAMPLING_KEYS.items() if key in fields}
    if generation:  # llama.cpp samples by the file's general.sampling.* (temp 0: greedy); in transformers' words:
        generation["do_sample"] = generation.get("temperature") != 0
    try:
        generation = check_generation_config(generation, f"{where} (general.sampling.*)")
    except ConfigError as e:
        raise GGUFLoadError(str(e)) from None
    if tokenizer.eos_ids:  # every end-of-turn token the file names, as llama.cpp stops at: what every engine stops at
        generation["eos_token_id"] = list(tokenizer.eos_ids)

    expected, state, types, problems = _expected(config), {}, {}, []
    for name, (ours, shape) in expected.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
            continue
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        kind = t.tensor_type.name
        if got != shape:
            problems.append(f"tensor {name} has shape {list(got)}, the metadata implies {list(shape)}")
        elif kind not in TYPES:
            problems.append(f"tensor {name} is {kind}, a type llmstep does not read (it reads {', '.join(TYPES)})")
        elif len(shape) == 1 and kind not in ("F32", "F16", "BF16"):
            problems.append(f"tensor {name} (a norm) is {kind}; llmstep expects a float type")
        state[ours], types[ours] = t, kind
    for name in tensors:
        if name not in expected and name != "rope_freqs.weight":
            problems.append(f"unexpected tensor {name}" + (" (biases are not part of LLaMA 3)" if "bias" in name
                                                            else ""))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise GGUFLoadError(f"{where}: " + "; ".join(problems[:5]) + more)
    return GGUFModel(path, config, tokenizer, generation, state, types)


def _dequantized(t, name: str, config: LlamaConfig) -> torch.Tensor:
    """A reader tensor -> float32 [out, in] (or [n]) in llmstep's row order."""
    gguf = _gguf()
    w = gguf.quants.dequantize(np.array(t.data), t.tensor_type)  # a copy: the file is mapped read-only
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    w = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(shape)
    return qk_rows(name.removesuffix(".weight"), w, config, from_interleaved)


def int4_from_blocks(blocks: np.ndarray, kind: str, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Q4_0 [N, K/32 * 18] or Q4_1 [N, K/32 * 20] bytes -> llmstep int4 (packed codes [N, K/2] uint8, scales and
    zeros [N, K/32] float32), with (q - 8) * scale + zero = the file's weight (see the module docstring)."""
    head = 2 if kind == "Q4_0" else 4  # f16 d, then (Q4_1) f16 m
    b = np.asarray(blocks).reshape(n, k // BLOCK, head + BLOCK // 2)
    d = torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))  # [N, K/32]
    nibbles = b[..., head:]  # [N, K/32, 16]: element j in the low nibble, element j + 16 in the high one
    q = torch.from_numpy(np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k))  # [N, K], 0..15
    if kind == "Q4_0":
        zero = torch.zeros_like(d)
    else:
        zero = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) + 8 * d
    return pack_int4(q), d, zero


def load_gguf(path: str | os.PathLike, device=None, dtype=None, keep_quantized: bool = False,
              progress: bool | None = None) -> tuple[Llama, Tokenizer]:
    """(model, tokenizer) from a GGUF file; see the module docstring. `dtype` None: float32 on the CPU (the file's
    float type above 4B parameters, as every loader: llmstep.core.loader.load_dtype); on a GPU the file's float
    type, bfloat16 for a quantized file (llmstep.core.device); `keep_quantized`: Q4_0/Q4_1 matrices stay 4-bit
    (int4-g32)."""
    from tqdm.auto import tqdm

    g = read_gguf(path)
    qc = g.quant_config(keep_quantized)
    device = resolve_device(device)
    dtype = load_dtype(g.config, device, dtype)  # the one rule every loader follows (llmstep.core.loader)
    check_fits(checkpoint_bytes(g.config, dtype, qc) + (g.dequantize_bytes if device.type == "cpu" else 0), device,
               f"{g.path.name} in {dtype_name(dtype)}")
    kept = set()
    if qc is not None:
        with torch.device("meta"):
            kept = {f"{n}.weight" for n in linear_names(Llama(g.config))}
    show = g.path.stat().st_size > 2**30 if progress is None else progress
    state: dict[str, torch.Tensor] = {}
    try:
        with tqdm(g.tensors.items(), desc=f"loading {g.path.name}", unit="tensor", disable=not show) as bar:
            for name, t in bar:  # the bar closed on the way out, a failure's too
                if name in kept:
                    n, k = (int(d) for d in reversed(t.shape.tolist()))
                    codes, scales, zeros = int4_from_blocks(np.asarray(t.data), g.types[name], n, k)
                    if not (all_finite(scales) and all_finite(zeros)):  # float32 here: no check_finite wording
                        raise GGUFLoadError(f"{g.path}: tensor {t.name} ({name}) has NaN or Inf scales; the file is "
                                            "damaged")
                    module = name.removesuffix(".weight")
                    parts = {"weight": codes, "scales": scales, "zeros": zeros}
                    for part, value in parts.items():  # rows permute whole: a block never crosses a row
                        rows = qk_rows(module, value, g.config, from_interleaved)
                        state[f"{module}.{part}"] = rows.to(device, dtype if part != "weight" else torch.uint8)
                    continue
                w = _dequantized(t, name, g.config).to(device, dtype)
                check_finite(w, f"{g.path}: tensor {t.name} ({name})", dtype, GGUFLoadError, "the file")
                state[name] = w
    except (ValueError, OSError) as e:
        if isinstance(e, GGUFLoadError):
            raise
        raise GGUFLoadError(f"{g.path}: could not read the weights ({e})") from None
    if qc is None:
        return materialize(g.config, state, g.generation_config), g.tokenizer
    model = materialize(g.config, state, g.generation_config, swap=lambda meta: empty_quantized(meta, qc, dtype))
    return quantized(model, qc), g.tokenizer

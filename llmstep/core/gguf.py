"""Export a model to GGUF, the one-file format of llama.cpp (and of the tools built on it: ollama, LM Studio, ...).

The file holds the same weights, the shapes llama.cpp needs (`llama.*` keys) and the tokenizer
(`tokenizer.ggml.*`), written with the `gguf` package (a dependency of llmstep), the way llama.cpp's
own converter (convert_hf_to_gguf.py, class LlamaModel) writes a Hugging Face Llama. What changes on the way:

- names: `layers.{i}.attention.wq` -> `blk.{i}.attn_q`, ... (GGUF_NAMES below; gguf.TENSOR_NAMES for LLAMA).
- the rows of wq and wk. llmstep (like Hugging Face) rotates the pair (i, i + head_dim/2) of each head
  (rope.rotate_half); llama.cpp rotates the neighbours (2i, 2i + 1). The rows of each head are reordered so
  that llama.cpp's pair i holds what llmstep's pair i holds: new row 2i + j = old row i + j * head_dim/2
  (`to_interleaved`). q.k is a sum over pairs, so the attention scores, and everything after, are unchanged.
- Llama 3.1 rope scaling: llama.cpp divides pair i's rotation speed by `rope_freqs[i]`, a float32 tensor in
  the file: inv_freq unscaled / inv_freq scaled, from llmstep.core.rope (the one place the rule is written).
- 1-D tensors (the norms, rope_freqs) stay float32, as llama.cpp's converter keeps them; the matrices and the
  embedding are written in the dtype asked for (default: the checkpoint's own, so nothing is rounded).
- a model quantised to int8 (per row: w = q * scale) is written as Q8_0 (blocks of 32: w = q * d, d a
  float16) with the same q and d = scale, which is exact when every scale is a float16 number; int4 (per
  group, with a float zero point) has no exact GGUF form and is refused.
- the tokenizer: model "gpt2" (byte-level BPE), pre "llama-bpe" (Llama 3's split regex), "smollm" or "gpt-2",
  every token's text and type (normal, control for special tokens, unused for ids with no text),
  the merges, the bos and eos ids, whether text starts with bos, and the tokenizer's own chat template (the
  Llama 3 one where it has none but has Llama 3's tokens). llmstep.core.gguf_load reads all of it back.

A tokenizer llama.cpp would read differently (another split rule, a normaliser) is refused, naming why,
before anything is written; the file is written whole or not at all (llmstep.core.files.atomic_write).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from .config import LlamaConfig, sampling_defaults
from .files import atomic_write, check_output_path
from .gguf_vocab import LLAMA3_SPLIT, PRE_TOKENIZERS
from .model import Llama
from .quantize import Int4Linear, Int8Linear
from .rope import inv_frequencies
from .tokens import Tokenizer

__all__ = ["GGUFError", "DTYPES", "CHAT_TEMPLATE", "GGUF_NAMES", "LLAMA3_SPLIT", "SAMPLING_KEYS", "export_gguf",
           "gguf_tensors", "gguf_vocab", "default_dtype", "sampling_fields", "to_interleaved", "from_interleaved",
           "qk_rows", "rope_freq_factors", "pre_tokenizer_name"]

# --dtype -> (torch dtype, GGML type name, gguf.LlamaFileType name)
DTYPES = {"f32": (torch.float32, "F32", "ALL_F32"), "bf16": (torch.bfloat16, "BF16", "MOSTLY_BF16"),
          "f16": (torch.float16, "F16", "MOSTLY_F16")}
_FROM_TORCH = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # config.json's torch_dtype -> default
# generation_config's sampling defaults -> llama.cpp's keys (gguf.Keys.General.SAMPLING_*), written and read back
SAMPLING_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
                 "top_p": "general.sampling.top_p"}
Q8_BLOCK = 32  # Q8_0: 32 int8 values share one float16 scale (ggml-common.h, block_q8_0)

# llmstep name -> GGUF name (gguf.TENSOR_NAMES of MODEL_ARCH.LLAMA, with ".weight"); {i} is the block.
GGUF_NAMES = {
    "tok_embeddings": "token_embd",
    "layers.{i}.attention_norm": "blk.{i}.attn_norm",
    "layers.{i}.attention.wq": "blk.{i}.attn_q",
    "layers.{i}.attention.wk": "blk.{i}.attn_k",
    "layers.{i}.attention.wv": "blk.{i}.attn_v",
    "layers.{i}.attention.wo": "blk.{i}.attn_output",
    "layers.{i}.ffn_norm": "blk.{i}.ffn_norm",
    "layers.{i}.feed_forward.w1": "blk.{i}.ffn_gate",
    "layers.{i}.feed_forward.w3": "blk.{i}.ffn_up",
    "layers.{i}.feed_forward.w2": "blk.{i}.ffn_down",
    "norm": "output_norm",
    "output": "output",
}
# Tokenizer.chat's Llama 3 format as the Jinja template llama.cpp's chat reads (tokenizer.chat_template); a test
# renders it and checks it spells Tokenizer.chat's prompt character for character.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                 "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# gguf.TokenType: what llama.cpp makes of each id.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


class GGUFError(ValueError):
    """A model, tokenizer or setting that cannot be written as GGUF exactly; the message says why."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError("GGUF export needs the gguf package: pip install 'llmstep[export]' (or pip install gguf)"
                        ) from None
    return gguf


# ---- the weights -----------------------------------------------------------------------------------------
def to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """wq or wk rows [n_heads * head_dim, dim], pairs (i, i + head_dim/2) per head -> pairs (2i, 2i + 1)."""
    rows, dim = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def from_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of to_interleaved: llama.cpp's row order back to llmstep's."""
    rows, dim = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def qk_rows(module: str, w: torch.Tensor, config: LlamaConfig, order=to_interleaved) -> torch.Tensor:
    """wq's and wk's rows (or their scales') in llama.cpp's order (`order=from_interleaved`: back to llmstep's);
    every other module's tensor as it is."""
    if module.endswith("attention.wq"):
        return order(w, config.n_heads)
    if module.endswith("attention.wk"):
        return order(w, config.n_kv_heads)
    return w


def rope_freq_factors(config: LlamaConfig) -> torch.Tensor | None:
    """[head_dim/2] float32: how much slower Llama 3.1's scaling turns each pair (1 = untouched), or None."""
    if config.rope_scaling is None:
        return None
    plain = inv_frequencies(config.head_dim, config.rope_theta)
    return plain / inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)


def q8_0_scales(q: torch.Tensor, scales: torch.Tensor, where: str) -> torch.Tensor:
    """An int8 linear's scales [N] as Q8_0's float16 d [N], or GGUFError naming a row float16 would round. A row
    whose codes are all 0 is exact whatever its scale (quantisation gives a zero row a tiny one): d = 0 there."""
    d = scales.to(torch.float16)
    inexact = (d.to(scales.dtype) != scales) & q.ne(0).any(dim=1)  # [N]
    if inexact.any():
        bad = int(inexact.nonzero()[0])
        advice = ("quantise the model in bfloat16 or float16 (its scales are float32)" if scales.dtype.itemsize > 2
                  else "the scale is outside float16's range")
        raise GGUFError(f"{where}: row {bad}'s scale {scales[bad].item()!r} is not a float16 number, so Q8_0 "
                        f"(float16 scales) cannot hold it exactly: {advice}; or export the float model")
    return d.masked_fill(q.eq(0).all(dim=1), 0.0)


def _q8_0(q: torch.Tensor, scales: torch.Tensor, where: str) -> np.ndarray:
    """An int8 linear's q [N, K] and scales [N] as Q8_0 blocks [N, K/32 * 34] bytes: d (float16), then 32 q."""
    q, scales = q.detach().cpu().contiguous(), scales.detach().cpu().contiguous()
    n, k = q.shape
    if k % Q8_BLOCK:
        raise GGUFError(f"{where}: {k} inputs per row is not a multiple of Q8_0's block of {Q8_BLOCK}")
    d = q8_0_scales(q, scales, where)
    d_bytes = d.view(torch.uint8).reshape(n, 1, 2).expand(n, k // Q8_BLOCK, 2)  # [N, K/32, 2], the same d per row
    q_bytes = q.view(torch.uint8).reshape(n, k // Q8_BLOCK, Q8_BLOCK)  # [N, K/32, 32]
    return torch.cat([d_bytes, q_bytes], dim=2).reshape(n, -1).numpy()


def _float(t: torch.Tensor, dtype: str, where: str) -> np.ndarray:
    """A float tensor in the GGUF dtype: float32/float16 as themselves, bfloat16 as its raw 16 bits."""
    torch_dtype = DTYPES[dtype][0]
    t = t.detach().to("cpu", torch_dtype).contiguous()
    if not torch.isfinite(t).all():
        raise GGUFError(f"{where} holds values that are NaN or Inf in {dtype}" +
                        (" (too large for float16: use --dtype bf16 or f32)" if dtype == "f16" else ""))
    return t.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else t.numpy()


def gguf_tensors(model: Llama, dtype: str) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (array, GGML type name), in llama.cpp's order and row layout; checked before any is written."""
    c = model.config
    out: dict[str, tuple[np.ndarray, str]] = {}
    factors = rope_freq_factors(c)
    if factors is not None:
        out["rope_freqs.weight"] = (factors.float().numpy(), "F32")
    pairs = [("tok_embeddings", "token_embd")]
    for i in range(c.n_layers):
        pairs += [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in GGUF_NAMES.items() if "{i}" in ours]
    pairs.append(("norm", "output_norm"))
    if not (c.tie_embeddings and isinstance(model.output, torch.nn.Linear)):  # tied: llama.cpp reuses token_embd
        pairs.append(("output", "output"))
    for ours, theirs in pairs:
        m = model.get_submodule(ours)
        if isinstance(m, Int4Linear):
            raise GGUFError(f"{ours} is int4: llmstep's int4 (per group, with a float zero point) has no exact GGUF "
                            "form; export the float checkpoint, or an int8 one (written as Q8_0)")
        if isinstance(m, Int8Linear):  # q [N, K] and scales [N] move row by row, like any weight
            q, scales = qk_rows(ours, m.weight, c), qk_rows(ours, m.scales[:, None], c)[:, 0]
            array, kind = _q8_0(q, scales, ours), "Q8_0"
        elif m.weight.dim() == 1:  # a norm
            array, kind = _float(m.weight, "f32", ours), "F32"
        else:
            array, kind = _float(qk_rows(ours, m.weight, c), dtype, ours), DTYPES[dtype][1]
        out[theirs + ".weight"] = (array, kind)
    return out


def default_dtype(model: Llama) -> str:
    """The --dtype an export without one uses: the checkpoint's own (config.torch_dtype) where every float matrix
    is exactly a number of that type, else f32. A model dequantized from a Q4_1 GGUF holds d * q + m, which
    bfloat16 would round, although its config says bfloat16 (llmstep.core.gguf_load): the default never rounds."""
    want = _FROM_TORCH.get(model.config.torch_dtype, "f32")
    if want == "f32":
        return want
    kind = DTYPES[want][0]
    exact = all(torch.equal(w.to(kind).to(w.dtype), w) for w in model.parameters()
                if w.dim() == 2 and w.is_floating_point() and w.dtype != kind)
    return want if exact else "f32"


def sampling_fields(generation_config: dict) -> dict[str, float | int]:
    """The general.sampling.* values (llama.cpp's sampling defaults) of a generation_config: temperature, top_k
    and top_p as it gives them; greedy by transformers' rule (`sampling_defaults`: no do_sample: true) is temperature 0,
    greedy in llama.cpp and in llmstep alike, so the file samples as the checkpoint did. top_k goes in as llama.cpp's
    int32 (GGUFError past it, before the file is opened)."""
    gen = sampling_defaults(generation_config)
    if gen.get("top_k") is not None and not 0 <= gen["top_k"] < 2**31:
        raise GGUFError(f"generation_config top_k {gen['top_k']} does not fit general.sampling.top_k (int32)")
    return {key: gen[ours] for ours, key in SAMPLING_KEYS.items() if gen.get(ours) is not None}


# ---- the tokenizer ---------------------------------------------------------------------------------------
def pre_tokenizer_name(spec: dict) -> str:
    """tokenizer.json (parsed) -> llama.cpp's name for how it splits text before BPE, or GGUFError."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or spec.get("normalizer") is not None:
        raise GGUFError("the tokenizer is not a plain byte-level BPE (model type "
                        f"{model.get('type')!r}, byte_fallback {model.get('byte_fallback')}, normalizer "
                        f"{(spec.get('normalizer') or {}).get('type')}); llama.cpp's 'gpt2' model reads only those")
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if (len(parts) == 1 and parts[0].get("type") == "ByteLevel" and parts[0].get("use_regex", True)
            and not parts[0].get("add_prefix_space")):
        return "gpt-2"
    if (len(parts) == 2 and parts[0].get("type") == "Split" and parts[0].get("pattern") == {"Regex": LLAMA3_SPLIT}
            and parts[0].get("behavior") == "Isolated" and not parts[0].get("invert")
            and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)
            and not parts[1].get("add_prefix_space")):
        return "llama-bpe"
    digits = len(parts) == 2 and (parts[0] == {"type": "Digits", "individual_digits": True} or (
        parts[0].get("type") == "Split" and parts[0].get("pattern") == {"Regex": r"\p{N}"}
        and parts[0].get("behavior") == "Isolated" and not parts[0].get("invert")))
    if (digits and parts[1].get("type") == "ByteLevel" and parts[1].get("use_regex", True)
            and not parts[1].get("add_prefix_space")):
        return "smollm"  # each digit alone, then GPT-2's rule (SmolLM2's tokenizer.json)
    raise GGUFError(f"the tokenizer splits text with {json.dumps(pre)[:200]}, which is none of Llama 3's rule "
                    "(llama.cpp's 'llama-bpe'), GPT-2's ('gpt-2') or SmolLM's ('smollm'): llama.cpp would split "
                    "text differently")


def _check_whole_words(tokenizer: Tokenizer, spec: dict, pre: str) -> None:
    """llama.cpp's llama-bpe reads a word that is itself a token as that token (tokenizers' ignore_merges); its
    other splits apply the merges to every word. A tokenizer that does otherwise than llama.cpp will for its split
    must give the same ids for every token's own text, or the two would differ."""
    ignores = PRE_TOKENIZERS[pre][1]  # what llama.cpp does with this split
    if bool(spec["model"].get("ignore_merges")) == ignores:
        return
    import tokenizers

    twin_spec = json.loads(json.dumps(spec))
    twin_spec["model"]["ignore_merges"] = ignores
    twin = tokenizers.Tokenizer.from_str(json.dumps(twin_spec))
    texts = [tokenizer.tok.decode([i]) for i in spec["model"]["vocab"].values()]
    ours = tokenizer.tok.encode_batch(texts, add_special_tokens=False)
    theirs = twin.encode_batch(texts, add_special_tokens=False)
    for text, a, b in zip(texts, ours, theirs, strict=True):
        if a.ids != b.ids:
            rule = ("reads a whole-word token as itself" if ignores
                    else f"applies the merges to every word with the {pre!r} split")
            fix = "set ignore_merges" if ignores else "unset ignore_merges"
            raise GGUFError(f"the tokenizer encodes {text!r} as {a.ids}, llama.cpp (which {rule}) as {b.ids}: "
                            f"{fix} in tokenizer.json, or retrain it")


def _check_added_tokens(spec: dict) -> None:
    """llama.cpp matches an added token's text exactly: one that strips the spaces beside it or matches whole words
    only (tokenizers' lstrip, rstrip, single_word) would give other ids there."""
    for a in spec.get("added_tokens", []):
        flags = [f for f in ("lstrip", "rstrip", "single_word") if a.get(f)]
        if flags:
            raise GGUFError(f"the added token {a['content']!r} (id {a['id']}) has {' and '.join(flags)} set in "
                            "tokenizer.json; llama.cpp matches added tokens exactly, so the two would split text "
                            "around it differently")


def gguf_vocab(tokenizer: Tokenizer, vocab_size: int) -> dict:
    """The tokenizer.ggml.* values: tokens [vocab_size], token_type, merges ("a b"), pre, bos and eos ids."""
    spec = json.loads(tokenizer.tok.to_str())
    pre = pre_tokenizer_name(spec)
    _check_whole_words(tokenizer, spec, pre)
    _check_added_tokens(spec)
    tokens: list[str | None] = [None] * vocab_size
    types = [UNUSED] * vocab_size
    entries = [(i, t, UNUSED if i in tokenizer.unused_ids else NORMAL) for t, i in spec["model"]["vocab"].items()]
    entries += [(a["id"], a["content"], CONTROL if a.get("special") else USER_DEFINED)
                for a in spec.get("added_tokens", [])]
    for i, text, kind in entries:
        if not 0 <= i < vocab_size:
            raise GGUFError(f"token {text!r} has id {i}, outside the model's vocabulary of {vocab_size}")
        tokens[i], types[i] = text, kind
    tokens = [f"[PAD{i}]" if t is None else t for i, t in enumerate(tokens)]  # llama.cpp's converter's name
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return {"pre": pre, "tokens": tokens, "types": types, "merges": merges, "bos": tokenizer.bos_id,
            "eos": _eos_id(tokenizer)}


def _eos_id(tokenizer: Tokenizer) -> int | None:
    """The one eos id a GGUF file holds: the tokenizer's named eos_token where it has one (a chat template's
    {{ eos_token }}, Llama 3.1 Instruct's <|eot_id|>; llama.cpp's converter writes the same) where it is one of its
    ends, else its first end."""
    named = tokenizer.named_tokens.get("eos_token")
    if named is not None and (i := tokenizer.tok.token_to_id(named)) in tokenizer.eos_ids:
        return i  # one of the ends: the loaded file stops where the tokenizer did
    return tokenizer.eos_ids[0] if tokenizer.eos_ids else None


# ---- the file --------------------------------------------------------------------------------------------
def export_gguf(model: Llama, tokenizer: Tokenizer, path: str | os.PathLike, dtype: str | None = None,
                name: str | None = None) -> Path:
    """Write `model` and `tokenizer` to the GGUF file `path`; return the path.

    `dtype`: "f32", "bf16" or "f16" for the matrices and the embedding (None: `default_dtype`, the checkpoint's
    own where that rounds nothing, else f32); norms stay float32, an int8 model's matrices are Q8_0. The model's
    sampling defaults (generation_config) go in as general.sampling.*. Everything is checked and converted
    before the file is opened; the file appears whole or not at all."""
    if dtype is None:
        dtype = default_dtype(model)
    if dtype not in DTYPES:
        raise GGUFError(f"unknown GGUF dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    path = check_output_path(path, "GGUF")
    gguf = _gguf()
    c = model.config
    vocab = gguf_vocab(tokenizer, c.vocab_size)
    tensors = gguf_tensors(model, dtype)
    quantised = any(kind == "Q8_0" for _, kind in tensors.values())
    sampling = sampling_fields(getattr(model, "generation_config", None) or {})
    file_type = "MOSTLY_Q8_0" if quantised else DTYPES[dtype][2]

    with atomic_write(path) as tmp:
        w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        w.add_name(name or path.stem)
        w.add_file_type(int(getattr(gguf.LlamaFileType, file_type)))
        w.add_vocab_size(c.vocab_size)
        w.add_context_length(c.max_seq_len)
        w.add_embedding_length(c.dim)
        w.add_block_count(c.n_layers)
        w.add_feed_forward_length(c.hidden_dim)
        w.add_head_count(c.n_heads)
        w.add_head_count_kv(c.n_kv_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_dimension_count(c.head_dim)
        w.add_rope_freq_base(float(c.rope_theta))
        w.add_layer_norm_rms_eps(float(c.norm_eps))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(vocab["pre"])
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        w.add_token_merges(vocab["merges"])
        if vocab["bos"] is not None:
            w.add_bos_token_id(vocab["bos"])
        if vocab["eos"] is not None:
            w.add_eos_token_id(vocab["eos"])
        w.add_add_bos_token(tokenizer.add_bos)  # whether llmstep's encode(text) starts with bos
        w.add_add_eos_token(False)
        if tokenizer.chat_template is not None:
            w.add_chat_template(tokenizer.chat_template)
        elif tokenizer.has_chat_format:
            w.add_chat_template(CHAT_TEMPLATE)
        for key, value in sampling.items():  # llama.cpp's types: top_k int32, the others float32
            (w.add_int32 if key.endswith("top_k") else w.add_float32)(key, value)
        for tensor_name, (array, kind) in tensors.items():
            w.add_tensor(tensor_name, array, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        except OSError as e:  # numpy's tofile says only "N requested and M written" when the disk is full
            raise OSError(e.errno, f"cannot write {path}: {e.strerror or e} (is its disk full?); nothing was "
                          "written there") from None
    return path

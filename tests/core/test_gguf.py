"""GGUF export (llmstep.core.gguf): the file read back with the gguf package holds llmstep's weights in the dtype
asked for (once llama.cpp's q/k row order is undone), the config as llama.cpp's keys, and a tokenizer that
encodes text to llmstep's ids; a forward pass that reads the file the way llama.cpp does (neighbouring pairs
rotated, rope_freqs dividing the speeds) gives llmstep's logits; bad input is refused before anything is written."""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import pytest
import tomllib
import torch
from gguf_oracle import llama_cpp_greedy, random_llama

import llmstep
from llmstep.core.config import LlamaConfig, RopeScaling
from llmstep.core.gguf import (
    CHAT_TEMPLATE,
    GGUF_NAMES,
    LLAMA3_SPLIT,
    GGUFError,
    export_gguf,
    from_interleaved,
    rope_freq_factors,
    to_interleaved,
)
from llmstep.core.model import Llama
from llmstep.core.quantize import quantize
from llmstep.core.tokens import Tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'llmstep[export]')")
ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ["ROMEO:\nBut soft, what light through yonder window breaks?", "  two  spaces,\ttabs\n\nand 12345 digits",
           "Naïve café, 東京 🙂", "<|begin_of_text|>KING:<|eot_id|><|start_header_id|>x<|end_header_id|>", "'s 'LL 'd"]


# ---- reading a file back ---------------------------------------------------------------------------------
def fields(reader) -> dict:
    return {name: f.contents() for name, f in reader.fields.items()}


def tensors(reader) -> dict[str, tuple[str, torch.Tensor]]:
    """GGUF name -> (GGML type name, float32 values in numpy's order)."""
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = (t.tensor_type.name, torch.from_numpy(values.copy()).float().reshape(
            [int(n) for n in reversed(t.shape.tolist())]))
    return out


def expected_weights(model: Llama) -> dict[str, torch.Tensor]:
    """GGUF name -> llmstep's weight, in llmstep's row order."""
    c, state = model.config, model.state_dict()
    names = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    for i in range(c.n_layers):
        for ours, theirs in GGUF_NAMES.items():
            if "{i}" in ours:
                names[theirs.format(i=i) + ".weight"] = ours.format(i=i) + ".weight"
    if not c.tie_embeddings:
        names["output.weight"] = "output.weight"
    return {theirs: state[ours] for theirs, ours in names.items()}


def check_weights(model: Llama, path: Path, dtype: str) -> dict:
    reader = gguf.GGUFReader(path)
    found = tensors(reader)
    want = expected_weights(model)
    rope = {"rope_freqs.weight"} if model.config.rope_scaling is not None else set()
    assert set(found) == set(want) | rope
    c = model.config
    for name, w in want.items():
        kind, got = found[name]
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            got = from_interleaved(got, c.n_heads if "attn_q" in name else c.n_kv_heads)
        torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[kind]
        assert kind == ("F32" if w.dim() == 1 else dtype.upper()), name
        assert torch.equal(got, w.to(torch_dtype).float()), name
    return fields(reader)


def rebuilt_tokenizer(f: dict):
    """A tokenizers BPE made from the file's tokenizer.ggml.* alone, splitting text as llama.cpp does."""
    import tokenizers

    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    typed = list(enumerate(zip(tokens, types, strict=True)))  # (id, (text, type))
    llama3 = f["tokenizer.ggml.pre"] == "llama-bpe"
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": not llama3}
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False}, byte_level,
    ]} if llama3 else byte_level
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "pre_tokenizer": pre,
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                             "use_regex": True},
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, (t, k) in typed if k == 3],
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": llama3,  # llama.cpp's llama-bpe reads a whole-word token as itself
                  "vocab": {t: i for i, (t, k) in typed if k == 1},
                  "merges": [m.split(" ") for m in f["tokenizer.ggml.merges"]]},
    }
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def check_tokenizer(f: dict, tokenizer: Tokenizer, texts: list[str]) -> None:
    rebuilt = rebuilt_tokenizer(f)
    for text in texts:
        assert rebuilt.encode(text, add_special_tokens=False).ids == tokenizer.encode(text, bos=False), text
    assert f["tokenizer.ggml.bos_token_id"] == tokenizer.bos_id
    assert f["tokenizer.ggml.eos_token_id"] == tokenizer.eos_ids[0]
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False
    for token, i in tokenizer.special_tokens.items():
        assert f["tokenizer.ggml.tokens"][i] == token and f["tokenizer.ggml.token_type"][i] == 3


def check_config(f: dict, c: LlamaConfig) -> None:
    assert f["general.architecture"] == "llama" and f["tokenizer.ggml.model"] == "gpt2"
    assert (f["llama.vocab_size"], f["llama.context_length"], f["llama.embedding_length"], f["llama.block_count"],
            f["llama.feed_forward_length"], f["llama.attention.head_count"], f["llama.attention.head_count_kv"],
            f["llama.attention.key_length"], f["llama.rope.dimension_count"]) == (
        c.vocab_size, c.max_seq_len, c.dim, c.n_layers, c.hidden_dim, c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim)
    assert f["llama.rope.freq_base"] == pytest.approx(c.rope_theta, rel=1e-7)  # stored as float32
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(c.norm_eps, rel=1e-7)
    assert len(f["tokenizer.ggml.tokens"]) == len(f["tokenizer.ggml.token_type"]) == c.vocab_size


# ---- models ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    return llmstep.load("target", device="cpu", dtype="float32")


def tiny_model(vocab_size: int, **overrides) -> Llama:
    """A random GQA model (8 query heads over 2 kv heads), untied head, Llama 3.1 rope scaling, norms not 1."""
    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=16)
    return random_llama(vocab_size=vocab_size, **({"rope_scaling": scaling} | overrides))


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_the_shipped_model_reads_back_with_every_tensor_its_config_and_its_tokenizer(shipped, tmp_path, dtype):
    model, tokenizer = shipped
    path = export_gguf(model, tokenizer, tmp_path / "shakespeare.gguf", dtype=dtype)
    f = check_weights(model, path, dtype)
    check_config(f, model.config)
    assert f["general.file_type"] == {"f32": 0, "f16": 1, "bf16": 32}[dtype]
    assert f["tokenizer.ggml.pre"] == "llama-bpe"
    with gzip.open(ROOT / "data" / "corpus" / "val.txt.gz", "rt", encoding="utf-8") as held_out:
        texts = SAMPLES + [held_out.read(20_000)]
    check_tokenizer(f, tokenizer, texts)


def test_the_chat_template_spells_the_tokenizers_chat_format(shipped, tmp_path):
    jinja2 = pytest.importorskip("jinja2")
    model, tokenizer = shipped
    f = fields(gguf.GGUFReader(export_gguf(model, tokenizer, tmp_path / "m.gguf")))
    messages = [{"role": "system", "content": " Speak as the Bard. "}, {"role": "user", "content": "Who art thou?\n"}]
    template = jinja2.Environment().from_string(f["tokenizer.chat_template"])
    for prompt in (True, False):
        rendered = template.render(messages=messages, add_generation_prompt=prompt, bos_token="<|begin_of_text|>")
        assert rendered == tokenizer.chat(messages, add_generation_prompt=prompt)


def test_the_default_dtype_is_the_checkpoints_own_so_nothing_is_rounded(shipped, tmp_path):
    model, tokenizer = shipped  # config.json: torch_dtype bfloat16
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf")
    check_weights(model, path, "bf16")


def test_a_random_gqa_model_with_untied_head_and_llama3_scaling_reads_back(tmp_path, tokenizer_file):
    tokenizer = Tokenizer.from_file(tokenizer_file)  # byte-level BPE with GPT-2's split: llama.cpp's "gpt-2"
    model = tiny_model(tokenizer.vocab_size)
    path = export_gguf(model, tokenizer, tmp_path / "tiny.gguf", dtype="f32")
    f = check_weights(model, path, "f32")
    check_config(f, model.config)
    assert f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.chat_template"] == CHAT_TEMPLATE  # the fixture's tokenizer has the chat tokens
    check_tokenizer(f, tokenizer, SAMPLES)


def test_rope_freqs_are_the_factors_llama_cpps_converter_computes(tmp_path, tokenizer_file):
    """llama.cpp divides pair i's speed by rope_freqs[i]; its converter's formula, written out here, is what
    llmstep's scaled frequencies imply."""
    tokenizer = Tokenizer.from_file(tokenizer_file)
    model = tiny_model(tokenizer.vocab_size, n_heads=2, n_kv_heads=1,  # head_dim 32: 16 pairs
                       rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64))
    s, c = model.config.rope_scaling, model.config
    expected = []
    for i in range(c.head_dim // 2):
        wavelen = 2 * math.pi * c.rope_theta ** (2 * i / c.head_dim)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        expected.append(1.0 if wavelen < s.original_max_position_embeddings / s.high_freq_factor else
                        s.factor if wavelen > s.original_max_position_embeddings / s.low_freq_factor else
                        1 / ((1 - smooth) / s.factor + smooth))
    assert {1.0, s.factor} < set(expected)  # kept, scaled and interpolated pairs
    torch.testing.assert_close(rope_freq_factors(c), torch.tensor(expected), rtol=1e-5, atol=0)
    path = export_gguf(model, tokenizer, tmp_path / "tiny.gguf", dtype="f32")
    _, got = tensors(gguf.GGUFReader(path))["rope_freqs.weight"]
    assert torch.equal(got, rope_freq_factors(c))
    assert rope_freq_factors(c.replace(rope_scaling=None)) is None


def llama_cpp_forward(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] computed from the file alone, as llama.cpp's llama graph reads it (float64): RMSNorm,
    RoPE on neighbouring pairs (2i, 2i + 1) at base^(-2i/d) / rope_freqs[i], causal GQA, SwiGLU."""
    reader = gguf.GGUFReader(path)
    f, w = fields(reader), {k: v.double() for k, (_, v) in tensors(reader).items()}
    n_heads, n_kv, d = f["llama.attention.head_count"], f["llama.attention.head_count_kv"], \
        f["llama.rope.dimension_count"]
    eps, base = f["llama.attention.layer_norm_rms_epsilon"], f["llama.rope.freq_base"]

    def norm(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    T = len(ids)
    speeds = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) / w.get("rope_freqs.weight", 1.0)
    angle = torch.arange(T, dtype=torch.float64)[:, None, None] * speeds  # [T, 1, d/2]

    def rope(x):  # x [T, heads, d]: pairs are neighbours
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * angle.cos() - x1 * angle.sin(), x0 * angle.sin() + x1 * angle.cos()], -1).flatten(2)

    x = w["token_embd.weight"][ids]
    for i in range(f["llama.block_count"]):
        b = {name.split(".")[2]: v for name, v in w.items() if name.startswith(f"blk.{i}.")}.__getitem__
        h = norm(x, b("attn_norm"))
        q = rope((h @ b("attn_q").T).view(T, n_heads, d)).transpose(0, 1)
        k = rope((h @ b("attn_k").T).view(T, n_kv, d)).repeat_interleave(n_heads // n_kv, 1).transpose(0, 1)
        v = (h @ b("attn_v").T).view(T, n_kv, d).repeat_interleave(n_heads // n_kv, 1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d) + torch.full((T, T), -math.inf).triu(1)
        x = x + (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1) @ b("attn_output").T
        h = norm(x, b("ffn_norm"))
        x = x + (torch.nn.functional.silu(h @ b("ffn_gate").T) * (h @ b("ffn_up").T)) @ b("ffn_down").T
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, w["output_norm.weight"]) @ head.T


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_forward_that_reads_the_file_as_llama_cpp_does_gives_llmsteps_logits(tmp_path, tokenizer_file, tied):
    tokenizer = Tokenizer.from_file(tokenizer_file)
    model = tiny_model(tokenizer.vocab_size, tie_embeddings=tied)
    path = export_gguf(model, tokenizer, tmp_path / "tiny.gguf", dtype="f32")
    ids = tokenizer.encode(SAMPLES[0])[:40]  # past original_max_position_embeddings (16): the scaling matters
    expected = model(torch.tensor([ids]))[0].double()
    torch.testing.assert_close(llama_cpp_forward(path, ids), expected, rtol=1e-4, atol=1e-4)
    assert ("output.weight" in {t.name for t in gguf.GGUFReader(path).tensors}) is not tied


def test_an_int8_model_with_float16_scales_is_written_as_q8_0_exactly(tmp_path, tokenizer_file):
    tokenizer = Tokenizer.from_file(tokenizer_file)
    model = quantize(tiny_model(tokenizer.vocab_size).to(torch.bfloat16), "int8", kernel="dequant")
    path = export_gguf(model, tokenizer, tmp_path / "q8.gguf", dtype="bf16")
    reader = gguf.GGUFReader(path)
    assert fields(reader)["general.file_type"] == 7  # MOSTLY_Q8_0
    found = tensors(reader)
    for i in range(model.config.n_layers):
        m = model.layers[i].attention.wq
        kind, got = found[f"blk.{i}.attn_q.weight"]
        assert kind == "Q8_0"
        assert torch.equal(from_interleaved(got, model.config.n_heads), m.weight.float() * m.scales.float()[:, None])
        kind, got = found[f"blk.{i}.ffn_down.weight"]
        m = model.layers[i].feed_forward.w2
        assert kind == "Q8_0" and torch.equal(got, m.weight.float() * m.scales.float()[:, None])
    assert found["token_embd.weight"][0] == "BF16" and found["output.weight"][0] == "BF16"


def test_an_int8_row_of_zero_codes_is_exact_whatever_its_scale(tmp_path, tokenizer_file):
    """Quantisation gives an all-zero row a scale of 1e-12, which float16 cannot hold: the row is exact anyway
    (d = 0), where a nonzero row with that scale is refused."""
    tokenizer = Tokenizer.from_file(tokenizer_file)
    float_model = tiny_model(tokenizer.vocab_size).to(torch.bfloat16)
    with torch.no_grad():
        float_model.layers[0].feed_forward.w2.weight[3] = 0
    model = quantize(float_model, "int8", kernel="dequant")
    w2 = model.layers[0].feed_forward.w2
    assert float(w2.scales[3]) < 1e-10 and not w2.weight[3].any()
    found = tensors(gguf.GGUFReader(export_gguf(model, tokenizer, tmp_path / "q8.gguf", dtype="bf16")))
    kind, got = found["blk.0.ffn_down.weight"]
    assert kind == "Q8_0" and torch.equal(got, w2.weight.float() * w2.scales.float().masked_fill(
        ~w2.weight.ne(0).any(1), 0)[:, None]) and not got[3].any()
    with torch.no_grad():
        w2.weight[3, 0] = 1  # a code beside the tiny scale: float16 would round it to 0
    with pytest.raises(GGUFError, match=r"row 3's scale .* is not a float16 number.*outside float16's range"):
        export_gguf(model, tokenizer, tmp_path / "bad.gguf", dtype="bf16")


def test_interleaving_moves_each_heads_pairs_next_to_each_other():
    w = torch.arange(2 * 8).float()[:, None]  # 2 heads of head_dim 8: rows 0..15
    moved = to_interleaved(w, n_heads=2)[:, 0].tolist()
    assert moved == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]  # pair (i, i + 4) -> rows (2i, 2i + 1)
    assert torch.equal(from_interleaved(to_interleaved(w, 2), 2), w)


# ---- bad input: refused before anything is written -------------------------------------------------------
@pytest.fixture
def tiny(tokenizer_file):
    tokenizer = Tokenizer.from_file(tokenizer_file)
    return tiny_model(tokenizer.vocab_size), tokenizer


def test_an_unknown_dtype_is_refused_with_the_choices(tiny, tmp_path):
    with pytest.raises(GGUFError, match=r"unknown GGUF dtype 'q4_k': use one of f32, bf16, f16"):
        export_gguf(*tiny, tmp_path / "m.gguf", dtype="q4_k")
    assert not (tmp_path / "m.gguf").exists()


def test_an_output_path_that_is_a_directory_is_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        export_gguf(*tiny, tmp_path)


def test_an_int4_model_is_refused_naming_what_is_supported(tiny, tmp_path):
    model, tokenizer = tiny
    quantize(model, "int4", group_size=32, kernel="dequant")
    with pytest.raises(GGUFError, match=r"layers\.0\.attention\.wq is int4.*float checkpoint, or an int8 one"):
        export_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_int8_scales_that_float16_cannot_hold_are_refused(tiny, tmp_path):
    model, tokenizer = tiny  # float32 scales: Q8_0's float16 d would round them
    quantize(model, "int8", kernel="dequant")
    with pytest.raises(GGUFError, match="is not a float16 number"):
        export_gguf(model, tokenizer, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_weights_too_large_for_float16_are_refused_naming_the_tensor(tiny, tmp_path):
    model, tokenizer = tiny
    model.layers[1].feed_forward.w2.weight[0, 0] = 1e6
    with pytest.raises(GGUFError, match=r"layers\.1\.feed_forward\.w2 .*too large for float16"):
        export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f16")
    export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="bf16")  # bf16 has float32's range


def test_a_tokenizer_llama_cpp_would_split_differently_is_refused(tiny, tmp_path):
    import tokenizers

    model, tokenizer = tiny
    spec = json.loads(tokenizer.tok.to_str())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    other = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))
    with pytest.raises(GGUFError, match="none of Llama 3's rule"):
        export_gguf(model, other, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_a_llama3_tokenizer_that_differs_on_whole_word_tokens_is_refused(tmp_path):
    """llama.cpp's llama-bpe reads a word that is a token as that token; BPE by merges may not reach it."""
    import tokenizers

    letters = {c: i for i, c in enumerate("abc")}
    spec = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
            "added_tokens": [],
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "ignore_merges": False, "vocab": letters | {"bc": 3, "ab": 4, "abc": 5},
                      "merges": [["b", "c"], ["a", "b"], ["ab", "c"]]}}  # "abc" by merges: a + bc
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))
    model = tiny_model(6)
    with pytest.raises(GGUFError, match=r"encodes 'abc' as \[0, 3\], llama.cpp .* as \[5\]"):
        export_gguf(model, tokenizer, tmp_path / "m.gguf")
    spec["model"]["ignore_merges"] = True
    export_gguf(model, Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec))), tmp_path / "m.gguf")


def test_a_gpt2_split_tokenizer_that_ignores_merges_is_refused_where_llama_cpp_would_merge(tmp_path):
    """With the GPT-2 and SmolLM splits llama.cpp applies the merges to every word: a tokenizer that takes a
    whole-word token as itself (ignore_merges) while merges would not reach it gives other ids there."""
    import tokenizers

    letters = {c: i for i, c in enumerate("abc")}
    spec = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
            "added_tokens": [],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "ignore_merges": True, "vocab": letters | {"bc": 3, "abc": 4},
                      "merges": [["b", "c"]]}}  # "abc" is a token no merge makes
    model = tiny_model(5)
    with pytest.raises(GGUFError, match=r"encodes 'abc' as \[4\], llama.cpp \(which applies the merges .*'gpt-2'.* "
                                        r"as \[0, 3\]: unset ignore_merges"):
        export_gguf(model, Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec))), tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []
    spec["model"]["ignore_merges"] = False
    export_gguf(model, Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec))), tmp_path / "m.gguf")


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_an_added_token_that_strips_spaces_or_matches_whole_words_is_refused(tiny, tmp_path, flag):
    import tokenizers

    model, tokenizer = tiny
    spec = json.loads(tokenizer.tok.to_str())
    spec["added_tokens"][-1][flag] = True
    other = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)), tokenizer.bos_id, tokenizer.eos_ids)
    with pytest.raises(GGUFError, match=rf"added token {re.escape(repr(spec['added_tokens'][-1]['content']))} "
                                        rf"\(id \d+\) has {flag} set"):
        export_gguf(model, other, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_the_file_s_eos_is_the_tokenizer_s_named_eos_token(tiny, tmp_path):
    """Llama 3.1 Instruct: generation ends at <|end_of_text|> or <|eot_id|>, and its eos_token (the one a chat
    template writes) is <|eot_id|>: the file's one eos is that, as llama.cpp's converter writes it."""
    model, tokenizer = tiny
    first, second = tokenizer.eos_ids[0], tokenizer.vocab_size - 1
    named = tokenizer.tok.id_to_token(second)
    other = Tokenizer(tokenizer.tok, tokenizer.bos_id, [first, second],
                      named_tokens={"bos_token": tokenizer.tok.id_to_token(tokenizer.bos_id), "eos_token": named},
                      chat_template="{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    assert second != first
    path = export_gguf(model, other, tmp_path / "m.gguf")
    assert fields(gguf.GGUFReader(str(path)))["tokenizer.ggml.eos_token_id"] == second
    _, back = llmstep.load(path, device="cpu")
    assert back.chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == f"hi{named}"
    assert export_gguf(model, Tokenizer(tokenizer.tok, tokenizer.bos_id, [first, second]), tmp_path / "n.gguf")
    assert fields(gguf.GGUFReader(str(tmp_path / "n.gguf")))["tokenizer.ggml.eos_token_id"] == first  # unnamed
    elsewhere = Tokenizer(tokenizer.tok, tokenizer.bos_id, [first], named_tokens={"eos_token": named})
    export_gguf(model, elsewhere, tmp_path / "o.gguf")  # a named eos that ends nothing: the file keeps the end
    assert fields(gguf.GGUFReader(str(tmp_path / "o.gguf")))["tokenizer.ggml.eos_token_id"] == first


def test_without_the_gguf_package_the_error_says_how_to_install_it(tiny, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(GGUFError, match=r"pip install 'llmstep\[export\]'"):
        export_gguf(*tiny, tmp_path / "m.gguf")


def test_a_failed_write_leaves_the_old_file_whole(tiny, tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"the old file")

    def boom(self, *args, **kwargs):
        raise OSError("3145728 requested and 913344 written")  # numpy's tofile on a full disk

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(OSError, match=rf"cannot write {path}: 3145728 requested and 913344 written \(is its disk "
                                      r"full\?\); nothing was written there"):
        export_gguf(*tiny, path)
    assert path.read_bytes() == b"the old file" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_the_gguf_package_is_installed_with_llmstep_so_ci_tests_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["optional-dependencies"]["export"]) <= set(project["dependencies"])


# ---- llama.cpp itself, where it is installed -------------------------------------------------------------
def test_llama_cpp_generates_llmsteps_greedy_tokens_from_the_exported_shipped_model(shipped, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                    "llama-cpp-python, a long compile): the exported file is checked above by a "
                                    "forward written the way llama.cpp reads it")
    model, tokenizer = shipped
    path = export_gguf(model, tokenizer, tmp_path / "shakespeare.gguf", dtype="f32")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, seed=0)
    prompt = "ROMEO:\nBut soft, what light"
    ids = tokenizer.encode(prompt)
    assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == ids
    expected, context = [], list(ids)
    for _ in range(32):  # llmstep's greedy continuation, one full forward per token (exact, no cache)
        context.append(int(model(torch.tensor([context]))[0, -1].argmax()))
        expected.append(context[-1])
    assert llama_cpp_greedy(llm, ids, len(expected)) == expected

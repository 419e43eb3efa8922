"""GGUF import (llmstep.core.gguf_load, gguf_vocab): files the tests write with the gguf package, in every tensor
type the loader reads, load into the function transformers' LlamaForCausalLM computes from the same dequantized
weights; q/k rows come back in llmstep's order (undone here independently, as GGUF-NOTES describes); Q4_0/Q4_1
kept as int4 hold the file's codes and weights; the tokenizer gives the ids the file's tokenizer gave; every
refusal comes before a weight is read."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from gguf_oracle import assert_close_rel, random_llama, reference_logits

import llmstep
from llmstep.core.config import RopeScaling
from llmstep.core.gguf import export_gguf, gguf_tensors, gguf_vocab
from llmstep.core.gguf_load import TYPES, GGUFLoadError, load_gguf, read_gguf, rope_scaling_of
from llmstep.core.gguf_vocab import GGUFVocabError
from llmstep.core.int4a8 import with_activations
from llmstep.core.model import Llama
from llmstep.core.quantize import Int4Linear, quantize_lm_head, unpack_int4
from llmstep.core.rope import inv_frequencies
from llmstep.core.tokens import Tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
SAMPLES = ["ROMEO:\nBut soft, what light through yonder window breaks?", "  two  spaces,\ttabs\n\nand 12345 digits",
           "Naïve café, 東京 🙂", "<|begin_of_text|>KING:<|eot_id|>", "'s 'LL 'd", "x = f(y) + 3.14159;  # code"]
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # 256 weights a block; gguf-py dequantizes, cannot quantize


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_file)


def write_gguf(path, model: Llama, tokenizer: Tokenizer, kind: str, arch: str = "llama", fields: dict | None = None,
               tensors: dict | None = None, n_tokens: int | None = None, head_kind: str | None = None,
               omit: tuple[str, ...] = ()):
    """A GGUF file as llama.cpp's converter lays it out (names, q/k rows, metadata), its matrices in `kind` (the LM
    head in `head_kind` if given: output.weight, or token_embd.weight where it is tied). Types gguf-py can quantize
    are quantized from the model; the K-quants get random blocks (scales kept small). omit: metadata keys (after
    the architecture's name) left out."""
    c = model.config
    arrays = gguf_tensors(model, "f32") if tensors is None else tensors
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": c.n_layers, "context_length": c.max_seq_len, "embedding_length": c.dim,
            "feed_forward_length": c.hidden_dim, "attention.head_count": c.n_heads,
            "attention.head_count_kv": c.n_kv_heads, "rope.freq_base": float(c.rope_theta),
            "attention.layer_norm_rms_epsilon": float(c.norm_eps), "vocab_size": c.vocab_size}
    for key, value in ((k, v) for k, v in meta.items() if k not in omit):
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    vocab = gguf_vocab(tokenizer, n_tokens or c.vocab_size)  # n_tokens: fewer than the embedding's rows
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_add_bos_token(True)
    for key, value in (fields or {}).items():
        add = {str: w.add_string, bool: w.add_bool, float: w.add_float32}.get(type(value), w.add_uint32)
        add(key, value)
    qtype = gguf.GGMLQuantizationType[kind]
    head = "output.weight" if "output.weight" in arrays else "token_embd.weight"
    for name, (array, _) in arrays.items():
        if array.ndim == 1 or (name == head and head_kind == "F32"):
            w.add_tensor(name, array)
        elif name == head and head_kind is not None:
            w.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType[head_kind]),
                         raw_dtype=gguf.GGMLQuantizationType[head_kind])
        elif kind in K_QUANTS:
            rows, cols = array.shape
            nbytes = gguf.quants.quant_shape_to_byte_shape((rows, cols), qtype)
            blocks = rng.integers(0, 0x3C, size=nbytes, dtype=np.uint8)  # every float16 in a block stays finite
            w.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the function the file describes --------------------------------------------------------------------
@pytest.mark.parametrize("kind", TYPES[1:])  # F32 is the next test's round trip
def test_every_tensor_type_loads_as_the_function_of_its_dequantized_weights(tmp_path, tokenizer, kind):
    wide = kind in K_QUANTS  # K-quant blocks hold 256 weights: every row must be a multiple of 256 wide
    model = random_llama(**(dict(dim=256, hidden_dim=256, n_heads=4, n_kv_heads=2, n_layers=1) if wide else {}))
    path = write_gguf(tmp_path / f"{kind}.gguf", model, tokenizer, kind)
    loaded, _ = load_gguf(path, device="cpu", dtype=torch.float32)
    ids = tokenizer.encode(SAMPLES[0])[:24]
    got = loaded(torch.tensor([ids]))[0]
    assert_close_rel(got, reference_logits(path, ids))
    assert loaded.config.n_kv_heads == model.config.n_kv_heads and loaded.config.tie_embeddings is False


@pytest.mark.parametrize("case", ["gqa-llama31-scaling", "mqa", "mha-tied"])
def test_an_exported_model_comes_back_as_the_same_function(tmp_path, tokenizer, case):
    overrides = {"gqa-llama31-scaling": dict(rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16)),
                 "mqa": dict(n_kv_heads=1), "mha-tied": dict(n_kv_heads=8, tie_embeddings=True)}[case]
    model = random_llama(**overrides)
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    loaded, tok = llmstep.load(path, device="cpu", dtype="float32")
    for name, value in model.state_dict().items():  # every weight bit for bit, q/k rows in llmstep's order
        assert torch.equal(loaded.state_dict()[name], value), name
    assert torch.allclose(loaded.inv_freq, model.inv_freq, rtol=1e-6, atol=0)
    c, d = loaded.config, model.config
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.tie_embeddings, c.norm_eps) == \
           (d.n_heads, d.n_kv_heads, d.head_dim, d.tie_embeddings, pytest.approx(d.norm_eps))
    ids = tokenizer.encode(SAMPLES[1])
    assert torch.equal(loaded(torch.tensor([ids])), model(torch.tensor([ids])))
    assert [tok.encode(s) for s in SAMPLES] == [tokenizer.encode(s) for s in SAMPLES]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_half_precision_files_load_their_own_values(tmp_path, tokenizer, dtype):
    model = random_llama()
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype=dtype)
    half = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    loaded, _ = llmstep.load(path, device="cpu", dtype="float32")
    w = model.layers[1].feed_forward.w2.weight
    assert torch.equal(loaded.layers[1].feed_forward.w2.weight, w.to(half).float())
    assert loaded.config.torch_dtype == {"bf16": "bfloat16", "f16": "float16"}[dtype]


def test_a_linear_factor_of_one_and_add_eos_false_change_nothing(tmp_path, tokenizer):
    model = random_llama()
    path = write_gguf(tmp_path / "x.gguf", model, tokenizer, "F32", fields={
        "llama.rope.scaling.factor": 1.0, "tokenizer.ggml.add_eos_token": False})
    loaded, tok = load_gguf(path)
    assert loaded.config.rope_scaling is None and loaded.config.norm_eps == 1e-5  # the float32 key read as 1e-05
    assert tok.encode("hello", bos=False) == tokenizer.encode("hello", bos=False)


def bare_gguf(path, fields: dict, embedding: tuple[int, int], **writer_options):
    """A GGUF file of a few uint32 llama.* keys and a zero token_embd.weight: metadata a test refuses."""
    w = gguf.GGUFWriter(str(path), "llama", **writer_options)
    for key, value in fields.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros(embedding, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_big_endian_file_is_refused_before_its_weights_are_read(tmp_path, no_weight_read):
    path = bare_gguf(tmp_path / "be.gguf", {"block_count": 1}, (4, 8), endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(GGUFLoadError, match="be.gguf is a big-endian GGUF file"):
        load_gguf(path)


def test_llama31_rope_scaling_is_recovered_from_rope_freqs_wherever_the_rule_has_room():
    """Settings where one pair or none lies between the kept and the slowed pairs leave the limits free within a
    range (any of them gives the same frequencies): each must be recovered, to the factors' precision."""
    for head_dim, theta, factor, high, orig in itertools.product([16, 32, 64, 128], [1e4, 5e5], [2.0, 8.0, 32.0],
                                                                 [2.0, 4.0], [256, 8192]):
        s = RopeScaling(factor=factor, high_freq_factor=high, original_max_position_embeddings=orig)
        want = inv_frequencies(head_dim, theta, s)
        got = rope_scaling_of((inv_frequencies(head_dim, theta) / want).numpy(), head_dim, theta, "test")
        assert torch.allclose(inv_frequencies(head_dim, theta, got), want, rtol=1e-6, atol=0), (head_dim, theta, s)
    every = rope_scaling_of(np.full(32, 8.0), 64, 5e5, "test")  # every pair slowed: orig below the fastest's
    assert torch.allclose(inv_frequencies(64, 5e5, every), inv_frequencies(64, 5e5) / 8, rtol=1e-6, atol=0)
    # limits with little room: no pair between (and a high below the round ones), one pair just under orig
    for head_dim, theta, s in [(128, 5e5, RopeScaling(factor=8.0, high_freq_factor=1.2)),
                               (32, 1e4, RopeScaling(factor=8.0, high_freq_factor=1.5,
                                                     original_max_position_embeddings=11200))]:
        want = inv_frequencies(head_dim, theta, s)
        got = rope_scaling_of((inv_frequencies(head_dim, theta) / want).numpy(), head_dim, theta, "test")
        assert torch.allclose(inv_frequencies(head_dim, theta, got), want, rtol=1e-5, atol=0), (head_dim, theta, s)


def test_llama31_rope_scaling_is_recovered_from_rope_freqs():
    for head_dim, theta, s in [(128, 500000.0, RopeScaling()), (64, 500000.0, RopeScaling(factor=32.0)),
                               (64, 10000.0, RopeScaling(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                                         original_max_position_embeddings=256))]:
        factors = (inv_frequencies(head_dim, theta) / inv_frequencies(head_dim, theta, s)).numpy()
        got = rope_scaling_of(factors, head_dim, theta, "test")
        assert torch.allclose(inv_frequencies(head_dim, theta, got), inv_frequencies(head_dim, theta, s), rtol=1e-5)
    assert rope_scaling_of(np.ones(32), 64, 10000.0, "test") is None
    with pytest.raises(GGUFLoadError, match="Llama 3.1's scaling rule"):
        rope_scaling_of(np.linspace(1, 3, 32)[::-1].copy(), 64, 10000.0, "test")


# ---- Q4_0 / Q4_1 kept as llmstep int4 -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_files_kept_quantized_hold_the_files_codes_and_weights(tmp_path, tokenizer, kind):
    model = random_llama()
    path = write_gguf(tmp_path / f"{kind}.gguf", model, tokenizer, kind)
    kept, _ = load_gguf(path, device="cpu", dtype=torch.float32, keep_quantized=True)
    plain, _ = load_gguf(path, device="cpu", dtype=torch.float32)
    assert str(kept.quantization) == "int4-g32"
    reader = gguf.GGUFReader(str(path))
    blocks = {t.name: np.array(t.data) for t in reader.tensors}
    for i in range(model.config.n_layers):
        m = kept.layers[i].feed_forward.w2
        assert isinstance(m, Int4Linear) and m.group_size == 32
        want = plain.layers[i].feed_forward.w2.weight  # gguf-py's dequantization
        if kind == "Q4_0":
            assert torch.equal(m.dequantized(), want)  # d * (q - 8) either way
        else:
            assert (m.dequantized() - want).abs().max() <= 2 * torch.finfo(torch.float32).eps * want.abs().max()
        # the codes are the file's nibbles: element j of a block in the low nibble of byte j, j + 16 in the high
        raw = blocks[f"blk.{i}.ffn_down.weight"].reshape(m.out_features, -1, 18 if kind == "Q4_0" else 20)
        nib = raw[..., -16:]
        file_codes = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(m.out_features, -1)
        assert np.array_equal(unpack_int4(m.codes()).numpy(), file_codes)
    ids = tokenizer.encode(SAMPLES[2])
    assert_close_rel(kept(torch.tensor([ids]))[0], plain(torch.tensor([ids]))[0], 1e-5)


@pytest.mark.parametrize("mode, tied, head_kind", [("int4-g32+lm_head-int8", False, None),
                                                   ("int4-g32+lm_head", False, None),
                                                   ("int4-g32+lm_head-int8", True, "Q8_0"),
                                                   ("int4-g32+lm_head-int8", True, "F32"),
                                                   ("int4-g32-a8+lm_head-int8", False, None),
                                                   ("int4-g32-a8+lm_head", True, "F32"),
                                                   ("int4-g32-a8+lm_head-int8-a8", True, "Q8_0"),
                                                   ("int4-g32+lm_head-int8-a8", False, None)])
def test_generate_quantizes_the_head_alone_under_kept_blocks(tmp_path, tokenizer, capsys, mode, tied, head_kind):
    """`llmstep generate --keep-quantized --quantize int4-g32+lm_head-int8`: the file's Q4 blocks kept, the LM head
    quantized as `llmstep bench` builds its int4 runs (quantize_lm_head); the text is that model's. A head the file
    holds quantized (Q4_1 as the blocks, Q8_0 tied as SmolLM2's) is rounded again, with a note; a float one is not."""
    from llmstep.cli import main

    model = random_llama(tie_embeddings=tied)
    path = write_gguf(tmp_path / "q4.gguf", model, tokenizer, "Q4_1", head_kind=head_kind)
    argv = ["generate", "--model", str(path), "--keep-quantized", "--prompt", "ROMEO:", "--max-new-tokens", "8",
            "--temperature", "0", "--device", "cpu", "--dtype", "float32"]
    main(argv + ["--quantize", mode])
    out = capsys.readouterr()
    kept, tok = load_gguf(path, device="cpu", dtype=torch.float32, keep_quantized=True)
    blocks, _, head = mode.partition("+lm_head")
    if blocks.endswith("-a8"):  # the file's blocks with 8-bit activations (llmstep.core.int4a8), the head's as named
        with_activations(kept)
        assert all(m.activations == 8 for m in kept.layers.modules() if hasattr(m, "activations"))
    quantize_lm_head(kept, head.removeprefix("-") or True)
    a8_head = head == "-int8-a8" or head == "" and blocks.endswith("-a8")
    assert kept.output.activations == (8 if a8_head else None)
    want = llmstep.generate(kept, tok, "ROMEO:", max_new_tokens=8, temperature=0).text
    assert str(kept.quantization) == mode
    assert out.out == "ROMEO:" + want + "\n"
    assert f"[cpu float32 {mode}]" in out.err
    if head_kind == "F32":
        assert "note:" not in out.err
    else:  # dequantized, then rounded again
        assert f"note: q4.gguf's LM head is {head_kind or 'Q4_1'}: --quantize {mode} rounds" in out.err
    main(argv)  # the kept blocks alone: a float head, more bytes a step
    plain = capsys.readouterr().err
    read = [float(e.split(" MB read per token")[0].rsplit("| ", 1)[1]) for e in (out.err, plain)]
    assert "[cpu float32 int4-g32]" in plain and read[0] < read[1]


@pytest.mark.parametrize("kind, mode, says", [
    ("Q4_1", "int8", r"can only add a quantized LM head to them \(int4-g32\+lm_head-int8, int4-g32\+lm_head-int8-a8 or "
                     r"int4-g32\+lm_head; int4-g32-a8\+\.\.\. gives them 8-bit activations too\), not int8$"),
    ("Q4_1", "int4-g32-a8", "not int4-g32-a8$"),  # 8-bit activations, but no head: nothing for --quantize to add
    ("Q4_0", "int4-g32", "not int4-g32$"),  # no head: nothing to quantize
    ("Q4_0", "int4-g64+lm_head-int8", "not int4-g64"),  # the kept blocks' groups are 32
    ("Q4_0", "int4+lm_head-int8", r"not int4\+lm_head-int8 \(int4-g64\+lm_head-int8\)$"),  # int4's default groups
    ("Q8_0", "int4-g32+lm_head-int8", "layers.0.attention.wq is Q8_0"),
])
def test_generate_refuses_what_kept_blocks_cannot_take_before_loading(tmp_path, tokenizer, capsys, monkeypatch, kind,
                                                                        mode, says):
    from llmstep.cli import main
    from llmstep.core import checkpoint

    path = write_gguf(tmp_path / f"{kind}.gguf", random_llama(), tokenizer, kind)
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("a weight was read before the refusal"))
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(path), "--keep-quantized", "--quantize", mode, "--prompt", "x"])
    assert re.search(says, capsys.readouterr().err.strip().splitlines()[-1])


def test_keep_quantized_refuses_a_file_whose_matrices_are_not_q4(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "q8.gguf", random_llama(), tokenizer, "Q8_0")
    with pytest.raises(GGUFLoadError, match=r"layers.0.attention.wq is Q8_0"):
        load_gguf(path, device="cpu", keep_quantized=True)


# ---- refusals, before any weight is read ----------------------------------------------------------------
@pytest.fixture
def no_weight_read(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a weight was read before the file was refused")

    monkeypatch.setattr(gguf.quants, "dequantize", boom)


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    for content in (b"", b"not a gguf file at all", b"PK\x03\x04" + bytes(100)):
        p = tmp_path / "x.gguf"
        p.write_bytes(content)
        with pytest.raises((GGUFLoadError, NotADirectoryError), match="not a GGUF file"):
            llmstep.load(p)


def test_a_truncated_file_is_a_clear_error(tmp_path, tokenizer):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    data = path.read_bytes()
    for cut in (40, len(data) // 3, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFLoadError, match="truncated or corrupt"):
            llmstep.load(tmp_path / "cut.gguf")


def test_the_memory_check_counts_a_tensor_dequantized_beside_the_model(tmp_path, tokenizer, monkeypatch,
                                                                        no_weight_read):
    from llmstep.core import cost

    model = random_llama()
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    g = read_gguf(path)
    largest = max(p.numel() for p in model.state_dict().values())
    assert g.dequantize_bytes == 8 * largest  # the embedding: its float32 values and their copy
    model_bytes = cost.checkpoint_bytes(g.config, torch.float32, None)
    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: model_bytes + g.dequantize_bytes - 1)
    with pytest.raises(cost.MemoryBudgetError, match="m.gguf in float32 needs about"):
        load_gguf(path, device="cpu", dtype=torch.float32)  # the model alone would fit: no weight read
    monkeypatch.undo()  # the refusal came before any weight was read; now load for real, with just enough
    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: model_bytes + g.dequantize_bytes)
    loaded, _ = load_gguf(path, device="cpu", dtype=torch.float32)
    assert all(torch.equal(loaded.state_dict()[n], v) for n, v in model.state_dict().items())


def test_another_architecture_is_refused_by_name(tmp_path, tokenizer, no_weight_read):
    path = write_gguf(tmp_path / "q.gguf", random_llama(), tokenizer, "F16", arch="qwen2")
    with pytest.raises(GGUFLoadError, match="general.architecture is 'qwen2'"):
        load_gguf(path)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("llama.expert_count", 8, "a mixture of experts"),
    ("llama.rope.scaling.type", "yarn", "llama.rope.scaling.type is 'yarn'"),
    ("llama.rope.scaling.factor", 4.0, "llama.rope.scaling.factor is 4.0: positions scaled linearly"),  # no type:
    ("llama.rope.scale_linear", 2.0, "llama.rope.scale_linear is 2.0: positions scaled linearly"),  # llama.cpp's
    ("tokenizer.ggml.add_eos_token", True, "add_eos_token is True"),  # linear, and eos after every text
])
def test_llama_files_with_parts_llmstep_does_not_implement_are_refused(tmp_path, tokenizer, no_weight_read, key,
                                                                       value, match):
    path = write_gguf(tmp_path / "x.gguf", random_llama(), tokenizer, "F16", fields={key: value})
    with pytest.raises(GGUFLoadError, match=match):
        load_gguf(path)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model is 'llama'"),
    ("tokenizer.ggml.pre", "qwen2", "tokenizer.ggml.pre is 'qwen2'"),
])
def test_tokenizers_llmstep_cannot_rebuild_are_refused_by_name(tmp_path, tokenizer, no_weight_read, key, value, match):
    path = write_gguf(tmp_path / "t.gguf", random_llama(), tokenizer, "F16")
    reader = gguf.GGUFReader(str(path))
    fields = {k: v.contents() for k, v in reader.fields.items()}
    fields[key] = value
    from llmstep.core.gguf_vocab import build_tokenizer

    with pytest.raises(GGUFVocabError, match=match):
        build_tokenizer({k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in fields.items()}, "t.gguf")


def test_an_unsupported_tensor_type_and_unexpected_tensors_are_refused_by_name(tmp_path, tokenizer, no_weight_read):
    model = random_llama()
    arrays = gguf_tensors(model, "f32")
    arrays["blk.0.attn_q.bias"] = (np.zeros(64, dtype=np.float32), "F32")
    path = write_gguf(tmp_path / "b.gguf", model, tokenizer, "F16", tensors=arrays)
    with pytest.raises(GGUFLoadError, match=r"unexpected tensor blk.0.attn_q.bias \(biases"):
        load_gguf(path)
    path = write_gguf(tmp_path / "tq.gguf", random_llama(dim=256, hidden_dim=256, n_heads=4, n_layers=1), tokenizer,
                      "TQ2_0")
    with pytest.raises(GGUFLoadError, match="is TQ2_0, a type llmstep does not read"):
        load_gguf(path)


def test_shapes_that_disagree_with_the_metadata_are_refused(tmp_path, tokenizer, no_weight_read):
    model = random_llama()
    arrays = gguf_tensors(model, "f32")
    arrays["blk.1.ffn_up.weight"] = (arrays["blk.1.ffn_up.weight"][0][:48], "F32")
    path = write_gguf(tmp_path / "s.gguf", model, tokenizer, "F16", tensors=arrays)
    with pytest.raises(GGUFLoadError, match=r"blk.1.ffn_up.weight has shape \[48, 64\].*\[96, 64\]"):
        load_gguf(path)
    del arrays["blk.1.ffn_up.weight"]
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, "F16", tensors=arrays)
    with pytest.raises(GGUFLoadError, match="missing tensor blk.1.ffn_up.weight"):
        load_gguf(path)


def test_a_nan_weight_is_refused_naming_the_tensor(tmp_path, tokenizer):
    model = random_llama()
    arrays = gguf_tensors(model, "f32")
    arrays["blk.1.attn_output.weight"] = (arrays["blk.1.attn_output.weight"][0].copy(), "F32")
    arrays["blk.1.attn_output.weight"][0][3, 5] = float("nan")  # the export itself refuses NaN: put it in after
    path = write_gguf(tmp_path / "n.gguf", model, tokenizer, "F32", tensors=arrays)
    with pytest.raises(GGUFLoadError, match=r"blk.1.attn_output.weight \(layers.1.attention.wo.weight\) holds NaN"):
        load_gguf(path, device="cpu")


# ---- the tokenizer, the names a file is found by --------------------------------------------------------
def test_the_tokenizer_keeps_bos_eos_add_bos_and_the_chat_template(tmp_path, tokenizer):
    template = "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{% endfor %}"
    path = write_gguf(tmp_path / "t.gguf", random_llama(), tokenizer, "F16",
                      fields={"tokenizer.chat_template": template})
    g = read_gguf(path)
    assert g.tokenizer.bos_id == tokenizer.bos_id and g.tokenizer.eos_ids[0] == tokenizer.eos_ids[0]
    assert g.tokenizer.add_bos is True and g.tokenizer.chat_template == template
    assert g.tokenizer.encode(SAMPLES[3]) == tokenizer.encode(SAMPLES[3])  # special tokens in text: their ids
    assert g.tokenizer.encode(SAMPLES[3], special=False) == tokenizer.encode(SAMPLES[3], special=False)


def test_a_loaded_gguf_exports_again_to_the_same_file_contents(tmp_path, tokenizer):
    model = random_llama(n_kv_heads=1)
    first = export_gguf(model, tokenizer, tmp_path / "a.gguf", dtype="f32")
    loaded, tok = llmstep.load(first, device="cpu", dtype="float32")
    second = export_gguf(loaded, tok, tmp_path / "b.gguf", dtype="f32")
    a, b = gguf.GGUFReader(str(first)), gguf.GGUFReader(str(second))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert np.array_equal(np.array(x.data), np.array(y.data)), x.name
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.pre"):
        assert a.fields[key].contents() == b.fields[key].contents(), key


def test_the_command_line_loads_a_gguf_file_kept_quantized(tmp_path, tokenizer, capsys):
    from llmstep.cli import main

    path = write_gguf(tmp_path / "q4.gguf", random_llama(), tokenizer, "Q4_1")
    main(["generate", "--model", str(path), "--keep-quantized", "--prompt", "ROMEO:", "--max-new-tokens", "4",
          "--temperature", "0", "--device", "cpu"])
    err = capsys.readouterr().err
    assert "[cpu float32 int4-g32]" in err and "decode" in err  # the kept blocks named in the summary
    main(["generate", "--model", str(path), "--quantize", "int8", "--prompt", "ROMEO:", "--max-new-tokens", "4",
          "--temperature", "0", "--device", "cpu"])  # dequantized, then rounded to int8: served, with a note
    err = capsys.readouterr().err
    assert "note: q4.gguf holds Q4_1" in err and "rounds their dequantized values again" in err
    assert "[cpu float32 int8]" in err
    with pytest.raises(SystemExit):  # a directory has nothing to keep quantized: one line, exit 2
        main(["generate", "--model", "target", "--keep-quantized", "--prompt", "x", "--max-new-tokens", "1"])
    assert "keep_quantized applies to GGUF files" in capsys.readouterr().err


def test_tensor_parallelism_refuses_a_gguf_file_naming_why(tmp_path, tokenizer):
    import torch.distributed as dist

    from llmstep.core import parallel

    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(parallel.ParallelError, match="is a GGUF file; tensor parallelism reads Hugging Face"):
            parallel.load(path)
    finally:
        dist.destroy_process_group()


# ---- what a fresh review found ---------------------------------------------------------------------------------
def converter_factors(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """rope_freqs as llama.cpp's converter computes them (float32 frequencies, its own loop): not llmstep's code."""
    import math

    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(("head_dim", "theta", "factor", "original"), [(128, 500000.0, 8.0, 8192),
                                                                       (64, 500000.0, 32.0, 8192)])
def test_rope_freqs_from_llama_cpps_converter_give_transformers_frequencies_exactly(head_dim, theta, factor,
                                                                                     original):
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    s = RopeScaling(factor=factor, original_max_position_embeddings=original)  # Llama 3.1 / 3.2's
    got = rope_scaling_of(converter_factors(head_dim, theta, s), head_dim, theta, "test")
    hf = HFConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters={
        "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": original})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.equal(inv_frequencies(head_dim, theta, got), want.float())


def test_a_llama3_file_without_add_bos_token_starts_text_with_bos_as_llama_cpp_does(tokenizer):
    vocab = gguf_vocab(tokenizer, 300)
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
              "tokenizer.ggml.tokens": vocab["tokens"], "tokenizer.ggml.token_type": vocab["types"],
              "tokenizer.ggml.merges": vocab["merges"], "tokenizer.ggml.bos_token_id": vocab["bos"]}
    from llmstep.core.gguf_vocab import build_tokenizer

    assert build_tokenizer(fields, "x").add_bos is True
    assert build_tokenizer(fields | {"tokenizer.ggml.pre": "smollm"}, "x").add_bos is False
    assert build_tokenizer(fields | {"tokenizer.ggml.add_bos_token": False}, "x").add_bos is False


def test_a_saved_gguf_tokenizer_starts_with_bos_in_transformers_too(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    g = read_gguf(export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32"))
    assert g.tokenizer.add_bos
    g.tokenizer.save_dir(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert hf(SAMPLES[0])["input_ids"] == g.tokenizer.encode(SAMPLES[0])


def test_kept_q4_blocks_with_a_nan_scale_are_refused(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "q.gguf", random_llama(), tokenizer, "Q4_1")
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    data = bytearray(path.read_bytes())
    data[t.data_offset:t.data_offset + 2] = np.array([np.nan], dtype=np.float16).tobytes()  # block 0's d
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFLoadError, match=r"blk.0.ffn_up.weight .* NaN or Inf scales"):
        load_gguf(path, device="cpu", keep_quantized=True)
    with pytest.raises(GGUFLoadError, match="blk.0.ffn_up.weight .* holds NaN"):
        load_gguf(path, device="cpu")


def test_odd_metadata_is_refused_by_name(tmp_path, tokenizer):
    model = random_llama()
    path = write_gguf(tmp_path / "none.gguf", model, tokenizer, "F32", tensors={})
    with pytest.raises(GGUFLoadError, match="no token_embd.weight"):
        read_gguf(path)
    heads = bare_gguf(tmp_path / "heads.gguf", {"block_count": 1, "embedding_length": 64, "attention.head_count": 7,
                                                "feed_forward_length": 96}, (300, 64))
    with pytest.raises(GGUFLoadError, match="embedding_length 64 is not a multiple of llama.attention.head_count 7"):
        read_gguf(heads)


@pytest.mark.parametrize("key", ["context_length", "attention.layer_norm_rms_epsilon"])
def test_metadata_llama_cpp_requires_is_required_not_guessed(tmp_path, tokenizer, key):
    path = write_gguf(tmp_path / "m.gguf", random_llama(), tokenizer, "F32", omit=(key,))
    with pytest.raises(GGUFLoadError, match=rf"metadata llama\.{re.escape(key)} is missing"):
        read_gguf(path)


def test_a_shard_of_a_split_model_is_named_as_one(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "m-00001-of-00003.gguf", random_llama(), tokenizer, "F32",
                      fields={"split.no": 0, "split.count": 3, "split.tensors.count": 10})
    with pytest.raises(GGUFLoadError, match=r"shard 1 of 3 of a model split over several files .* merge the shards"):
        read_gguf(path)


@pytest.mark.parametrize("kind", ["user-defined", "normal", "unused", "no types in the file"])
def test_a_token_spelled_like_an_end_of_turn_is_a_control_token_and_an_end_whatever_its_type(tokenizer, kind):
    """llama.cpp's rule: typed anything, such a token is a control token (its text not split up by BPE) and an end
    of generation; a file without token types has every token normal."""
    from llmstep.core.gguf_vocab import NORMAL, UNUSED, USER_DEFINED, build_tokenizer

    vocab = gguf_vocab(tokenizer, 300)
    types = list(vocab["types"])
    eot = vocab["tokens"].index("<|eot_id|>")
    types[eot] = {"user-defined": USER_DEFINED, "normal": NORMAL, "unused": UNUSED}.get(kind)
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": vocab["tokens"],
              "tokenizer.ggml.token_type": None if kind == "no types in the file" else types,
              "tokenizer.ggml.merges": vocab["merges"]}
    t = build_tokenizer({k: v for k, v in fields.items() if v is not None}, "x")
    assert eot in t.eos_ids and "<|eot_id|>" in t.special_tokens
    assert t.encode("hi<|eot_id|>")[-1] == eot  # one token, not its pieces


def test_a_file_whose_vocabulary_is_padded_past_its_tokens_decodes_the_padding_to_nothing(tmp_path, tokenizer):
    model = random_llama(vocab_size=320)  # 20 rows the tokenizer does not name (as padded vocabularies are)
    path = write_gguf(tmp_path / "padded.gguf", model, tokenizer, "F32", n_tokens=300)
    g = read_gguf(path)
    assert (g.tokenizer.vocab_size, g.config.vocab_size) == (300, 320)
    assert g.tokenizer.decode([5, 310]) == g.tokenizer.decode([5])
    with pytest.raises(ValueError, match="cannot decode token id 320"):
        g.tokenizer.decode([320])


def test_the_padding_export_writes_is_padding_again_when_read_back(tmp_path, tokenizer):
    """export_gguf names the ids past the tokenizer's `[PAD<id>]`, typed unused as llama.cpp's converter types them:
    read back, they are the model's padding again (decoded to nothing, as llama.cpp and the tokenizer exported
    decode them, by decode and by a stream alike), and an export writes them out the same."""
    path = export_gguf(random_llama(vocab_size=320), tokenizer, tmp_path / "padded.gguf")
    assert gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()[310] == "[PAD310]"
    back = read_gguf(path).tokenizer
    assert back.vocab_size == tokenizer.vocab_size == 300
    ids = [5, 310, 6]
    stream = back.stream()
    assert back.decode(ids) == "".join(map(stream.step, ids)) + stream.flush() == tokenizer.decode([5, 6])
    assert back.encode("[PAD310]") == tokenizer.encode("[PAD310]")
    assert gguf_vocab(back, 320) == gguf_vocab(tokenizer, 320)


def test_an_unused_token_inside_the_vocabulary_decodes_to_nothing_where_its_merges_still_make_it(tokenizer):
    """llama.cpp's BPE knows every token, an unused one too, so text its merges lead to is still that token (tried
    on llama.cpp: its tokenize gives it, its detokenize nothing); exported again, it is unused again."""
    from llmstep.core.gguf_vocab import UNUSED, build_tokenizer

    vocab = gguf_vocab(tokenizer, 300)
    merged = vocab["merges"][0].replace(" ", "")  # the first merge's token: BPE makes it
    i, types = vocab["tokens"].index(merged), list(vocab["types"])
    types[i] = UNUSED
    back = build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": vocab["pre"],
                            "tokenizer.ggml.tokens": vocab["tokens"], "tokenizer.ggml.token_type": types,
                            "tokenizer.ggml.merges": vocab["merges"]}, "x")
    text = tokenizer.decode([i])
    assert back.encode(text, bos=False) == tokenizer.encode(text, bos=False) == [i]
    stream = back.stream()
    assert back.decode([5, i, 6]) == "".join(map(stream.step, [5, i, 6])) + stream.flush() == tokenizer.decode([5, 6])
    assert gguf_vocab(back, 300)["types"] == types

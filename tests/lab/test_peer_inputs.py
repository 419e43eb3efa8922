"""What each engine of the peer benchmark runs on a GGUF model (llmstep.lab.peer_inputs): llama.cpp the file itself
at the file's own precision, llmstep the file's Q4_0/Q4_1 blocks exactly as int4-g32 beside its own int4, and every
other row from the same dequantized weights, a second rounding of a quantized file marked as lossy. The files are
tiny: a random model exported by llmstep.core.gguf.export_gguf, its block matrices written as Q4_1/Q4_0 by the gguf
package (the token embedding Q8_0 and tied, as in SmolLM2-135M-Instruct's file)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import llmstep
import llmstep.core.gguf as gguf_export
from llmstep.core.config import LlamaConfig
from llmstep.core.model import Llama
from llmstep.core.quantize import Int4Linear, Int8Linear
from llmstep.core.tokens import Tokenizer
from llmstep.lab import peer_engines, peer_inputs

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed")


def tiny_model() -> Llama:
    config = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=64,
                         tie_embeddings=True, torch_dtype="float32")
    torch.manual_seed(0)
    model = Llama(config).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_file)


def write(path, tokenizer, kind: str):
    """export_gguf's file with its block matrices in `kind` (F32: as exported) and, quantized, a Q8_0 embedding."""
    real = gguf_export.gguf_tensors

    def quantized(model, dtype):
        out = {}
        for name, (array, k) in real(model, dtype).items():
            qtype = kind if name.startswith("blk.") and array.ndim == 2 else "Q8_0" if name == "token_embd.weight" \
                else None
            t = gguf.GGMLQuantizationType[qtype] if qtype else None
            out[name] = (gguf.quants.quantize(array, t), qtype) if t is not None else (array, k)
        return out

    gguf_export.gguf_tensors = quantized if kind != "F32" else real
    try:
        return gguf_export.export_gguf(tiny_model(), tokenizer, path, dtype="f32")
    finally:
        gguf_export.gguf_tensors = real


def plan(path, precisions, workdir, peer_list=("llama.cpp", "transformers"), dtype="bfloat16"):
    model, tokenizer = llmstep.load(path, device="cpu", dtype=dtype)
    return model, peer_inputs.plan_inputs(model, list(peer_list), precisions, tokenizer, path, workdir, threads=1,
                                          n_ctx=16, log=lambda m: None)


@needs_llama_cpp
def test_a_q4_1_file_is_llama_cpps_own_int4_input_and_llmsteps_int4_holds_its_blocks_exactly(tmp_path, tokenizer):
    path = write(tmp_path / "m-q4_1.gguf", tokenizer, "Q4_1")
    assert peer_inputs.file_types(path)[0] == "Q4_1"
    model, p = plan(path, ["bfloat16", "int8", "int4"], tmp_path / "work")
    assert [(v.precision, v.weights, v.requantized) for v in p.variants] == [
        ("bfloat16", "bfloat16", False), ("int8", "int8+lm_head", True), ("int4", "int4-g32+lm_head-int8", False),
        ("int4", "int4-g64+lm_head-int8", True)]
    kept = p.variants[2]
    assert "blocks, exactly" in kept.source and isinstance(kept.model.layers[0].feed_forward.w2, Int4Linear)
    # every quantised row's LM head is int8 (llama.cpp's inputs hold theirs at Q8_0); the kept row's is the file's
    # Q8_0 head (the float model's, dequantized) rounded again per row
    assert all(isinstance(v.model.output, Int8Linear) for v in p.variants[1:])
    assert "its Q8_0 LM head as llmstep int8" in kept.source
    head = model.output.weight.float()
    assert (kept.model.output.dequantized().float() - head).abs().max() <= head.abs().max() / 127
    # the kept int4 is the file's weights: the float model (the file dequantized), to bfloat16's rounding of the
    # weights there and of the scales and zeros here
    w = model.layers[1].attention.wq.weight.float()
    got = kept.model.layers[1].attention.wq.dequantized().float()
    assert (got - w).abs().max() <= 2**-7 * w.abs().max()
    specs = [(p.variants[n].weights, s.peer, s.precision, s.weights, s.gguf and s.gguf.name, s.quantize_to,
              s.requantized) for n, s in p.peers]
    assert specs[1][:4] == ("bfloat16", "transformers", "bfloat16", "llmstep's tensors")
    assert specs[2][:3] == ("int8+lm_head", "llama.cpp", "int8") and specs[2][-1] is True  # Q8_0 of Q4_1: lossy
    q8 = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(p.peers[2][1].gguf)).tensors}
    assert q8["output.weight"] == "Q8_0" and q8["token_embd.weight"] == "BF16"  # llmstep's int8 head, exactly
    assert specs[:1] + specs[3:] == [
        ("bfloat16", "llama.cpp", "bfloat16", "GGUF bf16", "model-bf16.gguf", None, False),
        ("int4-g32+lm_head-int8", "llama.cpp", "int4", "GGUF q4_1 (the file)", "m-q4_1.gguf", None, False),
        ("int4-g64+lm_head-int8", "llama.cpp", "int4", "GGUF q4_0 (llama.cpp's quantiser)", "model-bf16.gguf", "q4_0",
         True)]
    assert p.peers[3][1].gguf == path  # the file itself, not a copy
    assert "requantized from the file's Q4_1" in p.peers[4][1].source
    # llama.cpp's bf16 file holds the very tensors llmstep's bf16 row runs
    exported, _ = llmstep.load(p.peers[0][1].gguf, device="cpu", dtype="bfloat16")
    for name, value in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name
    skipped = {(s["peer"], s["precision"]) for s in p.skipped}
    assert skipped == {("transformers", "int8"), ("transformers", "int4")}


@needs_llama_cpp
def test_int4_a8_from_a_q4_1_file_holds_its_blocks_with_8_bit_activations_against_the_file_itself(tmp_path, tokenizer):
    """int4-a8 comes twice, as int4 does: the file's blocks exactly, now with 8-bit activations (llama.cpp's own
    arithmetic on its own blocks), and llmstep's int4-a8 of the dequantized weights; against the same llama.cpp rows:
    the file itself and llama.cpp's Q4_0 of its export."""
    path = write(tmp_path / "m-q4_1.gguf", tokenizer, "Q4_1")
    model, p = plan(path, ["int4-a8"], tmp_path / "work", peer_list=("llama.cpp",))
    assert [(v.precision, v.weights, v.requantized) for v in p.variants] == [
        ("int4-a8", "int4-g32-a8+lm_head-int8-a8", False), ("int4-a8", "int4-g64-a8+lm_head-int8-a8", True)]
    kept = p.variants[0]
    assert "blocks, exactly (keep_quantized, 8-bit activations); its Q8_0 LM head as llmstep int8-a8" in kept.source
    assert kept.model.layers[0].feed_forward.w2.activations == 8 and isinstance(kept.model.output, Int8Linear)
    assert kept.model.output.activations == 8  # llama.cpp's Q8_0 head takes Q8_0 activations too
    assert [(n, s.weights) for n, s in p.peers] == [(0, "GGUF q4_1 (the file)"),
                                                   (1, "GGUF q4_0 (llama.cpp's quantiser)")]


@needs_llama_cpp
def test_a_float_file_is_its_own_float_input_and_has_no_int4_blocks_to_keep(tmp_path, tokenizer):
    path = write(tmp_path / "m-f32.gguf", tokenizer, "F32")
    _, p = plan(path, ["float32", "int4"], tmp_path / "work", peer_list=("llama.cpp",), dtype="float32")
    assert [(v.precision, v.weights, v.requantized) for v in p.variants] == [
        ("float32", "float32", False), ("int4", "int4-g64+lm_head-int8", False)]
    assert [(s.gguf, s.quantize_to, s.requantized) for _, s in p.peers] == [(path, None, False), (path, "q4_0", False)]
    assert [s["peer"] for s in p.skipped] == ["llmstep"] and "is F32" in p.skipped[0]["why"]


def test_a_gguf_files_step_streams_every_tensor_but_a_tied_head_streams_the_embedding_too(tmp_path, tokenizer):
    path = write(tmp_path / "m-q4_0.gguf", tokenizer, "Q4_0")
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    assert "output.weight" not in tensors  # tied: the head reads the whole Q8_0 embedding every step
    assert peer_engines.gguf_step_weight_bytes(path) == sum(tensors.values())
    untied = gguf_export.export_gguf(Llama(tiny_model().config.replace(tie_embeddings=False)), tokenizer,
                                     tmp_path / "untied.gguf", dtype="f32")
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(untied)).tensors}
    assert peer_engines.gguf_step_weight_bytes(untied) == sum(tensors.values()) - tensors["token_embd.weight"] + 64 * 4


@needs_llama_cpp
def test_the_bench_command_runs_llama_cpp_on_a_q4_1_file_and_names_each_rows_source(tmp_path, tokenizer, capsys):
    from llmstep import cli

    path = write(tmp_path / "m-q4_1.gguf", tokenizer, "Q4_1")
    record = cli.main(["bench", "--model", str(path), "--peers", "llama.cpp", "--no-compile", "--dtype", "bfloat16",
                       "--quantize", "none", "int4", "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1",
                       "--no-bandwidth", "--llama-cpp-extra-bufts", "off"])
    assert record["failed"] == [] and record["gguf_file"]["matrix_type"] == "Q4_1"
    assert record["llama_cpp_extra_buffer_types"] == "off (asked)"
    assert all("extra buffer types off" in r["notes"] for r in record["rows"] if r["engine"].startswith("llama"))
    rows = [(r["precision"], r["engine"].split(" (")[0], r["weights"]) for r in record["rows"]]
    assert rows == [("bfloat16", "llmstep FastDecoder", "bfloat16"), ("bfloat16", "llama.cpp", "GGUF bf16"),
                    ("int4", "llmstep FastDecoder", "int4-g32+lm_head-int8"),
                    ("int4", "llmstep FastDecoder", "int4-g64+lm_head-int8"),
                    ("int4", "llama.cpp", "GGUF q4_1 (the file)"),
                    ("int4", "llama.cpp", "GGUF q4_0 (llama.cpp's quantiser)")]
    q4_1, q4_0 = record["rows"][4], record["rows"][5]
    assert q4_1["compared_with"] == "llmstep int4-g32+lm_head-int8"
    assert q4_0["compared_with"] == "llmstep int4-g64+lm_head-int8"
    assert q4_0["requantized"] and not q4_1["requantized"]
    kv = (4 + (2 - 1) / 2 + 1) * 2 * 2 * 2 * 16 * 2  # mean context + 1 positions; k, v; 2 layers, 2 kv heads of 16
    assert q4_1["bytes_per_step"] == peer_engines.gguf_step_weight_bytes(path) + kv
    assert q4_1["bytes_counted_from"].startswith("the GGUF file's tensors")
    bf16 = record["rows"][1]
    assert bf16["same_tokens_as_llmstep"] == 3  # the same bf16 weights, the same greedy tokens
    out = capsys.readouterr().out
    assert "m-q4_1.gguf itself, as shipped" in out and "[lossy: requantized]" in out


@needs_llama_cpp
@pytest.mark.parametrize("extra_bufts", [False, True])
def test_llama_cpp_loads_with_its_extra_buffer_types_as_asked_and_says_so(tmp_path, tokenizer, monkeypatch,
                                                                          extra_bufts):
    import llama_cpp
    import llama_cpp._internals as internals

    seen = []
    real = internals.LlamaModel.__init__

    def spy(self, *args, params, **kwargs):
        seen.append(params.use_extra_bufts)
        real(self, *args, params=params, **kwargs)

    monkeypatch.setattr(internals.LlamaModel, "__init__", spy)
    path = write(tmp_path / "m-f32.gguf", tokenizer, "F32")
    spec = peer_engines.PeerSpec("llama.cpp", "float32", 1, 16, gguf=path, extra_bufts=extra_bufts)
    engine = peer_engines.make_llama_cpp(spec)  # here, in this process, to see the parameters it loads with
    assert seen == [extra_bufts]
    assert ("extra buffer types off" in engine.info["notes"]) == (not extra_bufts)
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is True  # put back after the load
    assert len(engine.run([1, 2, 3], 2)[2]) == 2


@needs_llama_cpp
@pytest.mark.parametrize("width", [64, 256])
def test_llama_cpps_quantiser_keeps_the_lm_head_at_q8_0_as_llmsteps_int8_head(tmp_path, tokenizer, width):
    """Left to itself llama.cpp's quantiser makes a head of 256-multiple width Q6_K; the peers' input is told Q8_0."""
    model = Llama(tiny_model().config.replace(dim=width, hidden_dim=2 * width))
    path = gguf_export.export_gguf(model, tokenizer, tmp_path / "m-f32.gguf", dtype="f32")
    spec = peer_engines.PeerSpec("llama.cpp", "int4", 1, 16, gguf=path, quantize_to="q4_0", workdir=tmp_path)
    engine = peer_engines.make_llama_cpp(spec)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(engine.info["gguf"]).tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "Q4_0"


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_every_quantized_files_rows_say_they_are_rounded_again(tmp_path, tokenizer, kind):
    """Not only Q4_0/Q4_1/Q8_0 files: any quantized file's weights, dequantized and quantized again, are a second
    rounding, marked lossy (a Q5_0 file's int8 row was not)."""
    path = write(tmp_path / f"m-{kind.lower()}.gguf", tokenizer, kind)
    assert peer_inputs.file_types(path)[0] == kind
    _, p = plan(path, ["int8"], tmp_path / "work", peer_list=("transformers",))
    assert [(v.precision, v.requantized) for v in p.variants] == [("int8", True)]
    assert f"requantized from the file's {kind}" in p.variants[0].source

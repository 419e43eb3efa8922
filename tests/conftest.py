"""Shared fixtures: small random Llama checkpoints written by transformers (the reference) and a tiny
byte-level BPE tokenizer, so every test runs offline in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TEXT = (
    "When forty winters shall besiege thy brow, and dig deep trenches in thy beauty's field, "
    "thy youth's proud livery, so gazed on now, will be a tatter'd weed, of small worth held. "
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
    "Naïve café, façade, 東京, emoji 🙂 and numbers 12345 for the byte fallback."
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def pytest_configure(config):
    config.addinivalue_line("markers", "tuned_matmuls: the test's compiled steps tune their matmuls as the engines "
                            "do by default (`compile.gemm_backends`); unmarked tests compile them untuned")


@pytest.fixture(autouse=True)
def untuned_matmuls(request, monkeypatch):
    """A compiled CPU step in a test does not tune its matmuls, unless the test is marked `tuned_matmuls`.

    Tuning (inductor's max_autotune_gemm) compiles and times a C++ GEMM template per matmul shape: it tripled the
    cold compile of the one-layer test model's FastDecoder on the AVX2 EPYC (69 s against 23 s), and the tests that
    compile are about the loops around the matmuls (their tokens, caches, guards, traces), which tuning leaves
    alone. The tuned default keeps its own tests: those marked here, tests/kernels/test_cpu_gemm.py's kernel tests,
    and every notebook (nbval runs them as a learner does)."""
    if request.node.get_closest_marker("tuned_matmuls") is None:
        from llmstep.engines import engine

        monkeypatch.setattr(engine, "gemm_backends", lambda *models: None)


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    """A 300-token byte-level BPE with the Llama 3 special tokens at the end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300 - len(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 5, trainer)
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def import_script(file_name: str, module_name: str | None = None):
    """scripts/FILE_NAME as a module (the scripts are files, not a package): its functions called by the tests."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / file_name
    spec = importlib.util.spec_from_file_location(module_name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_config(**overrides):
    from transformers import LlamaConfig as HFConfig

    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=295, eos_token_id=296,
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    kw.update(overrides)
    return HFConfig(**kw)


LLAMA3_SCALING = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def make_checkpoint(path: Path, tokenizer_file: Path, seed: int = 0, max_shard_size=None,
                    legacy_config: bool = False, **overrides):
    """Save a random transformers LlamaForCausalLM to `path`; return the transformers model (float32, eval)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():  # the default init leaves the norms at 1: make them count too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    (path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    if legacy_config:  # the published Llama 3.x form: top-level rope_theta and rope_scaling
        cfg = json.loads((path / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
        (path / "config.json").write_text(json.dumps(cfg))
    return model


# name -> transformers overrides: GQA x4 with llama3 scaling, MHA tied, MQA sharded in the legacy form, GQA x2
# with an explicit head_dim.
CASES = {
    "gqa4-llama3-rope": dict(rope_parameters=LLAMA3_SCALING),
    "mha-tied": dict(num_key_value_heads=8, tie_word_embeddings=True),
    "mqa-sharded-legacy": dict(num_key_value_heads=1, rope_parameters=LLAMA3_SCALING,
                               max_shard_size="40KB", legacy_config=True),
    # head_dim set apart from hidden_size / heads (transformers allows it): q is 8 x 16 = 128 wide, dim 64
    "explicit-head-dim": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16),
}


@pytest.fixture(scope="session", params=list(CASES))
def hf_checkpoint(request, tmp_path_factory, tokenizer_file):
    """(path, transformers model) for each architecture case."""
    overrides = dict(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(path, tokenizer_file, **overrides)
    return path, model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_file):
    """One small GQA checkpoint for tests that need any model."""
    path = tmp_path_factory.mktemp("tiny")
    make_checkpoint(path, tokenizer_file, rope_parameters=LLAMA3_SCALING)
    return path


@pytest.fixture(scope="session")
def one_layer_checkpoint(tmp_path_factory, tokenizer_file):
    """tiny_checkpoint with one block: for the compiled-step tests, which are about the loop around the block (a
    torch.compile on the CPU takes time in proportion to the graph, and a second block adds nothing they check)."""
    path = tmp_path_factory.mktemp("tiny-1-layer")
    make_checkpoint(path, tokenizer_file, num_hidden_layers=1, rope_parameters=LLAMA3_SCALING)
    return path


@pytest.fixture(scope="session")
def sample_text() -> str:
    return TEXT


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory, tokenizer_file):
    """A float64 model (batched and single-row matmuls agree to ~1e-15: token equality is exact), 48 positions."""
    path = tmp_path_factory.mktemp("tiny64paged")
    make_checkpoint(path, tokenizer_file, seed=3, max_position_embeddings=48, num_hidden_layers=3)
    import llmstep

    model, tok = llmstep.load(path, dtype="float32")
    return model.double(), tok

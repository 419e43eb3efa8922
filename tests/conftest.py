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


# ---- 8-bit activations (tests/kernels/test_cpu_int4a8.py, test_cpu_int8a8.py) --------------------------------

@pytest.fixture
def fake_cpu(monkeypatch):
    """fake_cpu(capability, flags, features=()): a CPU as torch reads its vector width, its /proc/cpuinfo flags (a
    string; None: no such file) and torch's own reading of its features (by torch's names), for
    kernels/cpp_build.isas_here, whatever CPU runs the test."""
    from llmstep.kernels import cpp_build

    def cpu(capability: str, flags: str | None, features: tuple[str, ...] = ()):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(cpp_build, "cpuinfo_fields", lambda: {} if flags is None else {"flags": flags})
        monkeypatch.setattr(torch.cpu, "get_capabilities",
                            lambda: dict.fromkeys(features, True) | {"avx512_4fmaps": False})

    return cpu


@pytest.fixture(scope="module", params=["avx512_vnni", "avx2"])
def a8_ops(request):
    """torch.ops of the 8-bit activation kernels (llmstep.kernels.cpu_int4a8: int4-a8's mm, int8-a8's mm8), each
    ISA's build where this CPU runs it (an AVX-512 VNNI CPU runs the AVX2 build too, so CI on either CPU kind holds
    both to the same tests), registered for the layers while the module's tests run."""
    from llmstep.kernels import cpu_int4a8

    if not cpu_int4a8.install():
        pytest.skip(f"the 8-bit activation kernels do not build here: {cpu_int4a8.why()}")
    if request.param not in cpu_int4a8.runs_here():
        pytest.skip(f"this CPU does not run {request.param} ({torch.backends.cpu.get_cpu_capability()})")
    with cpu_int4a8.using(request.param):
        yield cpu_int4a8.build(request.param)


@pytest.fixture(scope="module")
def model128(tmp_path_factory, tokenizer_file):
    """A small GQA model whose widths are whole blocks of 32 (the tiny fixture's MLP is 112 wide), float32."""
    import llmstep

    path = tmp_path_factory.mktemp("a8")
    make_checkpoint(path, tokenizer_file, intermediate_size=128, num_hidden_layers=2)
    return llmstep.load(path, dtype="float32")


def a8_rows(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """M rows of K activations whose blocks of 32 lie apart in scale, a block of zeros (step 0, codes 0) and, from
    two rows of 64 on, a block of evenly spaced values (many products near a rounding tie)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(M, K // 32, 1, generator=g).mul(4).expand(M, K // 32, 32).reshape(M, K)
    x = torch.randn(M, K, generator=g) * scale
    x[0, :32] = 0
    if M > 1 and K >= 64:
        x[1, 32:64] = torch.arange(32) - 15.5
    return x.to(dtype)


def a8_kernel_agrees(layer, module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer with 8-bit activations on [2, 2, in] rows: its output with `module`'s kernel (llmstep.core.int4a8 or
    int8a8) and with torch's ops (the kernel unregistered) agree to the dtype's rounding, and 0 rows give 0 rows.
    Returns (x, torch's ops' output)."""
    x = a8_rows(4, layer.in_features, dtype, 5).view(2, 2, layer.in_features)
    with torch.no_grad():
        y = layer(x)
        saved = module._kernel
        module.use_kernel(None)
        try:
            ref = layer(x)
        finally:
            module._kernel = saved
    assert y.shape == ref.shape == (2, 2, layer.out_features) and y.dtype == ref.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())
    assert layer(torch.zeros(0, layer.in_features, dtype=dtype)).shape == (0, layer.out_features)
    return x, ref

"""Bad input gets an error that names what is wrong and where, and never a half-loaded model."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import llmstep
from llmstep import CheckpointError, ConfigError, LlamaConfig


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint that a test may break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        llmstep.load(tmp_path / "nope")


def test_a_file_instead_of_a_directory(ckpt):
    with pytest.raises(NotADirectoryError, match="config.json"):
        llmstep.load(ckpt / "config.json")


@pytest.mark.parametrize("name, message", [("config.json", "config.json"), ("tokenizer.json", "tokenizer.json"),
                                           ("model.safetensors", "no model.safetensors")])
def test_missing_file(ckpt, name, message):
    (ckpt / name).unlink()
    with pytest.raises((FileNotFoundError, CheckpointError), match=message):
        llmstep.load(ckpt)


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
        llmstep.load(ckpt)


def test_corrupt_safetensors_header(ckpt):
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[8:40] = b"\x00garbage that is not json\xff" + b" " * 6
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        llmstep.load(ckpt)


def test_not_a_safetensors_file_at_all(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"PK\x03\x04 a zip file, say")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        llmstep.load(ckpt)


def test_missing_tensor_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj\.weight"):
        llmstep.load(ckpt)


def test_wrong_shape_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight .* shape \[8, 64\], config.json implies \[16, 64\]"):
        llmstep.load(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.bias"):
        llmstep.load(ckpt)


def test_missing_shard_is_named(tiny_checkpoint, tmp_path):
    model, tok = llmstep.load(tiny_checkpoint)
    out = llmstep.save(model, tmp_path / "sharded", tokenizer=tok, max_shard_bytes=50_000)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name}, which is missing"):
        llmstep.load(out)


def test_a_shard_that_fails_as_it_is_read_is_named_with_its_tensor(tiny_checkpoint, tmp_path, monkeypatch):
    """A shard cut short after the checkpoint was checked (another process writing it) is named; a read that fails
    inside an open shard names the shard and the tensor, not only the directory."""
    import llmstep.core.loader as loader

    model, tok = llmstep.load(tiny_checkpoint)
    out = llmstep.save(model, tmp_path / "sharded", tokenizer=tok, max_shard_bytes=50_000)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    fits = loader.check_fits

    def cut_then_fit(*args, **kwargs):  # the headers were checked by now
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        return fits(*args, **kwargs)

    monkeypatch.setattr(loader, "check_fits", cut_then_fit)
    with pytest.raises(CheckpointError, match=rf"sharded/{shard.name}: could not be read \(Error while deserializ"):
        llmstep.load(out)  # safetensors refuses the cut file as it opens it
    monkeypatch.setattr(loader, "check_fits", fits)
    read = loader.Slicer.read

    def failing(self, file, name, ours):  # a read error inside an open shard (an I/O error, a device's refusal)
        if name == "model.norm.weight":
            raise OSError(5, "Input/output error")
        return read(self, file, name, ours)

    monkeypatch.setattr(loader.Slicer, "read", failing)
    out = llmstep.save(model, tmp_path / "whole", tokenizer=tok, max_shard_bytes=50_000)  # no shard cut
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    with pytest.raises(CheckpointError, match=rf"whole/{shard}: tensor model.norm.weight: could not be read "
                                              r"\(\[Errno 5\] Input/output error\)"):
        llmstep.load(out)


def test_validation_happens_before_any_weight_is_read(ckpt, monkeypatch):
    """A bad tensor in the checkpoint is reported without reading (allocating) any tensor."""
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, ckpt / "model.safetensors")
    import llmstep.core.loader as loader

    def no_reading(*a, **k):
        raise AssertionError("weights were read before validation finished")

    monkeypatch.setattr(loader, "safe_open", no_reading)
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        llmstep.load(ckpt)


def rewrite_config(ckpt, change: dict) -> None:
    """config.json with `change` applied over its values."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(change)
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=60, head_dim=None), "hidden_size \\(60\\) is not divisible by num_attention_heads"),
    (dict(num_key_value_heads=3), "num_attention_heads \\(8\\) must be a multiple of num_key_value_heads"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
    (dict(hidden_act="gelu"), "silu"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(model_type="mistral"), "model_type"),
    (dict(eos_token_id=[None, 2]), r"eos_token_id lists null: \[None, 2\]"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 0.5, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
     r"rope_parameters\.factor must be >= 1"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "yarn"),
])
def test_config_values_that_cannot_fit(ckpt, change, message):
    rewrite_config(ckpt, change)
    with pytest.raises(ConfigError, match=message):
        llmstep.load(ckpt)


def test_config_error_names_the_file(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        LlamaConfig.from_hf(ckpt)


def test_direct_config_errors():
    with pytest.raises(ConfigError, match="n_heads"):
        LlamaConfig(dim=64, n_heads=6, n_kv_heads=4, hidden_dim=10, vocab_size=10, n_layers=1)
    with pytest.raises(ConfigError, match="head_dim"):
        LlamaConfig(dim=63, n_heads=9, n_kv_heads=3, hidden_dim=10, vocab_size=10, n_layers=1)
    with pytest.raises(KeyError, match="unknown preset"):
        LlamaConfig.preset("llama-9")


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return llmstep.load(tiny_checkpoint)


def test_prompt_longer_than_context(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match=r"the prompt is 200 tokens, but the model's context is 128"):
        llmstep.generate(model, tok, list(range(200)), max_new_tokens=1)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(loaded, prompt):
    model, tok = loaded
    with pytest.raises(ValueError, match="prompt is empty"):
        llmstep.generate(model, tok, prompt)


def test_prompt_id_outside_vocabulary(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match="token id 5000 is outside the vocabulary"):
        llmstep.generate(model, tok, [1, 5000])


def test_a_forward_of_an_id_outside_the_vocabulary_names_it_on_the_cpu(loaded):
    """The README's `model(ids)`: torch's embedding would say "index out of range in self"; the model names the id
    and where it is (on the CPU, where reading the ids back waits for nothing)."""
    model, _ = loaded
    V = model.config.vocab_size
    for ids, where in (([[1, V]], f"token id {V} at \\[0, 1\\]"), ([[1, 2], [-1, 3]], r"token id -1 at \[1, 0\]")):
        with pytest.raises(ValueError, match=f"{where} is outside the vocabulary \\(0..{V - 1}\\)"):
            model(torch.tensor(ids))
    assert model(torch.tensor([[0, V - 1]])).shape == (1, 2, V)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(max_new_tokens=-1), "max_new_tokens"),
])
def test_bad_generation_arguments(loaded, kwargs, message):
    model, tok = loaded
    with pytest.raises(ValueError, match=message):
        llmstep.generate(model, tok, "hello", **kwargs)


def test_bad_device_and_dtype(tiny_checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        llmstep.load(tiny_checkpoint, dtype="float8")
    with pytest.raises(ValueError, match="device"):
        llmstep.load(tiny_checkpoint, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            llmstep.load(tiny_checkpoint, device="cuda")


def test_save_leaves_nothing_half_written(tiny_checkpoint, tmp_path, monkeypatch):
    model, tok = llmstep.load(tiny_checkpoint)
    import llmstep.core.checkpoint as checkpoint

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        llmstep.save(model, tmp_path / "out", tokenizer=tok)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary folder left behind


L3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}


@pytest.mark.parametrize("change, message", [
    (dict(rms_norm_eps=None), "rms_norm_eps must be a number, got None"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}), "rope_theta must be a number"),
    (dict(rope_parameters=L3 | {"factor": "8"}), r"rope_parameters\.factor must be a number"),
    (dict(rope_parameters=L3 | {"original_max_position_embeddings": 16.5}), "original_max_position_embeddings"),
    (dict(rope_parameters=[1]), "rope_parameters must be an object"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "'linear'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling has rope type 'dynamic'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive integer"),
    (dict(head_dim=8.0), "head_dim must be an integer"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (dict(eos_token_id=[296, "x"]), "eos_token_id must be an integer"),
    (dict(eos_token_id=2.0), "eos_token_id must be an integer"),
])
def test_config_values_of_the_wrong_kind_name_the_field_and_the_file(ckpt, change, message):
    rewrite_config(ckpt, change)
    with pytest.raises(ConfigError, match=rf"config\.json: .*{message}"):
        llmstep.load(ckpt)


def test_config_json_that_is_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json must hold a JSON object, got list"):
        llmstep.load(ckpt)


def test_eos_token_id_zero_is_kept():
    hf = LlamaConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=8).to_hf()
    assert LlamaConfig.from_hf(hf | {"eos_token_id": 0}).eos_token_id == [0]
    assert LlamaConfig.from_hf(hf | {"eos_token_id": None}).eos_token_id == []


def _write_header(path, header: bytes):
    path.write_bytes(len(header).to_bytes(8, "little") + header)


@pytest.mark.parametrize("header", [
    b"[1, 2]", b'"text"', b'{"model.norm.weight": {"dtype": "F32", "data_offsets": [0, 4]}}',  # no shape
    b'{"model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}',
    b'{"model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}}',  # not a number of bytes
    b'{"model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, -4]}}',
])
def test_malformed_safetensors_header(ckpt, header):
    _write_header(ckpt / "model.safetensors", header)
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        llmstep.load(ckpt)


@pytest.mark.parametrize("meta", [b'{"format": 5}', b'["pt"]', b'"pt"'])
def test_a_safetensors_metadata_that_is_not_names_to_strings_is_refused_from_the_header(ckpt, meta):
    """safe_open refuses it too, but only as it reads the file, after any earlier shard was loaded."""
    file = ckpt / "model.safetensors"
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(n)), f.read()
    header["__metadata__"] = json.loads(meta)
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)
    with pytest.raises(CheckpointError, match="model.safetensors: its header's __metadata__ must map names to strings"):
        llmstep.load(ckpt)


@pytest.mark.parametrize("tensors, data, message", [
    ({"a": [[1], [0, 4]], "b": [[1], [0, 4]]}, 4, "tensor b starts at data byte 0: it overlaps the tensor before it"),
    ({"a": [[1], [0, 4]], "b": [[1], [8, 12]]}, 12, "tensor b starts at data byte 8: it leaves a gap of 4 bytes"),
    ({"a": [[2], [0, 4]]}, 4, r"tensor a \(F32 \[2\]\) spans 4 bytes \[0, 4\), its shape and dtype make 8"),
])
def test_safetensors_spans_that_overlap_leave_gaps_or_miscount_are_refused_from_the_header(ckpt, tensors, data,
                                                                                            message):
    """safe_open would refuse them too, but only as it opens the file, after any earlier shard was read."""
    header = {name: {"dtype": "F32", "shape": shape, "data_offsets": span} for name, (shape, span) in tensors.items()}
    text = json.dumps(header).encode()
    (ckpt / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + bytes(data))
    with pytest.raises(CheckpointError, match=f"model.safetensors: {message}"):
        llmstep.load(ckpt)


@pytest.mark.parametrize("weight_map, message", [
    ([1, 2], "weight_map must map tensor names to shard files"),
    ({"model.norm.weight": 3}, "model.norm.weight is mapped to 3"),
    ({"model.norm.weight": "../model.safetensors"}, "not a shard file name"),
])
def test_malformed_index(ckpt, weight_map, message):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")  # read before an index beside it
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json: .*{message}"):
        llmstep.load(ckpt)


@pytest.mark.parametrize("text, message", [("{oops", "is not valid JSON"), ("[1]", "must hold a JSON object")])
def test_bad_generation_config_is_named(ckpt, text, message):
    (ckpt / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"generation_config.json {message}"):
        llmstep.load(ckpt)
    with pytest.raises(ValueError, match=f"generation_config.json {message}"):
        llmstep.Tokenizer.from_dir(ckpt)


def test_float64_is_a_dtype_but_float8_is_not(tiny_checkpoint):
    model, _ = llmstep.load(tiny_checkpoint, device="cpu", dtype="float64")
    assert model.dtype == torch.float64 and model.new_cache(max_len=4).k[0].dtype == torch.float64
    with pytest.raises(ValueError, match="float8"):
        llmstep.load(tiny_checkpoint, dtype="float8")


def test_an_empty_model_path_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch):
    from llmstep.core.checkpoint import resolve_model_path

    monkeypatch.chdir(tmp_path)  # a folder that exists: "" would have been it
    with pytest.raises(FileNotFoundError, match="the model path is empty"):
        resolve_model_path("")


# ---- hostile sizes and shapes: refused by name, never a RecursionError, a panic or minutes of work -------------
DEEP = "[" * 100_000 + "]" * 100_000


def test_json_nested_too_deeply_is_refused_naming_the_file(ckpt):
    (ckpt / "config.json").write_text('{"a": ' + DEEP + "}")
    with pytest.raises(ConfigError, match=r"config.json nests its JSON too deeply"):
        llmstep.load(ckpt)


def test_a_safetensors_header_nested_too_deeply_is_refused_naming_the_file(ckpt):
    header = ('{"x": ' + DEEP + "}").encode()
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match=r"model.safetensors's header nests its JSON too deeply"):
        llmstep.load(ckpt)


def test_set_values_of_the_wrong_json_type_are_refused_naming_the_field():
    from llmstep.cli.bench import parse_sets

    assert parse_sets(["dim=128", "norm_eps=1e-6", "eos_token_id=[1, 2]", "rope_scaling=null", "head_dim=null",
                       "tie_embeddings=true"]) == {"dim": 128, "norm_eps": 1e-6, "eos_token_id": [1, 2],
                                                   "rope_scaling": None, "head_dim": None, "tie_embeddings": True}
    for bad, match in [('dim="8"', "dim takes int, got str"), ("dim=1.5", "dim takes int, got float"),
                       ("dim=true", "dim takes int, got bool"), ("eos_token_id=[1.5]", "eos_token_id takes list"),
                       ("rope_scaling=5", "rope_scaling takes RopeScaling or null"),
                       ('rope_scaling={"speed": 2}', "unexpected keyword argument 'speed'"),
                       ("norm_eps=true", "norm_eps takes float, got bool"), ("dim=" + DEEP, "nests its JSON too")]:
        with pytest.raises(ValueError, match=match):
            parse_sets([bad])


def test_a_prompt_far_longer_than_the_context_is_refused_before_it_is_tokenized(tiny_checkpoint, monkeypatch):
    model, tokenizer = llmstep.load(tiny_checkpoint)
    encoded = []
    monkeypatch.setattr(tokenizer.tok, "encode", lambda *a, **k: encoded.append(1))  # must never be reached
    with pytest.raises(ValueError, match=r"at least [\d,]+ tokens: more than the 128 there is room for"):
        llmstep.generate(model, tokenizer, "ab " * 1_000_000, max_new_tokens=1)
    assert encoded == []


def test_a_split_rule_that_backtracks_forever_is_a_value_error_not_a_panic(tiny_checkpoint):
    import tokenizers

    spec = json.loads((tiny_checkpoint / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    tok = llmstep.Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))
    with pytest.raises(ValueError, match="the tokenizer cannot split this text"):
        tok.encode("a" * 40 + "b")


def test_a_header_longer_than_safetensors_allows_is_refused_before_it_is_read(ckpt, monkeypatch):
    import builtins

    weights = ckpt / "model.safetensors"
    declared = 150_000_000  # more than safetensors' 100 MB bound; the (sparse) file is long enough to hold it
    with open(weights, "wb") as f:
        f.write(declared.to_bytes(8, "little"))
        f.truncate(8 + declared + 16)
    reads = []
    real_open = builtins.open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: Counting(real_open(p, *a, **k))
                        if str(p) == str(weights) else real_open(p, *a, **k))
    with pytest.raises(CheckpointError, match=r"model.safetensors: declares a 150,000,000-byte header; safetensors "
                                              r"allows at most 100,000,000"):
        llmstep.load(ckpt)
    assert max(reads, default=0) <= 8  # only the length itself was read



@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_config_without_a_dtype_takes_the_weights_own(tmp_path, dtype):
    """transformers' dtype="auto" reads the weights' dtype where config.json names none; bfloat16 assumed would load
    float32 or float16 weights rounded, on a GPU."""
    from llmstep.core.checkpoint_layout import read_checkpoint
    from llmstep.lab.hardware import random_model

    model = random_model(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                     max_seq_len=16), "cpu", getattr(torch, dtype))
    path = llmstep.save(model, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["torch_dtype"]
    (path / "config.json").write_text(json.dumps(config))
    assert read_checkpoint(path).config.torch_dtype == dtype
    assert llmstep.core.checkpoint.read_config(path).torch_dtype == dtype  # the benches read the config alone
    assert LlamaConfig.from_hf(config).torch_dtype == "bfloat16"  # the config alone says nothing
    alone = tmp_path / "config-only"  # a model's shape without its weights (llmstep info): read as it says
    alone.mkdir()
    (alone / "config.json").write_text(json.dumps(config))
    assert llmstep.core.checkpoint.read_config(alone).torch_dtype == "bfloat16"
    (alone / "model.safetensors").write_bytes(b"\x10")  # broken weights: the config as it says; load names them
    assert llmstep.core.checkpoint.read_config(alone).torch_dtype == "bfloat16"
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        llmstep.load_model(alone)

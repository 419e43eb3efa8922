"""`llmstep.save` over an existing checkpoint, interrupted at any file operation, leaves the directory loading as
exactly the old model or exactly the new one: never a directory without weights, never a mix."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import llmstep
import llmstep.core.checkpoint as checkpoint
from llmstep.core import files
from llmstep.core.quantize import quantize


class Boom(Exception):
    pass


# Every file operation a save may make, by (owner, attribute name).
OPERATIONS = [(os, "replace"), (os, "rename"), (os, "unlink"), (os, "link"), (os, "symlink"), (os, "fsync"),
              (os, "chmod"), (shutil, "copy2"), (shutil, "rmtree"), (checkpoint, "save_file"),
              (files, "_exchange"), (Path, "write_text"), (Path, "write_bytes")]


class FailAt:
    """Patch every operation to count its calls and raise Boom from call number k (0-based)."""

    def __init__(self, monkeypatch, k: int):
        self.k, self.n = k, 0
        for owner, name in OPERATIONS:
            monkeypatch.setattr(owner, name, self.wrap(getattr(owner, name), name))

    def wrap(self, real, name):
        def op(*args, **kwargs):
            self.n += 1
            if self.n - 1 == self.k:
                raise Boom(f"{name} (operation {self.k})")
            return real(*args, **kwargs)
        return op


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


CASES = {
    "single file over single file": (None, None, False),
    "shards over a single file": (None, 20_000, False),
    "a single file over shards": (20_000, None, False),
    "quantized shards over float": (None, 20_000, True),
}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_save_interrupted_at_each_file_operation_leaves_the_old_or_the_new_checkpoint(
        tiny_checkpoint, tmp_path, monkeypatch, case, exchange):
    old_shards, new_shards, quantized = CASES[case]
    old, tok = llmstep.load(tiny_checkpoint)
    new = llmstep.load(tiny_checkpoint)[0]
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(-1)  # a different model of the same shape
    if quantized:
        new = quantize(new, "int8")
    template = tmp_path / "template"
    llmstep.save(old, template, tokenizer=tok, max_shard_bytes=old_shards)
    (template / "README.md").write_text("the model card\n")  # a file save does not write: kept either way
    old_state, new_state = state(llmstep.load(template)[0]), state(new)
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)

    outcomes = []
    for k in range(200):
        target = tmp_path / "ckpt"
        for p in tmp_path.iterdir():
            if p.name != "template":
                shutil.rmtree(p)
        shutil.copytree(template, target)
        with monkeypatch.context() as m:
            FailAt(m, k)
            try:
                llmstep.save(new, target, tokenizer=tok, max_shard_bytes=new_shards)
                interrupted = False
            except Boom:
                interrupted = True
        loaded = state(llmstep.load(target)[0])
        assert same(loaded, old_state) or same(loaded, new_state), f"operation {k}: neither old nor new"
        assert (target / "README.md").read_text() == "the model card\n"
        outcomes.append("new" if same(loaded, new_state) else "old")
        if outcomes[-1] == "old":  # once the new folder is in place, a failed clean-up may leave the old one behind
            assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "template"], f"operation {k}: debris"
        if not interrupted:
            break
    else:
        pytest.fail("the save never completed")
    assert outcomes[0] == "old" and outcomes[-1] == "new" and len(outcomes) > 5, outcomes
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("model*.safetensors*"))
    assert (len(shards) > 1) == (new_shards is not None), shards  # no stale shards of the old save


def test_save_refuses_a_file_as_its_directory(tiny_checkpoint, tmp_path):
    model, _ = llmstep.load(tiny_checkpoint)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile is a file"):
        llmstep.save(model, tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_save_into_a_new_directory_gives_it_the_usual_mode(tiny_checkpoint, tmp_path):
    """What mkdir and open give under the process's umask, not the private 0o700 / 0o600 of the temporary folder
    the checkpoint is written in."""
    model, _ = llmstep.load(tiny_checkpoint)
    umask = os.umask(0o027)
    try:
        out = llmstep.save(model, tmp_path / "new")
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o750
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == dict.fromkeys(
        (f.name for f in out.iterdir()), 0o640)


def test_save_refuses_non_finite_weights_before_writing_anything(tmp_path):
    import llmstep
    from llmstep.core.config import LlamaConfig
    from llmstep.lab.hardware import random_model

    model = random_model(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                     max_seq_len=16), "cpu", torch.float32)
    model.layers[0].feed_forward.w2.weight.data[0, 0] = float("nan")
    with pytest.raises(llmstep.CheckpointError, match=r"model.layers.0.mlp.down_proj.weight holds NaN or Inf"):
        llmstep.save(model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_save_under_a_file_and_a_weights_directory_are_named(tmp_path):
    import llmstep
    from llmstep.core.config import LlamaConfig
    from llmstep.lab.hardware import random_model

    model = random_model(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                     max_seq_len=16), "cpu", torch.float32)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile is a file, not a directory"):
        llmstep.save(model, tmp_path / "afile" / "ckpt")
    llmstep.save(model, tmp_path / "ok")
    (tmp_path / "ok" / "model.safetensors").unlink()
    (tmp_path / "ok" / "model.safetensors").mkdir()
    with pytest.raises(llmstep.CheckpointError, match="model.safetensors is a directory"):
        llmstep.load_model(tmp_path / "ok")


def _small_model():
    from llmstep.core.config import LlamaConfig
    from llmstep.lab.hardware import random_model

    return random_model(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                    max_seq_len=16), "cpu", torch.float32)


def test_save_refuses_a_tensor_its_config_does_not_make_before_writing_anything(tmp_path):
    """A tensor-parallel rank's model holds slices of the config's tensors: written, it would load as nothing."""
    model = _small_model()
    wq = model.layers[0].attention.wq
    wq.weight = torch.nn.Parameter(wq.weight[:16].clone())  # rank 0 of 2's query rows
    with pytest.raises(llmstep.CheckpointError, match=r"layers.0.attention.wq.weight \(model.layers.0.self_attn."
                                                      r"q_proj.weight\) has shape \[16, 32\], its config makes "
                                                      r"\[32, 32\] \(a tensor-parallel rank's shard"):
        llmstep.save(model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype, words", [(torch.int8, "dtype must be a float dtype"),
                                          ("int8", "dtype must be a float dtype"), ("auto", "must be a float dtype"),
                                          (torch.float8_e4m3fn, "not supported")])
def test_save_refuses_a_dtype_that_is_not_a_float_one_before_writing_anything(tmp_path, dtype, words):
    with pytest.raises(ValueError, match=words):
        llmstep.save(_small_model(), tmp_path / "ckpt", dtype=dtype)
    assert list(tmp_path.iterdir()) == []


def test_save_takes_a_dtype_by_name(tmp_path):
    out = llmstep.save(_small_model(), tmp_path / "ckpt", dtype="bfloat16")
    assert llmstep.load_model(out, dtype="bfloat16").layers[0].attention.wq.weight.dtype == torch.bfloat16
    assert '"torch_dtype": "bfloat16"' in (out / "config.json").read_text()


@pytest.mark.parametrize("target", [".", "..", "here"])
def test_save_into_the_current_folder_or_one_holding_it_is_refused_before_writing(tmp_path, monkeypatch, target):
    """The save replaces the folder whole: the process would be left in a deleted folder."""
    model = _small_model()
    (tmp_path / "here" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here" / ("sub" if target != "." else ""))
    with pytest.raises(ValueError, match="it is the current folder or holds it"):
        llmstep.save(model, target if target != "here" else tmp_path / "here")
    assert Path.cwd().exists() and sorted(p.name for p in tmp_path.rglob("*")) == ["here", "sub"]


def test_save_relative_to_the_current_folder(tmp_path, monkeypatch):
    model = _small_model()
    monkeypatch.chdir(tmp_path)
    llmstep.save(model, "ckpt")
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(llmstep.load_model(tmp_path / "ckpt")(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "3MB"])
def test_save_refuses_a_shard_size_that_is_no_number_of_bytes_before_writing_anything(tmp_path, value):
    with pytest.raises(ValueError, match=rf"max_shard_bytes must be a whole number of bytes >= 1.*got {value!r}"):
        llmstep.save(_small_model(), tmp_path / "ckpt", max_shard_bytes=value)
    assert list(tmp_path.iterdir()) == []


def test_two_saves_of_one_quantized_model_are_the_same_bytes(tmp_path):
    """safetensors writes its header's metadata in a hash map's order; save writes the header again, sorted."""
    model = quantize(_small_model(), "int8")
    for i in range(6):  # two metadata keys: without sorting, six saves all in one order by chance 1 time in 32
        llmstep.save(model, tmp_path / f"ckpt{i}", max_shard_bytes=None if i % 2 else 4_000)
    for i in (2, 4):
        assert sorted((p.name, p.read_bytes()) for p in (tmp_path / f"ckpt{i}").iterdir()) == \
               sorted((p.name, p.read_bytes()) for p in (tmp_path / "ckpt0").iterdir())
    for i in (3, 5):
        assert (tmp_path / f"ckpt{i}/model.safetensors").read_bytes() == \
               (tmp_path / "ckpt1/model.safetensors").read_bytes()
    header = (tmp_path / "ckpt1/model.safetensors").read_bytes()[8:]
    assert header.index(b'"format"') < header.index(b'"llmstep_quantization"')
    assert same(state(llmstep.load_model(tmp_path / "ckpt1")), state(model))


@pytest.mark.parametrize("text", ["v", "é€"], ids=["ascii", "not-ascii"])
def test_the_rewritten_header_sorts_many_metadata_keys_and_keeps_every_offset(tmp_path, text):
    tensors = {"b": torch.arange(6.0).reshape(2, 3), f"a{text}": torch.ones(5, dtype=torch.bfloat16)}
    metadata = {str(k): text * k for k in range(16)}  # sixteen keys: a hash order is never the sorted one by chance
    checkpoint._save_file(tensors, tmp_path / "x.safetensors", metadata)
    data = (tmp_path / "x.safetensors").read_bytes()
    positions = [data.index(f'"{k}":'.encode()) for k in sorted(metadata)]
    assert positions == sorted(positions)
    from safetensors import safe_open
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == metadata and all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_a_full_disk_is_an_os_error_naming_the_checkpoint_and_leaves_it_as_it_was(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    model = _small_model()
    target = llmstep.save(model, tmp_path / "ckpt")
    before = sorted((p.name, p.read_bytes()) for p in target.iterdir())

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(OSError, match=rf"cannot save {tmp_path / 'ckpt'}: the weights could not be written "
                                      r"\(.*No space left on device.*\); .* is as it was"):
        llmstep.save(quantize(_small_model(), "int8"), target)
    assert sorted((p.name, p.read_bytes()) for p in target.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left


def test_a_tokenizer_that_cannot_be_written_is_an_os_error_naming_the_file(tiny_checkpoint, tmp_path, monkeypatch):
    model, tok = llmstep.load(tiny_checkpoint)

    class Full:  # tokenizers' Tokenizer.save raises a bare Exception when its write fails
        def __getattr__(self, name):
            return getattr(real, name)

        def save(self, path):
            raise Exception("No space left on device (os error 28)")

    real = tok.tok
    monkeypatch.setattr(tok, "tok", Full())
    with pytest.raises(OSError, match=r"cannot write .*tokenizer.json: No space left on device"):
        llmstep.save(model, tmp_path / "ckpt", tokenizer=tok)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(Full, "save", lambda self, path: [][1])  # any other error is not dressed as a write error
    with pytest.raises(IndexError):
        llmstep.save(model, tmp_path / "ckpt", tokenizer=tok)


@pytest.mark.parametrize("args, kwargs, words", [
    (("model", "ckpt"), {}, "save\\(model, path, tokenizer\\): model must be a llmstep model .*, got str"),
    ((None, 7), {}, "path must be a folder's path, got int"),
    ((None, "ckpt", "tok"), {}, "save: tokenizer must be a Tokenizer or None, got str"),
    ((None, "ckpt"), {"generation_config": 5}, "save: generation_config must be a Mapping or None, got int")])
def test_save_names_an_argument_of_the_wrong_kind_before_writing_anything(tmp_path, monkeypatch, args, kwargs, words):
    monkeypatch.chdir(tmp_path)
    args = tuple(_small_model() if a is None else a for a in args)
    with pytest.raises(TypeError, match=words):
        llmstep.save(*args, **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("double", torch.float64)])
def test_save_takes_the_dtype_names_load_takes(tmp_path, name, dtype):
    model = _small_model()
    llmstep.save(model, tmp_path / "ckpt", dtype=name)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
    assert checkpoint.load_model(tmp_path / "ckpt", dtype=name).dtype == dtype


@pytest.mark.parametrize("model", [123, 1.5, ["target"], b"target"])
def test_load_names_a_model_that_is_neither_a_name_nor_a_path(model):
    with pytest.raises(TypeError, match=f"a path to a checkpoint directory or GGUF file, got {type(model).__name__}"):
        llmstep.load(model)

"""The one loader (llmstep.core.loader): a checkpoint directory parsed once and handed along, one process and
tensor parallelism reading through the same path (a slicer), and the same dtype rule for every file format."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gguf_oracle import random_llama

import llmstep
from llmstep.core import loader, parallel
from llmstep.core.checkpoint import load_model, save
from llmstep.core.tokens import Tokenizer


@pytest.fixture
def reads(monkeypatch) -> collections.Counter:
    """File name -> how many times its text was read (every JSON file llmstep parses is read with read_text)."""
    counts: collections.Counter = collections.Counter()
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        counts[self.name] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    return counts


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_loading_a_directory_parses_config_and_generation_config_once(tiny_checkpoint, reads):
    llmstep.load(tiny_checkpoint, device="cpu")
    assert reads["config.json"] == 1 and reads["generation_config.json"] == 1


def test_a_tensor_parallel_load_parses_them_once_too(tiny_checkpoint, reads, one_rank):
    parallel.load(tiny_checkpoint, device="cpu", dtype="float32")
    assert reads["config.json"] == 1 and reads["generation_config.json"] == 1


def test_one_process_and_a_world_of_one_load_the_same_bits(tmp_path, tokenizer_file, one_rank):
    """The same loader with the whole-tensor slicer and with a rank's: a world of one takes every tensor whole."""
    model = random_llama(torch_dtype="bfloat16")
    path = save(model, tmp_path / "m", Tokenizer.from_file(tokenizer_file), dtype=torch.bfloat16)
    whole = load_model(path, device="cpu", dtype="float32")
    rank = parallel.load_sharded(path, device="cpu", dtype="float32")
    assert rank.split.world == 1 and rank.bytes_read == sum(p.nbytes for p in model.parameters()) // 2
    mine, theirs = whole.state_dict(), rank.state_dict()
    assert set(mine) == set(theirs)
    for name, t in mine.items():
        assert torch.equal(t, theirs[name]), name
        assert torch.equal(t, model.state_dict()[name].to(torch.bfloat16).float()), name  # the file's bits


def test_the_cpu_dtype_rule_is_the_same_for_a_directory_and_a_gguf_file(tmp_path, tokenizer_file, monkeypatch):
    """dtype None on the CPU: float32, except above loader.BIG_CPU_PARAMS, where every loader keeps the file's own
    dtype (a float32 copy of an 8B model would not fit most machines); here the threshold is lowered to 0."""
    from llmstep.core.gguf import export_gguf

    tokenizer = Tokenizer.from_file(tokenizer_file)
    model = random_llama(torch_dtype="float16")
    directory = save(model, tmp_path / "m", tokenizer, dtype=torch.float16)
    file = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f16")
    assert llmstep.load(directory, device="cpu")[0].dtype == llmstep.load(file, device="cpu")[0].dtype == torch.float32
    monkeypatch.setattr(loader, "BIG_CPU_PARAMS", 0)
    assert llmstep.load(directory, device="cpu")[0].dtype == llmstep.load(file, device="cpu")[0].dtype == torch.float16


def test_a_single_file_is_read_before_an_index_beside_it_as_transformers_reads_them(tmp_path, tokenizer_file):
    import shutil

    from conftest import make_checkpoint

    sharded, single = tmp_path / "sharded", tmp_path / "single"
    make_checkpoint(sharded, tokenizer_file, seed=1, max_shard_size="100KB")
    want = make_checkpoint(single, tokenizer_file, seed=2)
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    both = tmp_path / "both"
    shutil.copytree(sharded, both)
    shutil.copy(single / "model.safetensors", both)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(load_model(both)(ids), want(ids).logits, atol=1e-5)  # model.safetensors, not the shards
    for shard in both.glob("model-*.safetensors"):
        shard.unlink()  # a stale index, its shards gone: still the single file
    assert torch.allclose(load_model(both)(ids), want(ids).logits, atol=1e-5)


def test_a_checkpoints_files_are_checked_against_its_vocabulary_at_load(tmp_path, tokenizer_file):
    import json

    from conftest import make_checkpoint

    from llmstep.core.checkpoint_layout import CheckpointError

    path = tmp_path / "ckpt"
    make_checkpoint(path, tokenizer_file)
    vocab = llmstep.load(path)[0].config.vocab_size
    file = path / "generation_config.json"
    gen = json.loads(file.read_text()) if file.exists() else {}
    (path / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [vocab - 1, vocab + 5]}))
    for read in (llmstep.load, load_model):  # the model alone too: a stop id it could never make
        with pytest.raises(CheckpointError, match=rf"generation_config.json: eos_token_id {vocab + 5} is not a "
                                                  rf"token id of the model's vocabulary \(0..{vocab - 1}\)"):
            read(path)
    (path / "generation_config.json").write_text(json.dumps(gen))
    spec = json.loads((path / "tokenizer.json").read_text())
    word = next(iter(spec["model"]["vocab"]))
    spec["model"]["vocab"][word] = vocab + 100  # as many tokens as before, one id past the vocabulary: a gap
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match=rf"tokenizer.json has a token of id {vocab + 100} .*, past the "
                                              rf"model's vocabulary of {vocab} ids"):
        llmstep.load(path)
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.json").mkdir()
    with pytest.raises(IsADirectoryError, match=r"tokenizer.json is a directory, not a tokenizer.json file"):
        llmstep.load(path)

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

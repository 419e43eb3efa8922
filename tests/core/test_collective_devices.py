"""Every collective llmstep runs is handed tensors on its process group's device: NCCL takes CUDA tensors only, each
rank's own GPU (cuda:LOCAL_RANK); gloo takes CPU ones. A CPU tensor handed to NCCL fails on every GPU machine.

Proved without a GPU: a one-rank gloo group in this process answers "nccl" to `dist.get_backend`, a
TorchFunctionMode lets the code under test ask for CUDA tensors (it builds them on the CPU and remembers the device
asked for), and every collective records the device of each tensor it is handed. With world size 1 the model's
own all-reduces do not run (CommStats skips them); they work on the activations, which live where the model does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from llmstep.core import parallel, process_group
from llmstep.core.checkpoint import save
from llmstep.core.config import LlamaConfig
from llmstep.core.model import Llama
from llmstep.core.tokens import Tokenizer
from llmstep.lab import bench_tp

LOCAL_RANK = 1  # not 0: the GPU only torchrun's LOCAL_RANK names (torch.cuda.current_device() says 0 here)
GPU = torch.device("cuda", LOCAL_RANK)
COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce", "gather", "scatter", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_to_all_single")


class PretendCuda(TorchFunctionMode):
    """A factory asked for a CUDA device builds its tensor on the CPU; the device asked for is remembered, and
    `*_like` of such a tensor is remembered as being there too."""

    LIKE = (torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like)

    def __init__(self):
        super().__init__()
        self.devices: dict[int, torch.device] = {}  # id(tensor) -> the CUDA device it was asked on
        self.kept: list[torch.Tensor] = []  # those tensors, kept alive so that no id is reused

    def device_of(self, t: torch.Tensor) -> torch.device:
        return self.devices.get(id(t), t.device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        asked = None
        if kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type == "cuda":
                asked, kwargs["device"] = torch.device(kwargs["device"]), "cpu"
        elif func in self.LIKE and args and id(args[0]) in self.devices:
            asked = self.devices[id(args[0])]
        out = func(*args, **kwargs)
        if asked is not None and isinstance(out, torch.Tensor):
            self.devices[id(out)] = asked
            self.kept.append(out)
        return out


@pytest.fixture
def nccl(monkeypatch, tmp_path):
    """(mode, handed): a one-rank group that says it is NCCL, with LOCAL_RANK=1; `handed` lists (collective,
    [device of each tensor]) for every collective called."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    monkeypatch.setenv("LOCAL_RANK", str(LOCAL_RANK))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a process that never called set_device
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    mode, handed = PretendCuda(), []

    def recorded(name, real):
        def collective(*args, **kwargs):
            parts = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, list) else [a])]
            handed.append((name, [mode.device_of(t) for t in parts if isinstance(t, torch.Tensor)]))
            return real(*args, **kwargs)
        return collective

    def barrier(*args, device_ids=None, **kwargs):  # NCCL's barrier runs on the GPUs device_ids names
        handed.append(("barrier", [torch.device("cuda", i) for i in device_ids or []]))
        return real_barrier(*args, **kwargs)

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, recorded(name, getattr(dist, name)))
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", barrier)
    try:
        yield mode, handed
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def wrong(handed) -> list:
    return [(name, devices) for name, devices in handed if not devices or any(d != GPU for d in devices)]


def test_the_group_device_is_the_ranks_gpu_under_nccl_and_the_cpu_under_gloo(nccl, monkeypatch):
    assert process_group.collective_device() == GPU
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert process_group.collective_device() == torch.device("cpu")


def test_loading_shards_hands_every_collective_the_ranks_gpu(nccl, tmp_path, tokenizer_file):
    """The agreement after each rank reads its slices, and the tied-head check (a tied config whose file also
    holds lm_head.weight: tied only if every rank's slices are equal)."""
    mode, handed = nccl
    config = LlamaConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=32)
    path = save(Llama(config), tmp_path / "m", Tokenizer.from_file(tokenizer_file))
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text.replace('"tie_word_embeddings": false', '"tie_word_embeddings": true'))
    with mode:
        model, _ = parallel.load(path, device="cpu", dtype="float32")
    assert not model.config.tie_embeddings  # the file's head differs from the embedding: kept, as transformers does
    assert [name for name, _ in handed].count("all_reduce") >= 3  # two agreements and the tied-head check
    assert wrong(handed) == []


def test_an_agreed_error_and_the_agreed_seed_use_the_ranks_gpu(nccl):
    mode, handed = nccl
    with mode, pytest.raises(parallel.RankFailed, match="a bad slice"):
        with process_group.agreeing():
            raise ValueError("a bad slice")
    with mode:
        seed = parallel.agree_seed(None)
    assert isinstance(seed, int)
    assert [name for name, _ in handed] == ["all_reduce", "all_gather", "broadcast"]
    assert wrong(handed) == []


def test_the_tp_benchmark_hands_its_timings_and_its_lone_all_reduce_the_ranks_gpu(nccl):
    mode, handed = nccl
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=32)
    model = bench_tp.random_sharded(config, device="cpu")
    with mode:
        record = bench_tp.measure(model, prompt_len=2, new_tokens=2, repeats=1)
    assert record["world_size"] == 1
    assert {name for name, _ in handed} == {"all_gather", "all_reduce"}  # per-rank timings; the lone all-reduce
    assert wrong(handed) == []


def test_leaving_the_group_waits_for_the_others_on_the_ranks_gpu(nccl):
    mode, handed = nccl
    process_group.finish()
    assert handed == [("barrier", [GPU])]
    assert not dist.is_initialized()

"""Tensor parallelism measured and modelled: decode time per token at N ranks, the share spent in the
collectives, and a model of decode time on N GPUs.

    torchrun --standalone --nproc-per-node 2 -m llmstep bench --model target --prompt-len 32 --new-tokens 32

Measured (`measure`, every rank at once): one rank's model (llmstep.core.parallel), batch 1, greedy, a random
prompt; each decode step timed, and inside it each collective (CommStats.timing). all-reduce share = seconds
inside the collectives / decode seconds. A collective's time includes waiting for the slowest rank: on an
oversubscribed machine (more processes than cores) that wait is most of it. `time_all_reduce` times one
all-reduce of the residual stream's size alone: the latency the model below needs.

Modelled (`predict`), per decode step on N devices (Megatron-style, batch 1):

    t(N) = bytes / N / memory_bandwidth  +  (2 n_layers + 1) t_allreduce(dim values)  +  t_allgather(vocab/N values)

bytes: what one step reads (llmstep.core.cost.decode_step_cost: the weights and the KV cache); two all-reduces
per layer (after wo and after w2) and one after the embedding. A ring collective (NCCL's default for these
sizes) takes 2(N-1) steps for an all-reduce, N-1 for an all-gather; its time is
latency + steps * hop latency + bytes moved / link bandwidth, with the constants NCCL's own tuning model uses
(src/graph/tuning.cc, ring, LL protocol: 3.6 us base, 0.47 us per hop on NVLink, 1.0 on PCIe) and the links'
datasheet bandwidths. It ignores overlap and kernel launch overhead: a floor, like every roofline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.checks import check_int
from ..core.config import LlamaConfig
from ..core.cost import decode_step_cost, dtype_bytes, model_bytes
from ..core.device import resolve_dtype, synchronize
from ..core.model import LAST, Llama
from ..core.parallel import (
    TensorParallelLlama,
    build_rank_model,
    check_split,
    collective_device,
    load_sharded,
    rank_device,
    rank_slices,
    split,
)
from . import runinfo
from .bench import choose_model
from .hardware import DATASHEETS

__all__ = ["Link", "LINKS", "collective_seconds", "predict", "prediction_table", "measure", "time_all_reduce",
           "random_sharded", "bench_model", "predict_cpu", "format_measured", "FIT_FRACTION"]


@dataclass(frozen=True)
class Link:
    name: str
    gb_per_s: float  # one direction, per GPU, 1e9 bytes/s
    base_us: float  # a collective's fixed latency (NCCL tuning model, ring LL)
    hop_us: float  # per ring step (NCCL tuning model, ring LL)
    source: str


# NVIDIA H200 datasheet: NVLink 900 GB/s and PCIe Gen5 128 GB/s per GPU, both counting the two directions;
# a ring sends one way, so half. Latencies: NCCL src/graph/tuning.cc (baseLat, hwLat for Ring/LL).
LINKS = {
    "NVLink": Link("NVLink (H200 SXM)", 450.0, 3.6, 0.47, "NVIDIA H200 datasheet (900 GB/s bidirectional); "
                   "NCCL tuning.cc ring LL latencies"),
    "PCIe": Link("PCIe Gen5 x16", 64.0, 3.6, 1.0, "NVIDIA H200 datasheet (128 GB/s bidirectional); "
                 "NCCL tuning.cc ring LL latencies"),
}


# The weights must leave room for the KV cache, activations and the CUDA context: count a model as fitting when
# its weights take at most this share of a device's memory (an assumption, not a datasheet figure).
FIT_FRACTION = 0.9


def collective_seconds(nbytes: float, n: int, link: Link, kind: str = "all_reduce") -> float:
    """A ring all-reduce (2(N-1) steps, each rank sending 2(N-1)/N of the buffer) or all-gather (N-1 steps,
    (N-1)/N of the gathered buffer) of `nbytes` over `link`: 0 on one device."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return (link.base_us + steps * link.hop_us) * 1e-6 + nbytes * steps / n / (link.gb_per_s * 1e9)


def predict(config: LlamaConfig, n: int, chip: str = "H200 SXM", link: str = "NVLink",
            dtype: torch.dtype = torch.bfloat16, context: int = 0) -> dict:
    """One decode step (batch 1) of `config` on n devices: seconds for the bytes, for the collectives, in all."""
    c, lk, b = config, LINKS[link], dtype_bytes(dtype)
    nbytes = decode_step_cost(c, context=context, dtype=dtype).bytes
    memory = nbytes / n / (DATASHEETS[chip].memory_gb_per_s * 1e9)
    comm = (2 * c.n_layers + 1) * collective_seconds(c.dim * b, n, lk) + \
        collective_seconds(c.vocab_size * b, n, lk, "all_gather")
    weights_gb = model_bytes(c, dtype) / 1e9  # what a device must hold: every parameter, the embedding too
    return {"n": n, "link": link, "memory_s": memory, "comm_s": comm, "seconds": memory + comm,
            "comm_share": comm / (memory + comm), "weights_gb_per_device": weights_gb / n,
            "fits": weights_gb / n <= FIT_FRACTION * (DATASHEETS[chip].memory_gb or float("inf"))}


def prediction_table(presets=("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"), ns=(1, 2, 4, 8),
                     links=("NVLink", "PCIe"), chip: str = "H200 SXM") -> list[dict]:
    """predict for each preset, link and N; speedup against the fewest devices the weights fit on."""
    rows = []
    for name in presets:
        config = LlamaConfig.preset(name)
        for link in links:
            fitted = [predict(config, n, chip, link) for n in ns]
            base = next((p for p in fitted if p["fits"]), None)
            for p in fitted:
                p |= {"model": name, "ms_per_token": p["seconds"] * 1e3,
                      "speedup": base["seconds"] / p["seconds"] if base and p["fits"] else None,
                      "speedup_from_n": base["n"] if base else None}
                rows.append(p)
    return rows


# ---- measured ------------------------------------------------------------------------------------

def random_sharded(config: LlamaConfig, group=None, device="cpu", dtype=torch.float32, seed: int = 0,
                   std: float = 0.02) -> TensorParallelLlama:
    """A rank's shard of a random model, drawn on the rank (no rank holds the whole): for timing only."""
    s = split(config, dist.get_rank(group), dist.get_world_size(group))
    with torch.device("meta"):
        shapes = Llama(config)
    slices = rank_slices(config, s)
    g = torch.Generator(device=device).manual_seed(seed * 1000 + s.rank)
    state = {}
    for name, p in shapes.named_parameters():
        shape = list(p.shape)
        if name in slices:
            dim, start, stop = slices[name]
            shape[dim] = s.vocab_rows if name in ("tok_embeddings.weight", "output.weight") else stop - start
        w = torch.empty(shape, device=device, dtype=dtype)
        state[name] = w.fill_(1.0) if name.endswith("norm.weight") else w.normal_(0.0, std, generator=g)
    return build_rank_model(config, s, state, group)


def bench_model(model: str | None = None, preset: str | None = None, random_weights: bool = False,
                overrides: dict | None = None, device=None, dtype=None, seed: int = 0, group=None
                ) -> tuple[TensorParallelLlama, str]:
    """lab.bench.bench_model's choice of model (a preset's shape, a checkpoint, random weights or --set
    overrides), as this rank's shard: the world size checked against the heads first."""
    device = rank_device(device)
    config, path, source = choose_model(model, preset, random_weights, overrides)
    check_split(config, dist.get_world_size(group))
    dtype = resolve_dtype(dtype, device, "bfloat16" if preset else config.torch_dtype)
    if path is None:
        return random_sharded(config, group, device, dtype, seed), source
    return load_sharded(path, group, device, dtype), source


def time_all_reduce(nbytes: int, group=None, device=None, dtype=torch.float32, repeats: int = 200) -> float:
    """Median seconds of one all-reduce of nbytes, alone (after 20 untimed ones), on `device` (None: the group's,
    llmstep.core.process_group.collective_device)."""
    device = collective_device(group) if device is None else torch.device(device)
    x = torch.zeros(max(1, nbytes // dtype_bytes(dtype)), device=device, dtype=dtype)
    times = []
    for i in range(repeats + 20):
        synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        synchronize(device)
        if i >= 20:
            times.append(time.perf_counter() - start)
    return runinfo.median(times)


@torch.inference_mode()
def measure(model: TensorParallelLlama, prompt_len: int = 32, new_tokens: int = 32, repeats: int = 3,
            seed: int = 0, group=None, argv=None) -> dict:
    """Time greedy decode on every rank; return rank 0's view with every rank's all-reduce share."""
    check_int(prompt_len, "prompt_len", low=1)
    check_int(repeats, "repeats", low=1)
    check_int(new_tokens, "new_tokens", low=2)
    if prompt_len + new_tokens > model.config.max_seq_len:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the model's context "
                         f"({model.config.max_seq_len})")
    device, comm = model.device, model.comm
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    per_token, shares, tokens = [], [], []
    load_before = runinfo.load_average()
    for rep in range(repeats + 1):  # the first is a warm-up
        cache = model.new_cache(1, prompt_len + new_tokens)
        x = model(prompt.to(device), cache=cache, keep=LAST)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        comm.reset()
        comm.timing = True
        steps = []
        out = [int(x)]
        for _ in range(new_tokens - 1):
            synchronize(device)
            start = time.perf_counter()
            x = model(x, cache=cache, keep=LAST)[:, -1].argmax(-1, keepdim=True)
            out.append(int(x))  # waits for the device
            steps.append(time.perf_counter() - start)
        comm.timing = False
        if rep:
            per_token.append(sum(steps) / len(steps))
            shares.append(comm.seconds / sum(steps))
            tokens = out
    world = dist.get_world_size(group)  # (one rank runs no collective: its share is 0, no spread)
    mine = torch.tensor([runinfo.median(per_token), runinfo.median(shares)], dtype=torch.float64,
                        device=collective_device(group))  # [2], where the group's collectives take tensors
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = [t.cpu() for t in every]
    dim_bytes = model.config.dim * dtype_bytes(model.dtype)
    collectives = comm.by_kind.get("all_reduce", 0) // (new_tokens - 1)
    return runinfo.header(device, model.dtype, argv, load_before) | {
        "world_size": world, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        "per_token_seconds": runinfo.timing(per_token),
        "all_reduce_share": runinfo.timing(shares) if any(shares) else {"median": 0.0, "spread": 0.0,
                                                                        "all_runs": shares},
        "per_rank": [{"rank": r, "per_token_seconds": float(t[0]), "all_reduce_share": float(t[1])}
                     for r, t in enumerate(every)],
        "all_reduces_per_token": collectives, "all_reduce_bytes": dim_bytes,
        "all_reduce_seconds_alone": time_all_reduce(dim_bytes, group, dtype=model.dtype),
        "weight_bytes_per_rank": sum(p.nbytes for p in model.parameters()), "tokens": tokens,
        "threads_per_rank": torch.get_num_threads(),
    }


def predict_cpu(one: dict, n: int, all_reduce_seconds: float, cores: int) -> float:
    """The same model on a CPU, from measured numbers: the 1-process step's time over min(N, cores) (the
    bytes split N ways, but only `cores` processes run at once) plus the step's all-reduces at the latency
    measured alone at this N."""
    t1 = one["per_token_seconds"]["median"]
    return t1 / min(n, cores) + one["all_reduces_per_token"] * all_reduce_seconds * (n > 1)


def format_measured(record: dict) -> str:
    t, s = record["per_token_seconds"], record["all_reduce_share"]
    by_rank = ", ".join(f"{r['all_reduce_share']:.0%}" for r in record["per_rank"])
    return (f"{record['world_size']} rank(s): {t['median'] * 1e3:.2f} ms/token (spread {t['spread']:.0%}), "
            f"all-reduce share {s['median']:.0%} on rank 0 "
            f"({by_rank} by rank); "
            f"{record['all_reduces_per_token']} all-reduces of {record['all_reduce_bytes']:,} B per token, "
            f"{record['all_reduce_seconds_alone'] * 1e6:.0f} us each alone; "
            f"{record['weight_bytes_per_rank'] / 1e6:.1f} MB of weights per rank")

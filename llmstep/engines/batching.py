"""Continuous batching: many requests share the model, and one decode step advances all of them.

At batch 1 a decode step streams every weight to make one token. The same pass can serve B sequences:
the weights are read once, and each extra row adds only its own KV cache and a row of arithmetic, so B
requests decoding together make ~B tokens per weight pass, until the math or the KV cache catches up.

*Static* batching takes B requests, runs them until the longest is done, then takes the next B: a slot
whose request finished early sits idle. *Continuous* batching (Orca, Yu et al. 2022; vLLM) admits a
waiting request into a slot the moment one frees. Every engine step:

1. requests that have arrived join the queue;
2. free slots take requests from the queue (static: only when every slot is free); each newcomer's
   prompt is prefilled alone into its own row of the cache (`cache.slot(i)`), which gives its first token
   (a newcomer done at once, stopped by that token, frees its slot for the next in the queue);
3. one decode step for all slots: tokens [S, 1] at positions [S, 1], every row at its own position, the
   model's one forward. A free slot rides along with a dummy token at position 0 (fixed shapes, as CUDA
   graphs need): nothing reads it, and the next prompt in that row overwrites it. Keys that an earlier
   occupant left beyond a row's position are hidden by the causal mask, which compares positions;
4. requests that hit a stop token, their max_new_tokens, or the end of their slot leave.

Each request samples with its own generator, one draw per row, from `llmstep.sampling`: its tokens are
the ones `llmstep.generate` gives it alone with the same seed and the same cache size. Batching changes
when a token is made, not which token (up to the float rounding of a batched matmul; exact in float64).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from numbers import Integral

import torch

from ..cli import exit_on_bad_input
from ..core.device import synchronize
from ..core.model import Llama
from ..core.sampling import check_params, sample
from .fast import compile_step, uses_cuda_graphs
from .generate import check_max_new_tokens, check_prompt_ids, make_generator, stop_id_set

__all__ = ["Request", "Completion", "BatchRun", "ContinuousBatcher", "run_batch", "random_workload",
           "measure_batch_scaling", "POLICIES"]

POLICIES = ("continuous", "static")


@dataclass
class Request:
    """One generation request. arrival: the engine step at which it joins the queue."""

    prompt_ids: list[int] | torch.Tensor
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: Iterable[int] = ()  # () never stops early; pass tokenizer.eos_ids to stop at the end of a text
    arrival: int = 0


@dataclass
class Completion:
    """What became of a request: its tokens, and when (in engine steps and in seconds) things happened."""

    id: int  # the request's index in the order it was submitted
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, a final stop token included
    stop_reason: str = ""  # "stop", "length" or "context", as in llmstep.generate
    slot: int = -1
    arrival: int = 0  # engine step it arrived at
    admitted: int = -1  # engine step its prompt was prefilled in
    finished: int = -1  # engine step its last token was made in
    first_token_seconds: float = float("nan")  # from the start of its arrival step to its first token
    latency_seconds: float = float("nan")  # from the start of its arrival step to its last token

    @property
    def queued_steps(self) -> int:
        return self.admitted - self.arrival

    @property
    def latency_steps(self) -> int:
        """Engine steps from arrival to the last token, both counted."""
        return self.finished - self.arrival + 1


@dataclass
class BatchRun:
    """A finished run: every request's completion, and the slots' timeline for plotting.

    timeline[s][i]: the request id slot i decoded for in engine step s, or -1 when the slot was free.
    prefills: (engine step, slot, request id) for every prompt prefilled.
    """

    policy: str
    n_slots: int
    completions: list[Completion]
    timeline: list[list[int]] = field(default_factory=list)
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # per engine step: its prefills and decode step
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.timeline)

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def slot_utilisation(self) -> float:
        """The share of decode-step rows that served a request rather than a free slot."""
        rows = [i for step in self.timeline for i in step]
        return sum(i >= 0 for i in rows) / len(rows) if rows else float("nan")

    def summary(self) -> dict:
        lat = [c.latency_steps for c in self.completions]
        served = [c for c in self.completions if c.tokens]  # a request for 0 tokens has no first token
        return {"policy": self.policy, "slots": self.n_slots, "requests": len(self.completions),
                "tokens": self.tokens, "engine_steps": self.steps, "slot_utilisation": self.slot_utilisation,
                "mean_latency_steps": statistics.fmean(lat) if lat else float("nan"),
                "max_latency_steps": max(lat, default=0),
                "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
                "mean_first_token_seconds": statistics.fmean(c.first_token_seconds for c in served)
                if served else float("nan"),
                "mean_latency_seconds": statistics.fmean(c.latency_seconds for c in self.completions)
                if self.completions else float("nan")}


@dataclass
class _Running:
    completion: Completion
    request: Request
    stops: set[int]
    generator: torch.Generator
    arrived_at: float  # wall time at the start of its arrival step


class ContinuousBatcher:
    """n_slots rows of KV cache, max_len positions each, and the batched decode step over them.

    compile: compile the decode step (see `llmstep.fast`; on CUDA with CUDA graphs). None compiles on
    CUDA only. Frozen weights on a CPU: change the model's weights and you need a new batcher.
    """

    def __init__(self, model: Llama, n_slots: int = 8, max_len: int | None = None, compile: bool | None = None,
                 mode: str | None = None):
        if not isinstance(n_slots, int) or isinstance(n_slots, bool) or n_slots < 1:
            raise ValueError(f"n_slots must be an integer >= 1, got {n_slots!r}")
        self.model, self.device, self.n_slots = model, model.device, n_slots
        self.max_len = model.config.max_seq_len if max_len is None else max_len
        self.cache = model.new_cache(batch_size=n_slots, max_len=self.max_len)  # k, v: [L, S, n_kv, max_len, hd]
        self.compiled = self.device.type == "cuda" if compile is None else bool(compile)
        self.cuda_graphs = self.compiled and uses_cuda_graphs(self.device, mode)
        self._step = self._decode_step
        if self.compiled:
            self._step = compile_step(self._decode_step, self.device, mode,
                                      static=self.cache.buffers)

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [S, 1], positions [S, 1] -> logits [S, vocab] (float32): one token for every slot."""
        return self.model(tokens, positions, self.cache, last_only=True)[:, -1].float()

    def _check(self, i: int, r: Request) -> tuple[list[int], set[int]]:
        """A request's prompt ids and stop ids, checked (read once: either may be a one-shot iterator)."""
        where = f"request {i}"
        try:
            check_params(r.temperature, r.top_k, r.top_p)
            check_max_new_tokens(r.max_new_tokens)
            if not isinstance(r.arrival, Integral) or isinstance(r.arrival, bool) or r.arrival < 0:
                raise ValueError(f"arrival must be an engine step (an integer >= 0), got {r.arrival!r}")
            stops = stop_id_set(r.stop_ids)
            return check_prompt_ids(r.prompt_ids, self.model.config.vocab_size, self.max_len,
                                    room="a batch slot's length"), stops
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], policy: str = "continuous") -> BatchRun:
        """Serve every request; returns their completions (in submission order) and the timeline."""
        if policy not in POLICIES:
            raise ValueError(f"unknown batching policy {policy!r}: choose one of {', '.join(POLICIES)}")
        checked = [self._check(i, r) for i, r in enumerate(requests)]  # all checked before any work
        device = self.device
        run = BatchRun(policy, self.n_slots, [Completion(i, p, arrival=int(r.arrival))
                                              for i, (r, (p, _)) in enumerate(zip(requests, checked, strict=True))])
        arrivals = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
        queue: deque[_Running] = deque()
        slots: list[_Running | None] = [None] * self.n_slots
        self.cache.reset()
        step, start = 0, time.perf_counter()

        while arrivals or queue or any(slots):
            while not queue and not any(slots) and requests[arrivals[0]].arrival > step:
                run.timeline.append([-1] * self.n_slots)  # nothing to do until the next request arrives
                run.step_seconds.append(0.0)
                step += 1
            synchronize(device)
            step_start = time.perf_counter()
            while arrivals and requests[arrivals[0]].arrival <= step:
                i = arrivals.popleft()
                r = requests[i]
                queue.append(_Running(run.completions[i], r, checked[i][1], make_generator(device, r.seed),
                                      step_start))
            if policy == "static" and not any(slots):  # a static batch takes newcomers only when all of it is done
                for s in range(min(self.n_slots, len(queue))):
                    self._prefill(queue.popleft(), s, slots, run, step)
            while policy == "continuous" and queue and None in slots:  # also a slot freed by a prefill's token
                self._prefill(queue.popleft(), slots.index(None), slots, run, step)
            run.timeline.append([-1 if j is None else j.completion.id for j in slots])  # whom the step serves
            if any(slots):
                self._decode(slots, step)
            synchronize(device)
            run.step_seconds.append(time.perf_counter() - step_start)
            step += 1
        run.seconds = time.perf_counter() - start
        return run

    def _prefill(self, job: _Running, s: int, slots: list, run: BatchRun, step: int) -> None:
        """Admit a request into slot s: its prompt alone through the model into row s of the cache, at
        positions 0..T-1, gives its first token."""
        c, r = job.completion, job.request
        slots[s], c.slot, c.admitted = job, s, step
        run.prefills.append((step, s, c.id))
        if r.max_new_tokens == 0:
            self._finish(job, slots, "length", step)
            return
        prompt = torch.tensor([c.prompt_ids], device=self.device)  # [1, T]
        logits = self.model(prompt, torch.arange(prompt.shape[1], device=self.device), self.cache.slot(s),
                            last_only=True)[:, -1]  # [1, vocab]
        token = sample(logits.float(), r.temperature, r.top_k, r.top_p, job.generator)  # [1]
        self._take(job, int(token), slots, step)  # waits for the device: the scheduler needs the token

    def _decode(self, slots: list, step: int) -> None:
        """One decode step for every slot: each running request's newest token at its own position."""
        tokens = torch.tensor([[0 if j is None else j.completion.tokens[-1]] for j in slots],
                              device=self.device)  # [S, 1]: a free slot feeds token 0 at position 0
        positions = torch.tensor([[0 if j is None else self._position(j)] for j in slots], device=self.device)
        logits = self._step(tokens, positions)  # [S, vocab]
        running = [(s, j) for s, j in enumerate(slots) if j is not None]
        drawn = torch.cat([sample(logits[s:s + 1], j.request.temperature, j.request.top_k, j.request.top_p,
                                  j.generator) for s, j in running])  # [running]: one draw per row, its generator
        for (_, job), token_id in zip(running, drawn.tolist(), strict=True):  # one wait for the device
            self._take(job, token_id, slots, step)

    @staticmethod
    def _position(job: _Running) -> int:
        """Where a running request's newest token goes: after its prompt and the tokens before it."""
        return len(job.completion.prompt_ids) + len(job.completion.tokens) - 1

    def _take(self, job: _Running, token_id: int, slots: list, step: int) -> None:
        """Record a request's new token; free its slot if it is done."""
        c = job.completion
        if not c.tokens:
            c.first_token_seconds = time.perf_counter() - job.arrived_at
        c.tokens.append(token_id)
        if token_id in job.stops:
            self._finish(job, slots, "stop", step)
        elif len(c.tokens) == job.request.max_new_tokens:
            self._finish(job, slots, "length", step)
        elif self._position(job) >= self.max_len:  # the slot is full: nowhere to write this token
            self._finish(job, slots, "context", step)

    @staticmethod
    def _finish(job: _Running, slots: list, reason: str, step: int) -> None:
        c = job.completion
        c.stop_reason, c.finished = reason, step
        c.latency_seconds = time.perf_counter() - job.arrived_at
        slots[c.slot] = None


def run_batch(model: Llama, requests: Sequence[Request], n_slots: int = 8, policy: str = "continuous",
              max_len: int | None = None, compile: bool | None = None) -> BatchRun:
    """One-shot: a ContinuousBatcher with n_slots slots serves `requests`."""
    return ContinuousBatcher(model, n_slots, max_len, compile).run(requests, policy)


def random_workload(n_requests: int, vocab_size: int, prompt_len: tuple[int, int] = (16, 64),
                    new_tokens: tuple[int, int] = (8, 128), rate: float | None = None, seed: int = 0,
                    temperature: float = 0.0) -> list[Request]:
    """n_requests with prompt lengths and output lengths drawn uniformly from the given (low, high) ranges,
    random prompt ids, no stop tokens (each writes exactly its new tokens), arriving as a Poisson process
    of `rate` requests per engine step (None: all at step 0). Seeded: the same seed, the same workload."""
    if not isinstance(n_requests, Integral) or n_requests < 0:
        raise ValueError(f"n_requests must be an integer >= 0, got {n_requests!r}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got ({lo}, {hi})")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0 requests per step (or None: all at once), got {rate}")
    g = torch.Generator().manual_seed(seed)

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    requests, clock = [], 0.0
    for i in range(n_requests):
        if rate is not None and i:
            clock += float(torch.empty(1).exponential_(rate, generator=g))
        prompt = torch.randint(0, vocab_size, (between(*prompt_len),), generator=g).tolist()
        requests.append(Request(prompt, between(*new_tokens), temperature=temperature, seed=seed + i,
                                arrival=int(clock)))
    return requests


@torch.inference_mode()
def measure_batch_scaling(model: Llama, batch_sizes: Iterable[int] = (1, 2, 4, 8, 16), context: int = 64,
                          repeats: int = 10, compile: bool | None = False) -> list[dict]:
    """Time one decode step at each batch size, every row `context` tokens in: the weights are read once
    per step whatever the batch, so tokens/s grows with the batch until the step stops being memory-bound."""
    from ..core.cost import decode_step_cost

    rows = []
    for batch in batch_sizes:
        batcher = ContinuousBatcher(model, batch, max_len=context + 1, compile=compile)
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=batcher.device)
        positions = torch.full((batch, 1), context, dtype=torch.long, device=batcher.device)
        for _ in range(3):  # warm up (and compile)
            batcher._step(tokens, positions)
        times = []
        for _ in range(repeats):
            synchronize(batcher.device)
            start = time.perf_counter()
            batcher._step(tokens, positions)
            synchronize(batcher.device)
            times.append(time.perf_counter() - start)
        cost = decode_step_cost(model.config, context, model.dtype, batch=batch)
        seconds = statistics.median(times)
        rows.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_second": batch / seconds,
                     "bytes_per_step": cost.bytes, "bytes_per_token": cost.bytes / batch,
                     "flops_per_byte": cost.arithmetic_intensity,
                     "gb_per_second": cost.bytes / seconds / 1e9, "tflops": cost.flops / seconds / 1e12})
    return rows


def _parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None


def _parse_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmstep batch", description="Serve a random workload with static and "
                                "continuous batching, side by side, and time a decode step at each batch size.")
    p.add_argument("--model", default=None, help="checkpoint directory, or target/draft (default: target)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--slots", type=_parse_ints, default=[1, 4, 8], help="batch slots to try, e.g. 1,4,8")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=_parse_range, default=(16, 64), help="LOW:HIGH tokens")
    p.add_argument("--new-tokens", type=_parse_range, default=(8, 128), help="LOW:HIGH tokens")
    p.add_argument("--rate", type=float, default=None, help="arrivals per engine step (default: all at once)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-sizes", type=_parse_ints, default=[1, 2, 4, 8, 16, 32],
                   help="batch sizes for the decode-step timing")
    p.add_argument("--context", type=int, default=64, help="context of the decode-step timing")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the whole record here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    return exit_on_bad_input("batch", _main, args, sys.argv[1:] if argv is None else list(argv))


def _main(args, argv: list[str]) -> dict:
    import platform
    from pathlib import Path

    from .. import __version__
    from ..core.checkpoint import load_model
    from ..lab.hardware import describe

    if args.requests < 1 or (args.threads is not None and args.threads < 1):
        raise ValueError(f"--requests and --threads must be >= 1, got {args.requests} and {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    requests = random_workload(args.requests, model.config.vocab_size, args.prompt_len, args.new_tokens, args.rate,
                               args.seed, args.temperature)
    # Room for every request, up to the model's context (a longer request stops there, as generate does).
    max_len = min(max(len(r.prompt_ids) + r.max_new_tokens for r in requests), model.config.max_seq_len)
    record = {"command": "llmstep batch " + " ".join(argv),
              "model": str(args.model or "target"), "device": describe(model.device)["name"],
              "dtype": str(model.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "versions": {"llmstep": __version__, "torch": torch.__version__, "python": platform.python_version()},
              "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "rate": args.rate, "temperature": args.temperature, "seed": args.seed},
              "runs": [], "batch_scaling": []}
    print(f"llmstep batch: {record['model']} on {record['device']} {record['dtype']}, {args.requests} requests",
          flush=True)
    print(f"{'policy':<11} {'slots':>5} {'steps':>6} {'busy':>6} {'tok/s':>9} {'latency':>9} {'first tok':>10}")
    reference = None
    for n_slots in args.slots:
        batcher = ContinuousBatcher(model, n_slots, max_len, compile=args.compile)
        batcher.run(requests[:1], "continuous")  # warm up (and compile) before timing
        for policy in POLICIES if n_slots > 1 else POLICIES[:1]:
            run = batcher.run(requests, policy)
            tokens = [c.tokens for c in run.completions]
            reference = tokens if reference is None else reference
            summary = run.summary() | {"same_tokens_as_first_run": tokens == reference,
                                       "completions": [asdict(c) for c in run.completions]}
            record["runs"].append(summary)
            print(f"{policy:<11} {n_slots:>5} {run.steps:>6} {run.slot_utilisation:>6.0%} "
                  f"{run.tokens_per_second:>9,.1f} {summary['mean_latency_seconds']:>8.2f}s "
                  f"{summary['mean_first_token_seconds']:>9.2f}s", flush=True)
    print(f"\none decode step, {args.context} tokens of context in every row:")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>9} {'MB/token':>9} {'FLOP/byte':>10}")
    for row in measure_batch_scaling(model, args.batch_sizes, args.context, compile=args.compile):
        record["batch_scaling"].append(row)
        print(f"{row['batch']:>5} {row['step_ms']:>8.2f} {row['tokens_per_second']:>9,.1f} "
              f"{row['bytes_per_token'] / 1e6:>9.2f} {row['flops_per_byte']:>10.1f}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


if __name__ == "__main__":
    main()

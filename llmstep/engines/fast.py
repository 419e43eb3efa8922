"""The decode loop without the overhead: a static KV cache, the step compiled whole, sampling on the device.

`llmstep.generate` is the teaching loop: it waits for every token, turns it into text and counts its
bytes before the next step starts. At batch 1 a step of a small model is mostly that overhead, and on
a GPU the hundreds of kernel launches per step cost more than the weights take to stream. This loop
removes what is not the model:

- the KV cache is allocated once (`model.new_cache`, max_len slots) and written at explicit positions,
  so every decode step has the same shapes: token [1, 1] at position [1, 1];
- that step (`model(token, position, cache)`, the same forward as everywhere else: nothing here forks
  the model's math) is compiled whole with torch.compile (`compile_step`); on CUDA with mode
  "reduce-overhead", which records it once as a CUDA graph and replays it with one launch per token; on
  a CPU with the weights frozen into the compiled code (packed for oneDNN, q/k/v and gate/up each
  concatenated into one matmul) and a C++ wrapper between the kernels instead of Python. Frozen means
  frozen: change the model's weights and you need a new decoder;
- the position lives on the device and is advanced there; the sampled token is fed back without
  leaving it (`llmstep.sampling` draws with the exponential race, no torch.multinomial sync); tokens are
  copied to the host once at the end, or every `sync_every` steps when stop tokens are watched;
- the prompt goes through the model's one forward (PyTorch's fused scaled_dot_product_attention) once.

With compile=False it is the plain eager model in the same loop, and it gives the tokens
`llmstep.generate` gives: greedy, and seeded sampling (the same generator, the same draws in the same
order). tests/test_fast.py holds both to that.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..core.device import synchronize
from ..core.model import Llama
from ..core.sampling import check_params, sample
from .generate import check_max_new_tokens, check_prompt_ids, make_generator, stop_id_set

__all__ = ["FastResult", "FastDecoder", "fast_generate", "compile_step", "compile_options", "uses_cuda_graphs"]


def compile_options(device: torch.device, mode: str | None = None) -> dict:
    """torch.compile's inductor options for a decode step on `device` (mode None: this device's best).

    CUDA: mode "reduce-overhead", i.e. CUDA graphs. CPU: freeze the weights into the compiled code
    (`freezing`: packed layouts, constant folding), concatenate the linears that read one input
    (`cpp.enable_concat_linear`: wq|wk|wv and w1|w3 become one matmul each, so a step makes 4 weight
    passes per layer instead of 7), and call the kernels from C++ (`cpp_wrapper`), not from Python.
    "max-autotune" also times inductor's own C++ GEMM templates against oneDNN for every matmul shape.
    """
    if mode is None:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
    import torch._inductor

    options = dict(torch._inductor.list_mode_options(mode))
    if device.type == "cpu":
        options |= {"freezing": True, "cpp.enable_concat_linear": True, "cpp_wrapper": True}
    return options


def uses_cuda_graphs(device: torch.device, mode: str | None = None) -> bool:
    """Whether `compile_step` records the step as a CUDA graph on `device` in `mode`."""
    return device.type == "cuda" and bool(compile_options(device, mode).get("triton.cudagraphs"))


def compile_step(fn, device: torch.device, mode: str | None = None, static: Iterable[torch.Tensor] = ()):
    """fn compiled whole for `device` (see `compile_options`), fixed shapes; `static` are tensors it
    updates in place every call (a KV cache): fixed addresses let a CUDA graph write them directly.
    With CUDA graphs, each call first tells PyTorch that the last call's outputs are consumed, so the
    graph may reuse their memory: use what a step returns before calling it again."""
    for t in static:
        torch._dynamo.mark_static_address(t)
    # Dynamo keeps one compiled version per code object and shape: every decoder, batcher or batch size compiles
    # this same step anew, and a process that builds more than 8 of them would hit the default limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    options = compile_options(device, mode)
    compiled = torch.compile(fn, options=options, fullgraph=True, dynamic=False)
    if uses_cuda_graphs(device, mode):

        def graphed_step(*args):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)

        return graphed_step
    if not options.get("freezing"):
        return compiled
    import torch._inductor.config as inductor_config

    def frozen_step(*args):
        # Dynamo decides whether parameters become constants from the global `freezing` flag when it
        # traces, not from compile's options: hold it set while a call may trace (cost: ~1 us a call).
        before, inductor_config.freezing = inductor_config.freezing, True
        try:
            return compiled(*args)
        finally:
            inductor_config.freezing = before

    return frozen_step


@dataclass
class FastResult:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, a final stop token included
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # all decode steps together (one timer, synchronised at the end)
    decode_steps: int = 0  # forward passes after the prefill: len(tokens) - 1 when nothing stopped early
    stop_reason: str = ""  # "stop", "length" or "context", as in llmstep.generate

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else float("nan")


class FastDecoder:
    """One model, one static cache, one (optionally compiled) decode step; call `generate` many times.

    compile: None compiles on CUDA only (a CPU compile takes tens of seconds: worth it for a benchmark or a
    long run, not for one short generation).
    mode: torch.compile's mode; None is "reduce-overhead" (CUDA graphs) on CUDA, the default elsewhere;
    "max-autotune" also tunes every matmul (slowest to compile, fastest on a CPU). See `compile_options`.
    """

    def __init__(self, model: Llama, max_len: int | None = None, compile: bool | None = None, mode: str | None = None):
        self.model = model
        self.device = model.device
        self.max_len = model.config.max_seq_len if max_len is None else max_len
        self.cache = model.new_cache(batch_size=1, max_len=self.max_len)  # k, v: [layers, 1, n_kv, max_len, hd]
        self.compiled = self.device.type == "cuda" if compile is None else bool(compile)
        self.cuda_graphs = self.compiled and uses_cuda_graphs(self.device, mode)
        self.compile_seconds = 0.0  # spent in the first calls of the compiled step (warmup)
        self._warm = not self.compiled
        self._step = self._decode_step
        if self.compiled:
            self._step = compile_step(self._decode_step, self.device, mode, static=self.cache.buffers)

    def _decode_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """token [1, 1], position [1, 1] -> logits [1, vocab] (float32): one token through the model."""
        return self.model(token, position, self.cache, last_only=True)[:, -1].float()

    @torch.no_grad()
    def warmup(self, steps: int = 3) -> float:
        """Compile (and on CUDA record the graph) before timing anything; returns the seconds it took."""
        if self._warm:
            return 0.0
        synchronize(self.device)
        start = time.perf_counter()
        token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        position = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        for _ in range(steps):  # reduce-overhead records on the second or third call
            self._step(token, position)
        synchronize(self.device)
        self.cache.reset()
        self.compile_seconds = time.perf_counter() - start
        self._warm = True
        return self.compile_seconds

    @torch.no_grad()
    def generate(self, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_ids: Iterable[int] = (),
                 sync_every: int = 32) -> FastResult:
        """Continue prompt_ids (a list of ids) by up to max_new_tokens tokens; see llmstep.generate.

        Stops at `stop_ids` (checked every sync_every steps; the tokens after a stop are dropped, so the
        result is what a loop that checked every token would give). Empty stop_ids: never stop early.
        """
        check_params(temperature, top_k, top_p)
        check_max_new_tokens(max_new_tokens)
        ids = check_prompt_ids(prompt_ids, self.model.config.vocab_size, self.max_len, room="the cache it may fill")
        self.warmup()
        result = FastResult(prompt_ids=ids)
        # The last token is sampled but never written, so max_len slots allow max_len - len(ids) + 1 tokens.
        n = min(max_new_tokens, self.max_len - len(ids) + 1)
        result.stop_reason = "length" if n == max_new_tokens else "context"
        if n == 0:
            return result
        device, stops = self.device, sorted(stop_id_set(stop_ids))
        generator = make_generator(device, seed)  # the generator llmstep.generate uses: the same draws
        stop_tensor = torch.tensor(stops, device=device, dtype=torch.long)
        out = torch.empty(n, dtype=torch.long, device=device)  # the new tokens, on the device until the end

        self.cache.reset()
        prompt = torch.tensor([ids], device=device)  # [1, T]
        synchronize(device)
        start = time.perf_counter()
        logits = self.model(prompt, torch.arange(len(ids), device=device), self.cache, last_only=True)[:, -1]
        token = sample(logits.float(), temperature, top_k, top_p, generator)  # [1]
        out[0] = token[0]
        synchronize(device)
        result.prefill_seconds = time.perf_counter() - start

        position = torch.full((1, 1), len(ids), dtype=torch.long, device=device)  # advanced on the device
        steps, stopped = 0, False
        start = time.perf_counter()
        for i in range(1, n):
            if stops and i % sync_every == 0 and bool(torch.isin(out[:i], stop_tensor).any()):  # one sync
                stopped = True
                break
            logits = self._step(token.view(1, 1), position)
            token = sample(logits, temperature, top_k, top_p, generator)
            out[i] = token[0]
            position += 1
            steps += 1
        tokens = out[: steps + 1].tolist()  # waits for the device: the end of the timed region
        result.decode_seconds = time.perf_counter() - start
        result.decode_steps = steps
        if stops:
            hit = next((j for j, t in enumerate(tokens) if t in stops), None)
            if hit is not None:
                tokens, result.stop_reason = tokens[: hit + 1], "stop"
            elif stopped:  # cannot happen: the sync found a stop token
                raise RuntimeError("stop token seen on the device but not on the host")
        result.tokens = tokens
        return result


def fast_generate(model: Llama, prompt_ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_ids: Iterable[int] = (),
                  compile: bool | None = None) -> FastResult:
    """One-shot: a FastDecoder sized for this prompt (the cache llmstep.generate would allocate)."""
    n_ctx = min(model.config.max_seq_len, len(prompt_ids) + max_new_tokens)
    decoder = FastDecoder(model, max_len=max(n_ctx, len(prompt_ids) + 1), compile=compile)
    return decoder.generate(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_ids)

"""The load generator: requests arriving at random against a running server, as vLLM's serving benchmark sends them.

Arrivals are a Poisson process at `rate` requests per second (the gaps between them exponential, seeded), so
requests bunch up and spread out as real users do; rate inf sends them all at once. Each request is a streamed
/v1/completions of random token ids (prompt length and max_tokens drawn from their ranges, `ignore_eos` so that
each makes exactly max_tokens), greedy; with `shared_prefix` every prompt starts with the same system prompt (what
prefix caching shares). For every request the client clock records when it was sent, when each
token's event arrived and when it ended:

- TTFT, time to first token: sent -> first token (queueing + prefill, what a user waits before anything shows);
- ITL, inter-token latency: the gaps between consecutive tokens of a request (what a user sees as the pace);
- end-to-end latency; and for the run, output tokens per second and requests per second.

Latencies are summarised as p50/p90/p99 over all requests (ITL over all gaps). A 429 (the server's queue is
full) counts as refused, not as a latency. The record starts with llmstep.lab.runinfo's header (this client's
machine and command) and names the server's model, device and options from its /health.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

__all__ = ["check_server", "RequestTiming", "percentiles", "system_prompt", "run_load", "summarise", "bench"]


@dataclass
class RequestTiming:
    prompt_tokens: int
    max_tokens: int
    sent: float = math.nan  # client clock, seconds
    token_times: list[float] = field(default_factory=list)
    ended: float = math.nan
    status: int = 0  # HTTP status; 0: no answer (a connection error)
    completion_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict:
    """p50/p90/p99 (linear between the closest ranks, numpy's default); nan for no values."""
    xs = sorted(values)
    out = {}
    for p in ps:
        if not xs:
            out[f"p{p}"] = math.nan
            continue
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return out


async def _one(client, url: str, model: str, ids: list[int], t: RequestTiming) -> None:
    body = {"model": model, "prompt": ids, "max_tokens": t.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t.sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            t.status = response.status_code
            if response.status_code != 200:
                t.error = (await response.aread()).decode(errors="replace")[:200]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    t.error = event["error"]["message"]
                elif event.get("choices"):
                    t.token_times.append(time.perf_counter())
                elif event.get("usage"):
                    t.completion_tokens = event["usage"]["completion_tokens"]
    except Exception as e:  # a connection refused or cut: recorded, the run goes on
        t.error = f"{type(e).__name__}: {e}"
    finally:
        t.ended = time.perf_counter()


def system_prompt(n: int, vocab_size: int) -> list[int]:
    """The `n` random token ids every request of a shared-prefix load starts with: the same for every seed, so a
    warm-up run with another seed fills the server's prefix cache for the timed run."""
    rng = random.Random("llmstep system prompt")  # a str seed: the same in every process (no hash randomisation)
    return [rng.randrange(vocab_size) for _ in range(n)]


async def run_load(url: str, rate: float, requests: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int],
                   seed: int = 0, timeout: float = 600.0, shared_prefix: int = 0) -> tuple[list[RequestTiming], float]:
    """Send `requests` requests at a Poisson `rate` per second; returns their timings and the run's seconds.
    shared_prefix: every prompt starts with the same `system_prompt` of that many tokens, then its own
    prompt_len tokens (a chat server's system prompt: what prefix caching shares)."""
    import httpx

    if shared_prefix < 0:
        raise ValueError(f"shared_prefix must be >= 0 tokens, got {shared_prefix!r}")
    url = url.rstrip("/")
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        health = (await client.get(f"{url}/health")).json()
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        system, timings, prompts = system_prompt(shared_prefix, health["vocab_size"]), [], []
        for _ in range(requests):
            n = rng.randint(*prompt_len)
            prompts.append(system + [rng.randrange(health["vocab_size"]) for _ in range(n)])
            timings.append(RequestTiming(shared_prefix + n, rng.randint(*new_tokens)))
        gaps = [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(requests)]
        start, tasks = time.perf_counter(), []
        for ids, t, gap in zip(prompts, timings, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(client, url, model, ids, t)))
        await asyncio.gather(*tasks)
    return timings, time.perf_counter() - start


def summarise(timings: list[RequestTiming], seconds: float, rate: float) -> dict:
    ok = [t for t in timings if t.ok and t.token_times]
    ttft = [t.token_times[0] - t.sent for t in ok]
    itl = [b - a for t in ok for a, b in zip(t.token_times[:-1], t.token_times[1:], strict=True)]
    e2e = [t.ended - t.sent for t in ok]
    tokens = sum(len(t.token_times) for t in ok)
    ms = lambda xs: {k: v * 1e3 for k, v in percentiles(xs).items()}  # noqa: E731
    return {"rate_per_second": rate, "requests": len(timings), "completed": len(ok),
            "refused_429": sum(t.status == 429 for t in timings),
            "failed": sum(not t.ok and t.status != 429 for t in timings), "seconds": seconds,
            "output_tokens": tokens, "output_tokens_per_second": tokens / seconds if seconds else math.nan,
            "requests_per_second": len(ok) / seconds if seconds else math.nan,
            "ttft_ms": ms(ttft), "itl_ms": ms(itl), "e2e_latency_ms": ms(e2e),
            "errors": sorted({t.error for t in timings if t.error})[:5],
            "failures": sorted({t.error or f"HTTP {t.status}" for t in timings if not t.ok and t.status != 429})[:5]}


def check_server(url: str, longest: int) -> dict:
    """The /health of the llmstep server at url (ValueError if what answers is not one) whose requests hold
    `longest` tokens, prompt and new (ValueError if they do not: each request would fail)."""
    import httpx

    r = httpx.get(f"{url.rstrip('/')}/health", timeout=30)
    try:
        health = r.json()
        models = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=30).json()["data"]
        context = models[0]["max_model_len"]
    except (ValueError, KeyError, IndexError, TypeError):
        health = None
    if r.status_code != 200 or not isinstance(health, dict) or "vocab_size" not in health:
        raise ValueError(f"{url} is not an llmstep server: GET /health gave HTTP {r.status_code} "
                         f"{r.text[:80]!r} (start one with llmstep serve)")
    if longest > context:
        raise ValueError(f"the longest request asked for, {longest} tokens (prompt, shared prefix and new tokens), "
                         f"is more than the server at {url} holds ({context}): every such request would fail")
    return health


def bench(url: str, rates: list[float], requests: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int],
          seed: int = 0, log=print, shared_prefix: int = 0, on_run=None) -> dict:
    """One run per rate against the server at url; returns {"server": its /health before, "runs": [summary, ...],
    "server_after": its /health after (the counters: prefix cache hits, refusals, tokens)}. on_run(record), if
    given, gets the record so far once the server has answered and after each rate: a server that goes away later
    leaves the rates done (an httpx error is raised after that call)."""
    import httpx

    server = check_server(url, prompt_len[1] + shared_prefix + new_tokens[1])
    runs = []
    so_far = lambda: {"server": server | {"url": url}, "runs": runs,  # noqa: E731
                      "workload": {"requests": requests, "prompt_len": list(prompt_len),
                                   "new_tokens": list(new_tokens), "seed": seed, "shared_prefix": shared_prefix}}
    report = on_run or (lambda record: None)
    report(so_far())
    for rate in rates:
        timings, seconds = asyncio.run(run_load(url, rate, requests, prompt_len, new_tokens, seed,
                                                shared_prefix=shared_prefix))
        runs.append(summarise(timings, seconds, rate))
        r = runs[-1]
        log(f"rate {rate:g}/s: {r['completed']}/{r['requests']} done ({r['refused_429']} refused) in "
            f"{seconds:.1f} s, {r['output_tokens_per_second']:.1f} tok/s | TTFT p50 {r['ttft_ms']['p50']:.0f} "
            f"p90 {r['ttft_ms']['p90']:.0f} p99 {r['ttft_ms']['p99']:.0f} ms | ITL p50 {r['itl_ms']['p50']:.0f} "
            f"p90 {r['itl_ms']['p90']:.0f} p99 {r['itl_ms']['p99']:.0f} ms"
            + (f" | {r['failed']} failed: {r['failures'][0]}" if r["failures"] else ""))
        report(so_far())
        if r["failed"] and not r["completed"]:  # every request failed: a server gone raises here, not later
            httpx.get(f"{url.rstrip('/')}/health", timeout=30).raise_for_status()
    return so_far() | {"server_after": httpx.get(f"{url.rstrip('/')}/health", timeout=30).json()}

"""`llmstep serve` (an OpenAI-compatible server, llmstep.serve) and `llmstep bench-serve` (its load generator)."""

from __future__ import annotations

import argparse
import math
import socket
import sys

from ..lab.bench_batching import MAX_REQUESTS
from ..serve.engine import PREFILL_CHUNK
from .args import (
    add_attention_arg,
    int_between,
    nonneg_int,
    parse_range,
    positive_int,
    probe_attention,
    seed,
    threads,
)

SERVE_HELP = """\
Binding: the default, 127.0.0.1, takes connections from this machine only. --host 0.0.0.0 (or a LAN address)
lets anyone who can reach this machine's port use the model: there is no authentication, no TLS and no rate
limit per client, so do that only on a network you trust, or behind a proxy that adds them. On a loopback
address a request naming another host (DNS rebinding) or sent by a web page not served from localhost or a
loopback address is refused (403; a page this machine serves, on any port, is not): a proxy on this machine must
pass Host: localhost.

Talk to it with any OpenAI client, e.g.
  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.completions.create(model=client.models.list().data[0].id, prompt="ROMEO:", max_tokens=32)
SIGINT (Ctrl-C) or SIGTERM stops it: the engine stops at once, each open stream ends with an error event, and
connections still open 2 seconds later are closed. So does an engine that fails, with its error."""


def rates(text: str) -> list[float]:
    """Comma-separated requests per second, each > 0 ('inf': all at once)."""
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates per second like 1,2,4 or inf, got {text!r}") from None
    if not out or any(not (r > 0) for r in out):
        raise argparse.ArgumentTypeError(f"every rate must be > 0 (inf: all at once), got {text!r}")
    return out


def server_url(text: str) -> str:
    """An http(s) URL with a host; a trailing / and /v1 (what `llmstep serve` prints, the OpenAI clients' base)
    dropped: the load generator asks for /health and /v1/... itself."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text.strip())
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"a server's URL is http://HOST:PORT, got {text!r}")
    url = text.strip().rstrip("/")
    return url.removesuffix("/v1").rstrip("/")


def port(text: str) -> int:
    """A TCP port: 0 .. 65535 (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 .. 65535 (0: any free one), got {text}")
    return value


def host(text: str) -> str:
    """An address to listen on, as a name or a number this machine can resolve; checked before the model loads."""
    try:
        socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError; an over-long label a UnicodeError
        reason = getattr(e, "strerror", None) or str(e)
        raise argparse.ArgumentTypeError(f"{text!r} is not an address this machine can listen on ({reason})") \
            from None
    return text


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over continuous batching (paged KV cache)",
                       description="Serve a model over HTTP with the OpenAI API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health), streamed or not, with continuous "
                                   "batching over the paged KV cache, prefix caching and chunked prefill.",
                       epilog=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="any name or path llmstep.load takes (default: the shipped model)")
    p.add_argument("--host", type=host, default="127.0.0.1",
                   help="address to bind (default: loopback only; see below)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 0 .. 65535 (0: any free one, printed)")
    p.add_argument("--slots", type=positive_int, default=8, help="most requests decoding at once")
    p.add_argument("--max-queue", type=nonneg_int, default=64,
                   help="most requests waiting for a slot; beyond that a request gets HTTP 429 at once")
    p.add_argument("--kv", choices=["paged"], default="paged",
                   help="the KV cache layout: blocks (the server admits requests as they come; no contiguous)")
    p.add_argument("--block-size", type=positive_int, default=16, help="positions per KV block")
    p.add_argument("--kv-blocks", type=positive_int, default=None,
                   help="blocks in the pool (default: --slots sequences as long as the model's context)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share and keep full blocks of a common prefix")
    p.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help=f"most prompt tokens per engine step (chunked prefill), so a long prompt does not stall "
                        f"the others' tokens (default: {PREFILL_CHUNK})")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="compute each prompt whole in the step that admits it (the running requests wait for it)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)")
    p.add_argument("--threads", type=threads, default=None, help="CPU threads (default: torch's)")
    add_attention_arg(p)
    p.set_defaults(run=run_serve)

    b = sub.add_parser("bench-serve", help="load a running `llmstep serve` at Poisson rates: throughput, TTFT, ITL",
                       description=_loadgen_doc())
    b.add_argument("--url", type=server_url, default="http://127.0.0.1:8000",
                   help="the server, as `llmstep serve` prints it, with or without /v1 (default: "
                        "http://127.0.0.1:8000)")
    b.add_argument("--rate", type=rates, default=[1.0, 2.0, 4.0], help="requests per second, e.g. 1,2,4 (inf: all "
                   "at once)")
    b.add_argument("--requests", type=int_between(1, MAX_REQUESTS), default=32, help="requests per rate")
    b.add_argument("--prompt-len", type=parse_range, default=(16, 64), help="LOW:HIGH tokens")
    b.add_argument("--new-tokens", type=parse_range, default=(16, 64), help="LOW:HIGH tokens")
    b.add_argument("--shared-prefix", type=nonneg_int, default=0,
                   help="tokens of one system prompt every request starts with, before its own --prompt-len "
                        "tokens (what prefix caching shares; default 0: none)")
    b.add_argument("--seed", type=seed, default=0)
    b.add_argument("--json", default=None, help="write the whole record here")
    b.set_defaults(run=run_bench_serve)


def _loadgen_doc() -> str:
    return ("Send requests at a Poisson rate to a running llmstep serve (streamed completions) and report "
            "throughput, time to first token and inter-token latency (p50/p90/p99), as vLLM's serving benchmark.")


def _serve_module():
    try:
        from ..serve import app
    except ImportError as e:
        raise ValueError(f"llmstep serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'") \
            from None
    return app


def run_serve(args, argv) -> dict:
    import torch

    from ..core.checkpoint import load, read_config
    from ..core.paged_kv import check_block_size
    from ..core.registry import resolve_model_path

    if args.no_chunked_prefill and args.prefill_chunk is not None:
        raise ValueError("--prefill-chunk sets how much of a prompt a step computes: it cannot go with "
                         "--no-chunked-prefill")
    chunk = None if args.no_chunked_prefill else args.prefill_chunk or PREFILL_CHUNK
    app = _serve_module()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name = args.model or resolve_model_path(None).name
    context = read_config(resolve_model_path(args.model)).max_seq_len  # before the weights load
    check_block_size(args.block_size, context, "--block-size")
    sock = app.bind(args.host, args.port)  # a port in use is refused before the weights load
    try:
        model, tokenizer = load(args.model, device=args.device, dtype=args.dtype)
        probe_attention(model, args.attention)  # a kernel the device lacks: refused now, not at the first request
    except BaseException:
        sock.close()
        raise

    def ready(host: str, port: int, health: dict) -> None:
        where = f"[{host}]" if ":" in host else host
        print(f"llmstep serve: {name} on {model.device} at http://{where}:{port}/v1 ({args.slots} slots, paged KV "
              f"{health['kv_blocks_total']} blocks x {health['block_size']} = {health['kv_bytes'] / 1e6:,.0f} MB, "
              f"prefix caching {'on' if args.prefix_caching else 'off'}, chunked prefill "
              f"{'off' if chunk is None else f'{chunk} tokens a step'}); Ctrl-C stops it",
              file=sys.stderr, flush=True)

    stats = app.serve(model, tokenizer, name, args.host, args.port, args.slots, args.block_size, args.kv_blocks,
                      args.prefix_caching, chunk, args.max_queue, ready=ready, sock=sock)
    print(f"llmstep serve: stopped after {stats['requests']} requests, {stats['tokens']} tokens", file=sys.stderr)
    return stats


def run_bench_serve(args, argv) -> dict:
    from ..core.files import atomic_write_json, check_output_path
    from ..lab import runinfo

    try:
        import httpx

        from ..serve import loadgen
    except ImportError as e:
        raise ValueError(f"llmstep bench-serve needs httpx ({e.name} is missing): pip install -e '.[serve]'") from None
    if args.json is not None:  # "" too: refused as the folder it names, not skipped
        check_output_path(args.json, "--json")
    load_before = runinfo.load_average()
    done: list[dict] = []  # the record so far, once the server has answered

    def finished(result: dict) -> dict:  # the header, and rates JSON can hold ("inf", not Infinity)
        record = runinfo.header("cpu", None, argv, load_before) | result
        record["runs"] = [r | {"rate_per_second": r["rate_per_second"] if math.isfinite(r["rate_per_second"])
                               else "inf"} for r in record["runs"]]
        return record

    def keep(partial: dict) -> None:  # after each rate: a server that goes away later leaves the rates done
        done[:] = [partial]
        if args.json:
            atomic_write_json(args.json, finished(partial), default=str)

    try:
        result = loadgen.bench(args.url, args.rate, args.requests, args.prompt_len, args.new_tokens, args.seed,
                               log=lambda m: print(m, flush=True), shared_prefix=args.shared_prefix, on_run=keep)
    except httpx.HTTPError as e:
        if not done and isinstance(e, httpx.ConnectError):  # nobody listening at --url
            raise ValueError(f"no server at {args.url}: {e} (start one with llmstep serve)") from None
        if not done:  # it answered, but not as llmstep serve does (loadgen.check_server: its word)
            raise ValueError(f"the server at {args.url} failed: {type(e).__name__}: {e}") from None
        runs = len(done[0]["runs"])
        kept = f"; the {runs} rate(s) done are in {args.json}" if args.json and runs else ""
        raise ValueError(f"the server at {args.url} stopped answering during the run ({runs} of {len(args.rate)} "
                         f"rate(s) recorded): {type(e).__name__}: {e}{kept}") from None
    record = finished(result)
    if args.json:
        atomic_write_json(args.json, record, default=str)
    if not any(r["completed"] for r in record["runs"]):  # after the record: it says what failed
        first = record["runs"][0]
        why = f": {first['failures'][0]}" if first["failures"] else ""
        raise ValueError(f"no request completed at any rate (at the first, {first['failed']} failed{why}, "
                         f"{first['refused_429']} refused with 429)")
    return record

"""Decode at the memory wall, measured: llmstep's fast loop (float, int8, int4) next to transformers' generate().

    llmstep bench                                         # the shipped model on this machine
    llmstep bench --model target --random-weights         # its shape, random weights
    llmstep bench --preset llama-3.1-8b --dtype bfloat16 --quantize none int8 int4
    llmstep bench --preset llama-3.2-1b --set n_layers=2 dim=64 n_heads=4 n_kv_heads=2 \\
        hidden_dim=128 vocab_size=512 --prompt-len 8 --new-tokens 8 --json out.json   # a seconds-long smoke run

Batch 1, greedy, one random prompt of --prompt-len tokens, --new-tokens new ones. For each variant it
reports prefill and decode tokens per second, the bytes one decode step reads (the weights as stored,
quantised or not, plus the KV cache, from llmstep.core.cost), the bandwidth that achieves, and its share of
this device's bandwidth measured in the same run (llmstep.lab.hardware.measure_bandwidth: the faster of a
DRAM-sized copy and a read of a buffer the size of the weights, which a CPU's cache may hold). transformers'
LlamaForCausalLM.generate() runs on the same float weights (shared, in the model's dtype unless --hf-dtype asks for
another), same prompt, same token count: eager, and with a static cache and its decode step compiled (--hf-compile,
on by default on CUDA), the fair peer of llmstep's compiled loop. Every variant runs once per repeat, interleaved,
and the best repeat counts (what the machine can do, least disturbed by everything else on it). `run_bench` returns
the record (settings, machine, versions included); `format_table` renders it; llmstep.cli.bench prints and saves it.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch

from ..core import int8a8
from ..core.checkpoint import hf_names, load_model, read_config, resolve_model_path
from ..core.checks import is_int
from ..core.config import LlamaConfig
from ..core.cost import MemoryBudgetError, check_fits, decode_step_cost, kv_cache_bytes, mean_step_cost, model_bytes
from ..core.device import resolve_device, resolve_dtype
from ..core.model import Llama
from ..core.quantize import QuantConfig, check_config, quantize
from ..engines.decoding import check_int
from ..engines.fast import FastDecoder
from . import runinfo
from .hardware import describe, measure_bandwidth, random_model

__all__ = ["time_hf", "choose_model", "bench_model", "run_bench", "mean_step_cost", "format_table", "hf_twin",
           "peer_bytes", "check_peer_settings", "static_compiled_generate_kw", "matching_prefix"]


def choose_model(model: str | None = None, preset: str | None = None, random_weights: bool = False,
                 overrides: dict | None = None) -> tuple[LlamaConfig, object, str]:
    """(config, checkpoint path or None for random weights, a line saying what it is): the benchmarks' one rule
    for which model to measure: a preset's shape or a checkpoint, with random weights for a preset, with
    `random_weights`, or when `overrides` change the config's fields."""
    overrides = dict(overrides or {})
    if "vocab_size" in overrides:  # a shrunken vocabulary cannot keep Llama 3's special-token ids
        overrides = {"bos_token_id": None, "eos_token_id": []} | overrides
    if preset:
        return LlamaConfig.preset(preset, **overrides), None, f"preset {preset} (random weights)"
    path = resolve_model_path(model)
    config = read_config(path).replace(**overrides)
    if random_weights or overrides:
        return config, None, f"{path} (its shape, random weights)"
    return config, path, f"{path}"


def bench_model(model: str | None = None, preset: str | None = None, random_weights: bool = False,
                overrides: dict | None = None, device: str | torch.device | None = None, dtype: str | None = None,
                seed: int = 0) -> tuple[Llama, str]:
    """(the model to measure, a line saying what it is), chosen by `choose_model`."""
    device = resolve_device(device)
    config, path, source = choose_model(model, preset, random_weights, overrides)
    dtype = resolve_dtype(dtype, device, "bfloat16" if preset else config.torch_dtype)
    if path is None:
        return random_model(config, device, dtype, seed), source
    return load_model(path, device=device, dtype=dtype), source


# ---- the models ----------------------------------------------------------------------------------

@torch.no_grad()
def hf_twin(model: Llama, dtype: torch.dtype | None = None):
    """transformers' LlamaForCausalLM on `model`'s float weights, in `model`'s dtype or `dtype`, on its device.

    Built on the meta device (no memory, no random initialisation), then handed llmstep's tensors themselves
    (`load_state_dict(assign=True)`): in the model's own dtype the twin shares every weight with `model` and
    costs no weight memory at all; in another dtype it holds one copy cast to it, built directly in that dtype
    (bfloat16 weights widened to float32 are the same numbers). Only its rotary table (head_dim / 2 floats) is
    computed anew, on the device. `peer_bytes` says what it and its caches add; run_bench checks that first."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM  # optional: imported only when transformers runs

    dtype = dtype or model.dtype
    hf_config = HFConfig.from_dict(model.config.to_hf())
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_config)
    ours = dict(model.named_parameters(remove_duplicate=False))
    state = {hf_name: ours[name].detach().to(dtype) for hf_name, (name, _) in hf_names(model.config).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' model does not take llmstep's weights: missing {missing}, "
                           f"unexpected {unexpected}")
    if model.config.tie_embeddings:
        hf.tie_weights()
    with torch.device(model.device):  # its one non-persistent buffer, left on meta by the build
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)
    left = [n for n, t in (*hf.named_parameters(), *hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"transformers' model kept tensors llmstep does not give it: {left}")
    return hf.requires_grad_(False).eval()  # its own Parameter objects: llmstep's keep their flags


def peer_bytes(model: Llama, dtype: torch.dtype, max_len: int, compiled: bool) -> int:
    """Bytes transformers' peers add beside `model`: a copy of the weights only when `dtype` is not the model's
    (hf_twin shares them otherwise), the KV cache generate() grows to max_len (DynamicCache), and with
    `compiled` a StaticCache of max_len as well (both may be alive at once). Activations of a batch-1 prompt
    and a 1-token step are small beside these and not counted."""
    weights = 0 if dtype == model.dtype else model_bytes(model.config, dtype)
    return weights + (1 + compiled) * kv_cache_bytes(model.config, 1, max_len, dtype)


def check_peer_settings(hf: bool, hf_compile: bool | None, hf_dtype: torch.dtype | None) -> None:
    """Refuse settings for transformers' rows when transformers is not to run at all."""
    for name, value in (("hf_compile", hf_compile), ("hf_dtype", hf_dtype)):
        if not hf and value not in (None, False):
            raise ValueError(f"{name}={value!r} sets up transformers' rows, but hf=False skips transformers")


# ---- timing --------------------------------------------------------------------------------------

def time_hf(hf, prompt: torch.Tensor, new_tokens: int, extra: dict | None = None) -> tuple[float, float, list[int]]:
    """(seconds for prefill + 1 token, seconds for all new_tokens, the tokens) of greedy generate(), with `extra`
    arguments (static_compiled_generate_kw's for the compiled peer; none: eager, its DynamicCache).

    Two runs, of 1 and of new_tokens tokens: their difference is the decode time (transformers reports no time
    per token without a streamer, which would copy every token to the host). On a busy machine a few short steps
    can vanish in one run's noise: a pair whose difference is not positive is timed again (up to 3 pairs), then
    refused rather than reported as a negative rate."""
    kw = _greedy_kw(prompt, extra)
    outs: list[torch.Tensor] = []
    for _ in range(3):
        times = [runinfo.time_repeats(partial(_hf_generate, hf, prompt, n, kw, outs), prompt.device, 1,
                                      warmup=0)[0] for n in (1, new_tokens)]
        if times[1] > times[0]:
            return times[0], times[1], outs[-1][0, prompt.shape[1]:].tolist()
    raise RuntimeError(f"transformers' {new_tokens - 1} decode steps took no measurable time beyond its prefill in "
                       f"3 tries (the machine is busy, or the run is too short): give more new tokens")


def _greedy_kw(prompt: torch.Tensor, extra: dict | None = None) -> dict:
    """generate()'s arguments for greedy decoding of `prompt` to exactly the tokens asked (no end token), plus extra."""
    return dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(prompt)) | (
        extra or {})


def _hf_generate(hf, prompt: torch.Tensor, n: int, kw: dict, outs: list) -> None:
    if (cache := _static_cache(kw)) is not None:
        cache.reset()  # the same tensors, zeroed: a new request for the compiled step and its CUDA graph
    outs.append(hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw))


def static_compiled_generate_kw(hf, max_len: int) -> dict:
    """generate()'s arguments for transformers' "static cache + torch.compile" (transformers 5.x): one StaticCache
    of max_len positions, kept and reset between calls so its tensors keep their addresses, and a CompileConfig,
    with which generate() compiles the decode step whole (fullgraph) itself, the prefill eager: with CUDA graphs
    (mode "reduce-overhead") on CUDA, inductor's default mode elsewhere (where transformers compiles only when
    told to: `_compile_all_devices`).

    Not the older recipe `model.forward = torch.compile(model.forward)`: it compiles the prefill too, inside
    which StaticCache (created lazily by the first forward since 5.x) cannot mark its tensors as static
    addresses, so the CUDA graph of the step would copy the whole cache in or be re-recorded (transformers'
    cache_utils.StaticLayer.lazy_initialization says so)."""
    from transformers import CompileConfig, StaticCache

    cuda = hf.device.type == "cuda"
    compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
    if not cuda:
        compile_config._compile_all_devices = True
    key = next((k for k in CACHE_KEYWORDS if k in inspect.signature(hf.forward).parameters), CACHE_KEYWORDS[-1])
    return {key: StaticCache(config=hf.config, max_cache_len=max_len), "compile_config": compile_config}


# generate()'s (and forward's) names for a cache: `cache` since transformers 5.2x, `past_key_values` before (5.17)
CACHE_KEYWORDS = ("cache", "past_key_values")


def _static_cache(kw: dict):  # the cache among generate()'s arguments `kw`, or None (the eager peer's)
    return next((kw[k] for k in CACHE_KEYWORDS if k in kw), None)


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_bench(model: Llama, variants: list[str], prompt_len: int = 128, new_tokens: int = 128,
              compile: bool | None = None, compile_mode: str | None = None, repeats: int = 3,
              group_size: int | None = None, lm_head: bool | str = False, eager: bool = True, hf: bool = True,
              bandwidth: bool = True, seed: int = 0, bandwidth_bytes: int | None = None,
              hf_dtype: torch.dtype | None = None, log=print, on_repeat=None, argv: list[str] | None = None,
              hf_compile: bool | None = None) -> dict:
    """Measure each variant of `model` ("none": its float weights; int8, int4, int8-a8, int4-a8); return the record.
    transformers runs on the same weights in `hf_dtype` (default: the model's), twice: eager generate() and,
    with `hf_compile` (default: on CUDA only; compiling transformers on a CPU takes minutes), generate() with a
    static cache and its forward compiled; record["transformers_peers"] says which ran and why one did not.
    on_repeat(record), if given, gets the record of the repeats so far after each one (with "repeats_done"),
    to be written as the run goes. The record carries runinfo.header's run metadata (argv: the command that
    ran it, if any)."""
    device, config = model.device, model.config
    check_int(repeats, "repeats", low=1)
    check_int(prompt_len, "prompt_len", low=1)
    if not is_int(new_tokens) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an integer >= 2 (one token from the prefill, then decode steps), "
                         f"got {new_tokens!r}")
    if prompt_len + new_tokens > config.max_seq_len:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the model's context "
                         f"({config.max_seq_len})")
    check_peer_settings(hf, hf_compile, hf_dtype)
    base_q = getattr(model, "quantization", None)
    if base_q is not None and set(variants) - {"none"}:
        raise ValueError(f"the model is already quantised ({base_q}); it cannot also be run as {variants}")
    qcs = {v: QuantConfig.of(v, group_size if v.startswith("int4") else None, lm_head)
           for v in variants if v != "none"}
    for qc in qcs.values():  # a mode or group size the model's layers cannot take: refused before any measuring
        check_config(config, qc)
    compiled = device.type == "cuda" if compile is None else compile
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=g)
    ids = prompt[0].tolist()
    max_len = prompt_len + new_tokens

    record: dict = {"settings": {"prompt_len": prompt_len, "new_tokens": new_tokens, "batch": 1, "greedy": True,
                                 "repeats": repeats, "compile": compiled, "compile_mode": compile_mode,
                                 "seed": seed},  # device, dtype and threads: record["machine"] (runinfo.header)
                    "config": {k: v for k, v in vars(config).items() if k != "rope_scaling"}}
    load_before = runinfo.load_average()  # other processes on the machine skew every timing: record them
    if bandwidth:
        record["hardware"] = describe(device)
        log("measuring memory bandwidth ...")
        record["bandwidth_gb_per_s"] = measure_bandwidth(device, nbytes=bandwidth_bytes)
        record["bandwidth_buffer_bytes"] = bandwidth_bytes  # the copy's buffer; None: its default, 1 GiB (DRAM)
        # Reading (not copying) a buffer the size of the float weights, as a decode step does: where the LLC holds the
        # model, its ceiling (reads outrun copies there). At most 1 GiB, beyond every cache, or bandwidth_bytes.
        nbytes = int(decode_step_cost(config, dtype=model.dtype).weight_bytes)
        nbytes = min(max(nbytes, 2**20), 2**30 if bandwidth_bytes is None else bandwidth_bytes)
        record["weight_size_buffer_bytes"] = nbytes
        record["bandwidth_at_weight_size_gb_per_s"] = measure_bandwidth(device, nbytes=nbytes)
        record["read_bandwidth_at_weight_size_gb_per_s"] = measure_bandwidth(device, nbytes=nbytes, kind="read")
    # The share of bandwidth is taken against the larger of the two: the most this device showed it can move.
    rates = [record.get(k) for k in ("bandwidth_gb_per_s", "read_bandwidth_at_weight_size_gb_per_s")]
    bw = max((r for r in rates if r), default=None)
    record["ceiling_gb_per_s"] = bw

    # Build every variant first, then time them in turns.
    runs: list[dict] = []
    for v in variants:
        if v == "none":
            m, label = model, str(base_q) if base_q else "float"
        else:
            m, label = quantize(model, qcs[v], inplace=False), str(qcs[v])
        cost = mean_step_cost(m, prompt_len, new_tokens)
        wbytes, kvbytes = float(cost.weight_bytes), float(cost.kv_bytes)
        for c in ([False] if eager and compiled else []) + [compiled]:
            runs.append({"name": f"llmstep {'compiled' if c else 'eager'} {label}", "model": m, "compiled": c,
                         "quant": v, "weight_bytes": wbytes, "kv_bytes": kvbytes})
    for r in runs:
        r["decoder"] = FastDecoder(r["model"], max_len=max_len, compile=r["compiled"], mode=compile_mode)
        if r["compiled"]:
            log(f"compiling {r['name']} ...")
        r["compile_seconds"] = r["decoder"].warmup()
        r["decoder"].generate(ids, 2, temperature=0, stop_ids=())  # first-call allocations out of the timed runs
    hf_model, peers, record["transformers_peers"] = _transformers_peers(model, hf, hf_compile, hf_dtype,
                                                                        prompt.to(device), max_len, log)
    if record["transformers_peers"]["eager"]["why"] == _NOT_INSTALLED:
        record["transformers"] = "not installed"

    for rep in range(repeats):
        for r in runs:
            res = r["decoder"].generate(ids, new_tokens, temperature=0.0, stop_ids=())
            r.setdefault("prefill", []).append(res.prefill_tokens_per_second)
            r.setdefault("decode", []).append(res.decode_tokens_per_second)
            r["tokens"] = res.tokens
        for peer in peers:  # (prefill tok/s, decode tok/s, tokens) per repeat
            t1, tn, toks = time_hf(hf_model, prompt.to(device), new_tokens, peer["generate_kw"])
            peer["runs"].append((prompt_len / t1, (new_tokens - 1) / (tn - t1), toks))
        log(f"repeat {rep + 1}/{repeats} done")
        if on_repeat is not None and rep + 1 < repeats:
            so_far = _finish(dict(record), runs, peers, hf_model, model, bw, load_before, argv)
            on_repeat(so_far | {"repeats_done": rep + 1})
    return _finish(record, runs, peers, hf_model, model, bw, load_before, argv)


_NOT_INSTALLED = "transformers is not installed"


def _transformers_peers(model: Llama, hf: bool, hf_compile: bool | None, hf_dtype: torch.dtype | None,
                        prompt: torch.Tensor, max_len: int, log) -> tuple[object, list[dict], dict]:
    """transformers' twin of `model` and its peers, built and warmed up (the eager one; the static-cache one
    compiled when asked, by default on CUDA): (the twin or None, the peers to time, for each peer whether it
    ran and why or why not). A peer that does not fit in free memory is skipped, not the benchmark."""
    device, base_q = model.device, getattr(model, "quantization", None)
    dtype = hf_dtype or model.dtype
    want_compiled = device.type == "cuda" if hf_compile is None else hf_compile
    status = {"eager": {"ran": True, "why": "generate() as it comes: eager forward, DynamicCache"},
              "static_compiled": {"ran": want_compiled, "why": "generate() with a StaticCache and a CompileConfig: "
                                  "its decode step compiled whole (static_compiled_generate_kw)"}}
    if not want_compiled:
        status["static_compiled"]["why"] = ("hf_compile=False" if hf_compile is False else
                                            f"off by default on {device.type}, where compiling transformers is "
                                            f"slow: hf_compile=True (llmstep bench --hf-compile) runs it")
    skip = ("hf=False" if not hf else
            f"the model is quantised ({base_q}): transformers runs only on float weights" if base_q else None)
    if skip is None:
        try:
            import transformers  # noqa: F401  (optional: only when it runs)

            check_fits(peer_bytes(model, dtype, max_len, want_compiled), device, "transformers' peer")
        except ImportError:
            skip = _NOT_INSTALLED
        except MemoryBudgetError as e:
            skip = str(e)
    if skip is not None:
        for s in status.values():
            if s["ran"]:
                s.update(ran=False, why=skip)
        log(f"transformers skipped: {skip}")
        return None, [], status
    hf_model = hf_twin(model, dtype)
    suffix = "" if dtype == model.dtype else f" {str(dtype).removeprefix('torch.')}"
    peers = [{"key": "eager", "name": "transformers generate()" + suffix, "generate_kw": {}, "compile_mode": None,
              "compile_seconds": 0.0, "runs": []}]
    _hf_generate(hf_model, prompt, 2, _greedy_kw(prompt), [])  # warm-up, not timed
    if want_compiled:
        kw = static_compiled_generate_kw(hf_model, max_len)
        peer = {"key": "static_compiled", "name": "transformers static cache + compile" + suffix, "generate_kw": kw,
                "compile_mode": getattr(kw.get("compile_config"), "mode", None), "runs": []}
        log(f"compiling {peer['name']} ...")
        warm = partial(time_hf, hf_model, prompt, max_len - prompt.shape[1], kw)  # the timed calls, exactly
        try:  # The first call compiles the step; CUDA graphs are recorded on its second or third call.
            peer["compile_seconds"] = runinfo.time_repeats(warm, device, 1, warmup=0)[0]
            for _ in range(2):
                warm()
        except Exception as e:  # transformers' compile is the peer's, not llmstep's: say so, time the rest
            why = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            status["static_compiled"].update(ran=False, why=why)
            log(f"transformers static cache + compile {why}")
        else:
            peers.append(peer)
    return hf_model, peers, status


def _finish(record: dict, runs: list[dict], peers: list[dict], hf_model, model: Llama, bw: float | None,
            load_before: float | None, argv: list[str] | None) -> dict:
    """The record of the repeats run so far: a row per variant (its best repeat), transformers' rows, the machine."""
    prompt_len, new_tokens = record["settings"]["prompt_len"], record["settings"]["new_tokens"]
    # Every row's tokens against llmstep's eager float row, else (--quantize without none, --no-eager, a quantised
    # model) against the first row, named, the *_eager_float fields None
    ref = next((r for r in runs if r["quant"] == "none" and not r["compiled"]), runs[0])
    is_float = ref["quant"] == "none" and not ref["compiled"] and getattr(model, "quantization", None) is None
    record["token_reference"], reference = ref["name"], ref["tokens"]
    rows = []
    for r in runs:
        decode = max(r["decode"])
        step_bytes = r["weight_bytes"] + r["kv_bytes"]
        gbs = step_bytes * decode / 1e9
        rows.append({"name": r["name"], "implementation": "llmstep", "quantization": r["quant"],
                     "compiled": r["compiled"], "compile_seconds": r["compile_seconds"],
                     "prefill_tokens_per_s": max(r["prefill"]), "decode_tokens_per_s": decode,
                     "decode_tokens_per_s_all": list(r["decode"]), "weight_bytes_per_step": r["weight_bytes"],
                     "kv_bytes_per_step": r["kv_bytes"], "bytes_per_step": step_bytes,
                     "achieved_gb_per_s": gbs, "share_of_bandwidth": gbs / bw if bw else None,
                     **_same_tokens(r["tokens"], reference, is_float), "tokens": list(r["tokens"])})
        if (a8 := int8a8.describe(r["decoder"].net)) is not None:  # what the steps ran (fused or not)
            rows[-1]["a8_matmul"] = a8  # the kernels' ops, or torch's ops (llmstep.core.int4a8, int8a8)
    peer_rows = {}
    for peer in (p for p in peers if p["runs"]):
        runs_ = peer["runs"]
        decode = max(d for _, d, _ in runs_)
        widen = hf_model.dtype.itemsize / model.dtype.itemsize  # bytes per weight, its dtype over ours
        # The bytes a step needs, as for llmstep's rows (the mean context's KV cache): a static cache is
        # attended in full every step, which costs time but is not needed traffic.
        cost = mean_step_cost(model, prompt_len, new_tokens)
        wbytes, kvbytes = cost.weight_bytes * widen, cost.kv_bytes * widen
        gbs = (wbytes + kvbytes) * decode / 1e9
        toks = runs_[-1][2]
        import transformers

        record["transformers"] = transformers.__version__
        peer_rows[peer["key"]] = {
            "name": peer["name"], "implementation": "transformers", "quantization": "none",
            "compiled": peer["key"] == "static_compiled", "compile_seconds": peer["compile_seconds"],
            "compile_mode": peer["compile_mode"],
            "kv_cache": "dynamic" if _static_cache(peer["generate_kw"]) is None else "static",
            "prefill_tokens_per_s": max(p for p, _, _ in runs_), "decode_tokens_per_s": decode,
            "decode_tokens_per_s_all": [d for _, d, _ in runs_], "weight_bytes_per_step": wbytes,
            "kv_bytes_per_step": kvbytes, "bytes_per_step": wbytes + kvbytes, "achieved_gb_per_s": gbs,
            "share_of_bandwidth": gbs / bw if bw else None, **_same_tokens(toks, reference, is_float), "tokens": toks}
    rows += peer_rows.values()
    if "static_compiled" in peer_rows and "eager" in peer_rows:
        eager_toks = peer_rows["eager"]["tokens"]
        peer_rows["static_compiled"]["same_tokens_as_transformers_eager"] = (
            peer_rows["static_compiled"]["tokens"] == eager_toks)
    for key, speedup in (("eager", "decode_speedup_vs_transformers"),
                         ("static_compiled", "decode_speedup_vs_transformers_compiled")):
        if key in peer_rows:
            for row in rows:
                row[speedup] = row["decode_tokens_per_s"] / peer_rows[key]["decode_tokens_per_s"]
    record["rows"] = rows
    return runinfo.header(model.device, model.dtype, argv, load_before,
                          transformers=record.get("transformers")) | record


def _same_tokens(tokens: list[int], reference: list[int], is_float: bool) -> dict:
    """A row's tokens against record["token_reference"]'s; the *_eager_float fields only where that is a float row."""
    same, prefix = tokens == reference, matching_prefix(tokens, reference)
    return {"same_tokens_as_reference": same, "matching_prefix_with_reference": prefix,
            "same_tokens_as_eager_float": same if is_float else None,
            "matching_prefix_with_eager_float": prefix if is_float else None}


def format_table(record: dict) -> str:
    bw = record.get("ceiling_gb_per_s")
    speedups = {"decode_speedup_vs_transformers": "vs HF"}  # and vs its compiled row, when that ran
    if any("decode_speedup_vs_transformers_compiled" in r for r in record["rows"]):
        speedups["decode_speedup_vs_transformers_compiled"] = "vs HF compiled"
    as_float = record["rows"][0]["matching_prefix_with_eager_float"] is not None  # None: no float row ran (_finish)
    same = "matching_prefix_with_eager_float" if as_float else "matching_prefix_with_reference"
    head = ["variant", "prefill tok/s", "decode tok/s", "MB/step", "GB/s", "% of bw", *speedups.values(),
            "= eager float" if as_float else "= reference"]
    lines = [head]
    for r in record["rows"]:
        share = f"{100 * r['share_of_bandwidth']:.0f}%" if r.get("share_of_bandwidth") is not None else "-"
        vs = [f"{r[k]:.2f}x" if r.get(k) is not None else "-" for k in speedups]
        lines.append([r["name"], f"{r['prefill_tokens_per_s']:,.0f}", f"{r['decode_tokens_per_s']:,.1f}",
                      f"{r['bytes_per_step'] / 1e6:,.2f}", f"{r['achieved_gb_per_s']:,.1f}", share, *vs,
                      f"{r[same]}/{len(r['tokens'])}"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
           for row in lines]
    out.insert(1, "-" * len(out[0]))
    s, m = record["settings"], record["machine"]
    notes = [f"{m['device']} {m['dtype']}, {m['torch_threads']} threads, prompt {s['prompt_len']}, "
             f"{s['new_tokens']} new tokens, best of {s['repeats']}"]
    if not as_float:
        notes.append(f"= reference: tokens in common with {record['token_reference']}'s (no eager float row ran)")
    if bw:
        size = record.get("bandwidth_buffer_bytes")
        buffer = "DRAM-sized buffer" if size is None else f"{size:,}-byte buffer"
        notes.append(f"measured bandwidth: copy {record['bandwidth_gb_per_s']:,.1f} GB/s ({buffer}); at the "
                     f"weights' size copy {record['bandwidth_at_weight_size_gb_per_s']:,.1f} GB/s, read "
                     f"{record['read_bandwidth_at_weight_size_gb_per_s']:,.1f} GB/s; % of bw is of {bw:,.1f} GB/s")
    for key, peer in record.get("transformers_peers", {}).items():
        if not peer["ran"]:
            notes.append(f"transformers {key.replace('_', ' ')} skipped: {peer['why']}")
    return "\n".join(out + notes)

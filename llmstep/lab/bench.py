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
LlamaForCausalLM.generate() runs on the same float weights, same prompt, same token count. Every
variant runs once per repeat, interleaved, and the best repeat counts (what the machine can do, least
disturbed by everything else on it). `run_bench` returns the record (settings, machine, versions included);
`format_table` renders it; the command (llmstep.cli.bench) prints it and writes it as JSON.
"""

from __future__ import annotations

from functools import partial

import torch

from ..core.checkpoint import hf_names, load_model, resolve_model_path
from ..core.config import LlamaConfig
from ..core.cost import StepCost, decode_step_cost, model_step_cost
from ..core.device import resolve_device, resolve_dtype
from ..core.model import Llama
from ..core.quantize import QuantConfig, quantize
from ..engines.fast import FastDecoder
from . import runinfo
from .hardware import describe, measure_bandwidth, random_model
from .runinfo import check_positive_int

__all__ = ["bench_model", "run_bench", "mean_step_cost", "format_table", "hf_twin", "matching_prefix"]


def bench_model(model: str | None = None, preset: str | None = None, random_weights: bool = False,
                overrides: dict | None = None, device: str | torch.device | None = None, dtype: str | None = None,
                seed: int = 0) -> tuple[Llama, str]:
    """(the model to measure, a line saying what it is): a preset's shape or a checkpoint (plain or quantized),
    with random weights for a preset, with `random_weights`, or when `overrides` change the config's fields."""
    device = resolve_device(device)
    overrides = dict(overrides or {})
    if "vocab_size" in overrides:  # a shrunken vocabulary cannot keep Llama 3's special-token ids
        overrides = {"bos_token_id": None, "eos_token_id": []} | overrides
    if preset:
        config = LlamaConfig.preset(preset, **overrides)
        source = f"preset {preset} (random weights)"
    else:
        path = resolve_model_path(model)
        config = LlamaConfig.from_hf(path).replace(**overrides)
        source = f"{path}" + (" (its shape, random weights)" if random_weights else "")
    dtype = resolve_dtype(dtype, device, "bfloat16" if preset else config.torch_dtype)
    if preset or random_weights or overrides:
        return random_model(config, device, dtype, seed), source
    return load_model(path, device=device, dtype=dtype), source


# ---- the models ----------------------------------------------------------------------------------

@torch.no_grad()
def hf_twin(model: Llama, dtype: torch.dtype | None = None):
    """transformers' LlamaForCausalLM holding a copy of `model`'s float weights (same device; its dtype, or
    `dtype`: bfloat16 weights widened to float32 are the same numbers)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM  # optional: imported only when transformers runs

    hf_config = HFConfig.from_dict(model.config.to_hf())
    with torch.device(model.device):
        hf = LlamaForCausalLM(hf_config).to(dtype or model.dtype).eval()
    ours = dict(model.named_parameters(remove_duplicate=False))
    state = {hf_name: ours[name].to(dtype or model.dtype) for hf_name, (name, _) in hf_names(model.config).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' model does not take llmstep's weights: missing {missing}, "
                           f"unexpected {unexpected}")
    if model.config.tie_embeddings:
        hf.tie_weights()
    return hf


# ---- timing --------------------------------------------------------------------------------------

def _time_hf(hf, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, list[int]]:
    """(seconds for prefill + 1 token, seconds for all new_tokens, the tokens) of greedy generate()."""
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    outs: list[torch.Tensor] = []
    times = [runinfo.time_repeats(partial(_hf_generate, hf, prompt, n, kw, outs), prompt.device, 1, warmup=0)[0]
             for n in (1, new_tokens)]
    return times[0], times[1], outs[-1][0, prompt.shape[1]:].tolist()


def _hf_generate(hf, prompt: torch.Tensor, n: int, kw: dict, outs: list) -> None:
    outs.append(hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw))


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def mean_step_cost(model: Llama, prompt_len: int, new_tokens: int) -> StepCost:
    """llmstep.core.cost.model_step_cost of the mean decode step of this run: step i (1 <= i < new_tokens) runs
    with prompt_len + i - 1 tokens cached, so the KV-cache bytes are those of the mean context."""
    steps = max(new_tokens - 1, 1)
    return model_step_cost(model, context=prompt_len + (steps - 1) / 2)


def run_bench(model: Llama, variants: list[str], prompt_len: int = 128, new_tokens: int = 128,
              compile: bool | None = None, compile_mode: str | None = None, repeats: int = 3,
              group_size: int | None = None, lm_head: bool = False, eager: bool = True, hf: bool = True,
              bandwidth: bool = True, seed: int = 0, bandwidth_bytes: int | None = None,
              hf_dtype: torch.dtype | None = None, log=print, on_repeat=None, argv: list[str] | None = None
              ) -> dict:
    """Measure every variant on `model` ("none" = its float weights, "int8", "int4"); return the record.
    transformers runs on the same weights in `hf_dtype` (default: the model's). on_repeat(record), if given, gets
    the record of the repeats so far after each one (with "repeats_done"), to be written as the run goes.
    The record carries runinfo.header's run metadata (argv: the command that ran it, if any)."""
    device, config = model.device, model.config
    check_positive_int("repeats", repeats)
    check_positive_int("prompt_len", prompt_len)
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an integer >= 2 (one token from the prefill, then decode steps), "
                         f"got {new_tokens!r}")
    if prompt_len + new_tokens > config.max_seq_len:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the model's context "
                         f"({config.max_seq_len})")
    compiled = device.type == "cuda" if compile is None else compile
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=g)
    ids = prompt[0].tolist()
    max_len = prompt_len + new_tokens
    base_q = getattr(model, "quantization", None)

    record: dict = {"settings": {"prompt_len": prompt_len, "new_tokens": new_tokens, "batch": 1, "greedy": True,
                                 "repeats": repeats, "compile": compiled, "compile_mode": compile_mode,
                                 "seed": seed},  # device, dtype and threads: record["machine"] (runinfo.header)
                    "config": {k: v for k, v in vars(config).items() if k != "rope_scaling"}}
    load_before = runinfo.load_average()  # other processes on the machine skew every timing: record them
    if bandwidth:
        record["hardware"] = describe(device)
        log("measuring memory bandwidth ...")
        record["bandwidth_gb_per_s"] = measure_bandwidth(device, nbytes=bandwidth_bytes)
        # Reading (not copying) a buffer the size of the float weights: what a decode step does. On a
        # CPU whose last-level cache holds the whole model this, not DRAM, is the ceiling decode meets,
        # and reads run faster than copies there. Capped at 1 GiB, already beyond every cache.
        nbytes = int(decode_step_cost(config, dtype=model.dtype).weight_bytes)
        nbytes = min(max(nbytes, 2**20), 2**30 if bandwidth_bytes is None else bandwidth_bytes)
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
            if base_q is not None:
                raise ValueError(f"the model is already quantised ({base_q}); it cannot also be run as {v}")
            qc = QuantConfig(v, group_size if v == "int4" else None, lm_head)
            m, label = quantize(model, qc, inplace=False), str(qc)
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
        r["decoder"].generate(ids, 2)  # first-call allocations out of the timed runs
    hf_model = None
    if hf and base_q is None:
        try:
            hf_model = hf_twin(model, hf_dtype)
        except ImportError:
            record["transformers"] = "not installed"
        else:
            _time_hf(hf_model, prompt.to(device), 2)  # warm-up

    hf_runs: list[tuple[float, float, list[int]]] = []  # (prefill tok/s, decode tok/s, tokens) per repeat
    for rep in range(repeats):
        for r in runs:
            res = r["decoder"].generate(ids, new_tokens, temperature=0.0)
            r.setdefault("prefill", []).append(res.prefill_tokens_per_second)
            r.setdefault("decode", []).append(res.decode_tokens_per_second)
            r["tokens"] = res.tokens
        if hf_model is not None:
            t1, tn, toks = _time_hf(hf_model, prompt.to(device), new_tokens)
            hf_runs.append((prompt_len / t1, (new_tokens - 1) / (tn - t1), toks))
        log(f"repeat {rep + 1}/{repeats} done")
        if on_repeat is not None and rep + 1 < repeats:
            partial = _finish(dict(record), runs, hf_model, hf_runs, model, bw, load_before, argv)
            on_repeat(partial | {"repeats_done": rep + 1})
    return _finish(record, runs, hf_model, hf_runs, model, bw, load_before, argv)


def _finish(record: dict, runs: list[dict], hf_model, hf_runs: list, model: Llama, bw: float | None,
            load_before: float | None, argv: list[str] | None) -> dict:
    """The record of the repeats run so far: a row per variant (its best repeat), transformers' row, the machine."""
    prompt_len, new_tokens = record["settings"]["prompt_len"], record["settings"]["new_tokens"]

    reference = next((r["tokens"] for r in runs if r["quant"] == "none" and not r["compiled"]), runs[0]["tokens"])
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
                     "same_tokens_as_eager_float": r["tokens"] == reference,
                     "matching_prefix_with_eager_float": matching_prefix(r["tokens"], reference),
                     "tokens": list(r["tokens"])})
    if hf_model is not None and hf_runs:
        decode = max(d for _, d, _ in hf_runs)
        widen = hf_model.dtype.itemsize / model.dtype.itemsize  # bytes per weight, its dtype over ours
        cost = mean_step_cost(model, prompt_len, new_tokens)
        wbytes, kvbytes = cost.weight_bytes * widen, cost.kv_bytes * widen
        gbs = (wbytes + kvbytes) * decode / 1e9
        toks = hf_runs[-1][2]
        import transformers

        record["transformers"] = transformers.__version__
        hf_name = "transformers generate()" + ("" if hf_model.dtype == model.dtype else
                                               f" {str(hf_model.dtype).removeprefix('torch.')}")
        rows.append({"name": hf_name, "implementation": "transformers", "quantization": "none",
                     "compiled": False, "compile_seconds": 0.0,
                     "prefill_tokens_per_s": max(p for p, _, _ in hf_runs), "decode_tokens_per_s": decode,
                     "decode_tokens_per_s_all": [d for _, d, _ in hf_runs], "weight_bytes_per_step": wbytes,
                     "kv_bytes_per_step": kvbytes, "bytes_per_step": wbytes + kvbytes, "achieved_gb_per_s": gbs,
                     "share_of_bandwidth": gbs / bw if bw else None,
                     "same_tokens_as_eager_float": toks == reference,
                     "matching_prefix_with_eager_float": matching_prefix(toks, reference), "tokens": toks})
        for row in rows:
            row["decode_speedup_vs_transformers"] = row["decode_tokens_per_s"] / decode
    record["rows"] = rows
    return runinfo.header(model.device, model.dtype, argv, load_before,
                          transformers=record.get("transformers")) | record


def format_table(record: dict) -> str:
    bw = record.get("ceiling_gb_per_s")
    head = ["variant", "prefill tok/s", "decode tok/s", "MB/step", "GB/s", "% of bw", "vs HF", "= eager float"]
    lines = [head]
    for r in record["rows"]:
        share = f"{100 * r['share_of_bandwidth']:.0f}%" if r.get("share_of_bandwidth") is not None else "-"
        vs = r.get("decode_speedup_vs_transformers")
        lines.append([r["name"], f"{r['prefill_tokens_per_s']:,.0f}", f"{r['decode_tokens_per_s']:,.1f}",
                      f"{r['bytes_per_step'] / 1e6:,.2f}", f"{r['achieved_gb_per_s']:,.1f}", share,
                      f"{vs:.2f}x" if vs is not None else "-",
                      f"{r['matching_prefix_with_eager_float']}/{len(r['tokens'])}"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
           for row in lines]
    out.insert(1, "-" * len(out[0]))
    s, m = record["settings"], record["machine"]
    notes = [f"{m['device']} {m['dtype']}, {m['torch_threads']} threads, prompt {s['prompt_len']}, "
             f"{s['new_tokens']} new tokens, best of {s['repeats']}"]
    if bw:
        notes.append(f"measured bandwidth: copy {record['bandwidth_gb_per_s']:,.1f} GB/s (DRAM-sized buffer); at the "
                     f"weights' size copy {record['bandwidth_at_weight_size_gb_per_s']:,.1f} GB/s, read "
                     f"{record['read_bandwidth_at_weight_size_gb_per_s']:,.1f} GB/s; % of bw is of {bw:,.1f} GB/s")
    return "\n".join(out + notes)

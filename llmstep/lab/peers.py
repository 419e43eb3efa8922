"""Peers in the benchmark: llama.cpp, CTranslate2 and transformers decoding the weights llmstep decodes.

    llmstep bench --peers llama.cpp,ctranslate2,transformers --dtype float32 --quantize none int8 int4
    llmstep bench --peers llama.cpp,transformers --model smollm2-135m-instruct --dtype bfloat16 \
        --quantize none int8 int4

At each precision asked for (--dtype's float, and int8 / int4 / int8-a8 / int4-a8 quantised from it by
llmstep.core.quantize) llmstep's compiled loop (`FastDecoder(model, compile=True)`, its default mode) runs next to
every installed peer: the same greedy decode of the same random prompt, batch 1, one repeat of every engine after
another (interleaved, so a busy machine slows them alike), the median and spread of the repeats reported. What each
engine runs, and where its weights come from, is llmstep.lab.peer_inputs (for a GGUF model: llama.cpp on the file
itself, llmstep on the file's int4 blocks exactly, and both engines' other precisions from the same dequantized
weights); every row names its `source`, and a row whose weights were rounded a second time from an already quantized
file is marked `requantized`.

Each peer runs in its own child process (llmstep.lab.peer_process): a peer that raises or dies (llama.cpp's AMX
kernels can die with SIGILL on Intel virtual machines) loses its own row, recorded under `failed` with how it
failed and when, and the other rows still come. On a CPU with AMX llama.cpp's extra buffer types are turned off
(llmstep.lab.peer_engines; `--llama-cpp-extra-bufts on|off` overrides), and the record says so
(`llama_cpp_extra_buffer_types`, and each llama.cpp row's `notes`). A peer that is not installed, or cannot run a
precision, is skipped with the reason in the record (`skipped`).

Each row holds decode tokens/s (the steps after the first token), prefill tokens/s, how many leading tokens equal
those of the llmstep row it is compared with, and its roofline: the share of this machine's copy bandwidth
(`hardware.measure_bandwidth`, before the work and after it, the faster counts) that the bytes of one of its decode
steps make at the row's rate, and, where others share the machine and its bandwidth comes and goes (a virtual
machine's neighbours: 26 to 40 GB/s within a minute on one), the share paired run by run
(`copy_bandwidth_share_paired`): the copy bandwidth is measured again just before the first timed run and just after
each (`hardware.Bandwidth`: its buffers allocated once the engines are warm), and each run's rate is taken against
the mean of the two measurements either side of it (a failed run's too), the median of those. Those bytes are
llmstep's (`bench.mean_step_cost`) for llmstep, transformers and CTranslate2 (the same tensors), and for llama.cpp the
tensors of the GGUF file it runs (`peer_engines.gguf_step_weight_bytes`) plus its float16 KV cache at the same mean
context.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core import attention_backend, int8a8
from ..core.cost import MemoryBudgetError, kv_bytes_per_token
from ..core.model import Llama
from ..core.tokens import Tokenizer
from ..engines.decoding import check_int
from ..engines.fast import FastDecoder
from . import runinfo
from .bench import matching_prefix, mean_step_cost
from .hardware import Bandwidth, measure_bandwidth
from .peer_engines import MAKERS, PeerSpec, cpu_has_amx, gguf_step_weight_bytes
from .peer_inputs import GGUF_TYPE, PEERS, Variant, plan_inputs, why_not
from .peer_process import PeerFailed, PeerProcess

__all__ = ["PEERS", "PeerError", "parse_peers", "precisions", "why_not", "run_peers", "format_peers", "roofline_points"]


class PeerError(ValueError):
    """A peer list or setting the peer benchmark cannot run; the message says which."""


def parse_peers(text: str) -> list[str]:
    """"llama.cpp,ctranslate2" -> ["llama.cpp", "ctranslate2"]: known names, each once, in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise PeerError(f"unknown peer {', '.join(unknown) or repr(text)}: choose from {', '.join(PEERS)}")
    if len(set(names)) != len(names):
        raise PeerError(f"a peer is named twice in {text!r}")
    return names


def precisions(dtype: torch.dtype, quantize_modes: list[str]) -> list[str]:
    """--quantize's modes as the precisions compared: "none" is the model's float dtype."""
    return [str(dtype).removeprefix("torch.") if q == "none" else q for q in quantize_modes]


# ---- the engines: run(ids, n) -> (prefill seconds, decode seconds, the n tokens) -------------------

class _Llmstep:
    """llmstep's loop, in the benchmark's own process (the reference every peer row is compared with)."""

    def __init__(self, variant: Variant, compile: bool, compile_mode: str | None):
        self.info = {"name": f"llmstep FastDecoder{' compiled' if compile else ''}", "weights": variant.weights,
                     "source": variant.source}
        self.decoder = FastDecoder(variant.model, compile=compile, mode=compile_mode)

    def run(self, ids: list[int], n: int, doing: str = ""):
        r = self.decoder.generate(ids, n, temperature=0, stop_ids=())
        return r.prefill_seconds, r.decode_seconds, r.tokens


@dataclass
class _Entry:
    precision: str
    model: Llama  # the llmstep model whose step bytes the row counts (llama.cpp: its GGUF file instead)
    peer: str | None = None  # None: llmstep itself
    against: int | None = None  # the entry of the llmstep row a peer's row is compared with
    spec: PeerSpec | None = None
    engine: object = None
    requantized: bool = False
    failed: str | None = None


def _extra_bufts(asked: bool | None) -> tuple[bool, str]:
    """(llama.cpp's extra buffer types on?, the sentence for the record): off on a CPU with AMX unless asked."""
    if asked is not None:
        return asked, f"{'on' if asked else 'off'} (asked)"
    if cpu_has_amx():
        return False, ("off: this CPU has AMX (amx_tile in /proc/cpuinfo), and llama.cpp's AMX kernels for quantized "
                       "types can die with an illegal instruction on virtual machines (use_extra_bufts = False)")
    return True, "on (llama.cpp's default; no AMX on this CPU)"


# ---- the benchmark -------------------------------------------------------------------------------

def run_peers(model: Llama, peers: list[str], precision_list: list[str], tokenizer: Tokenizer | None = None,
              checkpoint: Path | None = None, prompt_len: int = 128, new_tokens: int = 128, repeats: int = 3,
              threads: int | None = None, compile: bool = True, compile_mode: str | None = None, bandwidth: bool = True,
              bandwidth_bytes: int | None = None, seed: int = 0, log=print, argv=None, group_size: int | None = None,
              extra_bufts: bool | None = None) -> dict:
    """llmstep's compiled loop and each peer at each precision, interleaved `repeats` times (see the module).
    `model` is the float model (on the CPU); the quantised precisions are quantised from it; `checkpoint` the
    directory or GGUF file it came from (None: a random model). compile=False runs llmstep's loop eager (a quick
    check, not the comparison). `extra_bufts`: llama.cpp's extra buffer types (None: off where the CPU has AMX).
    Returns the record."""
    for p in peers:
        if p not in MAKERS:
            raise PeerError(f"unknown peer {p!r}: choose from {', '.join(PEERS)}")
    for p in precision_list:
        if p not in GGUF_TYPE:
            raise PeerError(f"unknown precision {p!r}: choose from {', '.join(GGUF_TYPE)}")
    if model.device.type != "cpu":
        raise PeerError(f"the peer benchmark runs on the CPU; the model is on {model.device}")
    if model.dtype not in (torch.float32, torch.bfloat16):
        raise PeerError(f"the peer benchmark takes a float32 or bfloat16 model, not {model.dtype}")
    check_int(prompt_len, "prompt_len", low=1)
    check_int(new_tokens, "new_tokens", low=2)
    check_int(repeats, "repeats", low=1)
    threads = threads or torch.get_num_threads()
    n_ctx = prompt_len + new_tokens
    if n_ctx > model.config.max_seq_len:
        raise PeerError(f"prompt_len + new_tokens = {n_ctx} is past the model's {model.config.max_seq_len} positions")
    load_before = runinfo.load_average()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
    record = runinfo.header(model.device, model.dtype, argv, load_before) | {
        "benchmark": "peers", "threads": threads, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "repeats": repeats, "compile": compile, "compile_mode": compile_mode, "skipped": [], "failed": [], "rows": []}
    extra, why_extra = _extra_bufts(extra_bufts)
    if "llama.cpp" in peers:
        record["llama_cpp_extra_buffer_types"] = why_extra
    bw = [measure_bandwidth("cpu", bandwidth_bytes, kind="copy")] if bandwidth else []
    workdir = tempfile.TemporaryDirectory(prefix="llmstep-peers-")
    entries: list[_Entry] = []
    probe = None  # the copy bandwidth beside each timed run (`_probe`)
    try:
        plan = plan_inputs(model, peers, precision_list, tokenizer, checkpoint, Path(workdir.name), threads, n_ctx,
                           group_size, extra, log)
        record["skipped"] += plan.skipped
        if plan.gguf_file is not None:
            record["gguf_file"] = {"path": str(plan.gguf_file), "matrix_type": plan.file_type}
        index = {}  # variant number -> entry number
        for precision in precision_list:
            for n, v in enumerate(plan.variants):
                if v.precision == precision:
                    log(f"{precision}: building llmstep's loop ({v.weights}) ...")
                    index[n] = len(entries)
                    entries.append(_Entry(precision, v.model, engine=_Llmstep(v, compile, compile_mode),
                                          requantized=v.requantized))
            for n, spec in plan.peers:
                if spec.precision == precision:
                    log(f"{precision}: starting {spec.peer} ({spec.weights}) in its own process ...")
                    e = _Entry(precision, plan.variants[n].model, spec.peer, index[n], spec,
                               requantized=spec.requantized)
                    entries.append(e)
                    try:
                        e.engine = PeerProcess(MAKERS[spec.peer], spec)
                    except PeerFailed as failure:
                        _fail(record, e, str(failure), log)
        runs: dict[int, list[tuple[float, float, list[int]]]] = {i: [] for i in range(len(entries))}
        beside: dict[int, list[float]] = {i: [] for i in range(len(entries))}  # each run's copy bandwidth, GB/s
        for e in entries:  # warm-up: compile, first-call costs, page-in
            _attempt(record, e, ids, 8, "warming up", log)
        probe = _probe(record, bandwidth, bandwidth_bytes, log)
        between = [probe()] if probe else []  # GB/s: just before the first timed run, then just after each
        for r in range(repeats):
            for i, e in enumerate(entries):
                attempted = e.failed is None
                result = _attempt(record, e, ids, new_tokens, f"repeat {r + 1}", log)
                if probe and attempted:  # after this run (or its failure), before the next
                    between.append(probe())
                if result is not None:
                    runs[i].append(result)
                    if probe:  # the mean of the measurements on either side is this run's
                        beside[i].append((between[-2] + between[-1]) / 2)
            log(f"repeat {r + 1}/{repeats} done")
    finally:
        if probe:
            probe.close()
        for e in entries:
            if isinstance(e.engine, PeerProcess):
                e.engine.close()
    if bandwidth:
        try:
            bw.append(measure_bandwidth("cpu", bandwidth_bytes, kind="copy"))
        except MemoryBudgetError as e:  # the engines still hold their models: the one before the work counts
            record["copy_bandwidth_after"] = f"not measured: {e}"
            log(f"the copy bandwidth is not measured after the work: {e}")
    record["copy_bandwidth_gb_s"] = max(bw) if bw else None  # before the work and after it: the faster
    if between:
        record["copy_bandwidth_beside_runs_gb_s"] = runinfo.timing(between)
    record["rows"] = _rows(entries, runs, beside, ids, new_tokens, record["copy_bandwidth_gb_s"])
    record["load_average_1min_before_after"] = [load_before, runinfo.load_average()]
    record["attention"] = attention_backend.describe(model.device)  # now: compiling a CPU step installs its kernel
    workdir.cleanup()
    return record


def _probe(record: dict, bandwidth: bool, nbytes: int | None, log) -> Bandwidth | None:
    """The copy bandwidth's buffers for the measurements beside each timed run (`bandwidth`), allocated once the
    engines are warm; where free memory no longer holds them, none (the record says why): no pairing, the run goes
    on."""
    if not bandwidth:
        return None
    try:
        return Bandwidth("cpu", nbytes, kind="copy")
    except MemoryBudgetError as e:
        record["copy_bandwidth_paired"] = f"not measured: {e}"
        log(f"the copy bandwidth is not measured beside each run: {e}")
        return None


def _fail(record: dict, e: _Entry, why: str, log) -> None:
    e.failed = why
    log(f"{e.precision}: {e.peer} ({e.spec.weights}) failed: {why}")
    record["failed"].append({"peer": e.peer, "precision": e.precision, "weights": e.spec.weights,
                             "source": e.spec.source, "why": why})


def _attempt(record: dict, e: _Entry, ids: list[int], n: int, doing: str, log):
    """One run of an entry; a peer that fails is recorded and drops out (None)."""
    if e.failed is not None:
        return None
    try:
        return e.engine.run(ids, n, doing)
    except PeerFailed as failure:
        _fail(record, e, str(failure), log)
        e.engine.close()
        return None


def _step_bytes(e: _Entry, prompt_len: int, new_tokens: int) -> tuple[float, str]:
    """(bytes one mean decode step of this row reads, where the count comes from)."""
    cost = mean_step_cost(e.model, prompt_len, new_tokens)
    path = (e.engine.info.get("gguf") if e.peer == "llama.cpp" else None)
    if path is None:
        return cost.bytes, "llmstep.core.cost"
    context = prompt_len + (max(new_tokens - 1, 1) - 1) / 2  # as mean_step_cost counts it
    kv = (context + 1) * kv_bytes_per_token(e.model.config, torch.float16)  # llama.cpp's cache: float16
    return gguf_step_weight_bytes(path) + kv, "the GGUF file's tensors and a float16 KV cache"


def _rows(entries: list[_Entry], runs, beside, ids, new_tokens, bw) -> list[dict]:
    """Each entry's row (failed ones left out); beside[i]: the copy bandwidth (GB/s) beside each of entry i's runs."""
    rows, ours = [], {}
    for i, e in enumerate(entries):
        if e.failed is not None:
            continue
        decode = [(new_tokens - 1) / d for _, d, _ in runs[i]]
        prefill = [len(ids) / p for p, _, _ in runs[i]]
        step_bytes, counted = _step_bytes(e, len(ids), new_tokens)
        info = e.engine.info
        name = info.get("name", e.peer)
        row = {"precision": e.precision, "engine": name, "weights": info.get("weights", ""),
               "source": info.get("source", ""), "requantized": e.requantized,
               "decode_tokens_per_s": runinfo.timing(decode), "prefill_tokens_per_s": runinfo.timing(prefill),
               "bytes_per_step": step_bytes, "bytes_counted_from": counted, "tokens": runs[i][-1][2]}
        if info.get("notes"):
            row["notes"] = info["notes"]
        if e.peer is None and (a8 := int8a8.describe(e.engine.decoder.net)) is not None:
            row["a8_matmul"] = a8  # the kernels' ops, or torch's ops (llmstep.core.int4a8, int8a8)
        rate = row["decode_tokens_per_s"]["median"]
        row["copy_bandwidth_share"] = rate * step_bytes / (bw * 1e9) if bw else None
        paired = [r * step_bytes / (b * 1e9) for r, b in zip(decode, beside[i], strict=True)] if beside[i] else []
        row["copy_bandwidth_share_paired"] = runinfo.median(paired) if paired else None  # run by run (the module)
        if e.peer is None:
            ours[i] = row
        else:
            base = ours[e.against]
            row["compared_with"] = f"llmstep {base['weights']}"
            row["same_tokens_as_llmstep"] = matching_prefix(row["tokens"], base["tokens"])
            row["llmstep_vs_this"] = base["decode_tokens_per_s"]["median"] / rate
        rows.append(row)
    return rows


def format_peers(record: dict) -> str:
    """The record as a table: one line per precision and engine (its weights' source after it), then what failed,
    what was skipped, and why."""
    bw = record.get("copy_bandwidth_gb_s")
    lines = [f"{'precision':<9} {'engine':<30} {'weights':<33} {'decode tok/s':>12} {'spread':>7} "
             f"{'bw share':>8} {'paired':>6} {'llmstep/x':>9} {'same tok':>8}  source"]
    for row in record["rows"]:
        d = row["decode_tokens_per_s"]
        share, paired = (f"{row[k]:.0%}" if row.get(k) is not None else "-"
                         for k in ("copy_bandwidth_share", "copy_bandwidth_share_paired"))
        ratio = f"{row['llmstep_vs_this']:.2f}x" if "llmstep_vs_this" in row else ""
        same = f"{row['same_tokens_as_llmstep']}/{len(row['tokens'])}" if "same_tokens_as_llmstep" in row else ""
        lines.append(f"{row['precision']:<9} {row['engine'][:30]:<30} {row['weights'][:33]:<33} "
                     f"{d['median']:>12,.1f} {d['spread']:>7.0%} {share:>8} {paired:>6} {ratio:>9} {same:>8}  "
                     f"{row.get('source', '')}" + ("  [lossy: requantized]" if row.get("requantized") else ""))
    lines.append(f"median of {record['repeats']} interleaved repeats, {record['threads']} threads, "
                 f"{record['prompt_len']}-token prompt, {record['new_tokens']} new tokens"
                 + (f"; copy bandwidth {bw:.1f} GB/s, the faster measured before and after the work (bw share: of "
                    f"it, each row's own bytes per step; paired: of the bandwidth measured beside each run, the "
                    f"median)" if bw else ""))
    if (measured := record.get("copy_bandwidth_beside_runs_gb_s")) is not None:
        every = measured["all_runs"]
        lines.append(f"copy bandwidth beside the runs, measured {len(every)} times: median {measured['median']:.1f} "
                     f"GB/s, {min(every):.1f} to {max(every):.1f}")
    for key, when in (("copy_bandwidth_paired", "beside the runs"), ("copy_bandwidth_after", "after the work")):
        if key in record:
            lines.append(f"copy bandwidth {when} {record[key]}")
    if "llama_cpp_extra_buffer_types" in record:
        lines.append(f"llama.cpp's extra buffer types: {record['llama_cpp_extra_buffer_types']}")
    lines += [f"{f['peer']} FAILED at {f['precision']} ({f['weights']}): {f['why']}" for f in record.get("failed", [])]
    lines += [f"{s['peer']} skipped at {s['precision']}: {s['why']}" for s in record["skipped"]]
    return "\n".join(lines)


def roofline_points(record: dict, flops_per_step: float) -> list[tuple[float, float, str]]:
    """Each row of a run_peers record as a roofline point (FLOPs per byte, TFLOP/s, label) for
    llmstep.lab.roofline.plot_roofline: a step does the same FLOPs at every precision (two per weight, plus
    attention: `flops_per_step`, e.g. bench.mean_step_cost(model, prompt_len, new_tokens).flops) and reads the
    row's `bytes_per_step`; the row's median decode rate makes the TFLOP/s."""
    points = []
    for row in record["rows"]:
        rate = row["decode_tokens_per_s"]["median"]
        share = row["copy_bandwidth_share"]
        label = f"{row['precision']}, {row['engine']}: {rate:,.0f} tok/s"
        label += f", {share:.0%} of copy bw" if share else ""
        points.append((flops_per_step / row["bytes_per_step"], rate * flops_per_step / 1e12, label))
    return points

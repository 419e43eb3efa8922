"""Peers in the benchmark: llama.cpp, CTranslate2 and transformers decoding llmstep's own weights.

    llmstep bench --peers llama.cpp,ctranslate2,transformers --dtype float32 --quantize none int8 int4

At each precision asked for (--dtype's float, and int8 / int4 quantised from it by llmstep.core.quantize) llmstep's
compiled loop (`FastDecoder(model, compile=True)`, its default mode) runs next to every installed peer on the
same weights: the same greedy decode of the same random prompt, batch 1, one repeat of every engine after
another (interleaved, so a busy machine slows them alike), the median and spread of the repeats reported.

- llama.cpp (`pip install llama-cpp-python`): the model exported with `llmstep.core.gguf.export_gguf`: f32 or
  bf16, int8 as Q8_0 (llmstep's own int8 codes, exactly), int4 as Q4_0 made by llama.cpp's quantiser from the
  float file (GGUF has no exact form of llmstep's int4 groups with zero points: the same weights, rounded by
  llama.cpp's rule, 4.5 bits a weight as llmstep's 64-groups with bf16 scale and zero).
- CTranslate2 (`pip install ctranslate2`): converted from the checkpoint directory's safetensors by its own
  Transformers converter, float32 or int8 (its own per-row int8, llmstep's rule); no int4 on a CPU, and bf16
  only where the CPU build offers it (`ctranslate2.get_supported_compute_types`).
- transformers: `bench.hf_twin`, LlamaForCausalLM.generate() on the float weights themselves (eager, its
  dynamic cache); no CPU weight-only int8/int4 without further packages.

A peer that is not installed, or cannot run a precision, is skipped with the reason in the record
(`skipped`). Each row holds decode tokens/s (the steps after the first token), prefill tokens/s, how many
leading tokens equal llmstep's, and the share of this machine's copy bandwidth measured in the same run
(`hardware.measure_bandwidth`, before and after the timings, the faster counts) that the bytes of one llmstep
step at that precision (`bench.mean_step_cost`) make at the row's rate.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..core.files import atomic_write_json
from ..core.gguf import GGUFError, export_gguf
from ..core.model import Llama
from ..core.quantize import quantize
from ..core.tokens import Tokenizer
from ..engines.decoding import check_int
from ..engines.fast import FastDecoder
from . import runinfo
from .bench import hf_twin, matching_prefix, mean_step_cost, time_hf
from .hardware import measure_bandwidth

__all__ = ["PEERS", "PeerError", "parse_peers", "precisions", "why_not", "run_peers", "format_peers", "roofline_points"]

PEERS = ("llama.cpp", "ctranslate2", "transformers")
_MODULE = {"llama.cpp": "llama_cpp", "ctranslate2": "ctranslate2", "transformers": "transformers"}
_PIP = {"llama.cpp": "llama-cpp-python", "ctranslate2": "ctranslate2", "transformers": "transformers"}
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # llama.cpp's name at each
LLAMA_FTYPE = {"q8_0": 7, "q4_0": 2}  # llama.h's enum llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, _Q4_0
CT2_COMPUTE = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8_float32"}  # CTranslate2's compute_type


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


def why_not(peer: str, precision: str, checkpoint: Path | None, tokenizer: Tokenizer | None) -> str | None:
    """Why `peer` cannot run `precision` here (None: it can)."""
    if importlib.util.find_spec(_MODULE[peer]) is None:
        return f"not installed (pip install {_PIP[peer]})"
    if peer == "llama.cpp" and tokenizer is None:
        return "the GGUF file needs the checkpoint's tokenizer (give --model a checkpoint directory)"
    if peer == "llama.cpp" and precision not in GGUF_TYPE:
        return f"no GGUF type for {precision}"
    if peer == "ctranslate2":
        if checkpoint is None:
            return "its converter reads a checkpoint directory's safetensors (give --model one)"
        if precision not in CT2_COMPUTE:
            return f"no {precision} weights on a CPU in CTranslate2"
        import ctranslate2

        if CT2_COMPUTE[precision] not in ctranslate2.get_supported_compute_types("cpu"):
            return (f"compute type {CT2_COMPUTE[precision]} is not supported by CTranslate2 on this CPU "
                    f"(it offers {', '.join(sorted(ctranslate2.get_supported_compute_types('cpu')))})")
    if peer == "transformers" and precision in ("int8", "int4"):
        return "no weight-only int8/int4 on a CPU without further packages"
    return None


# ---- the engines: run(ids, n) -> (prefill seconds, decode seconds, the n tokens) -------------------

class _Llmstep:
    def __init__(self, model: Llama, compile: bool, compile_mode: str | None):
        self.name, self.weights = f"llmstep FastDecoder{' compiled' if compile else ''}", "llmstep"
        self.decoder = FastDecoder(model, compile=compile, mode=compile_mode)

    def run(self, ids: list[int], n: int):
        r = self.decoder.generate(ids, n, temperature=0, stop_ids=())
        return r.prefill_seconds, r.decode_seconds, r.tokens


class _LlamaCpp:
    def __init__(self, model: Llama, float_model: Llama, tokenizer: Tokenizer, precision: str, workdir: Path,
                 threads: int, n_ctx: int):
        import llama_cpp

        self.name, self.llama_cpp = "llama.cpp (llama-cpp-python)", llama_cpp
        kind = GGUF_TYPE[precision]
        self.weights = f"GGUF {kind}"
        path = None
        if precision in ("float32", "bfloat16"):
            path = export_gguf(model, tokenizer, workdir / f"model-{kind}.gguf", dtype=kind)
        elif precision == "int8":  # Q8_0 from llmstep's own int8 codes, where its scales are float16 numbers
            try:
                path = export_gguf(model, tokenizer, workdir / "model-q8_0.gguf")
            except GGUFError:  # float32 scales: llama.cpp's quantiser rounds the float weights its own way
                pass
        if path is None:  # llama.cpp's own quantiser on the float file
            source = export_gguf(float_model, tokenizer, workdir / "model-float.gguf")
            path = workdir / f"model-{kind}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = LLAMA_FTYPE[kind], threads
            if llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), params) != 0:
                raise PeerError(f"llama.cpp could not quantise {source} to {kind}")
            self.weights += " (llama.cpp's quantiser)"
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False, seed=0)
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))  # the last token's
        return int(logits.argmax())

    def run(self, ids: list[int], n: int):
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        tokens = [self._argmax()]
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval(tokens[-1:])
            tokens.append(self._argmax())
        return prefill, time.perf_counter() - start, tokens


class _CTranslate2:
    def __init__(self, model: Llama, checkpoint: Path, precision: str, workdir: Path, threads: int):
        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        self.name, self.weights = f"CTranslate2 {ctranslate2.__version__}", f"CTranslate2 {CT2_COMPUTE[precision]}"
        out = workdir / "ctranslate2"
        if not out.exists():
            TransformersConverter(str(checkpoint), low_cpu_mem_usage=True).convert(str(out), force=True)
            self.vocab = json.loads((out / "vocabulary.json").read_text())  # id -> token string: its input
            # Its converter takes bos/eos from a transformers tokenizer config, which llmstep's checkpoints do not
            # hold; CTranslate2 refuses a null one. Named from the model's config (never used: no stop token).
            config = json.loads((out / "config.json").read_text())
            c = model.config
            for key, token_id in (("bos_token", c.bos_token_id), ("eos_token", (c.eos_token_id or [None])[0])):
                if config.get(key) is None:
                    config[key] = self.vocab[token_id if token_id is not None else 0]
            atomic_write_json(out / "config.json", config)
        self.vocab = json.loads((out / "vocabulary.json").read_text())  # id -> token string: CTranslate2's input
        self.generator = ctranslate2.Generator(str(out), device="cpu", compute_type=CT2_COMPUTE[precision],
                                               inter_threads=1, intra_threads=threads)

    def run(self, ids: list[int], n: int):
        prompt = [self.vocab[i] for i in ids]
        tokens, start = [], time.perf_counter()
        prefill = 0.0
        for step in self.generator.generate_tokens(prompt, max_length=n, sampling_topk=1, end_token=[]):
            tokens.append(step.token_id)
            if len(tokens) == 1:
                prefill, start = time.perf_counter() - start, time.perf_counter()
            if len(tokens) == n:
                break
        return prefill, time.perf_counter() - start, tokens


class _Transformers:
    def __init__(self, model: Llama):
        self.name, self.weights = "transformers generate()", "llmstep's tensors"
        self.hf = hf_twin(model)

    def run(self, ids: list[int], n: int):
        first, total, tokens = time_hf(self.hf, torch.tensor([ids]), n)
        return first, total - first, tokens


# ---- the benchmark -------------------------------------------------------------------------------

def run_peers(model: Llama, peers: list[str], precision_list: list[str], tokenizer: Tokenizer | None = None,
              checkpoint: Path | None = None, prompt_len: int = 128, new_tokens: int = 128, repeats: int = 3,
              threads: int | None = None, compile: bool = True, compile_mode: str | None = None, bandwidth: bool = True,
              bandwidth_bytes: int | None = None, seed: int = 0, log=print, argv=None) -> dict:
    """llmstep's compiled loop and each peer at each precision, interleaved `repeats` times (see the module).
    `model` is the float model (on the CPU); int8 / int4 are quantised from it. compile=False runs llmstep's loop
    eager (a quick check, not the comparison). Returns the record."""
    for p in peers:
        if p not in PEERS:
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
        "repeats": repeats, "compile": compile, "compile_mode": compile_mode, "skipped": [], "rows": []}
    bw = [measure_bandwidth("cpu", bandwidth_bytes, kind="copy")] if bandwidth else []
    workdir = tempfile.TemporaryDirectory(prefix="llmstep-peers-")
    engines: list[tuple[str, object, object]] = []  # (precision, engine, the llmstep model at that precision)
    for precision in precision_list:
        m = model if precision not in ("int8", "int4") else quantize(model, precision, inplace=False)
        sub = Path(workdir.name) / precision
        sub.mkdir()
        log(f"{precision}: building llmstep's loop ...")
        engines.append((precision, _Llmstep(m, compile, compile_mode), m))
        for peer in peers:
            why = why_not(peer, precision, checkpoint, tokenizer)
            if why is None:
                log(f"{precision}: preparing {peer} ...")
                try:
                    engines.append((precision, _make(peer, m, model, tokenizer, precision, sub, checkpoint,
                                                     threads, n_ctx), m))
                except Exception as e:  # a peer's own failure is reported, not the benchmark's
                    why = f"failed to start: {type(e).__name__}: {e}"
            if why is not None:
                log(f"{precision}: {peer} skipped: {why}")
                record["skipped"].append({"peer": peer, "precision": precision, "why": why})
    runs: dict[int, list[tuple[float, float, list[int]]]] = {i: [] for i in range(len(engines))}
    for _, engine, _ in engines:  # warm-up: compile, first-call costs, page-in
        engine.run(ids, 8)
    for r in range(repeats):
        for i, (_, engine, _) in enumerate(engines):
            runs[i].append(engine.run(ids, new_tokens))
        log(f"repeat {r + 1}/{repeats} done")
    if bandwidth:
        bw.append(measure_bandwidth("cpu", bandwidth_bytes, kind="copy"))
    record["copy_bandwidth_gb_s"] = max(bw) if bw else None
    record["rows"] = _rows(engines, runs, ids, new_tokens, record["copy_bandwidth_gb_s"])
    record["load_average_1min_before_after"] = [load_before, runinfo.load_average()]
    workdir.cleanup()
    return record


def _make(peer, m, float_model, tokenizer, precision, sub, checkpoint, threads, n_ctx):
    if peer == "llama.cpp":
        return _LlamaCpp(m, float_model, tokenizer, precision, sub, threads, n_ctx)
    if peer == "ctranslate2":
        return _CTranslate2(float_model, checkpoint, precision, sub.parent, threads)
    return _Transformers(m)


def _rows(engines, runs, ids, new_tokens, bw) -> list[dict]:
    rows, ours = [], {}
    for i, (precision, engine, m) in enumerate(engines):
        decode = [(new_tokens - 1) / d for _, d, _ in runs[i]]
        prefill = [len(ids) / p for p, _, _ in runs[i]]
        step_bytes = mean_step_cost(m, len(ids), new_tokens).bytes
        row = {"precision": precision, "engine": engine.name, "weights": engine.weights,
               "decode_tokens_per_s": runinfo.timing(decode), "prefill_tokens_per_s": runinfo.timing(prefill),
               "bytes_per_step": step_bytes, "tokens": runs[i][-1][2]}
        rate = row["decode_tokens_per_s"]["median"]
        row["copy_bandwidth_share"] = rate * step_bytes / (bw * 1e9) if bw else None
        if isinstance(engine, _Llmstep):
            ours[precision] = row
        else:
            base = ours[precision]
            row["same_tokens_as_llmstep"] = matching_prefix(row["tokens"], base["tokens"])
            row["llmstep_vs_this"] = base["decode_tokens_per_s"]["median"] / rate
        rows.append(row)
    return rows


def format_peers(record: dict) -> str:
    """The record as a table: one line per precision and engine, then what was skipped and why."""
    bw = record.get("copy_bandwidth_gb_s")
    lines = [f"{'precision':<9} {'engine':<30} {'weights':<22} {'decode tok/s':>12} {'spread':>7} "
             f"{'bw share':>8} {'llmstep/x':>9} {'same tok':>8}"]
    for row in record["rows"]:
        d = row["decode_tokens_per_s"]
        share = f"{row['copy_bandwidth_share']:.0%}" if row["copy_bandwidth_share"] is not None else "-"
        ratio = f"{row['llmstep_vs_this']:.2f}x" if "llmstep_vs_this" in row else ""
        same = f"{row['same_tokens_as_llmstep']}/{len(row['tokens'])}" if "same_tokens_as_llmstep" in row else ""
        lines.append(f"{row['precision']:<9} {row['engine'][:30]:<30} {row['weights'][:22]:<22} "
                     f"{d['median']:>12,.1f} {d['spread']:>7.0%} {share:>8} {ratio:>9} {same:>8}")
    lines.append(f"median of {record['repeats']} interleaved repeats, {record['threads']} threads, "
                 f"{record['prompt_len']}-token prompt, {record['new_tokens']} new tokens"
                 + (f"; copy bandwidth {bw:.1f} GB/s measured in this run" if bw else ""))
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

"""`llmstep generate`, `info`, `trace` and `profile`: a model's text, its size and cost, one decode step timed
stage by stage, and where a (compiled) decode step's time goes, operator by operator."""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from ..core.config import PRESETS, LlamaConfig, sampling_defaults
from ..core.cost import checkpoint_bytes, decode_step_cost, kv_bytes_per_token, param_counts
from .args import (
    add_attention_arg,
    check_draft,
    check_window,
    decode_tokens,
    nonneg_int,
    positive_int,
    probability,
    probe_attention,
    quantization,
    seed,
    temperature,
    threads,
)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=nonneg_int, default=200)
    p.add_argument("--temperature", type=temperature, default=None,
                   help="0 = greedy (default: generation_config.json's, greedy where it gives sampling settings "
                        "without do_sample: true, as in transformers; else 0.8)")
    p.add_argument("--top-k", type=nonneg_int, default=None, help="0 = off (default: generation_config.json, else 0)")
    p.add_argument("--top-p", type=probability, default=None,
                   help="1 = off (default: generation_config.json, else 0.95)")
    p.add_argument("--seed", type=seed, default=None, help="makes the run reproducible")


def add_commands(sub) -> None:
    g = sub.add_parser("generate", help="stream a continuation of a prompt, then a speed summary")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the shipped Shakespeare model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message, in the checkpoint's chat template (Llama 3's format "
                        "where it has none)")
    g.add_argument("--system", default=None, metavar="TEXT", help="a system message before the prompt (with --chat)")
    _add_sampling_args(g)
    g.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or float64 (default: by device)")
    g.add_argument("--keep-quantized", action="store_true",
                   help="a GGUF file's Q4_0/Q4_1 matrices stay 4-bit (llmstep int4, groups of 32) instead of being "
                        "dequantized into --dtype")
    g.add_argument("--quantize", default="none", type=quantization,
                   help="quantization of the loaded float weights in --dtype before generating: int8, "
                        "int4, int4-g32, int8-a8, int4-g32-a8 (8-bit activations too), ...; +lm_head (the head too), "
                        "int4-g32+lm_head-int8 / -int8-a8 (an int8 head, weight-only / 8-bit activations); with "
                        "--keep-quantized, int4-g32+lm_head-int8, -int8-a8 or int4-g32+lm_head quantizes the head "
                        "alone under the file's kept blocks")
    g.add_argument("--draft", default=None,
                   help="speculative decoding with this draft: a checkpoint directory ('draft' = the shipped one) "
                        "or self-N (the model's own first N layers) or self-int8 / self-int4 (its quantized copy)")
    g.add_argument("--speculate-k", type=positive_int, default=None,
                   help="draft tokens proposed per round (with --draft; default 4)")
    g.add_argument("--adaptive-k", action="store_true",
                   help="choose each round's k (up to --speculate-k) from the acceptance measured so far")
    add_attention_arg(g)
    g.set_defaults(run=run_generate)

    i = sub.add_parser("info", help="parameters and per-token cost of a checkpoint or a preset shape")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--preset", choices=sorted(PRESETS))
    i.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float64"])
    i.add_argument("--context", type=nonneg_int, default=0, help="tokens already in the KV cache")
    i.set_defaults(run=run_info)

    t = sub.add_parser("trace", help="time one decode step stage by stage, with its bytes and FLOPs")
    src = t.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a real Llama 3.x shape with random weights")
    t.add_argument("--context", type=nonneg_int, default=256, help="tokens already in the KV cache")
    t.add_argument("--repeats", type=positive_int, default=5)
    t.add_argument("--device", default=None)
    t.add_argument("--dtype", default=None)
    add_attention_arg(t)
    t.set_defaults(run=run_trace)

    f = sub.add_parser("profile", help="decode rate, then a decode step's operators by self time (torch.profiler)",
                       description="The decode rate of FastDecoder (greedy, a random prompt), then --steps decode "
                                   "steps under torch.profiler: each operator's self time per step and the share "
                                   "of matmul, attention and elementwise work.")
    f.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    f.add_argument("--device", default=None)
    f.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: by device)")
    f.add_argument("--quantize", default="none", type=quantization,
                   help="quantization of the model in --dtype: int8, int4, int4-g32, int8-a8, int4-g32-a8 "
                        "(8-bit activations too), ...; +lm_head (the head too), int4-g32+lm_head-int8 / -int8-a8 "
                        "(an int8 head, weight-only / 8-bit activations)")
    f.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="the compiled step, FastDecoder's default settings (default: on)")
    f.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune")
    f.add_argument("--threads", type=threads, default=None, help="torch CPU threads (default: PyTorch's)")
    f.add_argument("--prompt-len", type=positive_int, default=128, help="random prompt tokens; the profiled "
                   "step sits at this position")
    f.add_argument("--new-tokens", type=decode_tokens, default=128)
    f.add_argument("--repeats", type=positive_int, default=5, help="timed decode runs (median reported)")
    f.add_argument("--steps", type=positive_int, default=None, help="decode steps under the profiler (default 100)")
    f.add_argument("--rate-only", action="store_true", help="the decode rate alone, no profile")
    f.add_argument("--kernel-profile", action="store_true", help="compiled: list each of inductor's C++ kernels "
                   "under its own name (inductor's cpp.enable_kernel_profile; its records cost a little time)")
    f.add_argument("--top", type=positive_int, default=None, help="operators listed (default 25)")
    f.set_defaults(run=run_profile)


def load_for_command(args, load_one):
    """(model, tokenizer, seed) for a command: `load_one()` in one process; under torchrun this rank's shard
    (llmstep.core.parallel: the process group joined, the world size checked against the heads before any
    weight is read) and the seed every rank will sample with."""
    from ..core import parallel

    if not parallel.launched_by_torchrun():
        return (*load_one(), args.seed)
    if getattr(args, "keep_quantized", False):  # before the process group is joined
        raise parallel.ParallelError("--keep-quantized does not run tensor-parallel (it splits float weights): "
                                     "run it in one process, without torchrun")
    group = parallel.init_from_environment(args.device)
    model, tokenizer = parallel.load(args.model, group, device=args.device, dtype=args.dtype)
    return model, tokenizer, parallel.agree_seed(args.seed, group)


def run_generate(args, argv) -> None:
    from ..core import parallel
    from ..core.checkpoint import load
    from ..engines.drafts import parse_draft
    from ..engines.generate import stream

    if not args.prompt:  # stream() refuses it too, but only once the model is loaded; a chat's empty message it takes
        raise ValueError("the prompt is empty: give at least one character")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat's system message: add --chat")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system or "")):
        try:
            text.encode()
        except UnicodeEncodeError as e:  # argv's bytes that are not UTF-8 arrive as lone surrogates
            raise ValueError(f"{flag} is not UTF-8 text: the byte at character {e.start} ({text[e.start]!r}) is "
                             "not; write it in UTF-8 (the terminal's encoding)") from None
    if args.draft is not None and parallel.launched_by_torchrun():
        raise parallel.ParallelError("speculative decoding (--draft) does not run tensor-parallel: "
                                     "run it in one process, without torchrun")
    if args.quantize != "none":
        check_quantize(args)  # before the draft's checks and any weight read
    if args.draft is not None:
        if args.keep_quantized and parse_draft(args.draft)[0] == "quantized":  # before the file's blocks are read
            raise ValueError(f"--draft {args.draft} quantizes a float copy of the target; --keep-quantized keeps "
                             "the file's quantized blocks: use a layer draft (self-N) or a draft checkpoint")
        check_draft(args.draft, args.model)  # a bad or missing draft is refused before the target is loaded
    elif args.speculate_k is not None or args.adaptive_k:
        raise ValueError(f"{'--speculate-k' if args.speculate_k is not None else '--adaptive-k'} sets speculative "
                         "decoding's rounds: add --draft (a draft model, or self-N for the target's first N layers)")
    with parallel.leaving():  # the process group, if any, left as the command ended
        _generate(args, lambda: load(args.model, device=args.device, dtype=args.dtype,
                                     keep_quantized=args.keep_quantized), stream)


FLOAT_GGUF = ("F32", "F16", "BF16")  # a GGUF file's tensor types that --quantize rounds once


def check_quantize(args) -> None:
    """generate's --quantize, refused before anything loads: under torchrun (tensor parallelism splits float
    weights), with a quantized self-draft (it quantizes the float target), for a checkpoint that is quantized
    already, or where the mode does not fit the model's shapes (int4's group size). A GGUF file whose tensors are
    quantized already is served, with a note that their dequantized values are rounded again. With --keep-quantized
    (a GGUF file's Q4 blocks kept as int4-g32) the mode may only add a quantized LM head to those blocks
    (`check_kept_head`)."""
    from ..core import parallel
    from ..core.checkpoint import read_config, read_quant_config, resolve_model_path
    from ..core.gguf_load import read_gguf
    from ..core.quantize import check_config
    from ..engines.drafts import parse_draft

    if parallel.launched_by_torchrun():
        raise parallel.ParallelError("--quantize does not run tensor-parallel (it splits float weights): run it in "
                                     "one process, without torchrun")
    if args.draft is not None and parse_draft(args.draft)[0] == "quantized":
        raise ValueError(f"--draft {args.draft} quantizes the float target, and --quantize {args.quantize} leaves "
                         "none: give a checkpoint or self-N draft, or no --quantize")
    path = resolve_model_path(args.model)
    if args.keep_quantized:
        return check_kept_head(path, args.quantize)
    if (qc := read_quant_config(path)) is not None:
        raise ValueError(f"--quantize {args.quantize}: {path} is quantized already ({qc}); it runs as it is")
    gguf = read_gguf(path) if path.is_file() else None  # its header read once, for the shapes and the types
    check_config(gguf.config if gguf else read_config(path), args.quantize)
    if gguf and (kinds := sorted({t for t in gguf.types.values() if t not in FLOAT_GGUF})):
        print(f"note: {path.name} holds {', '.join(kinds)} tensors: --quantize {args.quantize} rounds their "
              "dequantized values again (--keep-quantized holds Q4_0/Q4_1 matrices as they are)", file=sys.stderr)


def check_kept_head(path, mode: str) -> None:
    """--quantize beside --keep-quantized: the file must be a GGUF file whose blocks are kept (every matrix Q4_0 or
    Q4_1, held as int4-g32), and the mode those blocks plus a quantized LM head (int4-g32+lm_head-int8,
    +lm_head-int8-a8, or int4-g32+lm_head: the head in int4 too; -a8 blocks alike), the one thing left to quantize;
    the head's dequantized values rounded again where the file holds it quantized (a note says so). Read from the
    file's header alone."""
    from ..core.gguf_load import read_gguf
    from ..core.quantize import QuantConfig

    if path.is_dir():  # a file that is not GGUF was refused as the path was resolved
        raise ValueError(f"--keep-quantized keeps a GGUF file's Q4 matrices: {path} is a checkpoint directory")
    gguf = read_gguf(path)
    kept = gguf.quant_config(keep_quantized=True)  # GGUFLoadError naming a matrix that is not Q4_0/Q4_1
    qc = QuantConfig.of(mode)
    if (qc.mode, qc.group_size) != (kept.mode, kept.group_size) or qc.lm_head is False:
        raise ValueError(f"--keep-quantized keeps {path.name}'s blocks as {kept}: --quantize can only add a "
                         f"quantized LM head to them ({kept}+lm_head-int8, {kept}+lm_head-int8-a8 or {kept}+lm_head; "
                         f"{kept}-a8+... gives them 8-bit activations too), not {mode}"
                         + ("" if str(qc) == mode else f" ({qc})"))
    if (kind := gguf.head_type) not in FLOAT_GGUF:
        print(f"note: {path.name}'s LM head is {kind}: --quantize {mode} rounds its dequantized values again",
              file=sys.stderr)


def _generate(args, load_one, stream) -> None:
    model, tokenizer, seed = load_for_command(args, load_one)
    if args.quantize != "none" and args.keep_quantized:  # the file's blocks kept: the head alone (check_kept_head)
        from ..core.quantize import QuantConfig, quantize_lm_head

        qc = QuantConfig.of(args.quantize)
        if qc.activations:  # int4-g32-a8: the file's blocks with 8-bit activations, llama.cpp's own arithmetic
            from ..core.int4a8 import with_activations

            with_activations(model)
        quantize_lm_head(model, qc.lm_head)
    elif args.quantize != "none":  # checked above against the checkpoint's shapes (check_quantize)
        from ..core.quantize import quantize

        quantize(model, args.quantize)
    defaults = sampling_defaults(getattr(model, "generation_config", None))  # do_sample false: greedy
    temperature = args.temperature if args.temperature is not None else defaults.get("temperature", 0.8)
    top_k = args.top_k if args.top_k is not None else defaults.get("top_k", 0)
    top_p = args.top_p if args.top_p is not None else defaults.get("top_p", 0.95)
    ignored = [f"--{name.replace('_', '-')}" for name in ("top_k", "top_p", "seed") if getattr(args, name) is not None]
    if temperature == 0 and ignored:  # greedy: nothing is drawn, so nothing of the draw's settings applies
        why = "--temperature 0" if args.temperature is not None else \
            "the checkpoint's sampling defaults (give --temperature to sample)"
        print(f"note: greedy decoding by {why} takes the likeliest token every step; {', '.join(ignored)} "
              f"change{'s' if len(ignored) == 1 else ''} nothing", file=sys.stderr)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    prompt = [*system, {"role": "user", "content": args.prompt}] if args.chat else args.prompt
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=seed)
    if args.draft is not None:
        from ..engines.drafts import resolve_draft
        from ..engines.speculative import speculative_stream

        draft = resolve_draft(args.draft, model, tokenizer)
        run = speculative_stream(model, draft, tokenizer, prompt, k=args.speculate_k or 4, adaptive=args.adaptive_k,
                                 **sampling)
    else:
        run = stream(model, tokenizer, prompt, **sampling)
    probe_attention(model, args.attention)  # a kernel this device lacks fails at its first call: make it now
    if not args.chat:  # every argument was checked above: an error never lands after the echoed prompt
        print(args.prompt, end="", flush=True)
    try:
        for event in run:
            print(event.text, end="", flush=True)
    finally:
        print(flush=True)  # end the text's line, whatever ended the stream (Ctrl-C, an error)
    where = f"{model.device.type} {str(model.dtype).removeprefix('torch.')}"
    if (qc := getattr(model, "quantization", None)) is not None:
        where += f" {qc}"
    if hasattr(model, "split"):
        where += f", tensor-parallel over {model.split.world} ranks (bytes: rank 0's)"
    print(f"\n[{where}] {run.result.summary()}", file=sys.stderr)


def run_info(args, argv) -> None:
    qc = None  # a quantized checkpoint's settings: its step reads its codes, not float weights
    if args.preset:
        config, name = LlamaConfig.preset(args.preset), args.preset
    else:
        from ..core.checkpoint import read_config, read_quant_config, resolve_model_path

        path = resolve_model_path(args.model)
        config, name, qc = read_config(path), str(path), read_quant_config(path)
    check_window(args.context + 1, f"--context {args.context} and the step's token", config=config)  # before any line
    dtype = getattr(torch, args.dtype)
    counts = param_counts(config)
    total = sum(counts.values())
    print(f"{name}: {total / 1e9:.3f} B parameters")
    for part, n in counts.items():
        print(f"  {part:<10} {n:>16,}  {100 * n / total:5.1f}%")
    cost = decode_step_cost(config, context=args.context, dtype=dtype, qc=qc)
    if qc is not None:
        print(f"stored quantized ({qc}): {checkpoint_bytes(config, dtype, qc) / 1e9:.3f} GB in memory with the rest "
              f"in {args.dtype}")
    print(f"one decode step at {args.dtype}{f' {qc}' if qc is not None else ''}, {args.context} tokens of context: "
          f"{cost.weight_bytes / 1e9:.3f} GB of weights + {cost.kv_bytes / 1e6:.3f} MB of KV cache, "
          f"{cost.flops / 1e9:.2f} GFLOP, {cost.arithmetic_intensity:.2f} FLOP/byte")
    print(f"KV cache per token: {kv_bytes_per_token(config, dtype) / 1024:.1f} KiB")


def run_trace(args, argv) -> None:
    from ..lab.hardware import measure_matmul, random_model
    from ..lab.trace import trace_step

    check_window(args.context + 1, f"--context {args.context} and the step's token", args.model, args.preset)
    if args.preset:
        model = random_model(LlamaConfig.preset(args.preset), device=args.device, dtype=args.dtype)
    else:
        from ..core.checkpoint import load_model

        model = load_model(args.model, device=args.device, dtype=args.dtype)
    trace = trace_step(model, context=args.context, repeats=args.repeats)
    peak = measure_matmul(model.device, dtype=model.dtype)
    print(f"one decode step, {args.context} tokens of context, {model.device.type} {model.dtype}; "
          f"math-unit busy share against {peak:.2f} TFLOP/s measured here")
    print(trace.table(peak_tflops=peak))


def run_profile(args, argv) -> dict:
    import statistics

    from ..core import torch_compat
    from ..core.checkpoint import load_model
    from ..core.quantize import quantize
    from ..engines.fast import FastDecoder
    from ..lab.profile import decode_rates, profile_ops

    if args.kernel_profile and not args.compile:
        raise ValueError("--kernel-profile names a compiled step's kernels: it cannot go with --no-compile")
    profiled = [flag for flag, on in (("--steps", args.steps is not None), ("--top", args.top is not None),
                                      ("--kernel-profile", args.kernel_profile)) if on]
    if args.rate_only and profiled:
        raise ValueError(f"{profiled[0]} sets the profile, which --rate-only skips: drop one of them")
    if args.compile_mode is not None and not args.compile:
        raise ValueError("--compile-mode sets how the step compiles: it cannot go with --no-compile")
    check_window(args.prompt_len + args.new_tokens, f"--prompt-len {args.prompt_len} and --new-tokens "
                 f"{args.new_tokens}", args.model)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.quantize != "none":
        quantize(model, args.quantize)
    with torch_compat.kernel_profile() if args.kernel_profile else contextlib.nullcontext():  # steps compile inside
        decoder = FastDecoder(model, max_len=args.prompt_len + args.new_tokens, compile=args.compile,
                              mode=args.compile_mode)
        compile_seconds = decoder.warmup()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=generator).tolist()
        rates = decode_rates(decoder, ids, args.new_tokens, args.repeats)
        what = f"{model.device.type} {str(model.dtype).removeprefix('torch.')}" + \
            (f" {model.quantization}" if args.quantize != "none" else "") + \
            (" compiled" if decoder.compiled else " eager")
        print(f"[{what}] decode {statistics.median(rates):,.1f} tok/s, median of {args.repeats} runs of "
              f"{args.new_tokens} tokens (min {min(rates):,.1f}, max {max(rates):,.1f}); "
              f"compile {compile_seconds:.1f} s")
        record = {"decode_tokens_per_s_runs": rates, "compiled": decoder.compiled}
        if not args.rate_only:
            ops = profile_ops(decoder, context=args.prompt_len, steps=args.steps or 100)
            print(ops.table(args.top or 25))
            record["us_per_step_by_kind"] = ops.by_kind()
    return record

"""`llmstep bench`, `speculative` and `batch`: the benchmarks of llmstep.lab, their flags and their tables."""

from __future__ import annotations

import argparse
import sys

import torch

from ..core.config import PRESETS, LlamaConfig, RopeScaling, parse_json
from ..core.files import atomic_write_json, check_output_path
from ..core.quant_formats import HEADS
from ..lab import bench as decode_bench
from ..lab.hardware import check_bandwidth_bytes
from .args import (
    add_attention_arg,
    check_draft,
    check_window,
    decode_tokens,
    int_between,
    parse_ints,
    positive_int,
    seed,
    temperature,
    threads,
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _set_threads(count: int | None) -> None:
    if count is not None:  # 1 .. THREADS_LIMIT: checked by its type (args.threads), for every command alike
        torch.set_num_threads(count)


def _write_json(path: str | None, record: dict) -> None:
    """The record as JSON, atomically (a run interrupted mid-write keeps the last complete record)."""
    if path:
        atomic_write_json(path, record, default=str)


# --set KEY=VALUE: the JSON types each LlamaConfig field takes (rope_scaling: an object of RopeScaling's fields).
_SET_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "int | None": (int, type(None)),
              "list[int]": (list, int), "RopeScaling | None": (dict, type(None))}


def parse_sets(items: list[str]) -> dict:
    """--set KEY=VALUE ... as LlamaConfig overrides (VALUE in JSON; true/false as booleans), each of the JSON type
    its field takes (checked here: the config's own checks assume the right types), each key once."""
    out, given = {}, {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in LlamaConfig.__dataclass_fields__:
            raise ValueError(f"--set takes KEY=VALUE with KEY a LlamaConfig field, got {item!r}")
        if key in given:  # the last would win silently
            raise ValueError(f"--set {key} is given twice ({given[key]} and {item}): give each field once")
        given[key] = item
        parsed = parse_json(value, f"--set {key}'s value") if value not in ("true", "false") else value == "true"
        kind = str(LlamaConfig.__dataclass_fields__[key].type)
        allowed = _SET_TYPES[kind]
        ok = isinstance(parsed, allowed) and (type(parsed) is not bool or bool in allowed)  # bool is an int too
        if isinstance(parsed, list):
            ok = ok and all(type(i) is int for i in parsed)
        if not ok:
            raise ValueError(f"--set {key}: {key} takes {kind.replace(' | None', ' or null')}, "
                             f"got {type(parsed).__name__}")
        if isinstance(parsed, dict):
            try:
                RopeScaling(**parsed)
            except TypeError as e:
                raise ValueError(f"--set {key}: {e}; its fields are {', '.join(RopeScaling.__dataclass_fields__)}"
                                 ) from None
        out[key] = parsed
    return out


bandwidth_bytes = int_between(2**20, 2**40)  # the bandwidth copy's buffer: 1 MiB .. 1 TiB


def _head_mode(value: str) -> str:
    if value not in HEADS:
        raise argparse.ArgumentTypeError(f"the LM head's own mode can be {' or '.join(HEADS)} (or give no value: the "
                                         f"blocks' mode), got {value!r}")
    return value


def add_commands(sub) -> None:
    doc = decode_bench.__doc__
    p = sub.add_parser("bench", help="decode tokens/s, float and quantized, next to transformers",
                       description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory, or target/draft (default: target)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a real Llama 3.x shape with random weights")
    p.add_argument("--random-weights", action="store_true", help="with --model: its config.json, random weights")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config fields")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU, else bf16)")
    p.add_argument("--threads", type=threads, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--new-tokens", type=decode_tokens, default=128)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "int4", "int8-a8", "int4-a8"],
                   help="rows: the float weights, int8, int4 (weight-only), int8-a8 and int4-a8 (with 8-bit "
                        "activations, llama.cpp's arithmetic: llmstep.core.int8a8, int4a8)")
    p.add_argument("--group-size", type=positive_int, default=None, help="int4 group size (default 64)")
    p.add_argument("--quantize-lm-head", nargs="?", const=True, default=False, type=_head_mode, metavar="HEAD",
                   help="quantize the LM head too: in the blocks' mode, or in int8 (int8) or int8 with 8-bit "
                        "activations (int8-a8) under other blocks (not with --peers, whose quantised rows hold an "
                        "8-bit head already)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode step (default: on CUDA only)")
    p.add_argument("--compile-mode", default=None, help="default: reduce-overhead (CUDA graphs) on CUDA")
    p.add_argument("--no-eager", dest="eager", action="store_false", help="skip the eager reference rows")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' rows")
    p.add_argument("--hf-dtype", default=None, help="run transformers in this dtype (default: the model's)")
    p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time transformers with a static cache and its decode step compiled "
                        "(default: on CUDA only; compiling transformers on a CPU takes minutes)")
    p.add_argument("--no-bandwidth", dest="bandwidth", action="store_false")
    p.add_argument("--bandwidth-bytes", type=bandwidth_bytes, default=None,
                   help="buffer size for the bandwidth copy (and the most the reads at the weights' size take)")
    p.add_argument("--peers", default=None, metavar="NAME,...",
                   help="instead of the table above: llmstep's compiled loop next to these peers on the same "
                        "weights, at --dtype and each --quantize mode (llama.cpp, ctranslate2, transformers; "
                        "see llmstep.lab.peers)")
    p.add_argument("--llama-cpp-extra-bufts", choices=["auto", "on", "off"], default="auto",
                   help="--peers: llama.cpp's extra buffer types (weight repacking); auto: off on a CPU with AMX, "
                        "whose llama.cpp kernels can die with SIGILL on virtual machines")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", default=None, help="write the whole record here")
    add_attention_arg(p)
    p.set_defaults(run=run_bench)

    s = sub.add_parser("speculative", help="measure speculative decoding against the target alone",
                       description="measure speculative decoding against the target alone")
    s.add_argument("--bench", action="store_true", help="run the benchmark (the only action)")
    s.add_argument("--target", default="target", help="target checkpoint (default: the shipped one)")
    s.add_argument("--draft", default="draft",
                   help="draft checkpoint, self-N or self-int8 / self-int4 (default: the shipped draft)")
    s.add_argument("--ks", type=parse_ints, default=[1, 2, 3, 4, 6, 8], help="comma-separated draft lengths")
    s.add_argument("--max-new-tokens", type=int_between(3), default=200,  # the prefill's token, then a round's
                   help="at least 3: the prefill's token, then rounds that each propose one token or more")
    s.add_argument("--temperature", type=temperature, default=0.0)
    s.add_argument("--repeats", type=positive_int, default=3)
    s.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    s.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: float32 on a CPU)")
    s.add_argument("--compile", action="store_true",
                   help="the fast loops (static caches, compiled steps), greedy, fixed k; no adaptive k")
    s.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune (see llmstep.fast)")
    s.add_argument("--threads", type=threads, default=None, help="torch CPU threads (default: PyTorch's choice)")
    s.add_argument("--out", default=None, help="write the record to this JSON file, after every repeat (default: "
                   "no file; results/ holds the records its README cites, written only when asked)")
    add_attention_arg(s)
    s.set_defaults(run=run_speculative)


def check_bench_flags(args) -> None:
    """bench's flags that would do nothing as given: --random-weights with a preset (random already), a row twice,
    int4's group size or a quantised head with no quantised row, a compile mode with compiling turned off, a
    bandwidth copy's size with the copy skipped."""
    if args.random_weights and args.preset:
        raise ValueError(f"--random-weights takes a --model's shape with random weights; --preset {args.preset} has "
                         "random weights already: drop --random-weights")
    if len(set(args.quantize)) < len(args.quantize):
        raise ValueError(f"--quantize {' '.join(args.quantize)}: each mode once (a row twice is measured twice)")
    if args.group_size is not None and not {"int4", "int4-a8"} & set(args.quantize):
        raise ValueError("--group-size sets int4's groups: add int4 (or int4-a8) to --quantize")
    if args.quantize_lm_head and args.quantize == ["none"]:
        raise ValueError("--quantize-lm-head quantises the head of the quantised rows: add int8, int4, int8-a8 or "
                         "int4-a8 to --quantize")
    if args.compile_mode is not None and args.compile is False:
        raise ValueError("--compile-mode sets how the step compiles: it cannot go with --no-compile")
    if not args.bandwidth and args.bandwidth_bytes is not None:
        raise ValueError("--bandwidth-bytes sizes the bandwidth copy, which --no-bandwidth skips: drop one of them")


def check_bench_window(args) -> None:
    """The prompt and its new tokens inside the benched model's context, from its config alone (nothing built)."""
    check_window(args.prompt_len + args.new_tokens, f"--prompt-len {args.prompt_len} and --new-tokens "
                 f"{args.new_tokens}", config=decode_bench.choose_model(args.model, args.preset, args.random_weights,
                                                                        parse_sets(args.set))[0])


def check_compiling_flags(args, device) -> None:
    """bench's flags for compiled rows, refused where no row compiles: compiling is off by default on a CPU
    (`engines.compile.compiles`), so there --compile-mode and --no-eager need --compile."""
    from ..engines.compile import compiles

    if compiles(device, args.compile):
        return
    why = ("--no-compile turns compiling off" if args.compile is False
           else f"the bench does not compile on {device.type} by default")
    if args.compile_mode is not None:
        raise ValueError(f"--compile-mode sets how the step compiles, and {why}: add --compile")
    if not args.eager:
        raise ValueError(f"--no-eager drops the eager rows, the only ones without compiled rows ({why}): add "
                         "--compile")


def run_bench(args, argv) -> dict:
    from ..core import parallel
    from ..core.device import resolve_device, resolve_dtype

    if parallel.launched_by_torchrun():
        return _run_bench_tp(args, argv)
    check_bench_flags(args)

    if args.json is not None:  # "" too: refused as the folder it names, not skipped
        check_output_path(args.json, "--json")  # before any work: a late failure would lose the run
    if not args.hf and (args.hf_compile or args.hf_dtype):  # before the model is built
        raise ValueError(f"--no-hf skips transformers, so {'--hf-compile' if args.hf_compile else '--hf-dtype'} "
                         f"has nothing to set: drop one of them")
    if args.hf_dtype:
        resolve_dtype(args.hf_dtype, resolve_device(args.device))  # a bad name is refused before the model is built
    if args.bandwidth and args.bandwidth_bytes is not None:  # the copy's buffers must fit, before the model loads
        check_bandwidth_bytes(args.bandwidth_bytes, "cpu" if args.peers is not None else args.device,
                              name="--bandwidth-bytes")
    if args.peers is not None:
        return run_peer_bench(args, argv)
    if args.llama_cpp_extra_bufts != "auto":
        raise ValueError("--llama-cpp-extra-bufts sets the llama.cpp peer's buffers: add --peers llama.cpp")
    check_compiling_flags(args, resolve_device(args.device))
    check_bench_window(args)
    _set_threads(args.threads)
    model, source = decode_bench.bench_model(args.model, args.preset, args.random_weights, parse_sets(args.set),
                                             args.device, args.dtype, args.seed)
    if (qc := getattr(model, "quantization", None)) is not None and args.quantize != ["none"]:
        raise ValueError(f"{source} is quantized already ({qc}): it is measured as it is; drop --quantize "
                         f"{' '.join(args.quantize)}")
    variants = ["none"] if qc is not None else args.quantize
    print(f"llmstep bench: {source}, {sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters, "
          f"{model.device} {str(model.dtype).removeprefix('torch.')}", flush=True)
    hf_dtype = resolve_dtype(args.hf_dtype, model.device, model.dtype) if args.hf_dtype else None
    head = {"source": source}

    def write(partial: dict) -> None:  # after every repeat: an interrupted run keeps the repeats that finished
        _write_json(args.json, head | partial)

    record = decode_bench.run_bench(model, variants, args.prompt_len, args.new_tokens, args.compile,
                                    args.compile_mode, args.repeats, args.group_size, args.quantize_lm_head,
                                    args.eager, args.hf, args.bandwidth, args.seed, args.bandwidth_bytes, hf_dtype,
                                    log=_log, on_repeat=write, argv=argv, hf_compile=args.hf_compile)
    record = head | record
    print(decode_bench.format_table(record))
    _write_json(args.json, record)
    return record


def _run_bench_tp(args, argv) -> dict:
    """`torchrun --nproc-per-node N -m llmstep bench ...`: decode per token and its all-reduce share on N ranks
    (llmstep.lab.bench_tp); the quantised variants, compiled steps and transformers' rows run in one process."""
    from ..core import parallel
    from ..lab import bench_tp

    check_bench_flags(args)  # a row twice, a group size with no int4 row: said as in one process
    check_bench_window(args)  # before every rank joins the group and reads its shard
    one_process = [flag for flag, on in (("--quantize int8/int4", args.quantize != ["none"]),
                                         ("--quantize-lm-head", args.quantize_lm_head),
                                         ("--group-size", args.group_size is not None),
                                         ("--compile", bool(args.compile)), ("--compile-mode", bool(args.compile_mode)),
                                         ("--hf-compile", bool(args.hf_compile)), ("--hf-dtype", bool(args.hf_dtype)),
                                         ("--peers", args.peers is not None),
                                         ("--bandwidth-bytes", args.bandwidth_bytes is not None),
                                         ("--llama-cpp-extra-bufts", args.llama_cpp_extra_bufts != "auto"))
                   if on]
    if one_process:
        raise parallel.ParallelError(f"{one_process[0]} does not run tensor-parallel: drop it, or run the bench in "
                                     "one process, without torchrun")
    if args.json is not None:  # "" too: refused as the folder it names, not skipped
        check_output_path(args.json, "--json")  # before any work: a late failure would lose the run
    _set_threads(args.threads)
    with parallel.leaving():  # the process group left as the command ended
        group = parallel.init_from_environment(args.device)
        model, source = bench_tp.bench_model(args.model, args.preset, args.random_weights, parse_sets(args.set),
                                             args.device, args.dtype, args.seed, group)
        print(f"llmstep bench: {source}, tensor-parallel over {model.split.world} ranks, "
              f"{model.device} {str(model.dtype).removeprefix('torch.')}", flush=True)
        record = {"source": source} | bench_tp.measure(model, args.prompt_len, args.new_tokens, args.repeats,
                                                       args.seed, group, argv)
        print(bench_tp.format_measured(record))
        if model.split.rank == 0:
            _write_json(args.json, record)
        return record


def run_peer_bench(args, argv) -> dict:
    from ..core.checkpoint import check_files, resolve_model_path
    from ..lab import peers

    names = peers.parse_peers(args.peers)  # before the model is built
    if args.device not in (None, "cpu"):
        raise ValueError(f"--peers runs on the CPU: drop --device {args.device}")
    ignored = [flag for flag, on in (("--no-hf", not args.hf), ("--hf-dtype", bool(args.hf_dtype)),
                                     ("--hf-compile", bool(args.hf_compile)), ("--no-eager", not args.eager)) if on]
    if ignored:  # the peers table has its own rows: transformers is a peer there, llmstep's rows are compiled
        raise ValueError(f"{ignored[0]} sets a row of the bench without --peers; the peers table runs each engine "
                         "once, compiled (transformers as a peer: name it in --peers or leave it out): drop it")
    if args.quantize_lm_head:  # each peer's LM head is its own input's (llama.cpp's Q8_0 / Q4_x files keep theirs)
        raise ValueError("--quantize-lm-head does not apply to --peers: the int8 / int4 rows of every engine hold "
                         "the LM head in 8 bits already (int8 / Q8_0, as llama.cpp's int4 files keep theirs at 8 "
                         "or 6 bits); drop the flag")
    from ..core.device import resolve_dtype

    if args.dtype is not None and resolve_dtype(args.dtype, torch.device("cpu")) not in (torch.float32,
                                                                                       torch.bfloat16):
        raise ValueError(f"--peers compares float32 or bfloat16 weights (llama.cpp's F32 / BF16 files), not "
                         f"--dtype {args.dtype}")
    check_bench_window(args)
    _set_threads(args.threads)
    model, source = decode_bench.bench_model(args.model, args.preset, args.random_weights, parse_sets(args.set),
                                             "cpu", args.dtype, args.seed)
    checkpoint = tokenizer = None
    if not (args.preset or args.random_weights or args.set):
        checkpoint = resolve_model_path(args.model)
        tokenizer = check_files(checkpoint)[2]
    print(f"llmstep bench --peers: {source}, {str(model.dtype).removeprefix('torch.')}", flush=True)
    record = peers.run_peers(model, names, peers.precisions(model.dtype, args.quantize), tokenizer, checkpoint,
                             args.prompt_len, args.new_tokens, args.repeats, args.threads,
                             args.compile is not False, args.compile_mode,
                             args.bandwidth, args.bandwidth_bytes, args.seed, log=_log, argv=argv,
                             group_size=args.group_size,
                             extra_bufts={"auto": None, "on": True, "off": False}[args.llama_cpp_extra_bufts])
    record = {"source": source} | record
    print(peers.format_peers(record))
    _write_json(args.json, record)
    return record


def run_speculative(args, argv) -> dict:
    from ..core.checkpoint import load
    from ..engines.drafts import resolve_draft
    from ..lab.bench_speculative import bench, bench_compiled

    if not args.bench:
        raise ValueError("nothing to do: pass --bench")
    if args.compile and args.temperature != 0:
        raise ValueError("--compile measures greedy decoding: leave --temperature at 0")
    if args.compile_mode is not None and not args.compile:
        raise ValueError("--compile-mode sets how --compile compiles the loops: add --compile")
    if args.out is not None:
        check_output_path(args.out, "--out")  # before any work: a late failure would lose the run
    check_draft(args.draft, args.target)  # a bad or missing draft is refused before the target is loaded
    _set_threads(args.threads)
    target, tokenizer = load(args.target, device=args.device, dtype=args.dtype)
    draft = resolve_draft(args.draft, target, tokenizer)
    def write(partial: dict) -> None:  # after every repeat: an interrupted run keeps the repeats that finished
        _write_json(args.out, partial)

    if args.compile:
        report = bench_compiled(target, draft, tokenizer, ks=args.ks, max_new_tokens=args.max_new_tokens,
                                repeats=args.repeats, mode=args.compile_mode, on_repeat=write, argv=argv)
    else:
        report = bench(target, draft, tokenizer, ks=args.ks, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, repeats=args.repeats, on_repeat=write, argv=argv)
    print(f"\n{'':>9} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/fwd':>8} {'theory':>7}")
    for name, r in report["results"].items():
        if name == "target":
            print(f"{name:>9} {r['decode_tokens_per_second']:8.1f} {1:8.2f}")
        else:
            print(f"{name:>9} {r['decode_tokens_per_second']:8.1f} {r['speedup']:8.2f} {r['acceptance_rate']:7.1%} "
                  f"{r['tokens_per_target_forward']:8.2f} {r['theory_tokens_per_forward']:7.2f}"
                  + (f"  same tokens as the target alone: {r['matching_tokens']}" if "matching_tokens" in r else ""))
    if args.out is not None:
        _write_json(args.out, report)
        print(f"wrote {args.out}")
    return report

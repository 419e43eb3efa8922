"""Every subcommand, every option, a table of bad values: each run exits with status 2 and exactly one line on
stderr, no traceback, and fails before any model is built or any work starts (the work is replaced by a
tripwire here, so a value that slipped through ends the run with an internal error and fails the test)."""

from __future__ import annotations

import argparse
import time

import pytest

from llmstep import cli
from llmstep.cli import args as types
from llmstep.core import model as model_module
from llmstep.shakespeare import evaluate, train

HUGE = str(2**70)

# A flag's type -> values it must refuse.
BAD_BY_TYPE = {
    types.positive_int: ["0", "-1", "abc", "1.5", "", HUGE],
    types.nonneg_int: ["-1", "abc", "1.5", "", HUGE],
    types.threads: ["0", "-1", "abc", "1.5", "", HUGE, "1025", "2147483647"],
    types.seed: ["-1", "abc", "1.5", HUGE],
    types.nonneg_float: ["-1", "nan", "inf", "abc", ""],
    types.positive_float: ["0", "-1", "nan", "inf", "abc"],
    types.probability: ["0", "1.5", "-0.1", "nan", "abc"],
    types.fraction: ["-0.1", "1.5", "nan", "abc"],
    types.parse_ints: ["0", "-1", "a,b", "", "1,,2", HUGE],
    types.parse_range: ["0", "5:2", "a", "1:" + HUGE],
}
for t in (types.int_between(2), types.int_between(2**20, 2**40)):  # bench's own ranges, by their names
    BAD_BY_TYPE[t.__name__] = ["0", "-1", "abc", HUGE]


def bad_paths(tmp_path):
    """dest -> values: files to write that are directories or under a file; inputs that are missing or files."""
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a directory\n")
    missing = str(tmp_path / "missing")
    outputs = [str(tmp_path), str(a_file / "x.json")]
    return {"json": outputs, "out": outputs, "model": [missing, str(a_file)], "target": [missing, str(a_file)],
            "draft": [missing, str(a_file), str(tmp_path), "", "self-int3", "self-x", "self-0", "self-07", "self-99",
                      "self-²"],
            "device": ["nonsense"], "dtype": ["int3"], "hf_dtype": ["int3"],
            "prompt": [""], "set": ["nope=1", "n_layers=abc"], "corpus": [missing, str(a_file)],
            "sdist": [missing], "models": [missing], "root": [missing, str(a_file)], "gguf": outputs,
            "peers": ["nope", "", "llama.cpp,llama.cpp"], "name": ["nope", "", "../x"]}


# A valid command line for each (sub)command: the bad value replaces one option at a time.
def bases(tmp_path):
    run = tmp_path / "run"
    return {("generate",): ["generate", "--prompt", "ROMEO:"], ("info",): ["info", "--preset", "llama-3.2-1b"],
            ("trace",): ["trace"], ("bench",): ["bench"], ("speculative",): ["speculative", "--bench",
                                                                              "--out", str(tmp_path / "s.json")],
            ("batch",): ["batch", "--kv", "paged"], ("export",): ["export", "--gguf", str(tmp_path / "m.gguf")],
            ("train",): ["train", "--out", str(run)], ("eval",): ["eval"],
            ("data", "prepare"): ["data", "prepare", "--sdist", str(tmp_path / "missing.tar.gz"),
                                  "--out", str(tmp_path / "corpus")],
            ("data", "tokenizer"): ["data", "tokenizer", "--out", str(tmp_path / "tok.json")],
            ("data", "checksums"): ["data", "checksums", str(tmp_path)], ("pull",): ["pull"],
            ("models",): ["models"], ("serve",): ["serve", "--port", "0"],
            ("bench-serve",): ["bench-serve", "--url", "http://127.0.0.1:9"], ("profile",): ["profile"]}


def subparsers(parser: argparse.ArgumentParser, path=()):
    """(command path, parser) for every leaf (sub)command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from subparsers(sub, path + (name,))


def cases(tmp_path):
    paths = bad_paths(tmp_path)
    base = bases(tmp_path)
    for path, parser in subparsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            flag = action.option_strings[-1] if action.option_strings else None
            bad = BAD_BY_TYPE.get(action.type) or BAD_BY_TYPE.get(getattr(action.type, "__name__", None)) or []
            if path == ("train",) and action.dest == "out":
                bad = [str(tmp_path / "a_file.txt")]  # train's --out is a directory
            elif path == ("data", "prepare") and action.dest == "out":
                bad = [str(tmp_path / "a_file.txt")]  # prepare's --out is the corpus directory
            elif path != ("train",) or action.dest == "out":  # train's text flags are read by the training run
                bad = bad or paths.get(action.dest, [])
            for value in bad:
                argv = base[path] + ([flag, value] if flag else [value])
                yield path, flag or action.dest, value, argv


@pytest.fixture
def tripwires(monkeypatch):
    """The work every command would start once its input is accepted: a model built, a training or an eval run."""
    def tripped(*args, **kwargs):
        raise AssertionError("reached the work: the bad value was not refused first")

    monkeypatch.setattr(model_module.Llama, "__init__", tripped)
    monkeypatch.setattr(train, "train", tripped)
    monkeypatch.setattr(evaluate, "evaluate_models", tripped)
    monkeypatch.delenv("LLMSTEP_DEBUG", raising=False)


def test_every_bad_value_of_every_option_of_every_command_is_one_line_and_exit_status_2(tmp_path, tripwires,
                                                                                          capsys):
    start = time.perf_counter()
    checked, failures = 0, []
    for path, option, value, argv in cases(tmp_path):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        if e.value.code != 2 or len(lines) != 1 or "Traceback" in captured.err:
            failures.append(f"{' '.join(path)} {option} {value!r}: exit {e.value.code}, stderr {captured.err!r}")
        checked += 1
    assert not failures, f"{len(failures)} of {checked} cases:\n" + "\n".join(failures)
    assert checked > 300  # the table covers every command's options
    assert time.perf_counter() - start < 90  # no case does the work it was refused (loose: a loaded machine)


def test_the_error_names_the_option_and_comes_before_anything_is_printed(tmp_path, tripwires, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "ROMEO:", "--seed", HUGE])
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("llmstep generate: error: argument --seed: must be in 0 ..")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--threads", "0"])
    assert "argument --threads: must be an integer in 1 .." in capsys.readouterr().err


def test_every_threads_flag_takes_one_type_capped_where_openmp_still_starts():
    """--threads 2147483647 passed a count's type and killed the process inside libgomp (no llmstep line): every
    command's --threads is args.threads, 1 .. THREADS_LIMIT."""
    flags = {path: action.type for path, parser in subparsers(cli.build_parser()) for action in parser._actions
             if "--threads" in action.option_strings}
    assert set(flags) >= {("profile",), ("bench",), ("speculative",), ("batch",), ("serve",)}
    assert set(flags.values()) == {types.threads}
    assert types.threads(str(types.THREADS_LIMIT)) == types.THREADS_LIMIT
    with pytest.raises(argparse.ArgumentTypeError, match=rf"must be an integer in 1 \.\. {types.THREADS_LIMIT} "):
        types.threads("2147483647")

"""The dispatcher: every subcommand is there, and the library's errors end the command with one line on stderr,
exit status 2 (Ctrl-C: 130), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmstep import cli

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["generate", "info", "trace", "bench", "speculative", "batch", "train", "eval", "data", "export", "serve",
            "bench-serve"]


def test_every_subcommand_is_dispatched(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: llmstep {name}")


def test_an_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["nonsense"])
    assert e.value.code == 2 and "invalid choice: 'nonsense'" in capsys.readouterr().err


def test_a_flag_a_command_does_not_take_is_named_by_that_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--bogus", "1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("llmstep bench: error: unrecognized arguments: --bogus 1 "
                                               "(see llmstep bench --help)")


@pytest.mark.parametrize("error", [ValueError("top_p must be in (0, 1]"), FileNotFoundError("no model directory x"),
                                   NotADirectoryError("x is a file"), KeyError("unknown preset 'x'")])
def test_a_library_error_becomes_one_line_and_exit_status_2(monkeypatch, capsys, error):
    def fail(args, argv):
        raise error

    monkeypatch.setattr(cli.model, "run_info", fail)
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--preset", "llama-3-8b"])
    message = error.args[0]
    assert e.value.code == 2 and str(e.value) == f"llmstep info: error: {message}"
    assert capsys.readouterr().err == f"llmstep info: error: {message}\n"


def test_other_exceptions_are_bugs_one_line_and_exit_1_with_the_traceback_kept_for_llmstep_debug(monkeypatch, capsys):
    def fail(args, argv):
        raise RuntimeError("a bug\nwith a second line")

    monkeypatch.setattr(cli.model, "run_info", fail)
    monkeypatch.delenv("LLMSTEP_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--preset", "llama-3-8b"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("llmstep info: internal error: RuntimeError: a bug -- a bug in llmstep; please report it")
    assert "LLMSTEP_DEBUG=1 shows the traceback" in err
    monkeypatch.setenv("LLMSTEP_DEBUG", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["info", "--preset", "llama-3-8b"])


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(args, argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.model, "run_info", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--preset", "llama-3-8b"])
    assert e.value.code == 130 and capsys.readouterr().err == "llmstep info: interrupted\n"


def test_python_dash_m_llmstep_exits_2_with_one_line_on_stderr():
    done = subprocess.run([sys.executable, "-m", "llmstep", "info", "--preset", "llama-3-8b", "--context", "-5"],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert done.returncode == 2
    assert done.stderr == ("llmstep info: error: argument --context: must be an integer in 0 .. 2147483647, got -5 "
                           "(see llmstep info --help)\n") and done.stdout == ""


def test_the_speculative_benchmark_writes_a_file_only_when_asked(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """Run from anywhere (the repository's root included), it leaves no file behind unless --out names one: a
    default path once overwrote a record that results/ cites."""
    monkeypatch.chdir(tmp_path)
    report = cli.main(["speculative", "--bench", "--target", str(tiny_checkpoint), "--draft", "self-1", "--ks", "1",
                       "--max-new-tokens", "4", "--repeats", "1"])
    assert {"target", "k=1"} <= set(report["results"])
    assert list(tmp_path.iterdir()) == [] and "wrote" not in capsys.readouterr().out


def test_the_speculative_benchmark_refuses_a_k_its_cost_timing_cannot_fit_before_any_run(tiny_checkpoint, monkeypatch):
    """The round's forwards are timed after 64 cached tokens: k + 1 more must fit the 128-position context."""
    from llmstep.lab import bench_speculative

    monkeypatch.setattr(bench_speculative, "generate", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit, match=r"max\(ks\) 64: .* needs 129 positions, the target's context has 128; "
                                         r"choose max\(ks\) at most 63"):
        cli.main(["speculative", "--bench", "--target", str(tiny_checkpoint), "--draft", "self-1", "--ks", "1,64",
                  "--max-new-tokens", "4", "--repeats", "1"])


def test_the_commands_record_how_they_were_called(tmp_path, tiny_checkpoint, capsys):
    out = tmp_path / "spec.json"
    argv = ["speculative", "--bench", "--target", str(tiny_checkpoint), "--draft", "self-1", "--ks", "1,2",
            "--max-new-tokens", "6", "--repeats", "1", "--out", str(out)]
    report = cli.main(argv)
    assert report["command"].startswith("llmstep speculative --bench --target")
    assert set(report["results"]) == {"target", "k=1", "k=2", "adaptive"}
    assert report["hardware"]["cores"] and report["hardware"]["dtype"] == "float32"
    assert len(report["hardware"]["load_average_1min_before_after"]) == 2
    assert report["machine"] == {k: v for k, v in report["hardware"].items() if k != "load_average_1min_before_after"}
    assert report["load_average_1min_before_after"] == report["hardware"]["load_average_1min_before_after"]
    assert report["versions"]["llmstep"] and "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="llmstep speculative: error: nothing to do: pass --bench"):
        cli.main(["speculative"])
    with pytest.raises(SystemExit, match="--compile measures greedy decoding"):
        cli.main(["speculative", "--bench", "--compile", "--temperature", "0.5"])


@pytest.mark.parametrize("chat", [[], ["--chat"]])
def test_an_empty_prompt_is_refused_before_any_text(tiny_checkpoint, capsys, chat):
    """An empty prompt, plain or as a chat message, ends the command with one line and prints no text."""
    with pytest.raises(SystemExit, match="llmstep generate: error: the prompt is empty"):
        cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "", *chat])
    assert capsys.readouterr().out == ""


def test_the_console_script_exits_0_after_a_command_that_returns_a_record():
    """The installed `llmstep` program hands its function's return value to sys.exit, as every console script does:
    a benchmark's record must not become exit status 1 and a dump on stderr."""
    import subprocess
    import sys
    from pathlib import Path

    import tomllib

    target = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = target["llmstep"].partition(":")
    argv = ["llmstep", "batch", "--slots", "1", "--requests", "2", "--prompt-len", "2:3", "--new-tokens", "2:2",
            "--batch-sizes", "1", "--context", "8"]
    code = f"import sys; sys.argv = {argv!r}; from {module} import {function}; sys.exit({function}())"  # the wrapper
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == ""


@pytest.mark.parametrize("gen", [{"do_sample": False, "temperature": 0.9, "top_p": 0.9},
                                 {"temperature": 0.9, "top_p": 0.9}])  # GenerationConfig's do_sample defaults false
def test_a_generation_config_without_do_sample_true_means_greedy(tmp_path, tiny_checkpoint, capsys, gen):
    import json
    import shutil

    model = tmp_path / "greedy-by-config"
    shutil.copytree(tiny_checkpoint, model)
    (model / "generation_config.json").write_text(json.dumps(gen))
    argv = ["generate", "--model", str(model), "--prompt", "ab", "--max-new-tokens", "12", "--seed", "1"]
    outputs = []
    for extra in ([], ["--temperature", "0"], ["--temperature", "0.9"]):
        cli.main(argv + extra)
        outputs.append(capsys.readouterr().out)
    by_config, greedy, sampled = outputs
    assert by_config == greedy  # the file's do_sample: false wins over its temperature, as in transformers
    assert sampled != greedy  # a --temperature given on the command line still samples


def test_sigterm_during_a_write_removes_its_temporary_and_says_so(tmp_path):
    script = """
import os, signal, time
from llmstep import cli
from llmstep.cli import export
from llmstep.core.files import atomic_write

def run_export(args, argv):  # a command caught by SIGTERM halfway through writing its output
    with atomic_write(args.gguf) as tmp:
        tmp.write_text("half")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

export.run_export = run_export
cli.console()
"""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.gguf").write_text("the old file")
    done = subprocess.run([sys.executable, "-c", script, "export", "--gguf", str(out / "model.gguf")],
                          capture_output=True, text=True, timeout=60, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stderr) == (143, "llmstep export: terminated\n")
    assert [p.name for p in out.iterdir()] == ["model.gguf"] and (out / "model.gguf").read_text() == "the old file"


@pytest.mark.parametrize("flags, words", [(["--speculate-k", "3"], "--speculate-k sets speculative decoding's rounds"),
                                          (["--adaptive-k"], "--adaptive-k sets speculative decoding's rounds")])
def test_generate_refuses_speculation_settings_without_a_draft_by_name(flags, words):
    with pytest.raises(SystemExit, match=f"{words}: add --draft"):  # before the (missing) model is read
        cli.main(["generate", "--model", "/no/such/model", "--prompt", "x", *flags])


@pytest.mark.parametrize("argv, twice", [(["batch", "--slots", "1,1"], "1 is given twice in '1,1'"),
                                         (["speculative", "--bench", "--ks", "2,4,2"], "2 is given twice in '2,4,2'")])
def test_a_list_with_a_value_given_twice_is_refused(argv, twice, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert twice in capsys.readouterr().err

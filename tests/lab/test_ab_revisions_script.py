"""scripts/ab_revisions.py's record names each side's commit and, where a side's checkout has changes not committed
(a worktree with a patch applied, the way kernel A/Bs are run), a hash of them: two sides on one commit differ."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ab_revisions.py"
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def load():
    spec = importlib.util.spec_from_file_location("ab_revisions", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def checkout(path: Path) -> Path:
    """A git repository at path with one commit of kernel.py."""
    path.mkdir()

    def git(*args):
        subprocess.run(["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q")
    (path / "kernel.py").write_text("a = 1\n")
    git("add", "kernel.py")
    git("commit", "-q", "-m", "one")
    return path


@needs_git
def test_a_checkout_with_uncommitted_changes_is_told_apart_from_its_commit(tmp_path):
    script = load()
    repo = checkout(tmp_path / "repo")
    assert script.changes(repo) is None  # clean: the commit says it all
    head = script.git(repo, "rev-parse", "HEAD")
    (repo / "kernel.py").write_text("a = 2\n")
    first = script.changes(repo)
    assert first is not None and len(first) == 64
    (repo / "kernel.py").write_text("a = 3\n")
    assert script.changes(repo) not in (None, first)  # another patch, another hash
    subprocess.run(["git", "-C", str(repo), "add", "kernel.py"], check=True)
    assert script.changes(repo) is not None  # staged is still not committed
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "HEAD", "--", "kernel.py"], check=True)
    assert script.changes(repo) is None
    (repo / "new_kernel.py").write_text("b = 1\n")  # a patch that only adds a file
    added = script.changes(repo)
    assert added is not None
    (repo / "new_kernel.py").write_text("b = 2\n")
    assert script.changes(repo) not in (None, added)
    assert script.git(repo, "rev-parse", "HEAD") == head  # all on the same commit


@needs_git
def test_the_record_carries_both_sides_commits_and_changes(tmp_path, monkeypatch):
    script = load()
    before, after = checkout(tmp_path / "before"), checkout(tmp_path / "after")
    (after / "kernel.py").write_text("a = 2\n")  # the patched side
    runs = []
    monkeypatch.setattr(script, "BENCHES", {"fake": (["bench"], lambda r: (r["rate"], [1, 2]))})
    monkeypatch.setattr(script, "run", lambda checkout, args, threads, env: runs.append((checkout, env))
                        or {"rate": 10.0})
    out = tmp_path / "record.json"
    monkeypatch.setattr("sys.argv", ["ab_revisions.py", str(before), str(after), "--rounds", "2", "--out", str(out),
                                     "--env-after", "LD_PRELOAD=/x/libiomp5.so", "--env-after", "KMP_BLOCKTIME=1"])
    script.main()
    record = json.loads(out.read_text())
    after_env = {"LD_PRELOAD": "/x/libiomp5.so", "KMP_BLOCKTIME": "1"}
    assert sorted(env == after_env for path, env in runs) == [False, False, True, True]
    assert all((env == after_env) == (path == after.resolve()) for path, env in runs)  # only the after side's
    assert record["environment"] == {"before": {}, "after": after_env}
    assert record["revisions"]["before"] == script.git(before, "rev-parse", "HEAD")
    assert record["revisions"]["after"] == script.git(after, "rev-parse", "HEAD")
    assert record["uncommitted_changes"] == {"before": None, "after": script.changes(after)}
    assert record["uncommitted_changes"]["after"] is not None
    assert record["results"]["fake"]["paired_ratios"] == [1.0, 1.0] and len(runs) == 4


def test_an_environment_variable_is_name_equals_value():
    script = load()
    assert script.variable("LD_PRELOAD=/a/b.so:/c.so") == ("LD_PRELOAD", "/a/b.so:/c.so")
    assert script.variable("EMPTY=") == ("EMPTY", "")
    for bad in ("LD_PRELOAD", "=1", "1X=2", "A B=1", "PYTHONPATH=/elsewhere"):
        with pytest.raises(Exception, match="NAME=VALUE|each side's checkout"):
            script.variable(bad)


@needs_git
def test_a_folder_that_is_no_checkout_fails_before_any_run(tmp_path, monkeypatch):
    script = load()
    repo = checkout(tmp_path / "repo")
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setattr(script, "run", lambda *a: pytest.fail("ran a benchmark"))
    monkeypatch.setattr("sys.argv", ["ab_revisions.py", str(repo), str(plain)])
    with pytest.raises(subprocess.CalledProcessError):
        script.main()

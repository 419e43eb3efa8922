"""scripts/ab_revisions.py's record names each side's commit and, where a side's checkout has changes not committed
(a worktree with a patch applied, the way kernel A/Bs are run), a hash of them: two sides on one commit differ."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ab_revisions.py"


def load():
    spec = importlib.util.spec_from_file_location("ab_revisions", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checkout_with_uncommitted_changes_is_told_apart_from_its_commit(tmp_path):
    script = load()

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "kernel.py").write_text("a = 1\n")
    git("add", "kernel.py")
    git("commit", "-q", "-m", "one")
    assert script.changes(tmp_path) is None  # clean: the commit says it all
    head = script.git(tmp_path, "rev-parse", "HEAD")
    assert len(head) == 40
    (tmp_path / "kernel.py").write_text("a = 2\n")
    first = script.changes(tmp_path)
    assert first is not None and len(first) == 64
    (tmp_path / "kernel.py").write_text("a = 3\n")
    assert script.changes(tmp_path) not in (None, first)  # another patch, another hash
    assert script.git(tmp_path, "rev-parse", "HEAD") == head  # on the same commit

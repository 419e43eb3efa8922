"""scripts/ab_revisions.py's record names each side's commit and, where a side's checkout has changes not committed
(a worktree with a patch applied, the way kernel A/Bs are run), a hash of them: two sides on one commit differ."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import import_script

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def load():
    return import_script("ab_revisions.py")


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


@pytest.mark.parametrize("argv, says", [(["--only", "nomatch"], "argument --only: no benchmark's name contains"),
                                        (["--rounds", "0"], "argument --rounds"),
                                        (["--threads", "0"], "argument --threads")])
def test_a_run_that_would_measure_nothing_is_refused_before_git_or_any_run(tmp_path, monkeypatch, capsys, argv,
                                                                            says):
    """--only nomatch exited 0 with "results": {}; --rounds 0 ended in StatisticsError (median of no figures)."""
    script = load()
    monkeypatch.setattr(script, "git", lambda *a: pytest.fail("ran git"))
    monkeypatch.setattr(script, "run", lambda *a: pytest.fail("ran a benchmark"))
    out = tmp_path / "record.json"
    with pytest.raises(SystemExit) as e:
        script.main([str(tmp_path), str(tmp_path), *argv, "--out", str(out)])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not out.exists()


def test_an_out_that_cannot_be_written_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    script = load()
    monkeypatch.setattr(script, "run", lambda *a: pytest.fail("ran a benchmark"))
    with pytest.raises(SystemExit):
        script.main([str(tmp_path), str(tmp_path), "--out", str(tmp_path)])
    assert "--out path" in capsys.readouterr().err


@needs_git
def test_the_record_carries_the_machine_versions_and_a_command_to_type_again(tmp_path, monkeypatch):
    """The record's command was `ab_revisions.py . . ...` (the script's basename, the checkouts as typed, relative)
    and it named no machine or versions."""
    script = load()
    repo = checkout(tmp_path / "repo")
    monkeypatch.setattr(script, "BENCHES", {"fake": (["bench"], lambda r: (r["rate"], [1, 2]))})
    monkeypatch.setattr(script, "run", lambda *a: {"rate": 10.0})
    monkeypatch.chdir(repo)
    record = script.main([".", ".", "--rounds", "1", "--out", "record.json", "--env-after", "A=1 2"])
    assert record["command"] == (f"python scripts/ab_revisions.py {repo.resolve()} {repo.resolve()} --rounds 1 "
                                 f"--threads 2 --env-after 'A=1 2' --out {repo.resolve() / 'record.json'}")
    assert record["machine"]["cores"] and record["versions"]["llmstep"] and record["versions"]["torch"]
    assert json.loads((repo / "record.json").read_text())["command"] == record["command"]


def test_every_benchmark_it_can_run_is_a_command_llmstep_accepts():
    """Each benchmark's arguments (the default ones and those --only picks) parse and pass `llmstep bench`'s flag
    checks: a flag bench refuses (--group-size without int4, as the SmolLM2 int8 and bf16 ones once passed) would fail
    an A/B only after its first side had run."""
    from llmstep.cli import build_parser
    from llmstep.cli.bench import check_bench_flags

    script = load()
    for name, (args, _) in {**script.BENCHES, **script.OPTIONAL}.items():
        parsed = build_parser().parse_args([*args, "--threads", "2", "--json", "out.json"])
        if args[0] == "bench":
            check_bench_flags(parsed)  # raises ValueError naming the flag
        assert parsed.threads == 2, name


def test_only_picks_a_name_not_the_start_of_a_longer_mode():
    """The records' commands (`--only "SmolLM2 int4"`) were written before the int4-a8 rows: they still pick the
    weight-only row alone, and the a8 rows are named in full."""
    script = load()
    picked = [name for name in script.OPTIONAL if script.names("SmolLM2 int4", name)]
    assert picked == ["fast loop, SmolLM2 int4, compiled (decode tok/s)"]
    assert [name for name in script.OPTIONAL if script.names("int4-a8", name)] == [
        "fast loop, SmolLM2 int4-a8, compiled (decode tok/s)", "fast loop, shipped int4-a8, compiled (decode tok/s)"]
    assert script.names("paged", "continuous batcher, paged KV, 8 slots (tok/s)")

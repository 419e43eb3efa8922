"""scripts/bench_serve.py, the one command that records results/serve.md, cannot rot: on the shipped model with a
tiny load it starts `llmstep serve` as a child process for the load curve and for each prefix-caching x
chunked-prefill setting, runs the load generator against each, stops each, and writes one record naming every
server's options."""

from __future__ import annotations

import json

import pytest
from conftest import import_script

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def test_one_command_records_the_curve_and_the_four_settings(tmp_path):
    script = import_script("bench_serve.py")
    started = []
    real_server = script.Server

    class Server(real_server):
        def __init__(self, flags):
            super().__init__(flags)
            started.append(self)

    script.Server = Server
    out = tmp_path / "serve.json"
    script.main(["--models", "target", "--rate", "1000,inf", "--requests", "2", "--prompt-len", "2:4",
                 "--new-tokens", "2:3", "--shared-prefix", "32", "--shared-rate", "1000", "--threads", "1",
                 "--out", str(out)])
    runs = json.loads(out.read_text())["models"]["target"]
    assert [r["rate_per_second"] for r in runs["load_curve"]["runs"]] == [1000.0, "inf"]  # JSON has no infinity
    assert all(r["completed"] == 2 for r in runs["load_curve"]["runs"])
    settings = {key: (run["server"]["prefix_caching"], run["server"]["prefill_chunk"], run["runs"][0]["completed"])
                for key, run in runs["shared_prefix"].items()}
    assert settings == {"prefix caching on, chunked prefill 64": (True, 64, 2),
                        "prefix caching on, chunked prefill off": (True, None, 2),
                        "prefix caching off, chunked prefill 64": (False, 64, 2),
                        "prefix caching off, chunked prefill off": (False, None, 2)}
    # the warm-up put the system prompt's 2 full blocks in the cache: each timed request found them, if caching is on
    assert [run["server_after"]["prefix_hit_tokens"] for run in runs["shared_prefix"].values()] == [64, 64, 0, 0]
    assert len(started) == 5 and all(s.proc.poll() is not None for s in started)  # every server stopped


def load_script():
    return import_script("bench_serve.py")


@pytest.mark.parametrize("argv, flag", [
    (["--prompt-len", "0:4"], "--prompt-len"), (["--prompt-len", "8:4"], "--prompt-len"),
    (["--prompt-len", "a:b"], "--prompt-len"), (["--new-tokens", "x"], "--new-tokens"),
    (["--requests", "0"], "--requests"), (["--slots", "0"], "--slots"), (["--chunk", "0"], "--chunk"),
    (["--shared-rate", "0"], "--shared-rate"), (["--shared-rate", "1,2"], "--shared-rate"),
    (["--shared-prefix", "-1"], "--shared-prefix"), (["--threads", "0"], "--threads"),
    (["--models", "target,"], "--models")])
def test_a_bad_flag_is_refused_before_any_server_starts(tmp_path, monkeypatch, capsys, argv, flag):
    """--prompt-len 16 started a server, then failed with a TypeError; --requests 0 and the like likewise."""
    script = load_script()
    monkeypatch.setattr(script, "Server", lambda flags: pytest.fail("started a server"))
    with pytest.raises(SystemExit) as e:
        script.main([*argv, "--out", str(tmp_path / "serve.json")])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "serve.json").exists()


def test_the_record_names_the_script_and_takes_one_length(tmp_path, monkeypatch):
    """The record's command said `llmstep python scripts/bench_serve.py ...`; --prompt-len N is N:N."""
    script = load_script()
    seen = []
    monkeypatch.setattr(script, "measure", lambda flags, rates, requests, prompt_len, *a: seen.append(prompt_len)
                        or {"runs": []})
    out = tmp_path / "serve.json"
    argv = ["--models", "target", "--prompt-len", "16", "--shared-prefix", "0", "--out", str(out)]
    script.main(argv)
    assert json.loads(out.read_text())["command"] == "python scripts/bench_serve.py " + " ".join(argv)
    assert seen == [(16, 16)]

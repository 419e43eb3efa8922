"""`llmstep serve` as a process: it prints where it listens, serves, and SIGTERM or SIGINT stop it cleanly within
seconds, an open stream included (exit status 0, the port closed)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving import TIMEOUT, wait_for

ROOT = Path(__file__).resolve().parents[2]
STOP_SECONDS = 30.0  # a bound for a loaded machine; the server itself gives open streams 2 s


def start_server(*flags: str) -> tuple[subprocess.Popen, int]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "llmstep", "serve", "--port", "0", "--threads", "1", *flags],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    line, deadline = "", time.monotonic() + TIMEOUT
    while "http://" not in line:  # "llmstep serve: ... at http://127.0.0.1:PORT/v1 ..."
        assert time.monotonic() < deadline and proc.poll() is None, f"the server did not start: {line}"
        line = proc.stderr.readline()
    return proc, int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_within_seconds_with_a_stream_open(sig):
    proc, port = start_server("--slots", "2")
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"prompt": "ROMEO:", "max_tokens": 400, "stream": True, "ignore_eos": True}
        seen, ended = [], threading.Event()

        def stream():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                    for line in r.iter_lines():
                        seen.append(line)
            except httpx.HTTPError:
                pass  # cut off by the shutdown: allowed
            finally:
                ended.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_for(lambda: any(line.startswith("data: {") for line in seen), "the first streamed token")
        proc.send_signal(sig)
        start = time.monotonic()
        assert proc.wait(STOP_SECONDS) == 0
        print(f"stopped {time.monotonic() - start:.1f} s after {sig.name}")
        said = proc.stderr.read()
        assert "Traceback" not in said and "stopped after 1 requests" in said, said
        assert ended.wait(STOP_SECONDS), "the open stream was left hanging"
        reader.join(STOP_SECONDS)
        assert len([line for line in seen if line.startswith("data: {")]) < 400  # cut short, not run to its end
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # nobody listens there any more
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)
        proc.stderr.close()


def test_leaving_a_background_server_ends_its_open_stream_with_an_event_not_a_cut():
    """`background`'s exit stops the engine as a signal does: the client reads the shutdown's error event and
    [DONE] (before, the engine ran on until uvicorn's grace expired and cut the stream mid-chunk)."""
    from serving import load_shipped

    from llmstep.serve.app import background

    model, tokenizer = load_shipped()
    seen, ended = [], {}
    with background(model, tokenizer, n_slots=2) as (url, engine):
        def stream():
            try:
                body = {"prompt": "ROMEO:", "max_tokens": 400, "stream": True, "ignore_eos": True}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                    for line in r.iter_lines():
                        seen.append(line)
                ended["how"] = "whole"
            except httpx.HTTPError as e:
                ended["how"] = f"cut: {e}"

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_for(lambda: any(line.startswith("data: {") for line in seen), "the first streamed token")
    reader.join(STOP_SECONDS)
    events = [line for line in seen if line.startswith("data: ")]
    assert ended.get("how") == "whole", ended
    assert '"code": "engine_stopped"' in events[-2] and events[-1] == "data: [DONE]", events[-2:]

"""Joining torchrun's process group: ranks that never come, a rank 0 nobody can reach, a taken MASTER_PORT and a
RANK/WORLD_SIZE left in a shell without torchrun each end the command with one line that says so (a ParallelError,
bad input), within LLMSTEP_TP_TIMEOUT; torch's other errors are not taken for them."""

from __future__ import annotations

import socket
import time

import pytest
import torch.distributed as dist

from llmstep import cli
from llmstep.core import parallel, process_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(monkeypatch, rank: int, world: int, port: int | None) -> None:
    """This process as rank `rank` of `world` would be under torchrun (MASTER_* only where `port` is given)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LLMSTEP_TP_TIMEOUT", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        if port is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def test_rank_0_whose_peers_never_join_says_so_within_the_timeout(monkeypatch, capsys):
    port = free_port()
    rank_env(monkeypatch, 0, 2, port)
    start = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "ROMEO", "--max-new-tokens", "2"])
    assert time.perf_counter() - start < 30 and e.value.code == 2 and not dist.is_initialized()
    assert capsys.readouterr().err.splitlines()[-1] == (
        "llmstep generate: error: rank 0 of 2: the other 1 rank did not join within 1 s (LLMSTEP_TP_TIMEOUT sets "
        f"this timeout, in seconds): start all 2 ranks with the same MASTER_ADDR and MASTER_PORT (127.0.0.1:{port}), "
        "as torchrun --nproc-per-node 2 does")


def test_a_rank_that_finds_no_rank_0_names_the_address(monkeypatch):
    port = free_port()  # nobody listens there
    rank_env(monkeypatch, 1, 2, port)
    with pytest.raises(parallel.ParallelError, match=rf"^rank 1 of 2 could not reach rank 0 at 127.0.0.1:{port} "
                                                     r"within 1 s \(LLMSTEP_TP_TIMEOUT sets this timeout"):
        parallel.init_from_environment("cpu")
    assert not dist.is_initialized()


def test_a_taken_master_port_is_named(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rank_env(monkeypatch, 0, 2, port)
        with pytest.raises(parallel.ParallelError, match=rf"^MASTER_PORT {port} is in use on this machine"):
            parallel.init_from_environment("cpu")


def test_a_stray_rank_and_world_size_without_torchrun_are_named_before_joining(monkeypatch, capsys):
    rank_env(monkeypatch, 0, 1, None)  # left in a shell: torchrun would have set MASTER_ADDR and MASTER_PORT too
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "ROMEO", "--max-new-tokens", "2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "llmstep generate: error: RANK (0) and WORLD_SIZE (1) are set, but MASTER_ADDR and MASTER_PORT are not: this "
        "process was not started by torchrun (it sets all four); unset RANK and WORLD_SIZE to run in one process, or "
        "start the command with torchrun")


def test_other_errors_of_the_join_are_not_taken_for_absent_ranks(monkeypatch):
    rank_env(monkeypatch, 0, 2, free_port())
    assert process_group.join_failure(dist.DistError("some other failure of the backend")) is None
    assert process_group.join_failure(dist.DistStoreError("Timed out after 2 seconds waiting for clients. 2/3 clients "
                                                     "joined.")) is not None

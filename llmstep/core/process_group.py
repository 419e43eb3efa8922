"""The process group, as torchrun sets it up: joined with a bounded timeout, errors agreed on, left cleanly.

Under `torchrun --nproc-per-node N` every rank runs the same command, and a collective (an all-reduce, a
broadcast, a barrier) waits until every rank has reached it. A rank that fails alone would leave the others
waiting, so two rules keep a run from hanging:

- A bounded timeout. Every collective gives up after `timeout_seconds()`: TIMEOUT_SECONDS (300 s) unless the
  environment variable LLMSTEP_TP_TIMEOUT says otherwise. torch's default is 30 minutes
  (torch.distributed.constants.default_pg_timeout); 300 s is long enough for the slowest rank to read its
  slice of a large checkpoint from a slow disk, short enough that a stalled run ends while someone watches.
- Agreement on errors. The work that can fail on one rank alone (reading its slice of the weights: a NaN only
  in rank 1's rows) ends in `agreeing()`, a collective every rank reaches whether its work succeeded or not.
  If any rank failed, every rank raises the same error, naming the first failing rank and its message, so the
  command's one line is the same on every rank and all of them stop at once.

A peer that crashes or stalls where no agreement was planned surfaces as the backend's RuntimeError on the
others (a reset connection at once, a timeout after timeout_seconds()); `peer_failure` turns it into one line.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .device import resolve_device

__all__ = ["ParallelError", "RankFailed", "TIMEOUT_SECONDS", "TIMEOUT_ENV", "timeout_seconds", "agree", "agreeing",
           "peer_failure", "launched_by_torchrun", "launched_world_size", "launched_rank", "local_rank",
           "collective_device", "rank_device", "init_from_environment", "check_rendezvous_environment",
           "join_failure", "finish", "leaving", "agree_seed"]

TIMEOUT_SECONDS = 300  # see the module docstring
TIMEOUT_ENV = "LLMSTEP_TP_TIMEOUT"
MESSAGE_BYTES = 1024  # an agreed error's message, UTF-8, cut to this length (one line of a terminal or two)


class ParallelError(ValueError):
    """A model that cannot be split over this many ranks, or a setting tensor parallelism does not take."""


class RankFailed(ParallelError):
    """The error one rank raised, as every rank raises it after `agree` (`rank` is the first that failed)."""

    def __init__(self, message: str, rank: int, bad_input: bool):
        super().__init__(message)
        self.rank, self.bad_input = rank, bad_input


def timeout_seconds() -> float:
    """How long a collective waits for the other ranks: LLMSTEP_TP_TIMEOUT seconds, else TIMEOUT_SECONDS."""
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return float(TIMEOUT_SECONDS)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 24 * 3600:
        raise ParallelError(f"{TIMEOUT_ENV} is {value!r}: give the collective timeout in seconds, "
                            "more than 0 and at most 86400 (a day)")
    return seconds


def collective_device(group=None) -> torch.device:
    """Where the group's collectives take their tensors, the one rule every collective in llmstep follows: NCCL
    takes only CUDA tensors on this rank's own GPU (cuda:LOCAL_RANK, see local_rank); gloo, CPU tensors."""
    return torch.device("cuda", local_rank()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def agree(error: BaseException | None, group=None) -> None:
    """Every rank calls this at the same point, with the error its own work raised (or None). Returns if no
    rank failed; else raises RankFailed with the first failing rank's message on every rank."""
    device = collective_device(group)
    failed = torch.tensor([0 if error is None else 1], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    line = "" if error is None else " ".join(str(error).split()) or type(error).__name__
    bad_input = isinstance(error, (ValueError, OSError, KeyError))  # as the command line sorts errors
    if error is not None and not bad_input:
        line = f"{type(error).__name__}: {line}"
    data = (line.encode()[:MESSAGE_BYTES - 2]).ljust(MESSAGE_BYTES - 2, b"\0")
    mine = torch.tensor([error is not None, bad_input, *data], dtype=torch.uint8, device=device)  # [MESSAGE_BYTES]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rank = next(r for r, t in enumerate(every) if t[0])
    message = bytes(every[rank][2:].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    if not all(torch.equal(t, every[rank]) for t in every):  # one rank's error (every rank's alike: said once)
        message = f"rank {rank} of {len(every)}: {message}"
    raise RankFailed(message, rank, bool(every[rank][1])) from error


@contextlib.contextmanager
def agreeing(group=None) -> Iterator[None]:
    """`with agreeing(group):` the block's work on every rank, then `agree` on how it went (see agree)."""
    try:
        yield
    except Exception as e:
        agree(e, group)
        raise  # not reached: agree raises when any rank failed
    agree(None, group)


def peer_failure(error: BaseException) -> ParallelError | None:
    """The backend's error when another rank crashed (a reset connection) or stalled (the timeout), as a
    ParallelError of one line; None for any other error, or outside a process group."""
    if not dist.is_available() or not dist.is_initialized() or not isinstance(error, RuntimeError):
        return None
    text = " ".join(str(error).split())
    if "Timed out" in text or "timed out" in text:
        return ParallelError(f"another rank stopped answering: a collective timed out after {timeout_seconds():g} s "
                             f"({TIMEOUT_ENV} sets it); see that rank's own message")
    if any(s in text for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe")) or \
            isinstance(error, getattr(dist, "DistNetworkError", ())):
        return ParallelError("another rank of this run has stopped (its connection closed); see that rank's own "
                             "message")
    return None


def launched_by_torchrun() -> bool:
    """True in a process torchrun started (it sets RANK and WORLD_SIZE), even with --nproc-per-node 1."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """The number of processes torchrun started (its WORLD_SIZE), 1 outside torchrun."""
    value = os.environ["WORLD_SIZE"] if launched_by_torchrun() else "1"
    if not value.isdigit() or int(value) < 1:
        raise ParallelError(f"WORLD_SIZE is {value!r}; torchrun sets it to the number of processes")
    return int(value)


def launched_rank() -> int:
    """This process's rank under torchrun (its RANK), 0 outside torchrun (a stray RANK alone is not torchrun)."""
    value = os.environ["RANK"] if launched_by_torchrun() else "0"
    if not value.isdigit():
        raise ParallelError(f"RANK is {value!r}; torchrun sets it to this process's rank")
    return int(value)


def local_rank() -> int:
    """This process's GPU: torchrun's LOCAL_RANK (one GPU per process), else the current CUDA device (a group
    joined without torchrun, after torch.cuda.set_device)."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        return torch.cuda.current_device()
    if not value.isdigit():
        raise ParallelError(f"LOCAL_RANK is {value!r}; torchrun sets it to this process's index on its machine")
    return int(value)


def rank_device(device=None) -> torch.device:
    """The device this rank runs on: a CUDA rank takes GPU LOCAL_RANK (one GPU per process); else `device`. Another
    GPU's index is refused: the rank's collectives run on its own GPU, and its model must be there too."""
    dev = resolve_device(device)
    if dev.type == "cuda" and dist.is_initialized():
        own = local_rank()
        if dev.index is not None and dev.index != own:
            how = ("LOCAL_RANK under torchrun: one GPU per process): give the device as plain 'cuda'"
                   if "LOCAL_RANK" in os.environ else "the current device): torch.cuda.set_device(...) first")
            raise ParallelError(f"rank {dist.get_rank()} was given device {dev}, but its GPU is cuda:{own} ({how}")
        dev = torch.device("cuda", own)
    if dev.type == "mps":
        raise ParallelError("tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not on MPS")
    return dev


def init_from_environment(device=None):
    """Join torchrun's process group (gloo on a CPU, NCCL on CUDA) once, every collective bounded by
    timeout_seconds(); return the world group. The join itself waits as long: ranks that do not all arrive in
    time (one never started, a wrong MASTER_ADDR) end it with a ParallelError saying so (join_failure)."""
    dev = resolve_device(device)
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if not dist.is_initialized():
        check_rendezvous_environment()
        if dev.type == "cuda":
            torch.cuda.set_device(local_rank())
        try:
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timeout)
        except dist.DistError as e:
            failure = join_failure(e)
            if failure is None:
                raise
            raise failure from None
    return dist.group.WORLD


def check_rendezvous_environment() -> None:
    """What torchrun sets for every rank before it joins: RANK and WORLD_SIZE (launched_by_torchrun), and where
    rank 0 waits for the others, MASTER_ADDR and MASTER_PORT. RANK and WORLD_SIZE left in a shell without the
    other two are not torchrun: said before torch's env:// rendezvous asks for them."""
    if not launched_by_torchrun():
        raise ParallelError("tensor parallelism runs under torchrun (torchrun --nproc-per-node N -m llmstep ...): "
                            "RANK and WORLD_SIZE are not set")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ParallelError(f"RANK ({os.environ['RANK']}) and WORLD_SIZE ({os.environ['WORLD_SIZE']}) are set, but "
                            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: this process was "
                            "not started by torchrun (it sets all four); unset RANK and WORLD_SIZE to run in one "
                            "process, or start the command with torchrun")


def join_failure(error: BaseException) -> ParallelError | None:
    """torch's error from joining the process group, as a ParallelError of one line where it is the other ranks
    that did not come (the join timed out) or MASTER_PORT that is taken; None for any other error."""
    text = " ".join(str(error).split())
    rank, world = launched_rank(), launched_world_size()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if "EADDRINUSE" in text:  # rank 0's store could not listen
        return ParallelError(f"MASTER_PORT {os.environ.get('MASTER_PORT')} is in use on this machine (another run?): "
                             "give torchrun another --master-port")
    if not any(s in text for s in ("Timed out", "timed out", "timeout")):
        return None
    how_long = f"within {timeout_seconds():g} s ({TIMEOUT_ENV} sets this timeout, in seconds)"
    if "trying to connect" in text:  # a rank > 0 that found no rank 0 at MASTER_ADDR:MASTER_PORT
        return ParallelError(f"rank {rank} of {world} could not reach rank 0 at {where} {how_long}: start rank 0 "
                             "too, or check MASTER_ADDR and MASTER_PORT")
    joined = re.search(r"(\d+)/\d+ clients joined", text)  # rank 0 counts the ranks that came, itself included
    missing = world - int(joined.group(1)) if joined else None
    if missing is None:  # a rank > 0, waiting with rank 0 for the rest
        others = f"the other {world - 1} ranks did not all join"
    elif missing == world - 1:
        others = f"the other {world - 1} rank{'s' if world > 2 else ''} did not join"
    else:
        others = f"{missing} of the other {world - 1} ranks did not join"
    return ParallelError(f"rank {rank} of {world}: {others} {how_long}: start all {world} ranks with the same "
                         f"MASTER_ADDR and MASTER_PORT ({where}), as torchrun --nproc-per-node {world} does")


def finish(error: BaseException | None = None) -> None:
    """Leave the process group, if this process joined one (the end of a torchrun command). After a run that
    ended well, or an error every rank agreed on, the ranks wait for each other first (a rank that tears its
    group down while another still talks to it aborts, with gloo); after an error of this rank alone there
    is nobody to wait for: the others learn of it from the closed connection."""
    if dist.is_initialized():
        if error is None or isinstance(error, RankFailed):
            device = collective_device()  # NCCL's barrier is a collective on a GPU too: this rank's own
            dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def leaving() -> Iterator[None]:
    """`with leaving():` a torchrun command's body, then `finish` as it ended; a peer's crash or stall
    (peer_failure) is re-raised as its one-line ParallelError."""
    try:
        yield
    except BaseException as e:
        peer = peer_failure(e)
        finish(peer or e)
        if peer is not None:
            raise peer from None
        raise
    finish()


def agree_seed(seed: int | None, group=None, device: torch.device | str | None = None) -> int | None:
    """The seed every rank samples with: `seed` itself, or (None) one drawn on rank 0 and broadcast, so that
    the ranks, sampling from the same logits, pick the same tokens. The broadcast runs on the group's device
    (collective_device); `device` is accepted for older callers and not used."""
    if seed is not None:
        return seed
    drawn = torch.tensor([random.SystemRandom().randrange(2**63)], dtype=torch.long, device=collective_device(group))
    dist.broadcast(drawn, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(drawn.item())

"""A training run's checkpoint, without pickle: one safetensors file whose tensors are the model's and the
optimizer's, and whose header carries everything else as JSON (step, history, settings, the optimizer's
hyperparameters).

`torch.load` of a pickle can run any code the file's author chose, so `--resume` never calls it: a file that is
not safetensors is refused before anything in it is interpreted. One file, written atomically
(llmstep.core.files), so an interrupted save leaves the previous checkpoint whole.

Everything read is validated before it is used, as every other file llmstep reads: a tensor with a NaN or an
infinity (a weight or an optimizer moment) is refused, the JSON state must have the types and ranges
`save_train_state`'s caller writes (`check_state`), and the optimizer's hyperparameters in the file must be the
ones the run's own settings give (a file cannot switch on `maximize` or change eps, betas or the weight decay).
A checkpoint that cannot be written (a full disk, a file-size limit) is an OSError naming the file; the
previous checkpoint is kept.

No random-number state is stored: the weights come from the seed and the batch of step s from a generator
seeded with (seed, s) (llmstep.shakespeare.train), so a resumed run draws what the whole run would have.

The run's folder holds the checkpoint and train.log, one run's: `check_run_folder` refuses, before anything is
written, a fresh run into a folder that holds a checkpoint (its first save would overwrite it) and a resumed one
without a checkpoint; `open_log` starts a fresh run's log anew and cuts a resumed run's log after the checkpoint's
step (what a stopped run logged past its last checkpoint is trained again) before appending to it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..core.checks import is_finite_number, is_int
from ..core.files import atomic_write, atomic_write_bytes

__all__ = ["CHECKPOINT", "LEGACY_CHECKPOINT", "LOG", "TrainStateError", "save_train_state", "load_train_state",
           "check_state", "first_nonfinite", "check_run_folder", "open_log", "resume_state"]

CHECKPOINT = "ckpt.safetensors"
LOG = "train.log"
LEGACY_CHECKPOINT = "ckpt.pt"  # an older llmstep's pickle checkpoint: refused, never read (a pickle runs code)
_STATE_KEY = "llmstep_train_state"
FORMAT_VERSION = 1


class TrainStateError(ValueError):
    """A training checkpoint that cannot be resumed from; the message names the file."""


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity; None if all are finite."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _is_number(value, low: float = 0.0) -> bool:
    return is_finite_number(value) and value >= low


def check_state(state: dict) -> None:
    """The JSON state a training run writes: step (an integer >= 0), elapsed_seconds (a finite number >= 0),
    history (a list of records) and commands (a list of strings). Raises ValueError naming the field."""
    checks = {"step": lambda v: is_int(v) and v >= 0,
              "elapsed_seconds": _is_number,
              "history": lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v),
              "commands": lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v)}
    want = {"step": "an integer >= 0", "elapsed_seconds": "a finite number >= 0",
            "history": "a list of records", "commands": "a list of strings"}
    for key, ok in checks.items():
        if key in state and not ok(state[key]):
            raise ValueError(f"its state's {key} must be {want[key]}, got {state[key]!r:.80}")


def _check_groups(path: Path, groups, optimizer: torch.optim.Optimizer) -> None:
    """The file's param groups must be the live optimizer's (built from the same settings), lr aside: it is set
    at every step from the schedule."""
    live = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(live) or not all(isinstance(g, dict) for g in groups):
        raise TrainStateError(f"{path}: its optimizer has {len(groups) if isinstance(groups, list) else groups!r} "
                              f"parameter groups, this run's has {len(live)}")
    for i, (saved, own) in enumerate(zip(groups, live, strict=True)):
        if not isinstance(saved.get("params"), list) or len(saved["params"]) != len(own["params"]):
            raise TrainStateError(f"{path}: optimizer group {i} does not hold this model's parameters")
        for key, value in own.items():
            if key in ("params", "lr", "initial_lr"):
                continue
            stored = tuple(saved[key]) if isinstance(saved.get(key), list) else saved.get(key, "missing")
            if stored != value:
                raise TrainStateError(f"{path}: optimizer group {i} has {key} {stored!r}, but this run's settings "
                                      f"give {value!r}; resume with the original arguments")


def _check_moments(state: dict[int, dict], groups: list[dict], optimizer: torch.optim.Optimizer) -> None:
    """Every parameter of the live optimizer, by the file's index for it, must have AdamW's state: a step (a number
    >= 0) and exp_avg and exp_avg_sq of the parameter's own shape; no state for an index the model lacks.
    `Optimizer.load_state_dict` checks no shape: a wrong one would fail only inside the first step."""
    indices = [i for g in groups for i in g["params"]]
    if not all(is_int(i) for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"its optimizer's parameter indices must be distinct integers, got {indices!r:.80}")
    unknown = sorted(set(state) - set(indices))
    if unknown:
        raise ValueError(f"optimizer state for parameter {unknown[0]}, which this model does not have")
    live = [p for g in optimizer.param_groups for p in g["params"]]
    for index, param in zip(indices, live, strict=True):
        values = state.get(index, {})
        for key in ("exp_avg", "exp_avg_sq"):
            t = values.get(key)
            if not isinstance(t, torch.Tensor) or t.shape != param.shape:
                got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else "none" if t is None else repr(t)
                raise ValueError(f"parameter {index}'s optimizer {key} must have the parameter's shape "
                                 f"{list(param.shape)}, got {got}")
        step = values.get("step")
        if isinstance(step, torch.Tensor):
            step = float(step) if step.numel() == 1 else step
        if not _is_number(step):
            raise ValueError(f"parameter {index}'s optimizer step must be a number >= 0, got {step!r:.80}")


def check_run_folder(out: Path, resume: bool) -> Path:
    """The run folder's checkpoint path, once the folder suits the run: a fresh run must not start where a
    checkpoint is (its first save would overwrite it), a resumed one needs one (or the legacy pickle, which
    load_train_state refuses by name). Reads nothing, writes nothing."""
    path = Path(out) / CHECKPOINT
    if not resume and path.exists():
        raise ValueError(f"out {out} already holds a training checkpoint ({CHECKPOINT}): resume it (resume=True) "
                         "or start the run in another folder")
    if resume and not path.is_file() and not path.with_name(LEGACY_CHECKPOINT).is_file():
        raise FileNotFoundError(f"resume: no checkpoint at {path}")
    return path


_STEP_LINE = re.compile(rb"^\S+ \S+ step +(\d+)/\d+ ")  # "2024-01-01 12:00:00 step    300/900 loss ..."


def _cut_log(path: Path, step: int) -> None:
    """Drop the lines from the first one logging a step past `step` on: the run is resumed from there."""
    if not path.is_file():
        return
    lines = path.read_bytes().splitlines(keepends=True)
    cut = next((i for i, line in enumerate(lines) if (m := _STEP_LINE.match(line)) and int(m[1]) > step), None)
    if cut is not None:
        atomic_write_bytes(path, b"".join(lines[:cut]))


def open_log(out: Path, resumed_at: int | None = None) -> logging.Logger:
    """A logger writing to out/train.log and, through tqdm.write, to the terminal without breaking the bar. A fresh
    run (resumed_at None) starts the file anew; a resumed one keeps it up to the checkpoint's step and appends."""

    class TqdmHandler(logging.Handler):
        def emit(self, record):
            tqdm.write(self.format(record), file=sys.stderr)

    log = logging.getLogger(f"llmstep.shakespeare.train.{Path(out).resolve()}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    if resumed_at is not None:
        _cut_log(Path(out) / LOG, resumed_at)
    file = logging.FileHandler(Path(out) / LOG, mode="w" if resumed_at is None else "a", encoding="utf-8")
    file.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(file)
    log.addHandler(TqdmHandler())
    return log


def save_train_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """model and optimizer tensors, plus `state` (JSON-serialisable: step, history, settings), to `path`."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype)  # a tied head shares the embedding's memory: stored once
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[f"model.{name}"] = t.detach().cpu().contiguous()
    opt = optimizer.state_dict()
    scalars: dict[str, dict] = {}
    for index, values in opt["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    header = {"format_version": FORMAT_VERSION, "state": state, "aliases": aliases,
              "optimizer": {"param_groups": opt["param_groups"], "scalars": scalars}}
    try:
        with atomic_write(path) as tmp:
            save_file(tensors, tmp, metadata={_STATE_KEY: json.dumps(header)})
    except SafetensorError as e:  # safetensors reports its write errors (ENOSPC, EFBIG) as its own type
        raise OSError(f"{path}: the training checkpoint could not be written ({e}); the previous one, if any, "
                      "is kept") from None


def load_train_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     check: Callable[[dict], None] | None = None) -> dict:
    """Fill `model` and `optimizer` from `path`; return the JSON state. Refuses anything but a safetensors file
    written by save_train_state (a pickle included), naming the file. `check(state)` may refuse the state (by
    raising) before any tensor is put into the model."""
    path = Path(path)
    legacy = path.with_name(LEGACY_CHECKPOINT)
    if not path.is_file() and legacy.is_file():
        raise TrainStateError(f"{legacy} is a pickle checkpoint of an older llmstep; llmstep no longer reads "
                              "pickles (loading one can run any code in it): start the run again")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            header = json.loads((f.metadata() or {})[_STATE_KEY])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TrainStateError(f"{path} is not a training checkpoint written by llmstep ({type(e).__name__}: {e}); "
                              "it is not read any further") from None
    if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
        raise TrainStateError(f"{path}: unknown training checkpoint format; this llmstep writes version "
                              f"{FORMAT_VERSION}")
    if not isinstance(header.get("state"), dict):
        raise TrainStateError(f"{path}: its header holds no training state")
    bad = first_nonfinite(tensors)
    if bad is not None:
        raise TrainStateError(f"{path}: tensor {bad} holds NaN or infinite values; a run does not resume from it")
    try:
        check_state(header["state"])
    except ValueError as e:
        raise TrainStateError(f"{path}: {e}") from None
    if check is not None:
        try:
            check(header["state"])
        except (KeyError, TypeError) as e:
            raise TrainStateError(f"{path}: incomplete training state ({type(e).__name__}: {e})") from None
    scalars = header.get("optimizer", {}).get("scalars") if isinstance(header.get("optimizer"), dict) else None
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) and all(_is_number(x, -math.inf)
                                                for x in v.values()) for v in scalars.values()):
        raise TrainStateError(f"{path}: its header's optimizer scalars must be finite numbers, got {scalars!r:.80}")
    _check_groups(path, header["optimizer"].get("param_groups"), optimizer)
    try:
        weights = {k.removeprefix("model."): t for k, t in tensors.items() if k.startswith("model.")}
        weights |= {name: weights[source] for name, source in header["aliases"].items()}
        opt_state: dict[int, dict] = {}
        for k, t in tensors.items():
            if k.startswith("optimizer."):
                _, index, key = k.split(".", 2)
                opt_state.setdefault(int(index), {})[key] = t
        for index, values in header["optimizer"]["scalars"].items():
            opt_state.setdefault(int(index), {}).update(values)
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                  for g in header["optimizer"]["param_groups"]]  # JSON has no tuples; AdamW's betas are one
        _check_moments(opt_state, groups, optimizer)
        model.load_state_dict(weights)
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TrainStateError(f"{path}: does not fit this model and optimizer ({type(e).__name__}: {e})") from None
    return header["state"]


def resume_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_config: dict,
                 model_config: dict) -> dict:
    """load_train_state for a resumed run whose settings are `train_config` and `model_config` (asdict of
    llmstep.shakespeare.train's TrainConfig and the LlamaConfig): the file's must be the same, the device aside,
    before any tensor is put into the model. Errors start with "resume:"."""

    def same_settings(state: dict) -> None:
        saved = state["train_config"]
        if not isinstance(saved, dict) or set(saved) != set(train_config):
            fields = sorted(saved) if isinstance(saved, dict) else saved
            raise TypeError(f"its train_config has the fields {fields!r:.200}, this run's {sorted(train_config)}")
        changed = [name for name, value in train_config.items() if name != "device" and saved[name] != value]
        if changed or state["model_config"] != model_config:
            what = ", ".join(f"{n}: {saved[n]!r} -> {train_config[n]!r}" for n in changed)
            raise ValueError(f"{path} was trained with different settings ({what or 'model shape'}); "
                             "resume with the original arguments")

    try:
        return load_train_state(path, model, optimizer, check=same_settings)  # never a pickle
    except FileNotFoundError:
        raise FileNotFoundError(f"resume: no checkpoint at {path}") from None
    except ValueError as e:
        raise ValueError(f"resume: {e}") from None

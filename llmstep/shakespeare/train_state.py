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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..core.checks import is_finite_number, is_int
from ..core.files import atomic_write

__all__ = ["CHECKPOINT", "LEGACY_CHECKPOINT", "TrainStateError", "save_train_state", "load_train_state",
           "check_state", "first_nonfinite"]

CHECKPOINT = "ckpt.safetensors"
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
        for index, values in opt_state.items():
            if not _is_number(float(values.get("step", 0))):
                raise ValueError(f"parameter {index}'s optimizer step is {values['step']!r}")
        model.load_state_dict(weights)
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TrainStateError(f"{path}: does not fit this model and optimizer ({type(e).__name__}: {e})") from None
    return header["state"]

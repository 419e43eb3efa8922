"""A training run's checkpoint, without pickle: one safetensors file whose tensors are the model's and the
optimizer's, and whose header carries everything else as JSON (step, history, settings, the optimizer's
hyperparameters).

`torch.load` of a pickle can run any code the file's author chose, so `--resume` never calls it: a file that is
not safetensors is refused before anything in it is interpreted. One file, written atomically
(llmstep.core.files), so an interrupted save leaves the previous checkpoint whole.

No random-number state is stored: the weights come from the seed and the batch of step s from a generator
seeded with (seed, s) (llmstep.shakespeare.train), so a resumed run draws what the whole run would have.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..core.files import atomic_write

__all__ = ["CHECKPOINT", "LEGACY_CHECKPOINT", "TrainStateError", "save_train_state", "load_train_state"]

CHECKPOINT = "ckpt.safetensors"
LEGACY_CHECKPOINT = "ckpt.pt"  # the pickle of llmstep before issue 14: refused, never read
_STATE_KEY = "llmstep_train_state"
FORMAT_VERSION = 1


class TrainStateError(ValueError):
    """A training checkpoint that cannot be resumed from; the message names the file."""


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
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TrainStateError(f"{path} is not a training checkpoint written by llmstep ({type(e).__name__}: {e}); "
                              "it is not read any further") from None
    if not isinstance(header, dict) or header.get("format_version") != FORMAT_VERSION:
        raise TrainStateError(f"{path}: unknown training checkpoint format; this llmstep writes version "
                              f"{FORMAT_VERSION}")
    if not isinstance(header.get("state"), dict):
        raise TrainStateError(f"{path}: its header holds no training state")
    if check is not None:
        try:
            check(header["state"])
        except (KeyError, TypeError) as e:
            raise TrainStateError(f"{path}: incomplete training state ({type(e).__name__}: {e})") from None
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
        groups = header["optimizer"]["param_groups"]
        for group in groups:
            if isinstance(group.get("betas"), list):
                group["betas"] = tuple(group["betas"])  # JSON has no tuples; AdamW's own are tuples
        model.load_state_dict(weights)
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TrainStateError(f"{path}: does not fit this model and optimizer ({type(e).__name__}: {e})") from None
    return header["state"]

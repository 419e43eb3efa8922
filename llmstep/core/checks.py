"""The checks every layer's arguments share: an integer is an integer (not a bool, not a float), a seed fits a
torch.Generator, a cache's length fits the model's context. Each error names the argument it refuses."""

from __future__ import annotations

import math
from numbers import Integral, Real

__all__ = ["is_int", "is_number", "is_finite_number", "check_int", "check_flag", "SEED_LIMIT", "check_seed",
           "check_max_len", "check_step_context", "commonest"]


def is_int(value) -> bool:
    """An integer: a Python or numpy int, not a bool (which Python counts as one) and not a float."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number: an int or a float (numpy's too), not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """A real number that is neither infinite nor NaN (not a bool)."""
    return is_number(value) and math.isfinite(value)


def commonest(values: list[str]) -> str | None:
    """The value met most often (None for none); a tie goes to the first in sorted order, so that every process
    picks the same (set order would follow PYTHONHASHSEED). A checkpoint's stored dtype, from its matrices' types."""
    return max(sorted(set(values)), key=values.count) if values else None


def check_int(value, name: str, low: int = 0) -> None:
    """An integer >= low, or a ValueError that names it."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_flag(value, name: str) -> None:
    """True, False or None (the default's choice), or a ValueError that names it: "no" or 0 is not False."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None, got {value!r}")


SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 64-bit seeds (a CPU one keeps 32: request.generator_seed)


def check_seed(seed, name: str = "seed") -> None:
    """None (a fresh seed) or an integer in 0 .. 2**64 - 1; a bool, a float or a string is refused by name."""
    if seed is None:
        return
    if not is_int(seed):
        raise ValueError(f"{name} must be an integer (or None), got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{name} must be in 0 .. 2**64 - 1, got {seed}")


def check_max_len(max_len, limit: int, low: int = 2) -> int:
    """A static cache's slots per sequence: an integer in low .. limit (the model's context), before anything is
    allocated. None means the model's context."""
    if max_len is None:
        return limit
    if not is_int(max_len) or not low <= max_len <= limit:
        beyond = f": {max_len} exceeds the model's context" if isinstance(max_len, int) and max_len > limit else ""
        raise ValueError(f"max_len must be an integer in {low}..{limit} (the model's context), got {max_len!r}{beyond}")
    return int(max_len)


def check_step_context(context, window: int, low: int = 0) -> None:
    """A decode step after `context` cached tokens: its own token needs one position more, within the model's
    `window` (max_seq_len). low: the fewest cached tokens the caller's step takes."""
    if not is_int(context) or not low <= context < window:
        raise ValueError(f"context must be an integer in {low}..{window - 1} (the model's {window}-token window less "
                         f"the step's own token), got {context!r}")

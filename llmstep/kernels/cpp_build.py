"""Building llmstep's C++ ops: once per machine, in llmstep's cache, for one vector ISA, and loaded into torch.ops.

A kernel module (cpu_attention, cpu_int4a8) hands over its source, with LLMSTEP_NS standing for the op namespace,
and the compiler flags of its ISA; `load_library` builds it with torch.utils.cpp_extension (ninja and the C++
compiler inductor needs anyway: seconds the first time) in $LLMSTEP_HOME/kernels/<namespace>_<op>_<digest>, a folder
named by the source and flags, so an edited source is a new build and an unchanged one is loaded from there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import torch

from ..core import registry
from ..core.files import atomic_write_text

__all__ = ["load_library", "first_error"]

_STALE_LOCK_SECONDS = 300  # a build takes ~10 s; a lock this old is a killed build's


def load_library(namespace: str, op: str, source: str, flags: list[str], filename: str):
    """torch.ops.<namespace>, with `source` (LLMSTEP_NS replaced by `namespace`) built by `flags` and loaded unless
    its op `op` is loaded already; `filename` names the source file in the build folder."""
    from torch.utils import cpp_extension

    if not hasattr(getattr(torch.ops, namespace), op):  # torch.ops makes any namespace; the op is there once loaded
        if shutil.which("ninja") is None:  # the ninja wheel (a dependency) without its environment's bin/ on PATH
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        text = source.replace("LLMSTEP_NS", namespace)
        digest = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
        name = f"{namespace}_{op}_{digest}"
        folder = registry.home() / "kernels" / name  # llmstep's cache ($LLMSTEP_HOME), the build torch's own
        path = folder / filename
        if not path.exists() or path.read_text() != text:
            atomic_write_text(path, text)  # a reader (another process building) never sees half of it
        lock = folder / "lock"  # torch's build lock: a build killed midway leaves it, and every later load waits
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)
        cpp_extension.load(name, [str(path)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(folder), is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace)


def first_error(message: str) -> str:
    """The compiler's first error line in a failed build's output, else its last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "")

"""Building llmstep's C++ ops: once per machine, in llmstep's cache, for one vector ISA, and loaded into torch.ops.

A kernel module (cpu_attention, cpu_int4a8) hands over its source, with LLMSTEP_NS standing for the op namespace,
and the compiler flags of its ISA; `load_library` builds it with torch.utils.cpp_extension (ninja and the C++
compiler inductor needs anyway: seconds the first time) in $LLMSTEP_HOME/kernels/<namespace>_<op>_<digest>, a folder
named by the source and flags and by what else the library is built against (`build_name`), so an edited source is a
new build and an unchanged one is loaded from there. `isas_here` is the one rule for which of a module's builds this
CPU runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path

import torch

from ..core import registry
from ..core.device import cpuinfo_fields
from ..core.files import atomic_write_text

__all__ = ["load_library", "build_name", "clear_stale_lock", "first_error", "cpu_features", "isas_here", "why_not"]

# torch's own reading of the CPU's features (cpuinfo, every OS), by /proc/cpuinfo's names, for CPUs with no such file
_TORCH_NAMES = {"avx2": "avx2", "fma": "fma3", "avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512vl": "avx512_vl",
                "avx512_vnni": "avx512_vnni"}

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
        name = build_name(namespace, op, text, flags)
        folder = registry.home() / "kernels" / name  # llmstep's cache ($LLMSTEP_HOME), the build torch's own
        path = folder / filename
        if not path.exists() or path.read_text() != text:
            atomic_write_text(path, text)  # a reader (another process building) never sees half of it
        lock = folder / "lock"  # torch's build lock: a build killed midway leaves it, and every later load waits
        clear_stale_lock(lock)
        cpp_extension.load(name, [str(path)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(folder), is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace)


def cpu_features() -> set[str]:
    """The CPU's features by /proc/cpuinfo's names: the flags that file lists on Linux (a guest may lack what its
    host's model has), else those of _TORCH_NAMES that torch reads the CPU to have (torch.cpu.get_capabilities)."""
    flags = cpuinfo_fields().get("flags")
    if flags is not None:
        return set(flags.split())
    features = torch.cpu.get_capabilities()
    return {name for name, torch_name in _TORCH_NAMES.items() if features.get(torch_name)}


def isas_here(needs: dict[str, tuple[set[str], set[str]]]) -> tuple[str, ...]:
    """The ISAs of `needs` (ISA -> (torch's CPU capabilities it runs under, the CPU features it needs)) this CPU runs,
    in `needs`' order: torch's reading of its vector width (torch.backends.cpu.get_cpu_capability; the environment's
    ATEN_CPU_CAPABILITY lowers it, and can raise it past the CPU: hence the features too) among the first, and every
    feature of the second (`cpu_features`: AVX-512 does not imply VNNI, a Skylake-X has the one without the other).
    A build of an ISA the CPU does not run would die of an illegal instruction as it loads."""
    capability = torch.backends.cpu.get_cpu_capability()
    have = cpu_features()
    return tuple(isa for isa, (capabilities, features) in needs.items()
                 if capability in capabilities and features <= have)


def why_not(isa: str, needs: dict[str, tuple[set[str], set[str]]]) -> str:
    """What keeps this CPU from running `isa`'s build (`isas_here`' rule, `needs[isa]`), for an error: torch's
    reading of its vector width where the build needs another, and the features the CPU lacks."""
    capabilities, features = needs[isa]
    capability = torch.backends.cpu.get_cpu_capability()
    parts = [f"torch reads its vector instructions as {capability}"
             + ("" if capability in capabilities else f", not {' or '.join(sorted(capabilities))}")]
    if missing := sorted(features - cpu_features()):
        parts.append(f"the CPU lacks {', '.join(missing)}")
    return "; ".join(parts)


def build_name(namespace: str, op: str, text: str, flags: list[str]) -> str:
    """The build folder's name, <namespace>_<op>_<digest>: the digest of the source and flags, and of what else the
    library is built against, torch (its version and commit: its headers and ABI), Python (sys.implementation's
    cache tag) and the compiler ($CXX or torch's default, c++, with the file it resolves to). The cache is one per
    user, shared by every environment: two that differed in any of these relinked one .so in place, and torch's
    build lets go of its lock before it loads the library, so another process could relink it in between."""
    cxx = os.environ.get("CXX", "c++")  # torch.utils.cpp_extension's choice on Linux and macOS
    try:
        words = shlex.split(cxx) or [cxx]
    except ValueError as e:
        raise ValueError(f"$CXX {cxx!r} is not a valid shell command line: {e}") from None
    # each word that names a program, resolved ("ccache g++": both); another word as it is (a path of the current
    # folder would vary with it): c++ -> /usr/bin/x86_64-linux-gnu-g++-12
    resolved = [os.path.realpath(found) if (found := shutil.which(w)) else w for w in words]
    compiler = f"{cxx} -> {' '.join(resolved)}"
    parts = (text, " ".join(flags), str(torch.__version__), str(torch.version.git_version),
             str(sys.implementation.cache_tag), compiler)
    return f"{namespace}_{op}_{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}"


def clear_stale_lock(lock: Path) -> None:
    """Remove torch's build lock `lock` where it is older than a build takes (a killed build left it), without a race
    with its holder or another process clearing it: it is looked at once (gone: nothing to do), renamed to a name of
    this call's own (one process takes it), and looked at again there: a fresh lock, made between the look and the
    rename by a build that has just begun, is put back (a hard link, never over a newer one); a stale one removed."""
    try:
        if time.time() - lock.stat().st_mtime <= _STALE_LOCK_SECONDS:
            return
        aside = lock.with_name(f"{lock.name}.stale-{os.getpid()}-{uuid.uuid4().hex}")
        lock.rename(aside)
    except FileNotFoundError:  # its holder finished (or another process cleared it) meanwhile
        return
    with contextlib.suppress(OSError):  # OSError: another build holds `lock` by now (or no hard links here)
        if time.time() - aside.stat().st_mtime <= _STALE_LOCK_SECONDS:
            os.link(aside, lock)  # back where its holder removes it when done
    aside.unlink(missing_ok=True)


def first_error(message: str) -> str:
    """The compiler's first error line in a failed build's output, else its last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "")

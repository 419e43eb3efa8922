"""environment.yml (conda) and pyproject.toml (pip) install the same things."""

import sys
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent


def normalise(req: str) -> str:
    return req.replace(" ", "").lower()


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {normalise(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["name"] == "llmstep"
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {normalise(r) for r in pip if not r.startswith("-e")}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject.toml: {wanted - listed}"
    assert "-e .[dev]" in pip
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    minimum = project["requires-python"].removeprefix(">=")
    assert tuple(map(int, python.split("=")[1].split("."))) >= tuple(map(int, minimum.split(".")))


def transformers_imports() -> dict[str, list[int]]:
    """Every module of llmstep that imports transformers (any import statement, also inside a function), with
    the lines: read from the import graph, not from the text, so a docstring that names it does not count."""
    import ast

    found = {}
    for f in sorted((ROOT / "llmstep").rglob("*.py")):
        lines = [n.lineno for n in ast.walk(ast.parse(f.read_text()))
                 if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "transformers" for a in n.names)
                 or isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "transformers"]
        if lines:
            found[str(f.relative_to(ROOT))] = lines
    return found


def test_transformers_is_only_a_test_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(r.startswith("transformers") for r in project["dependencies"])
    # the benchmark runs transformers beside llmstep, if installed; nothing else imports it
    assert set(transformers_imports()) == {"llmstep/lab/bench.py"}


def test_every_llmstep_module_imports_without_transformers():
    """With transformers unimportable, the package and each of its modules still import (lab/bench.py imports it
    only when a benchmark runs it)."""
    import subprocess
    import sys

    script = ("import importlib, pkgutil, sys\nsys.modules['transformers'] = None\nimport llmstep\n"
              "names = [m.name for m in pkgutil.walk_packages(llmstep.__path__, 'llmstep.')\n"
              "         if m.name != 'llmstep.__main__']  # (importing it runs the command line)\n"
              "for name in names:\n    importlib.import_module(name)\nprint(len(names))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 50  # every module was walked


def test_the_import_reader_finds_each_form_of_import(tmp_path, monkeypatch):
    package = tmp_path / "llmstep"
    package.mkdir()
    (package / "a.py").write_text('"""from transformers import X: a docstring is not an import."""\n')
    (package / "b.py").write_text("def f():\n    import transformers.models.llama as m\n")
    (package / "c.py").write_text("from transformers.cache_utils import StaticCache\nfrom .transformers import y\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert transformers_imports() == {"llmstep/b.py": [2], "llmstep/c.py": [1]}


def test_the_command_is_the_cli_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"llmstep": "llmstep.cli:console"}  # main returns records; console exits 0
    assert (ROOT / "llmstep" / "cli" / "__init__.py").is_file()


def test_the_version_pip_installs_is_the_one_python_and_every_record_report():
    import llmstep
    from llmstep.lab import runinfo

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert llmstep.__version__ == version  # written twice: pyproject.toml for pip, llmstep/_version.py for Python
    assert runinfo.versions()["llmstep"] == version  # what a benchmark's record says it measured

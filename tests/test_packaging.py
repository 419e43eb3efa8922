"""environment.yml (conda) and pyproject.toml (pip) install the same things."""

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


def test_transformers_is_only_a_test_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(r.startswith("transformers") for r in project["dependencies"])
    oracle = ROOT / "llmstep" / "lab" / "bench.py"  # the benchmark runs transformers beside llmstep, if installed
    for f in (ROOT / "llmstep").rglob("*.py"):
        text = f.read_text()
        assert "import transformers" not in text and "from transformers" not in text or f == oracle, f


def test_the_command_is_the_cli_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"llmstep": "llmstep.cli:console"}  # main returns records; console exits 0
    assert (ROOT / "llmstep" / "cli" / "__init__.py").is_file()


def test_the_version_is_written_once_for_python_and_once_for_pip():
    import llmstep
    from llmstep._version import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__ == llmstep.__version__

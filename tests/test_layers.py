"""The package is laid out in layers, each importing only the layers below it (see llmstep/__init__.py):

    core  <-  kernels  <-  engines  <-  lab  <-  shakespeare  <-  serve  <-  cli

Read from every module's source (ast, every import, also those inside functions): no import cycle between
llmstep's modules, no layer imports one above it, nothing but the command line (and `python -m llmstep`)
imports llmstep.cli, no layer imports the public API in llmstep/__init__.py, and no module is longer than a
reader can hold beside its notebook.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llmstep"
MAX_LINES = 450
# A layer may import from the layers before it in this list, never from those after it.
LAYERS = ["core", "kernels", "engines", "lab", "shakespeare", "serve", "cli"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, source: str, modules: set[str]) -> set[str]:
    """The llmstep modules `name` imports: `from .x import y` is llmstep...x.y when that is a module, else x."""
    package = name if f"{name}.__init__" in modules or any(m.startswith(name + ".") for m in modules) else \
        name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import llmstep.core.cost.x`: the module it names
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(srcs: dict[str, str]) -> dict[str, set[str]]:
    modules = set(srcs)
    return {name: imports(name, src, modules) for name, src in srcs.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each as the modules on it (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import that breaks the layering, as 'importer -> imported: why'."""
    out = []
    for name, targets in sorted(edges.items()):
        own = layer(name)
        for target in sorted(targets):
            other = layer(target)
            if other == "cli" and own != "cli" and name != "llmstep.__main__":
                out.append(f"{name} -> {target}: only the command line imports llmstep.cli")
            elif own and other and LAYERS.index(other) > LAYERS.index(own):
                out.append(f"{name} -> {target}: {own} may not import from {other}, a layer above it")
            elif own and target == "llmstep":
                out.append(f"{name} -> llmstep: a layer imports the modules it needs, not the public API")
    return out


def test_no_import_cycle():
    assert cycles(graph(sources())) == []


def test_every_layer_imports_only_the_layers_below_it():
    assert violations(graph(sources())) == []


def test_no_module_is_longer_than_a_reader_can_hold():
    long = {name: n for name, src in sources().items() if (n := len(src.splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: {long}"


# The checks themselves, on made-up packages: each rule must catch what it is for.

def test_the_checks_find_a_cycle_and_each_kind_of_violation():
    fake = {
        "llmstep": "from .core import model\n",
        "llmstep.core": "", "llmstep.engines": "", "llmstep.lab": "", "llmstep.cli": "",
        "llmstep.core.model": "from ..engines import fast\nimport llmstep\n",
        "llmstep.engines.fast": "def f():\n    from ..core.model import Llama\n",  # a lazy import counts
        "llmstep.lab.bench": "from llmstep.cli import main\nfrom ..core import model\n",
        "llmstep.__main__": "from .cli import main\n",
    }
    edges = graph(fake)
    assert edges["llmstep.core.model"] == {"llmstep.engines.fast", "llmstep"}
    assert edges["llmstep.lab.bench"] == {"llmstep.cli", "llmstep.core.model"}
    assert cycles(edges) == [["llmstep", "llmstep.core.model", "llmstep.engines.fast"]]
    found = violations(edges)
    assert any(v.startswith("llmstep.core.model -> llmstep.engines.fast: core may not") for v in found)
    assert any(v.startswith("llmstep.core.model -> llmstep: a layer imports") for v in found)
    assert any(v.startswith("llmstep.lab.bench -> llmstep.cli: only the command line") for v in found)
    assert not any(v.startswith("llmstep.__main__") for v in found)
    assert not any("lab.bench -> llmstep.core" in v for v in found)


@pytest.mark.parametrize(("source", "expected"), [
    ("from . import runinfo", {"llmstep.lab.runinfo"}),
    ("from .. import _version", {"llmstep._version"}),
    ("from ..core.cost import weight_bytes", {"llmstep.core.cost"}),
    ("import llmstep.core.cost", {"llmstep.core.cost"}),
    ("import torch", set()),
])
def test_relative_imports_resolve_to_modules(source, expected):
    modules = {"llmstep", "llmstep._version", "llmstep.core", "llmstep.core.cost", "llmstep.lab",
               "llmstep.lab.bench", "llmstep.lab.runinfo"}
    assert imports("llmstep.lab.bench", source, modules) == expected


def test_the_package_map_and_the_readme_table_name_every_module_of_the_tree():
    """llmstep/__init__.py's map and README.md's module table list exactly the modules there are (the command
    line is named as a package)."""
    tree = {p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")}
    listed = {p for p in tree if p.parts[0] not in ("cli",) and p.name not in ("__init__.py", "__main__.py")
              and not p.name.startswith("_")}
    doc = (PACKAGE / "__init__.py").read_text().split('"""')[1]
    readme = (ROOT / "README.md").read_text()
    for path in sorted(listed):
        assert f"{path.parts[0]}/" in doc and path.name in doc, f"llmstep/__init__.py's map lacks {path}"
        assert f"`{path.parts[0]}/`" in readme and f"`{path.name}`" in readme, f"README's module table lacks {path}"
    import re

    named = set(re.findall(r"\b(\w+\.py)\b", doc)) | set(re.findall(r"`(\w+\.py)`", readme))
    assert named <= {p.name for p in tree}, f"named but not in the tree: {sorted(named - {p.name for p in tree})}"


def _resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_names_and_test_files_the_docs_cite_exist():
    """Every `llmstep.x.y` a document or a docstring cites imports, and every tests/... file it cites is there
    (the re-layout in layers left old names such as llmstep.cost and tests/test_fast.py behind)."""
    import re

    docs = [ROOT / "README.md", ROOT / "data" / "README.md", *sorted((ROOT / "results").glob("*.md")),
            *sorted(PACKAGE.rglob("*.py"))]
    stale = []
    for doc in docs:
        text = doc.read_text()
        for name in re.findall(r"\bllmstep(?:\.[A-Za-z_]\w*)+", text):
            name = name.rstrip(".")
            if not _resolves(name):
                stale.append(f"{doc.relative_to(ROOT)}: {name}")
        for path in re.findall(r"\btests/[\w/]+\.py\b", text):
            if not (ROOT / path).is_file():
                stale.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not stale, stale

"""The widgets in a real JupyterLab, in a real browser: each renders, and moving a control changes its output.

One JupyterLab server for the module (127.0.0.1, a free port, a random token, a temporary root holding copies of
the notebooks, so nothing the test runs is saved back), driven by Playwright in headless Chromium: Debian's
`chromium` package (apt-get install chromium), never a browser downloaded by `playwright install`. Opened:
a notebook generated here that shows every explorer of llmstep.lab.explorers (one per cell, and the attention
explorer on the shipped model), and every notebook of notebooks/ that uses widgets. For each: run all cells,
fail on any error output, then for every widget with an output area: it holds an image or text, and after one
move of a control (a slider, else a dropdown or toggle) that output changes. A check of the checker runs a
widget whose callback raises and expects it to be caught.

Skipped, with the reason, where Playwright or a Chromium executable is missing (LLMSTEP_CHROMIUM names another
executable). Waits are on conditions, with generous limits: a 2-core CI machine under load is slow, not broken.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
START_S = 180  # the server, the page, a kernel
RUN_S = 600  # all cells of a notebook (06 loads a model and samples 20,000 draws)
CHANGE_S = 120  # one redraw after a control moved

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def chromium() -> str | None:
    for candidate in (os.environ.get("LLMSTEP_CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


def code_cell(source: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": source}


def notebook(cells: list[str]) -> dict:
    return {"cells": [code_cell(c) for c in cells], "nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}


def explorers_notebook() -> tuple[dict, int]:
    """Every explorer, one per cell; and how many widgets that makes."""
    from llmstep.lab.explorers import EXPLORERS

    cells = ["import torch\nimport llmstep\nfrom llmstep.lab import explorers"]
    cells += [f"explorers.{name}()" for name in EXPLORERS]
    cells.append("model, tokenizer = llmstep.load('target', device='cpu', dtype=torch.float32)\n"
                 "explorers.attention_explorer(model, tokenizer, 'ROMEO:\\nBut soft, what light')")
    return notebook(cells), len(EXPLORERS) + 1


def broken_notebook() -> dict:
    """Two widgets: the first answers its slider, the second's callback raises once its slider moves."""
    return notebook(["from llmstep.lab.explorers import explorer\nimport ipywidgets as w\n"
                     "import matplotlib.pyplot as plt\n\n"
                     "def works(x):\n    return plt.figure(), f'x = {x}'\n\n"
                     "def broken(x):\n    if x != 3:\n        raise RuntimeError('a broken callback')\n"
                     "    return plt.figure(), f'x = {x}'",
                     "explorer(works, {'x': w.IntSlider(value=3, min=0, max=10)}, fallback=False)",
                     "explorer(broken, {'x': w.IntSlider(value=3, min=0, max=10)}, fallback=False)"])


def widget_notebooks() -> list[Path]:
    """The course's notebooks (and solutions) that make widgets."""
    found = sorted(NOTEBOOKS.glob("*.ipynb")) + sorted(NOTEBOOKS.glob("solutions/*.ipynb"))
    return [p for p in found if any(("ipywidgets" in "".join(c["source"]) or "explorers" in "".join(c["source"]))
                                    for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(url, token, root) of a JupyterLab server, and a headless Chromium driven by Playwright."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    browser_path = chromium()
    if browser_path is None:
        pytest.skip("no Chromium to drive: apt-get install chromium (Debian), or set LLMSTEP_CHROMIUM")
    root = tmp_path_factory.mktemp("lab")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel draws inline, as for a learner
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JUPYTER_RUNTIME_DIR"] = str(root / ".runtime")
    env["JUPYTER_CONFIG_DIR"] = str(root / ".config")  # no user settings; and no news toast over the widgets
    (root / ".config" / "labconfig").mkdir(parents=True)
    (root / ".config" / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--expose-app-in-browser",
               f"--LabApp.workspaces_dir={root / '.workspaces'}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # CI containers run as root
    log = open(root / "server.log", "w")  # open for the server's lifetime
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n{(root / 'server.log').read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    tail = (root / "server.log").read_text()[-3000:]
                    pytest.fail(f"JupyterLab did not answer in {START_S} s:\n{tail}")
                time.sleep(0.25)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=browser_path, headless=True,
                                        args=["--no-sandbox", "--disable-dev-shm-usage"])
            yield url, token, root, browser
            browser.close()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
    return !!k && k.status === 'idle'; }"""

# Every code cell has run (an execution count) and the kernel is idle again; or an error output appeared.
ALL_RUN = """() => { const w = window.jupyterapp.shell.currentWidget;
    const cells = w.content.widgets.filter(c => c.model.type === 'code');
    const errors = cells.flatMap(c => c.model.outputs.toJSON().filter(o => o.output_type === 'error'));
    if (errors.length) return 'error';
    const k = w.sessionContext.session.kernel;
    return cells.every(c => c.model.executionCount !== null) && k.status === 'idle' ? 'done' : false; }"""

ERRORS = """() => window.jupyterapp.shell.currentWidget.content.widgets.flatMap(c => c.model.type === 'code' ?
    c.model.outputs.toJSON().filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue) : [])"""

# The widgets that have an output area: top-level boxes (in a cell's output) holding a .widget-output.
ROOTS = """() => { const roots = [...document.querySelectorAll('.jp-OutputArea-output .widget-box')].filter(
        b => b.querySelector('.widget-output') && !b.parentElement.closest('.widget-box'));
    roots.forEach((b, i) => b.setAttribute('data-test-widget', i)); return roots.length; }"""


def signature(page, i: int) -> str:
    """What widget i's output area shows: its text and its images."""
    return page.evaluate("""i => { const o = document.querySelector(`[data-test-widget="${i}"] .widget-output`);
        return o.innerText + [...o.querySelectorAll('img')].map(im => im.src).join('|'); }""", i)


def move_a_control(page, i: int) -> str:
    """One step of widget i's first slider (else: its dropdown's next option, else another toggle button)."""
    box = page.locator(f'[data-test-widget="{i}"]')
    handles = box.locator(".widget-slider .noUi-handle")
    if handles.count():
        handle = handles.first
        at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
        handle.focus()
        handle.press("ArrowLeft" if at_max else "ArrowRight")
        return "slider"
    selects = box.locator(".widget-dropdown select")
    if selects.count():
        options = selects.first.locator("option")
        current = selects.first.input_value()
        values = [options.nth(j).get_attribute("value") for j in range(options.count())]
        selects.first.select_option(next(v for v in values if v != current))
        return "dropdown"
    box.locator(".widget-toggle-buttons button:not(.mod-active)").first.click()
    return "toggle"


def open_and_run(page, lab, relative: str) -> int:
    """Open the notebook at `relative` (in the server's root), run all its cells; the number of widgets."""
    url, token, _, _ = lab
    page.goto(f"{url}/lab/tree/{relative}?reset&token={token}")  # reset: no tabs restored from a workspace
    page.wait_for_function(KERNEL_IDLE, timeout=START_S * 1000)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")  # not awaited
    handle = page.wait_for_function(ALL_RUN, timeout=RUN_S * 1000, polling=500)
    if handle.json_value() == "error":
        pytest.fail(f"{relative}: a cell failed: {page.evaluate(ERRORS)}")
    return page.evaluate(ROOTS)


def check_widgets(lab, relative: str, expected: int | None = None, change_s: float = CHANGE_S) -> list[str]:
    """Run the notebook; every widget shows something and changes when a control moves. Returns the problems."""
    context = lab[3].new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        return _check(page, lab, relative, expected, change_s)
    finally:
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")  # frees the CPU
        context.close()


def _check(page, lab, relative: str, expected: int | None, change_s: float) -> list[str]:
    n = open_and_run(page, lab, relative)
    problems = [] if expected is None or n == expected else [f"{relative}: {n} widgets rendered, {expected} expected"]
    if n == 0:
        problems.append(f"{relative}: no widget with an output area rendered")
    for i in range(n):
        page.wait_for_function("""i => { const o = document.querySelector(`[data-test-widget="${i}"] .widget-output`);
            return o.innerText.trim() || o.querySelector('img'); }""", arg=i, timeout=CHANGE_S * 1000)
        before = signature(page, i)
        how = move_a_control(page, i)
        try:
            page.wait_for_function("""([i, before]) => { const o = document.querySelector(
                `[data-test-widget="${i}"] .widget-output`);
                return o.innerText + [...o.querySelectorAll('img')].map(im => im.src).join('|') !== before; }""",
                                   arg=[i, before], timeout=change_s * 1000)
        except Exception as e:  # playwright's TimeoutError
            problems.append(f"{relative}: widget {i}'s output did not change within {change_s} s after its {how} "
                            f"moved ({type(e).__name__})")
    return problems


def test_every_explorer_renders_and_answers_its_controls(lab):
    nb, n = explorers_notebook()
    (lab[2] / "explorers.ipynb").write_text(json.dumps(nb))
    assert check_widgets(lab, "explorers.ipynb", expected=n) == []



def test_the_batching_explorer_draws_the_queue_and_redraws_it(lab):
    """The queue view in a browser: the explorer's summary and figure show the queue beside the slots, and one
    step of the slots slider redraws both for the new number of slots."""
    (lab[2] / "queue.ipynb").write_text(json.dumps(notebook(["from llmstep.lab import explorers",
                                                             "explorers.batching_explorer(fallback=False)"])))
    context = lab[3].new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    text = """() => document.querySelector('[data-test-widget="0"] .widget-output').innerText"""
    try:
        assert open_and_run(page, lab, "queue.ipynb") == 1
        page.wait_for_function("""() => document.querySelector('[data-test-widget="0"] .widget-output img')""",
                               timeout=CHANGE_S * 1000)
        before = page.evaluate(text)
        assert "4 slots" in before and "queue at most" in before
        assert move_a_control(page, 0) == "slider"  # the first slider: slots, 4 -> 5
        page.wait_for_function(f"() => ({text})().includes('5 slots')", timeout=CHANGE_S * 1000)
        assert "queue at most" in page.evaluate(text)
    finally:
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        context.close()

def widgets_made(path: Path) -> int:
    """How many widgets with an output area the notebook's code makes: its calls of an explorer (any callee whose
    name ends in "explorer") and of ipywidgets' `interactive`, read from each cell's syntax tree (so not in comments
    or strings; IPython's % and ! lines left out). A call in a loop, a comprehension or a function makes a number
    of widgets the code does not say: refused."""
    count = 0
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        tree = ast.parse("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
        count += _widget_calls(tree, path.name, repeated=False)
    return count


_REPEATED = (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp,
             ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _widget_calls(node: ast.AST, where: str, repeated: bool) -> int:
    count = 0
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name.endswith("explorer") or name == "interactive":
            if repeated:
                raise ValueError(f"{where}: {name}() is called in a loop or a function (line {node.lineno} of its "
                                 "cell): count its widgets by hand")
            count += 1
    for child in ast.iter_child_nodes(node):
        count += _widget_calls(child, where, repeated or isinstance(node, _REPEATED))
    return count


def up_to_the_last_widget(path: Path) -> dict:
    """The notebook without the cells after its last widget-making one: what its widgets need runs (a cell they
    depend on comes before them), the measurements that follow them (nbval runs those) do not."""
    nb = json.loads(path.read_text())

    def makes_widgets(cell: dict) -> bool:
        lines = "".join(cell["source"]).splitlines()
        source = "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))
        return cell["cell_type"] == "code" and _widget_calls(ast.parse(source), path.name, repeated=False) > 0

    last = max(i for i, cell in enumerate(nb["cells"]) if makes_widgets(cell))
    return nb | {"cells": nb["cells"][: last + 1]}


@pytest.mark.parametrize("path", widget_notebooks(), ids=lambda p: p.name)
def test_the_course_notebooks_widgets_render_and_answer(lab, path):
    target = lab[2] / path.relative_to(ROOT)
    target.parent.mkdir(parents=True, exist_ok=True)
    trimmed = up_to_the_last_widget(path)
    target.write_text(json.dumps(trimmed))  # a copy: what the browser runs is never saved into the course
    assert widgets_made(target) == widgets_made(path)  # every widget is in what runs
    assert check_widgets(lab, str(path.relative_to(ROOT)), expected=widgets_made(path)) == []


def test_the_speculative_explorers_verify_cost_slider_redraws(lab):
    """The verify-cost control (not the first slider, which the test above moves) reaches the figure and the text."""
    (lab[2] / "verify.ipynb").write_text(json.dumps(notebook(
        ["from llmstep.lab import explorers\nexplorers.speculative_explorer(0.74, 0.09, verify_cost=1.5)"])))
    context = lab[3].new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    try:
        assert open_and_run(page, lab, "verify.ipynb") == 1
        output = '[data-test-widget="0"] .widget-output'
        page.wait_for_function(f"() => document.querySelector('{output}').innerText.includes('tokens 1.50:')",
                               timeout=CHANGE_S * 1000)
        slider = page.locator('[data-test-widget="0"] .widget-slider').filter(has_text="verify cost")
        slider.locator(".noUi-handle").focus()
        slider.locator(".noUi-handle").press("ArrowRight")  # one step: 1.50 -> 1.51
        page.wait_for_function(f"() => document.querySelector('{output}').innerText.includes('tokens 1.51:')",
                               timeout=CHANGE_S * 1000)
    finally:
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        context.close()


def test_the_check_catches_a_broken_callback(lab):
    (lab[2] / "broken.ipynb").write_text(json.dumps(broken_notebook()))
    problems = check_widgets(lab, "broken.ipynb", expected=2, change_s=30)  # the working one redraws in < 1 s
    assert len(problems) == 1 and "widget 1's output did not change" in problems[0], problems


def test_widgets_made_counts_calls_not_text(tmp_path):
    """No browser: the count each course notebook is held to."""
    def made(*cells: str) -> int:
        path = tmp_path / "n.ipynb"
        path.write_text(json.dumps(notebook(list(cells))))
        return widgets_made(path)

    assert made("from llmstep.lab import explorers\nexplorers.rope_explorer()", "x = 1\nexplorers.kv_memory_explorer()",
                "import ipywidgets as widgets\nwidgets.interactive(print, x=3)") == 3
    assert made("# explorers.rope_explorer() would draw it\nprint('explorers.rope_explorer(')") == 0
    assert made("x", "explorers.rope_explorer()") == 1  # the cells' sources are not run together
    assert made("%matplotlib inline\nexplorers.rope_explorer()") == 1
    for loop in ("for c in configs:\n    display(explorers.rope_explorer(c))",
                 "[explorers.rope_explorer(c) for c in configs]", "def f():\n    return explorers.rope_explorer()"):
        with pytest.raises(ValueError, match="loop or a function"):
            made(loop)


def test_the_course_notebooks_saved_as_many_widgets_as_widgets_made_counts():
    """The committed outputs come from a real run: the count read from the code must match what that run showed."""
    for path in widget_notebooks():
        nb = json.loads(path.read_text())
        saved = sum("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                    for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"])
        assert widgets_made(path) == saved, path.name

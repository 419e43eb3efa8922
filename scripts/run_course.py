"""Re-run the course's notebooks top to bottom, one after another, and record where and how long each ran.

    PYTHONPATH=. MPLBACKEND=agg PYTHONHASHSEED=0 python scripts/run_course.py            # every notebook and solution
    PYTHONPATH=. MPLBACKEND=agg PYTHONHASHSEED=0 python scripts/run_course.py notebooks/05_prefill_vs_decode.ipynb

Each notebook is executed in place (its stored outputs replaced by this run's) in a fresh kernel, in reading order,
so no two compete for the CPU. notebooks/RUNS.md is rewritten with the machine (CPU model, cores, flags that
change kernels), the software, the load average before each notebook, and each notebook's wall time: the committed
outputs' provenance, which the notebooks' "Runs in" lines quote. A notebook that fails stops the run and keeps
its previous file (nbclient writes nothing until the whole notebook has run).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import torch
from nbclient import NotebookClient

from llmstep.core.files import atomic_write_text
from llmstep.lab import runinfo

ROOT = Path(__file__).resolve().parent.parent


def cpu() -> str:
    flags = runinfo.cpu_flags()
    return (f"{runinfo.describe('cpu')['name']}, {os.cpu_count()} logical CPUs, flags: "
            f"{', '.join(flags) or 'none of ' + ', '.join(runinfo.CPU_FLAGS)}")


def course() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted(
        (ROOT / "notebooks" / "solutions").glob("[0-9][0-9]_*.ipynb"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook, then every solutions notebook")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    a = p.parse_args()
    paths = [q.resolve() for q in a.notebooks] or course()
    missing = [str(q) for q in paths if not q.is_file()]
    if missing:
        sys.exit(f"no such notebook: {', '.join(missing)}")
    rows = []
    for path in paths:
        load = os.getloadavg()[0]
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=a.timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        seconds = time.perf_counter() - t0
        atomic_write_text(path, nbformat.writes(nb) + "\n")
        rows.append((path.relative_to(ROOT), load, seconds))
        print(f"{path.relative_to(ROOT)}: {seconds:.0f} s (load before {load:.2f})", flush=True)
    lines = [
        "# Where the stored outputs come from",
        "",
        "Written by `scripts/run_course.py`, which executed these notebooks in place, one after another, in a fresh",
        "kernel each. The stored outputs are this run's; nbval re-runs them in CI on other machines.",
        "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- CPU: {cpu()}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} {platform.release()}",
        "",
        "| notebook | wall time (s) | load average before |",
        "|---|---|---|",
        *(f"| `{name}` | {seconds:.0f} | {load:.2f} |" for name, load, seconds in rows),
        f"| total | {sum(r[2] for r in rows):.0f} | |",
        "",
    ]
    if a.notebooks:
        print("a partial run: notebooks/RUNS.md left as it is")
    else:
        atomic_write_text(ROOT / "notebooks" / "RUNS.md", "\n".join(lines))


if __name__ == "__main__":
    main()

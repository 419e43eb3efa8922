"""From logits to one token: temperature, top-k, top-p, softmax, a categorical draw.

Pure, batched functions: logits [B, V] in, a distribution [B, V] or tokens [B] out. `probs` returns the
exact distribution that `sample` draws from, so tests (and speculative decoding) can use it.
"""

from __future__ import annotations

import math

import torch

from .checks import is_int, is_number

__all__ = ["check_params", "apply_temperature", "top_k_filter", "top_p_filter", "probs", "sample", "greedy",
           "first_max", "draw", "race", "picker"]


FLOAT32_MAX = torch.finfo(torch.float32).max


def check_params(temperature: float = 1.0, top_k: int | None = 0, top_p: float = 1.0) -> None:
    """Raise ValueError naming the bad argument (a bool or a string is not a number)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not is_number(value):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if float(temperature) > FLOAT32_MAX:  # finite here, infinite in float32, where the logits are divided by it
        raise ValueError(f"temperature must be at most {FLOAT32_MAX:.4g} (float32's largest), got {temperature}")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 means off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 means off), got {top_p}")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by T: T < 1 sharpens the distribution, T > 1 flattens it. Computed in float32."""
    return logits.float() / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k largest logits of each row (ties broken by index), set the rest to -inf."""
    if not k or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # [..., 1]: the k-th largest value
    above = logits > kth
    tied = logits == kth  # of these, keep the lowest indices until there are k (topk's own choice varies)
    keep = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # ties: the lower index first
    sorted_probs = sorted_logits.softmax(dim=-1)
    # the probability of the tokens ranked above each one, summed (cumsum - p would round a mass that reaches p
    # exactly to just under it, and keep one token too many)
    mass_before = torch.cat([torch.zeros_like(sorted_probs[..., :1]), sorted_probs[..., :-1].cumsum(dim=-1)], dim=-1)
    drop_sorted = mass_before >= p  # already reached p without this token
    drop_sorted[..., 0] = False  # the top token is always kept (a p below float32's range compares as 0)
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B]: the most likely token (the first one on ties)."""
    return first_max(logits)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...]: the index of the first largest value along the last dim, a NaN counting as larger than
    any number: torch.argmax's rule. Eager, and on other devices, it is torch.argmax. In a compiled CPU step it is
    the same index from two plain reductions, the largest value and then the first index holding it (or holding a
    NaN), which inductor's C++ vectorises well: its argmax kernel took ~3x as long over a vocabulary's row
    (results/README.md, claim 2, session 33). Eager the two passes are the slower; on a GPU, not measured."""
    if not torch.compiler.is_compiling() or x.device.type != "cpu":
        return x.argmax(dim=-1)
    hit = (x == x.amax(dim=-1, keepdim=True)) | x.isnan()  # [..., V]; with a NaN the max is NaN and equals nothing
    index = torch.arange(x.shape[-1], device=x.device)
    return torch.where(hit, index, x.shape[-1]).amin(dim=-1)


def probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> the distribution the draw uses [..., V], float32.

    The article's order: temperature, then top-k, then top-p on what is left, then softmax.
    Temperature 0 is greedy: all the mass on the argmax. A T below float32's smallest normal number (~1.2e-38),
    which float32 arithmetic cannot divide by on every device (0/0 there), gives its limit: the mass shared by the
    tied largest logits (what any T that small gives unless two logits differ by less than ~100 T). A row with +inf
    logits shares its mass among them at any T; NaN logits give NaN, and so does a row with no logit above -inf
    (no distribution to draw from: `sample` then returns index 0; the engines refuse non-finite logits first).
    """
    check_params(temperature, top_k, top_p)
    if temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, greedy(logits)[..., None], 1.0)
    temperature, top_k, top_p = float(temperature), int(top_k or 0), float(top_p)  # any real number (a Fraction)
    logits = logits.float()
    top = logits.amax(-1, keepdim=True)
    # the same softmax; a tiny T then gives -inf, never inf - inf. A row holding +inf: every T gives its limit,
    # the mass shared by the +inf logits (as T = 0 does), where inf - inf would be NaN (no host sync to tell)
    at_inf = torch.full_like(logits, float("-inf")).masked_fill(logits == float("inf"), 0.0)  # float32, as logits
    logits = torch.where(top == float("inf"), at_inf, logits - top)
    if temperature < torch.finfo(torch.float32).tiny:
        scaled = torch.zeros_like(logits).masked_fill(logits != 0, float("-inf"))  # T -> 0: the largest, alike
    else:
        scaled = apply_temperature(logits, temperature)
    return top_p_filter(top_k_filter(scaled, top_k), top_p).softmax(dim=-1)


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A categorical draw from p [B, V] -> [B], without a host sync.

    argmax(p_i / E_i) with E_i ~ Exponential(1) picks i with probability exactly p_i (the "exponential
    race"; the same as torch.multinomial, but it stays on the device).
    """
    return race(p, torch.empty_like(p).exponential_(1.0, generator=generator))


def race(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """`draw` given its random numbers: p [B, V] and Exp(1) draws e [B, V] -> argmax(p / e) [B]. A compiled
    step takes e as an input (a seeded torch.Generator cannot be used inside one): llmstep.engines.fast."""
    e = e.clamp_min(torch.finfo(e.dtype).tiny)  # an exact 0 would make 0/0 = nan for a filtered-out token
    return first_max(p / e)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> tokens [B], drawn from `probs(logits, temperature, top_k, top_p)`."""
    if temperature == 0:
        check_params(temperature, top_k, top_p)
        return greedy(logits)
    return draw(probs(logits, temperature, top_k, top_p), generator)


def picker(sampling: tuple[float, int, float], generator: torch.Generator | None):
    """pick(logits [1, V]) -> (token [1], the distribution it was drawn from, or None at temperature 0), for
    speculative decoding, which needs the draft's distribution q beside its token."""
    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if sampling[0] == 0:
            return greedy(logits), None
        dist = probs(logits, *sampling)
        return draw(dist, generator), dist

    return pick

"""Speculative decoding: a small draft guesses k tokens, the target checks them all in one forward.

Decode is bound by reading the weights, not by arithmetic: a forward over k+1 tokens costs the target
about what a forward over one token costs. So a cheap draft proposes k tokens one at a time, the target
scores all k+1 positions at once, and a rejection rule keeps what the target would have produced:

    accept draft token x (drawn from q) with probability min(1, p(x) / q(x));
    at the first rejection draw instead from the residual max(0, p - q) / sum(max(0, p - q));
    if all k are accepted, draw a bonus token from the target's distribution at position k+1.

Every emitted token is then distributed exactly as a draw from p, the target's (filtered) distribution
(Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding", Thm 1;
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", Thm 1):
    P(emit x) = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) * (p(x) - q(x))+ / sum_y (p(y) - q(y))+ = p(x).
At temperature 0 both distributions are one-hot and the rule reduces to "accept iff the draft's token is
the target's argmax": the output is plain greedy decoding's, token for token.

With a per-token acceptance probability a, one target forward yields on average (1 - a^(k+1)) / (1 - a)
tokens (Leviathan et al., eq. 1). Both KV caches roll back after a rejection by moving their lengths back.

Layout: the acceptance rule (pure, batched), the theory, a layer-skipping self-draft, the generation
loop, the benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..core.cost import model_step_cost
from ..core.device import synchronize
from ..core.kv_cache import KVCache
from ..core.model import Llama
from ..core.sampling import check_params, draw, probs
from ..core.tokens import Tokenizer
from .fast import FastResult, compile_step, uses_cuda_graphs
from .generate import (
    Generation,
    Stream,
    TokenEvent,
    check_max_new_tokens,
    check_prompt_ids,
    encode_prompt,
    make_generator,
    stop_id_set,
)

__all__ = ["verify", "verify_greedy", "expected_tokens_per_forward", "expected_speedup", "best_k", "measure_costs",
           "step_bytes", "draft_cost_ratio", "LayerSkipDraft", "resolve_draft", "SpeculativeGeneration",
           "speculative_stream", "speculative_generate", "Rounds", "FastSpeculator", "FastSpeculativeResult"]


# --------------------------------------------------------------------------------------------------
# The acceptance rule
# --------------------------------------------------------------------------------------------------


def verify(p: torch.Tensor, q: torch.Tensor, proposed: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject k proposed tokens; return (n_accepted [B], next_token [B]).

    p [B, k+1, V]: the target's distributions at the k proposed positions and the one after them.
    q [B, k, V]: the draft's distributions, from which `proposed` [B, k] were drawn.
    The emitted tokens are proposed[:, :n] followed by next_token: the residual draw at the first
    rejection, or the bonus draw from p[:, k] when all k were accepted.
    """
    B, k = proposed.shape
    p_x = p[:, :k].gather(-1, proposed[..., None])[..., 0]  # [B, k]: p(x) of each proposed token
    q_x = q.gather(-1, proposed[..., None])[..., 0]  # [B, k]: q(x) > 0, since x was drawn from q
    u = torch.rand(B, k, generator=generator, device=p.device)
    accepted = u * q_x < p_x  # u < p(x)/q(x): accepted with probability min(1, p(x)/q(x))
    n = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]: the run of accepts before the first rejection
    # The next token comes from max(0, p - q) at position n; past the last proposal q is 0, leaving p.
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [B, k+1, V]
    index = n[:, None, None].expand(B, 1, p.shape[-1])
    p_n, q_n = p.gather(1, index)[:, 0], q_padded.gather(1, index)[:, 0]  # [B, V]
    residual = (p_n - q_n).clamp_min(0)
    # A rejection where p == q has probability 0, but rounding can make one: fall back to p itself.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    return n, draw(residual, generator)  # draw() normalises: it picks i with probability w_i / sum(w)


def verify_greedy(target_logits: torch.Tensor, proposed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` at temperature 0, where p and q are one-hot: accept while the draft's token is the
    target's argmax; the next token is the target's argmax where they first differ (or the bonus one).

    target_logits [B, k+1, V], proposed [B, k] -> (n_accepted [B], next_token [B]). No randomness.
    """
    best = target_logits.argmax(dim=-1)  # [B, k+1]: what plain greedy decoding would emit at each position
    n = (best[:, :-1] == proposed).long().cumprod(dim=-1).sum(dim=-1)  # [B]
    return n, best.gather(1, n[:, None])[:, 0]


# --------------------------------------------------------------------------------------------------
# The theory (Leviathan et al. 2023, section 3)
# --------------------------------------------------------------------------------------------------


def expected_tokens_per_forward(a: float, k: int) -> float:
    """Tokens one target forward yields when each draft token is accepted with probability a."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def expected_speedup(a: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Over target-only decoding, when a draft forward costs `cost_ratio` target forwards and the
    target's (k+1)-token forward costs `verify_cost` one-token forwards (1 while decode is memory-bound)."""
    return expected_tokens_per_forward(a, k) / (cost_ratio * k + verify_cost)


def best_k(a: float, cost_ratio: float, k_max: int = 16, verify_costs: Sequence[float] | None = None) -> int:
    """The k in 1..k_max with the largest expected speedup; verify_costs[k]: the (k+1)-token forward's
    cost in one-token forwards (default 1; on a CPU it grows with k, see `measure_costs`)."""
    def verify_cost(k: int) -> float:
        return 1.0 if verify_costs is None else verify_costs[min(k, len(verify_costs) - 1)]

    return max(range(1, k_max + 1), key=lambda k: expected_speedup(a, k, cost_ratio, verify_cost(k)))


@torch.inference_mode()
def measure_costs(target: Llama, draft: Llama, k_max: int = 8, context: int = 64,
                  repeats: int = 10) -> tuple[float, list[float]]:
    """Time the forwards a round is made of: (a draft forward in target forwards, [the target's
    (k+1)-token forward in one-token forwards, for k = 0..k_max]). Each time is the fastest of `repeats`
    runs: other work on the machine only ever adds time."""
    def seconds(model: Llama, n_tokens: int, last_only: bool) -> float:
        cache = model.new_cache(max_len=context + n_tokens)
        model(torch.zeros(1, context, dtype=torch.long, device=model.device), cache=cache)
        x = torch.ones(1, n_tokens, dtype=torch.long, device=model.device)
        times = []
        for _ in range(repeats + 2):  # two to warm up
            cache.rollback(context)
            synchronize(model.device)
            start = time.perf_counter()
            model(x, cache=cache, last_only=last_only)
            synchronize(model.device)
            times.append(time.perf_counter() - start)
        return min(times[2:])

    one = seconds(target, 1, last_only=False)
    return seconds(draft, 1, last_only=True) / one, [seconds(target, k + 1, False) / one for k in range(k_max + 1)]


def step_bytes(model: Llama, context: int = 0) -> float:
    """Bytes one decode forward reads (llmstep.cost; llmstep.quantize's count for quantized weights)."""
    return model_step_cost(model, context=context).bytes


def draft_cost_ratio(target: Llama, draft: Llama) -> float:
    """Bytes a draft forward reads over bytes a target forward reads."""
    return step_bytes(draft) / step_bytes(target)


# --------------------------------------------------------------------------------------------------
# Self-speculation: the target's first layers as its own draft
# --------------------------------------------------------------------------------------------------


class LayerSkipDraft(Llama):
    """The target's first n_layers blocks, then its final norm and LM head, sharing its weights.

    A draft for any model, with no second checkpoint (self-speculative decoding: Zhang et al. 2023,
    "Draft & Verify"; Elhoushi et al. 2024, "LayerSkip"). It is a `Llama` whose layer list is a prefix
    of the target's, so the forward path is the same one; it keeps its own, shallower KV cache.
    An early exit the model was not trained for agrees with the full stack less often than a trained
    draft does, and the LM head is read in full each time, so expect a smaller gain.
    """

    def __init__(self, target: Llama, n_layers: int):
        if not isinstance(n_layers, int) or not 1 <= n_layers <= target.config.n_layers:
            raise ValueError(f"a layer-skip draft keeps 1..{target.config.n_layers} of the target's layers, "
                             f"got {n_layers!r}")
        torch.nn.Module.__init__(self)
        self.config = target.config.replace(n_layers=n_layers)
        self.tok_embeddings = target.tok_embeddings  # the same modules: no weight is copied
        self.layers = torch.nn.ModuleList(target.layers[:n_layers])
        self.norm = target.norm
        self.output = target.output
        self.register_buffer("inv_freq", target.inv_freq, persistent=False)
        self.generation_config = getattr(target, "generation_config", {})
        self.train(target.training)


def resolve_draft(spec: str, target: Llama, tokenizer: Tokenizer | None = None, device=None, dtype=None) -> Llama:
    """A draft from a command-line word: "self-N" (the target's first N layers), "self-int8" /
    "self-int4" (a quantized copy), or a checkpoint path ("draft"
    is the shipped one). A loaded checkpoint must share the target's tokenizer."""
    if spec.startswith("self-int"):
        from ..core import quantize

        mode = spec.removeprefix("self-")
        if mode not in ("int8", "int4"):
            raise ValueError(f"--draft {spec}: the quantized self-drafts are self-int8 and self-int4")
        # A twin sharing the float model's embeddings and norms, with its matmuls (LM head included) quantized.
        return quantize.quantize(target, mode, lm_head=True, inplace=False)
    if spec.startswith("self-"):
        try:
            n = int(spec.removeprefix("self-"))
        except ValueError:
            raise ValueError(f"--draft {spec}: write self-N with N the number of layers to keep") from None
        return LayerSkipDraft(target, n)
    from ..core.checkpoint import load

    draft, draft_tokenizer = load(spec, device=device or target.device, dtype=dtype or target.dtype)
    if tokenizer is not None and draft_tokenizer.tok.get_vocab() != tokenizer.tok.get_vocab():
        raise ValueError(f"the draft at {spec} uses a different tokenizer from the target's: speculative "
                         "decoding needs both models to read and write the same token ids")
    return draft


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Rounds:
    """What a speculative run did, one entry per round (a target forward after the prefill)."""

    k: int = 0  # the largest number of draft tokens proposed per round
    proposed: list[int] = field(default_factory=list)  # draft tokens proposed, one entry per round
    accepted: list[int] = field(default_factory=list)  # of which the target accepted (a prefix)
    produced: list[int] = field(default_factory=list)  # tokens each round emitted (accepted + 1, or fewer at a stop)

    @property
    def rounds(self) -> int:
        """Target forwards after the prefill."""
        return len(self.proposed)

    @property
    def draft_forwards(self) -> int:
        return sum(self.proposed)

    @property
    def examined(self) -> int:
        """Draft tokens the rule looked at: the accepted ones and the first rejected one of each round."""
        return sum(a + (a < k) for a, k in zip(self.accepted, self.proposed, strict=True))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / examined: the per-token acceptance probability a of the theory."""
        return sum(self.accepted) / self.examined if self.examined else float("nan")

    @property
    def tokens_per_target_forward(self) -> float:
        return sum(self.produced) / self.rounds if self.rounds else float("nan")

    @property
    def theory_tokens_per_forward(self) -> float:
        """(1 - a^(k+1)) / (1 - a) at the measured a, averaged over the rounds' actual k."""
        a = self.acceptance_rate
        return sum(expected_tokens_per_forward(a, k) for k in self.proposed) / self.rounds if self.rounds else a

    def record(self, k: int, n: int, produced: int) -> None:
        self.proposed.append(k)
        self.accepted.append(n)
        self.produced.append(produced)


@dataclass
class SpeculativeGeneration(Generation, Rounds):
    """A `Generation` plus what the speculation did. `step_seconds` has one entry per new token after
    the first, as for plain decoding: each round's time shared equally among the tokens it produced."""

    overlap: list[float] = field(default_factory=list)  # sum_x min(p, q) at each examined position: its exact
    #                                                     acceptance probability
    draft_seconds: float = 0.0  # time in the draft's forwards and draws (decode rounds)
    target_seconds: float = 0.0  # time in the target's verification forwards and the acceptance rule

    @property
    def expected_acceptance_rate(self) -> float:
        """The mean of sum_x min(p, q) over the examined positions: what acceptance_rate estimates."""
        return sum(self.overlap) / len(self.overlap) if self.overlap else float("nan")

    def summary(self) -> str:
        return (super().summary() + f"\nspeculative: k={self.k}, {self.rounds} target forwards, "
                f"{self.draft_forwards} draft forwards, acceptance {self.acceptance_rate:.1%} "
                f"(expected {self.expected_acceptance_rate:.1%}), {self.tokens_per_target_forward:.2f} tokens "
                f"per target forward (theory {self.theory_tokens_per_forward:.2f})")


def _check_k(k) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (draft tokens per round) must be an integer >= 1, got {k!r}")


def _check_pair(target: Llama, draft: Llama) -> None:
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
        raise ValueError(f"the draft must be a llmstep Llama (or a LayerSkipDraft), got {type(draft).__name__}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                         f"({target.config.vocab_size}): both must score the same token ids")
    if draft.device != target.device:
        raise ValueError(f"the draft is on {draft.device} and the target on {target.device}: put both on one device")


def speculative_stream(target: Llama, draft: Llama, tokenizer: Tokenizer, prompt, k: int = 4,
                       max_new_tokens: int = 128, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int | None = None, stop_ids: Iterable[int] | None = None, adaptive: bool = False,
                       cost_ratio: float | None = None, verify_costs: Sequence[float] | None = None) -> Stream:
    """Start speculative generation; see `speculative_generate`. Errors in the arguments are raised here."""
    check_params(temperature, top_k, top_p)
    _check_k(k)
    _check_pair(target, draft)
    check_max_new_tokens(max_new_tokens)
    if cost_ratio is not None and not cost_ratio >= 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    ids = encode_prompt(tokenizer, prompt, target.config.max_seq_len)
    stops = stop_id_set(tokenizer.eos_ids if stop_ids is None else stop_ids)
    result = SpeculativeGeneration(prompt_ids=ids, k=k)
    if adaptive and cost_ratio is None:
        cost_ratio = draft_cost_ratio(target, draft)
    sampling = (temperature, top_k, top_p)
    policy = (cost_ratio, verify_costs) if adaptive else None
    events = _run(target, draft, tokenizer, ids, k, max_new_tokens, sampling, seed, stops, result, policy)
    return Stream(events, result)


def _picker(sampling: tuple[float, int, float], generator: torch.Generator | None):
    """pick(logits [1, V]) -> (token [1], the distribution it was drawn from, or None at temperature 0)."""
    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if sampling[0] == 0:
            return logits.argmax(dim=-1), None
        dist = probs(logits, *sampling)
        return draw(dist, generator), dist

    return pick


@torch.inference_mode()
def _run(target, draft, tokenizer, ids, k_max, max_new_tokens, sampling, seed, stops, result,
         policy) -> Iterator[TokenEvent]:
    device = target.device
    n_ctx = min(target.config.max_seq_len, len(ids) + max_new_tokens)  # target cache slots
    n_ctx_draft = min(draft.config.max_seq_len, n_ctx)  # a draft with a shorter context stops proposing
    target_cache = target.new_cache(batch_size=1, max_len=n_ctx)
    draft_cache: KVCache = draft.new_cache(batch_size=1, max_len=n_ctx_draft)
    generator = make_generator(device, seed)
    detok = tokenizer.stream(skip_special_tokens=True)
    seq = list(ids)  # every token so far; the last one is not yet in either cache
    result.stop_reason = "length"

    def emit(token_id: int, seconds: float) -> TokenEvent:
        index = len(result.tokens)
        result.tokens.append(token_id)
        if index:
            result.step_seconds.append(seconds)
        is_stop = token_id in stops
        text = "" if is_stop else detok.step(token_id)
        if is_stop or index == max_new_tokens - 1 or len(seq) - 1 >= n_ctx:  # the last token: flush the text
            text += detok.flush()
        result.text += text
        return TokenEvent(token_id, text, index, seconds, is_stop)

    if max_new_tokens == 0:
        return
    # Prefill both models on the prompt; the target's last logits give the first token.
    synchronize(device)
    start = time.perf_counter()
    greedy = sampling[0] == 0  # temperature 0: argmax comparisons, no distributions needed

    pick = _picker(sampling, generator)
    x = torch.tensor([seq], device=device)  # [1, T]
    token, _ = pick(target(x, cache=target_cache, last_only=True)[:, -1])  # [1]
    if len(seq) <= n_ctx_draft:
        draft(x, cache=draft_cache, last_only=True)  # only its cache is wanted
    seq.append(int(token))
    result.prefill_seconds = time.perf_counter() - start
    event = emit(seq[-1], result.prefill_seconds)
    yield event
    if event.stop:
        result.stop_reason = "stop"
        return

    target_len, draft_len = len(seq) - 1, int(draft_cache.lengths[0])  # positions held by each cache
    k = k_max
    while len(result.tokens) < max_new_tokens:
        L = len(seq)  # the pending token sits at position L - 1
        if L - 1 >= n_ctx:  # the context is full: nowhere to write the pending token
            result.stop_reason = "context"
            break
        if policy is not None:  # adaptive: the best k for the acceptance seen so far (Laplace estimate)
            cost_ratio, verify_costs = policy
            k = best_k((sum(result.accepted) + 1) / (result.examined + 2), cost_ratio, k_max, verify_costs)
        # Propose no more than the budget can use (a round always adds one token of its own) or the
        # caches can hold: the target writes positions L-1 .. L-1+k, the draft L-1 .. L+k-2.
        k = max(0, min(k, max_new_tokens - len(result.tokens) - 1, n_ctx - L, n_ctx_draft - L + 1))

        synchronize(device)
        start = time.perf_counter()
        # 1. The draft proposes k tokens, one forward each. Its first input is every token it has not
        #    seen: the pending one, and after a round with all k accepted also the last proposal.
        proposed, q = [], []
        x = torch.tensor([seq[draft_len:L]], device=device) if k else None
        for _ in range(k):
            token, q_i = pick(draft(x, cache=draft_cache, last_only=True)[:, -1])  # [1], [1, V]
            x = token[:, None]  # [1, 1]
            proposed.append(x)
            q.append(q_i)
        if k:
            draft_len = L + k - 1  # it has seen everything but its own last proposal
        synchronize(device)
        draft_seconds = time.perf_counter() - start

        # 2. The target scores the pending token and all k proposals in one forward: k+1 distributions.
        x = torch.cat([torch.tensor([seq[target_len:L]], device=device), *proposed], dim=1)  # [1, L-target_len+k]
        logits = target(x, cache=target_cache)[:, -(k + 1):]  # [1, k+1, V]
        if not k:
            n, new, overlap = 0, [int(pick(logits[:, 0])[0])], []
        elif greedy:
            drafted = torch.cat(proposed, dim=1)  # [1, k]
            n, token = verify_greedy(logits, drafted)
            n = int(n)
            new = drafted[0, :n].tolist() + [int(token)]
            overlap = [1.0] * n + [0.0] * (n < k)  # one-hot p and q overlap fully or not at all
        else:
            p = probs(logits, *sampling)  # [1, k+1, V]
            drafted, q = torch.cat(proposed, dim=1), torch.stack(q, dim=1)  # [1, k], [1, k, V]
            n, token = verify(p, q, drafted, generator)
            n = int(n)
            new = drafted[0, :n].tolist() + [int(token)]
            overlap = torch.minimum(p[0, :k], q[0]).sum(-1)[: min(n + 1, k)].tolist()  # the examined positions
        # 3. Roll both caches back to the accepted prefix: what lies beyond their lengths is never read.
        target_len = L + n
        target_cache.rollback(target_len)
        draft_len = min(draft_len, L + n)
        draft_cache.rollback(draft_len)
        synchronize(device)
        seconds = time.perf_counter() - start

        # Keep the new tokens up to a stop token (the budget was already respected by the choice of k).
        for i, t in enumerate(new):
            if t in stops:
                new = new[: i + 1]
                break
        result.record(k, n, len(new))
        result.overlap += overlap
        result.draft_seconds += draft_seconds
        result.target_seconds += seconds - draft_seconds
        result.decode_bytes += step_bytes(target, L - 1) + sum(step_bytes(draft, L - 1 + i) for i in range(k))
        for t in new:
            seq.append(t)
            event = emit(t, seconds / len(new))
            yield event
            if event.stop:
                result.stop_reason = "stop"
                return


def speculative_generate(target: Llama, draft: Llama, tokenizer: Tokenizer, prompt, k: int = 4,
                         max_new_tokens: int = 128, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                         seed: int | None = None, stop_ids: Iterable[int] | None = None, adaptive: bool = False,
                         cost_ratio: float | None = None,
                         verify_costs: Sequence[float] | None = None) -> SpeculativeGeneration:
    """Continue `prompt` as `llmstep.generate(target, ...)` would, with `draft` proposing k tokens a round.

    The tokens follow the target's distribution (after temperature, top-k and top-p) exactly; at
    temperature 0 they are the target's greedy tokens. A seed makes a run reproducible, but the random
    numbers are used differently from plain sampling, so the same seed gives a different sample.
    `adaptive`: choose each round's k (<= k) from the acceptance measured so far, `cost_ratio` (a draft
    forward in target forwards; default: the ratio of the bytes they read) and `verify_costs` (see
    `best_k`; default: verifying k+1 tokens costs one forward). `measure_costs` times both.
    """
    s = speculative_stream(target, draft, tokenizer, prompt, k, max_new_tokens, temperature, top_k, top_p,
                           seed, stop_ids, adaptive, cost_ratio, verify_costs)
    for _ in s:
        pass
    return s.result


# --------------------------------------------------------------------------------------------------
# The fast loop: static caches, compiled draft step and verification
# --------------------------------------------------------------------------------------------------


@dataclass
class FastSpeculativeResult(FastResult, Rounds):
    """A `FastResult` plus the rounds. decode_steps counts the tokens after the first (as plain decoding
    does, one per forward), so decode_tokens_per_second compares directly with FastDecoder's."""


class FastSpeculator:
    """Speculative decoding the way `llmstep.fast.FastDecoder` decodes: static KV caches written at
    explicit positions, fixed shapes, compiled steps (`llmstep.fast.compile_step`).

    Each round the draft first reads two tokens, the one before the pending token and the pending one:
    when the last round accepted all k proposals the first of them is new to the draft's cache, and
    otherwise it rewrites a slot with the token already there. Then every round has the same shapes,
    whatever was accepted. At temperature 0 the whole round (k draft steps, the target's (k+1)-token
    forward, the greedy rule) is one compiled call and one host sync. With sampling the draft steps and
    the verification are separate calls, since each draw comes from the host's generator.

    The rule is `verify` / `verify_greedy`, the same as `speculative_generate`'s, with the random
    numbers drawn in the same order; k is fixed (one compilation per k) and the last round keeps what
    fits the budget.
    """

    def __init__(self, target: Llama, draft: Llama, k: int = 4, max_len: int | None = None,
                 compile: bool | None = None, mode: str | None = None):
        _check_k(k)
        _check_pair(target, draft)
        limit = min(target.config.max_seq_len, draft.config.max_seq_len)
        if max_len is not None and not (isinstance(max_len, int) and k + 2 <= max_len <= limit):
            raise ValueError(f"max_len must be an integer in {k + 2}..{limit} (k + 2 .. both models' context), "
                             f"got {max_len!r}")
        self.target, self.draft, self.k = target, draft, k
        self.max_len = limit if max_len is None else max_len
        self.device = target.device
        self.target_cache = target.new_cache(batch_size=1, max_len=self.max_len)  # [L, 1, n_kv, max_len, hd]
        self.draft_cache = draft.new_cache(batch_size=1, max_len=self.max_len)
        self.compiled = self.device.type == "cuda" if compile is None else bool(compile)
        self.cuda_graphs = self.compiled and uses_cuda_graphs(self.device, mode)
        self._draft_step, self._verify_step, self._greedy_step = self._draft, self._verify, self._greedy_round
        if self.compiled:
            d, t = self.draft_cache.buffers, self.target_cache.buffers
            self._draft_step = compile_step(self._draft, self.device, mode, static=d)
            self._verify_step = compile_step(self._verify, self.device, mode, static=t)
            self._greedy_step = compile_step(self._greedy_round, self.device, mode, static=d + t)
        self._warm: set[str] = set() if self.compiled else {"greedy", "sampling"}  # the round kinds compiled
        self.compile_seconds = 0.0

    def _draft(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [1, T] at positions [1, T] -> the draft's logits after the last one [1, V] (float32)."""
        return self.draft(tokens, positions, self.draft_cache, last_only=True)[:, -1].float()

    def _verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [1, k+1] at positions [1, k+1] -> the target's logits [1, k+1, V] (float32)."""
        return self.target(tokens, positions, self.target_cache).float()

    def _greedy_round(self, pair: torch.Tensor, position: torch.Tensor):
        """pair [1, 2] at positions position-1, position ([1, 1]) -> (drafted [1, k], n [1], next token [1])."""
        x = self._draft(pair, position + torch.arange(-1, 1, device=pair.device)).argmax(-1, keepdim=True)
        proposed = [x]  # [1, 1] each
        for i in range(1, self.k):
            x = self._draft(x, position + i).argmax(-1, keepdim=True)
            proposed.append(x)
        drafted = torch.cat(proposed, dim=1)  # [1, k]
        tokens = torch.cat([pair[:, 1:], drafted], dim=1)  # [1, k+1]: the pending token and the proposals
        n, token = verify_greedy(self._verify(tokens, position + torch.arange(self.k + 1, device=pair.device)),
                                 drafted)
        return drafted, n, token

    @torch.no_grad()
    def warmup(self, greedy: bool = True, steps: int = 3) -> float:
        """Compile the round's steps (on CUDA, record their graphs) before timing anything; returns the seconds."""
        kind = "greedy" if greedy else "sampling"
        if kind in self._warm:
            return 0.0
        synchronize(self.device)
        start = time.perf_counter()

        def ids(n: int) -> torch.Tensor:  # [1, n] of zeros: the shapes and layouts `generate` passes
            return torch.zeros(1, n, dtype=torch.long, device=self.device)

        for _ in range(steps):
            if greedy:
                self._greedy_step(ids(2), ids(1) + 1)
            else:
                self._draft_step(ids(2), torch.arange(2, device=self.device)[None])
                self._draft_step(ids(1), ids(1))
                self._verify_step(ids(self.k + 1), torch.arange(self.k + 1, device=self.device)[None])
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        self._warm.add(kind)
        return seconds

    @torch.no_grad()
    def generate(self, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop_ids: Iterable[int] = ()) -> FastSpeculativeResult:
        """Continue prompt_ids by up to max_new_tokens tokens, distributed as the target's (see `verify`)."""
        check_params(temperature, top_k, top_p)
        check_max_new_tokens(max_new_tokens)
        ids = check_prompt_ids(prompt_ids, self.target.config.vocab_size, self.max_len, room="the cache it may fill")
        greedy = temperature == 0
        self.warmup(greedy)
        k, device, stops = self.k, self.device, stop_id_set(stop_ids)
        result = FastSpeculativeResult(prompt_ids=ids, k=k, stop_reason="length")
        if max_new_tokens == 0:
            return result
        generator = make_generator(device, seed)
        pick = _picker((temperature, top_k, top_p), generator)
        for cache in (self.target_cache, self.draft_cache):
            cache.reset()

        synchronize(device)
        start = time.perf_counter()
        prompt, positions = torch.tensor([ids], device=device), torch.arange(len(ids), device=device)  # [1, T], [T]
        token, _ = pick(self.target(prompt, positions, self.target_cache, last_only=True)[:, -1].float())  # [1]
        self.draft(prompt, positions, self.draft_cache, last_only=True)  # only its cache is wanted
        seq = ids + [int(token)]
        result.prefill_seconds = time.perf_counter() - start

        start = time.perf_counter()
        while len(seq) - len(ids) < max_new_tokens and seq[-1] not in stops:
            L = len(seq)  # the pending token seq[-1] sits at position L - 1, in neither cache yet
            if L + k > self.max_len:  # the target writes L-1 .. L-1+k
                result.stop_reason = "context"
                break
            pair = torch.tensor([seq[-2:]], device=device)  # [1, 2] at positions L-2, L-1
            if greedy:
                drafted, n, token = self._greedy_step(pair, torch.full((1, 1), L - 1, device=device))
            else:
                x, pos, proposed, q = pair, torch.arange(L - 2, L, device=device)[None], [], []
                for i in range(k):
                    t, q_i = pick(self._draft_step(x, pos))
                    x, pos = t.view(1, 1), torch.full((1, 1), L + i, device=device)
                    proposed.append(x)
                    q.append(q_i)
                drafted = torch.cat(proposed, dim=1)  # [1, k]
                logits = self._verify_step(torch.cat([pair[:, 1:], drafted], dim=1),
                                    torch.arange(L - 1, L + k, device=device)[None])  # [1, k+1, V]
                p = probs(logits, temperature, top_k, top_p)
                n, token = verify(p, torch.stack(q, dim=1), drafted, generator)
            n = int(n)  # the one host sync of the round
            # Nothing to roll back: slots past the accepted tokens are rewritten before a query can see them.
            new = (drafted[0, :n].tolist() + [int(token)])[: max_new_tokens - (len(seq) - len(ids))]
            hit = next((i for i, t in enumerate(new) if t in stops), None)
            new = new if hit is None else new[: hit + 1]
            result.record(k, n, len(new))
            seq += new
        synchronize(device)
        result.decode_seconds = time.perf_counter() - start
        result.tokens = seq[len(ids):]
        result.decode_steps = len(result.tokens) - 1
        if result.tokens[-1] in stops:
            result.stop_reason = "stop"
        return result

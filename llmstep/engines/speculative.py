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

Here: the acceptance rule (pure, batched), the theory, the teaching loop. The drafts are in drafts.py, the
compiled loop (`FastSpeculator`) in fast.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..core.checks import check_flag, is_finite_number
from ..core.cost import step_bytes
from ..core.device import synchronize
from ..core.kv_cache import KVCache
from ..core.model import LAST, Llama
from ..core.sampling import draw, first_max, picker, probs
from ..core.tokens import Tokenizer
from . import decoding
from .generate import Generation, Stream, TokenEvent, emit
from .request import Checked, Request, as_request, check_request

__all__ = ["verify", "verify_greedy", "expected_tokens_per_forward", "expected_speedup", "best_k", "check_costs_args",
           "measure_costs", "step_bytes", "draft_cost_ratio", "SpeculativeGeneration", "speculative_stream",
           "speculative_generate", "Rounds", "check_k", "check_costs", "check_pair"]


# ---- The acceptance rule -----------------------------------------------------------------------------------


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
    u = torch.rand(B, k, generator=generator, device=p.device, dtype=torch.float32)  # whatever the default dtype
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
    best = first_max(target_logits)  # [B, k+1]: what plain greedy decoding would emit at each position
    n = (best[:, :-1] == proposed).long().cumprod(dim=-1).sum(dim=-1)  # [B]
    return n, best.gather(1, n[:, None])[:, 0]


# ---- The theory (Leviathan et al. 2023, section 3) ---------------------------------------------------------


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


def check_costs_args(target: Llama, draft: Llama, k_max, context, repeats=1, k_name: str = "k_max") -> None:
    """`measure_costs`'s settings, each refused by name before any forward: k_max + 1 tokens after `context`
    must fit the target's context, one token after it the draft's. k_name: what k_max is called by the caller."""
    decoding.check_int(k_max, k_name, low=0)
    decoding.check_int(context, "context", low=1)
    decoding.check_int(repeats, "repeats", low=1)
    for name, model in (("target", target), ("draft", draft)):
        if context + 1 > model.config.max_seq_len:
            raise ValueError(f"context {context}: timing a token after it needs {context + 1} positions, the "
                             f"{name}'s context has {model.config.max_seq_len}")
    need = context + k_max + 1  # a round's k_max + 1 target tokens after `context` cached
    if need > target.config.max_seq_len:
        raise ValueError(f"{k_name} {k_max}: timing a round of k + 1 = {k_max + 1} target tokens after {context} "
                         f"cached needs {need} positions, the target's context has {target.config.max_seq_len}; "
                         f"choose {k_name} at most {target.config.max_seq_len - context - 1}")


@torch.inference_mode()
def measure_costs(target: Llama, draft: Llama, k_max: int = 8, context: int = 64,
                  repeats: int = 10) -> tuple[float, list[float]]:
    """Time the forwards a round is made of: (a draft forward in target forwards, [the target's
    (k+1)-token forward in one-token forwards, for k = 0..k_max]). Each time is the fastest of `repeats`
    runs: other work on the machine only ever adds time."""
    check_costs_args(target, draft, k_max, context, repeats)

    def seconds(model: Llama, n_tokens: int, keep: slice | None) -> float:
        cache = model.new_cache(max_len=context + n_tokens)
        model(torch.zeros(1, context, dtype=torch.long, device=model.device), cache=cache)
        x = torch.ones(1, n_tokens, dtype=torch.long, device=model.device)
        times = []
        for _ in range(repeats + 2):  # two to warm up
            cache.rollback(context)
            synchronize(model.device)
            start = time.perf_counter()
            model(x, cache=cache, keep=keep)
            synchronize(model.device)
            times.append(time.perf_counter() - start)
        return min(times[2:])

    one = seconds(target, 1, keep=None)
    return seconds(draft, 1, keep=LAST) / one, [seconds(target, k + 1, None) / one for k in range(k_max + 1)]


def draft_cost_ratio(target: Llama, draft: Llama) -> float:
    """Bytes a draft forward reads over bytes a target forward reads."""
    return step_bytes(draft) / step_bytes(target)


# ---- The teaching loop -------------------------------------------------------------------------------------


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
        line = f"\nspeculative: k={self.k}, {self.rounds} target forwards, {self.draft_forwards} draft forwards, "
        if not self.examined:  # too few tokens for a round with a draft token (the last round may have none)
            return super().summary() + line + "no draft token examined: no acceptance measured"
        return (super().summary() + line + f"acceptance {self.acceptance_rate:.1%} "
                f"(expected {self.expected_acceptance_rate:.1%}), {self.tokens_per_target_forward:.2f} tokens "
                f"per target forward (theory {self.theory_tokens_per_forward:.2f})")


def check_k(k) -> None:
    decoding.check_int(k, "k (draft tokens per round)", low=1)


def check_costs(cost_ratio, verify_costs) -> None:
    """cost_ratio None or a finite number >= 0; verify_costs None or a non-empty list of finite numbers > 0
    (see best_k); numpy's numbers count, bools do not."""
    if cost_ratio is not None and not (is_finite_number(cost_ratio) and cost_ratio >= 0):
        raise ValueError(f"cost_ratio must be a finite number >= 0, got {cost_ratio!r}")
    if verify_costs is not None and not (isinstance(verify_costs, list | tuple) and verify_costs and all(
            is_finite_number(v) and v > 0 for v in verify_costs)):
        raise ValueError(f"verify_costs must be a non-empty list of finite numbers > 0, got {verify_costs!r}")


def check_pair(target: Llama, draft: Llama) -> None:
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
        raise ValueError(f"the draft must be a llmstep Llama (or a LayerSkipDraft), got {type(draft).__name__}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                         f"({target.config.vocab_size}): both must score the same token ids")
    if draft.device != target.device:
        raise ValueError(f"the draft is on {draft.device} and the target on {target.device}: put both on one device")


def speculative_stream(target: Llama, draft: Llama, tokenizer: Tokenizer, prompt: str | list | torch.Tensor | Request,
                       k: int = 4, max_new_tokens: int | None = None, temperature: float | None = None,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None, stop_ids=None,
                       adaptive: bool = False, cost_ratio: float | None = None,
                       verify_costs: Sequence[float] | None = None) -> Stream:
    """Start speculative generation; see `speculative_generate`. Errors in the arguments are raised here."""
    request = as_request(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, stop_ids=stop_ids)
    r = check_request(request, target, tokenizer=tokenizer)
    check_k(k)
    check_flag(adaptive, "adaptive")
    check_pair(target, draft)
    check_costs(cost_ratio, verify_costs)
    result = SpeculativeGeneration(prompt_ids=r.ids, k=k)
    policy = (draft_cost_ratio(target, draft) if cost_ratio is None else cost_ratio, verify_costs) if adaptive else None
    return Stream(_run(target, draft, tokenizer, r, k, result, policy), result)


@torch.inference_mode()
def _run(target, draft, tokenizer, r: Checked, k_max, result, policy) -> Iterator[TokenEvent]:
    device, ids, sampling, stops = target.device, r.ids, r.sampling, r.stops
    n_ctx = decoding.cache_len(len(ids), r.max_new_tokens, target.config.max_seq_len)  # target cache slots
    n_ctx_draft = min(draft.config.max_seq_len, n_ctx)  # a draft with a shorter context stops proposing
    plan = decoding.budget(len(ids), r.max_new_tokens, n_ctx)
    target_cache = target.new_cache(batch_size=1, max_len=n_ctx)
    draft_cache: KVCache = draft.new_cache(batch_size=1, max_len=n_ctx_draft)
    target_bytes = decoding.step_bytes_by_context(target)  # bytes(context) of a step; weights counted once
    draft_bytes = decoding.step_bytes_by_context(draft)
    generator = r.generator(device)
    detok = tokenizer.stream(skip_special_tokens=True)
    seq = list(ids)  # every token so far; the last one is not yet in either cache
    result.stop_reason = "interrupted" if plan.tokens else plan.stop_reason  # until the last token is made

    if plan.tokens == 0:
        return
    # Prefill both models on the prompt; the target's last logits give the first token.
    synchronize(device)
    start = time.perf_counter()
    greedy = sampling[0] == 0  # temperature 0: argmax comparisons, no distributions needed

    pick = picker(sampling, generator)
    x = torch.tensor([seq], device=device)  # [1, T]
    logits = target(x, cache=target_cache, keep=LAST)[:, -1].float()  # [1, V]
    decoding.check_finite(logits, 0)
    token, _ = pick(logits)  # [1]
    if len(seq) <= n_ctx_draft:
        draft(x, cache=draft_cache, keep=LAST)  # only its cache is wanted
    seq.append(int(token))
    result.prefill_seconds = time.perf_counter() - start
    yield emit(result, detok, seq[-1], result.prefill_seconds, stops, plan)

    target_len, draft_len = len(seq) - 1, int(draft_cache.lengths[0])  # positions held by each cache
    k = k_max
    while decoding.end_reason(result.tokens, stops, plan) is None:
        L = len(seq)  # the pending token sits at position L - 1
        if policy is not None:  # adaptive: the best k for the acceptance seen so far (Laplace estimate)
            cost_ratio, verify_costs = policy
            usable = max(1, min(k_max, plan.tokens - len(result.tokens) - 1))  # no round proposes past the budget
            k = best_k((sum(result.accepted) + 1) / (result.examined + 2), cost_ratio, usable, verify_costs)
        # A round adds one token of its own after its accepted proposals, so it proposes at most one less than
        # the budget has left (which also keeps the target's writes, L-1 .. L-1+k, inside its cache); the draft,
        # proposing from the L tokens so far, writes L-1 .. L+k-2, inside its own cache.
        k = max(0, min(k, plan.tokens - len(result.tokens) - 1, decoding.budget(L, k, n_ctx_draft).tokens))

        synchronize(device)
        start = time.perf_counter()
        # 1. The draft proposes k tokens, one forward each. Its first input is every token it has not
        #    seen: the pending one, and after a round with all k accepted also the last proposal.
        proposed, q = [], []
        x = torch.tensor([seq[draft_len:L]], device=device) if k else None
        for i in range(k):
            draft_logits = draft(x, cache=draft_cache, keep=LAST)[:, -1].float()  # [1, V], as every engine's
            decoding.check_finite(draft_logits, len(result.tokens) + i, "the draft")
            token, q_i = pick(draft_logits)  # [1], [1, V]
            x = token[:, None]  # [1, 1]
            proposed.append(x)
            q.append(q_i)
        if k:
            draft_len = L + k - 1  # it has seen everything but its own last proposal
        synchronize(device)
        draft_seconds = time.perf_counter() - start

        # 2. The target scores the pending token and all k proposals in one forward: k+1 distributions.
        x = torch.cat([torch.tensor([seq[target_len:L]], device=device), *proposed], dim=1)  # [1, L-target_len+k]
        logits = target(x, cache=target_cache)[:, -(k + 1):].float()  # [1, k+1, V] float32, as every engine's
        decoding.check_finite(logits, len(result.tokens), "the target")  # the step of the round's first token
        if not k:
            n, new, overlap = 0, [int(pick(logits[:, 0])[0])], []
        else:
            drafted = torch.cat(proposed, dim=1)  # [1, k]
            if greedy:
                n, token = verify_greedy(logits, drafted)
            else:
                p, q = probs(logits, *sampling), torch.stack(q, dim=1)  # [1, k+1, V], [1, k, V]
                n, token = verify(p, q, drafted, generator)
            n = int(n)
            new = drafted[0, :n].tolist() + [int(token)]
            overlap = ([1.0] * n + [0.0] * (n < k) if greedy  # one-hot p and q overlap fully or not at all
                       else torch.minimum(p[0, :k], q[0]).sum(-1)[: min(n + 1, k)].tolist())  # the examined ones
        # 3. Roll both caches back to the accepted prefix: what lies beyond their lengths is never read.
        target_len = L + n
        target_cache.rollback(target_len)
        draft_len = min(draft_len, L + n)
        draft_cache.rollback(draft_len)
        synchronize(device)
        seconds = time.perf_counter() - start

        new, _ = decoding.cut_at_stop(new, stops)  # the budget was already respected by the choice of k
        result.record(k, n, len(new))
        result.overlap += overlap
        result.draft_seconds += draft_seconds
        result.target_seconds += seconds - draft_seconds
        result.decode_bytes += decoding.round_bytes(target_bytes, draft_bytes, L, k)
        for t in new:
            seq.append(t)
            yield emit(result, detok, t, seconds / len(new), stops, plan)


def speculative_generate(target: Llama, draft: Llama, tokenizer: Tokenizer,
                         prompt: str | list | torch.Tensor | Request, k: int = 4, max_new_tokens: int | None = None,
                         temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                         seed: int | None = None, stop_ids=None, adaptive: bool = False,
                         cost_ratio: float | None = None,
                         verify_costs: Sequence[float] | None = None) -> SpeculativeGeneration:
    """Serve a `Request` (or continue `prompt`, the request's fields as keywords) as `llmstep.generate(target, ...)`
    would, with `draft` proposing k tokens a round.

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

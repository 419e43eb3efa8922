"""Speculative decoding keeps the target's distribution: token for token at temperature 0, and in law
(a chi-square test against the exact distribution) with temperature, top-k and top-p."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from llmstep.fast import FastSpeculator
from llmstep.sampling import draw, probs

import llmstep
import llmstep.engines.drafts as drafts_mod
import llmstep.engines.speculative as spec
from llmstep import Llama, LlamaConfig, Tokenizer
from llmstep.cli import main as llmstep_main
from llmstep.engines.drafts import LayerSkipDraft
from llmstep.engines.speculative import speculative_generate, speculative_stream, verify
from llmstep.lab.probe import no_recompiles

GREEDY = dict(temperature=0, stop_ids=())  # greedy, never stopping early: what these runs ask for

PROMPT = [5, 17, 101, 42, 7]  # token ids, so no BOS or tokenizer detail gets in the way


def random_model(seed: int, vocab_size: int = 300, logit_scale: float = 1.0, **shape) -> Llama:
    """A random Llama; logit_scale sharpens its distributions (the default init gives nearly flat ones)."""
    torch.manual_seed(seed)
    kw = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=128) | shape
    model = Llama(LlamaConfig(vocab_size=vocab_size, rope_theta=500000.0, **kw)).eval()
    with torch.no_grad():
        model.output.weight.mul_(logit_scale)
    return model


def noisy_copy(model: Llama, noise: float, seed: int) -> Llama:
    """The model with Gaussian noise on every weight: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return draft


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second thread only adds synchronisation (and fights other jobs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok(tokenizer_file) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_file)


@pytest.fixture(scope="module")
def target() -> Llama:
    return random_model(0, logit_scale=4.0)


@pytest.fixture(scope="module")
def drafts(target) -> dict[str, Llama]:
    return {
        "noisy-copy": noisy_copy(target, 0.5, seed=1),  # accepts some, rejects some
        "independent": random_model(2, logit_scale=4.0),  # almost never agrees
        "layer-skip": LayerSkipDraft(target, 2),  # the target's first 2 of 4 layers
    }


def plain_greedy(target, tok, max_new_tokens, **kw):
    return llmstep.generate(target, tok, PROMPT, max_new_tokens=max_new_tokens, temperature=0, **kw)


# --------------------------------------------------------------------------------------------------
# Temperature 0: the output is plain greedy decoding's, token for token
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("draft_name", ["noisy-copy", "independent", "layer-skip"])
def test_greedy_speculative_equals_plain_greedy(target, drafts, tok, k, draft_name):
    ref = plain_greedy(target, tok, 40, stop_ids=[])
    out = speculative_generate(target, drafts[draft_name], tok, PROMPT, k=k, max_new_tokens=40, temperature=0,
                               stop_ids=[])
    assert out.tokens == ref.tokens
    assert out.text == ref.text
    assert out.stop_reason == ref.stop_reason == "length"
    assert len(out.tokens) == 1 + sum(out.produced) == 40
    assert len(out.step_seconds) == 39  # one per token after the first, as for plain decoding
    assert all(a <= p for a, p in zip(out.accepted, out.proposed, strict=True))


def test_the_drafts_exercise_both_rejection_and_full_acceptance(target, drafts, tok):
    kw = dict(k=4, max_new_tokens=40, temperature=0, stop_ids=[])
    noisy = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, **kw)
    assert 0.2 < noisy.acceptance_rate < 0.95
    assert 0 in noisy.accepted and 4 in noisy.accepted  # rejected at once, and all accepted (a bonus token)
    independent = speculative_generate(target, drafts["independent"], tok, PROMPT, **kw)
    assert independent.acceptance_rate < 0.2


@pytest.mark.parametrize("max_new_tokens, measured", [(1, False), (2, False), (12, True)])
def test_the_summary_says_so_when_no_draft_token_was_examined(target, drafts, tok, max_new_tokens, measured):
    """One or two new tokens leave no round with a draft token: no acceptance to print (it printed nan%)."""
    out = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, k=4, max_new_tokens=max_new_tokens,
                               temperature=0, stop_ids=[])
    text = out.summary().splitlines()[-1]
    assert "nan" not in text and bool(re.search(r"acceptance \d", text)) == measured
    assert ("no acceptance measured" in text) != measured


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 9, 10])
def test_k_larger_than_the_budget_stops_exactly_at_max_new_tokens(target, drafts, tok, max_new_tokens):
    ref = plain_greedy(target, tok, max_new_tokens, stop_ids=[])
    out = speculative_generate(target, drafts["layer-skip"], tok, PROMPT, k=50, max_new_tokens=max_new_tokens,
                               temperature=0, stop_ids=[])
    assert out.tokens == ref.tokens and len(out.tokens) == max_new_tokens
    assert out.stop_reason == "length"
    if max_new_tokens > 1:  # never proposes more than the remaining budget can use
        assert out.proposed[0] == max_new_tokens - 2


def test_max_new_tokens_zero_gives_nothing(target, drafts, tok):
    out = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, max_new_tokens=0, temperature=0)
    assert out.tokens == [] and out.rounds == 0


@pytest.mark.parametrize("stop_index", [1, 5, 6])
def test_a_stop_token_inside_an_accepted_draft_ends_the_output_there(target, drafts, tok, stop_index):
    ref = plain_greedy(target, tok, 30, stop_ids=[])
    stop = ref.tokens[stop_index]
    first = ref.tokens.index(stop)  # the stop token's first appearance ends plain decoding
    plain = plain_greedy(target, tok, 30, stop_ids=[stop])
    assert plain.tokens == ref.tokens[: first + 1] and plain.stop_reason == "stop"
    # A perfect draft (the target itself) is always accepted: the stop token falls inside a round.
    for draft in (target, drafts["layer-skip"], drafts["noisy-copy"]):
        out = speculative_generate(target, draft, tok, PROMPT, k=8, max_new_tokens=30, temperature=0,
                                   stop_ids=[stop])
        assert out.tokens == plain.tokens and out.text == plain.text and out.stop_reason == "stop"
        if draft is target and first > 0:
            assert out.accepted == [8] * len(out.accepted) and out.produced[-1] < 9


def test_context_limits_of_target_and_draft(tok):
    target = random_model(3, logit_scale=4.0, max_seq_len=24)
    draft = noisy_copy(target, 0.2, seed=4)
    draft.config = draft.config.replace(max_seq_len=16)  # a draft with a shorter context than the target's
    ref = plain_greedy(target, tok, 50, stop_ids=[])
    out = speculative_generate(target, draft, tok, PROMPT, k=4, max_new_tokens=50, temperature=0, stop_ids=[])
    assert ref.stop_reason == "context"
    assert out.tokens == ref.tokens and out.stop_reason == "context"
    assert out.proposed[-1] == 0  # past the draft's context the target decodes on its own


def test_stream_yields_the_tokens_of_the_result(target, drafts, tok):
    s = speculative_stream(target, drafts["noisy-copy"], tok, PROMPT, k=3, max_new_tokens=20, temperature=0.8,
                           seed=3, stop_ids=[])
    events = list(s)
    assert [e.id for e in events] == s.result.tokens
    assert [e.index for e in events] == list(range(20))
    assert "".join(e.text for e in events) == s.result.text
    assert s.result.decode_tokens_per_second > 0 and s.result.tokens_per_target_forward >= 1


def test_seeded_runs_reproduce(target, drafts, tok):
    kw = dict(k=3, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7, stop_ids=[])
    a = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, **kw)
    b = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, **kw)
    assert a.tokens == b.tokens


def test_adaptive_k_keeps_the_greedy_output(target, drafts, tok):
    ref = plain_greedy(target, tok, 40, stop_ids=[])
    out = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, k=8, max_new_tokens=40, temperature=0,
                               stop_ids=[], adaptive=True, cost_ratio=0.05)
    assert out.tokens == ref.tokens
    assert len(set(out.proposed[:-3])) > 1  # k moved with the acceptance measured


def test_adaptive_k_far_past_the_context_chooses_among_the_ks_a_round_can_use(target, drafts, tok, monkeypatch):
    """k is any positive integer; adaptive k searches 1..k each round, so a k of ten million (a flag typed wrong)
    searched ten million a round: the search stops at what the round can use (the tokens left), the output the
    same."""
    searched, best = [], spec.best_k
    monkeypatch.setattr(spec, "best_k", lambda a, c, k_max, v=None: searched.append(k_max) or best(a, c, k_max, v))
    ref = plain_greedy(target, tok, 12, stop_ids=[])
    out = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, k=10_000_000, max_new_tokens=12,
                               temperature=0, stop_ids=[], adaptive=True, cost_ratio=0.0)
    assert out.tokens == ref.tokens
    assert searched and max(searched) <= 12 - 2  # the first round: 12 tokens, one made by the prefill, one its own


def test_theory_of_tokens_per_forward_and_the_best_k():
    assert spec.expected_tokens_per_forward(0.0, 4) == 1  # every proposal rejected: one token per forward
    assert spec.expected_tokens_per_forward(1.0, 4) == 5  # all accepted: k + 1
    assert spec.expected_tokens_per_forward(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert spec.best_k(0.9, cost_ratio=0.01, k_max=8) == 8  # a free, good draft: propose as many as allowed
    assert spec.best_k(0.3, cost_ratio=0.5, k_max=8) == 1
    # When verifying more tokens costs more (a CPU past its sweet spot), the best k shrinks.
    assert spec.best_k(0.8, 0.1, 8, verify_costs=[1, 1, 1, 2, 2, 2, 3, 3, 3]) < spec.best_k(0.8, 0.1, 8)


def test_measure_costs_times_the_forwards_of_a_round(target, drafts):
    cost_ratio, verify_costs = spec.measure_costs(target, drafts["layer-skip"], k_max=3, repeats=3)
    assert cost_ratio > 0 and len(verify_costs) == 4 and all(v > 0 for v in verify_costs)


def test_measure_costs_refuses_what_it_cannot_time_by_name_before_any_forward(target, drafts, monkeypatch):
    draft = drafts["noisy-copy"]  # both contexts: 128 positions
    monkeypatch.setattr(spec, "synchronize", lambda device: pytest.fail("a forward was timed"))
    with pytest.raises(ValueError, match=r"k_max 64: .* needs 129 positions, the target's context has 128; "
                                         r"choose k_max at most 63"):
        spec.measure_costs(target, draft, k_max=64, context=64)
    with pytest.raises(ValueError, match="repeats must be"):
        spec.measure_costs(target, draft, k_max=3, repeats=0)
    with pytest.raises(ValueError, match="context 128: timing a token after it needs 129 positions, the target's"):
        spec.measure_costs(target, draft, k_max=3, context=128)
    with pytest.raises(ValueError, match="context must be"):
        spec.measure_costs(target, draft, k_max=3, context=0)


def test_a_layer_skip_draft_takes_a_numpy_integer_as_every_count_does(target):
    import numpy as np

    draft = LayerSkipDraft(target, np.int64(2))
    assert draft.config.n_layers == 2 and type(draft.config.n_layers) is int


def test_layer_skip_draft_shares_the_targets_weights(target):
    draft = LayerSkipDraft(target, 2)
    assert draft.config.n_layers == 2 and len(draft.new_cache().k) == 2
    assert draft.layers[1] is target.layers[1] and draft.output.weight is target.output.weight
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        full, short = target(tokens), draft(tokens)
    assert short.shape == full.shape and not torch.allclose(short, full)


def test_bad_arguments_are_named(target, drafts, tok):
    draft = drafts["noisy-copy"]
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, random_model(0, vocab_size=299), tok, PROMPT)
    for k in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="k"):
            speculative_generate(target, draft, tok, PROMPT, k=k)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, draft, tok, PROMPT, temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, draft, tok, PROMPT, max_new_tokens=-1)
    with pytest.raises(ValueError, match="draft must be"):
        speculative_generate(target, "draft", tok, PROMPT)
    for adaptive in ("no", 0, 1.0):  # "no" turned adaptive k on
        with pytest.raises(ValueError, match="adaptive must be True, False or None"):
            speculative_generate(target, draft, tok, PROMPT, adaptive=adaptive)
    with pytest.raises(ValueError, match="layers"):
        LayerSkipDraft(target, 0)
    with pytest.raises(ValueError, match="layers"):
        LayerSkipDraft(target, 5)


# --------------------------------------------------------------------------------------------------
# With sampling: the output is distributed as the target's filtered distribution
# --------------------------------------------------------------------------------------------------

P_VALUE_FLOOR = 1e-6  # a correct implementation fails one check with probability 1e-6 (8 checks per case)


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities (cells with expected count < 5 pooled).

    A count in a cell of probability 0 is impossible under the hypothesis: p-value 0.
    """
    observed, expected_probs = observed.flatten().double(), expected_probs.flatten().double()
    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))  # chi2 sf


def test_chi_square_helper_accepts_a_fair_sample_and_rejects_a_biased_one():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    fair = torch.bincount(torch.multinomial(p, 5000, replacement=True, generator=g), minlength=4)
    assert chi_square_p_value(fair, p) > 1e-3
    biased_p = torch.tensor([0.45, 0.35, 0.2, 0.0])
    biased = torch.bincount(torch.multinomial(biased_p, 5000, replacement=True, generator=g), minlength=4)
    assert chi_square_p_value(biased, p) < 1e-6
    assert chi_square_p_value(torch.tensor([10, 0, 0, 1]), p) == 0.0


def test_the_acceptance_rule_alone_emits_exactly_p():
    """200,000 independent trials in one batched call, a law of its own at each position (p and q alike): the
    token emitted at position i ~ p_i, the proposal, the residual and the bonus each read at its own position."""
    g = torch.Generator().manual_seed(0)
    B, k, V = 200_000, 2, 6
    p = probs(torch.randn(k + 1, V, generator=g) * 2, 1.0).expand(B, k + 1, V)  # [B, k + 1, V]
    q = probs(torch.randn(k, V, generator=g) * 2, 1.0).expand(B, k, V)  # [B, k, V]
    proposed = draw(q.reshape(B * k, V), g).reshape(B, k)
    n, nxt = verify(p, q, proposed, g)
    first = torch.where(n > 0, proposed[:, 0], nxt)
    assert chi_square_p_value(torch.bincount(first, minlength=V), p[0, 0]) > P_VALUE_FLOOR
    assert chi_square_p_value(torch.bincount(first, minlength=V), p[0, 1]) < 1e-6  # the laws differ: a mix-up shows
    # The second emitted token: proposal 2 if both accepted, else the residual at position 2.
    second = torch.where(n > 1, proposed[:, 1], nxt)[n >= 1]
    assert chi_square_p_value(torch.bincount(second, minlength=V), p[0, 1]) > P_VALUE_FLOOR
    # The third: the bonus draw from p_3 when both proposals were accepted.
    assert chi_square_p_value(torch.bincount(nxt[n == k], minlength=V), p[0, 2]) > P_VALUE_FLOOR
    # Rejections and acceptances both happen, often: every branch above was drawn thousands of times.
    assert 0.05 < (n == 0).double().mean() < 0.95 and (n == k).sum() > 1000


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64])
def test_the_acceptance_draw_is_the_same_whatever_the_default_dtype(default):
    """u ~ U(0, 1) in float32: a bf16 u sits on a grid of 1/256 (acceptance then not min(1, p/q)), a float64 one
    draws other numbers from the same seed."""
    g = torch.Generator().manual_seed(0)
    B, k, V = 2000, 3, 6
    p = probs(torch.randn(B, k + 1, V, generator=g), 1.0)
    q = probs(torch.randn(B, k, V, generator=g), 1.0)
    proposed = draw(q.reshape(B * k, V), g).reshape(B, k)
    expected = verify(p, q, proposed, torch.Generator().manual_seed(1))
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = verify(p, q, proposed, torch.Generator().manual_seed(1))
    finally:
        torch.set_default_dtype(old)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_at_temperature_0_the_general_rule_is_the_greedy_rule():
    """One-hot p and q: accepted with probability 1 or 0, and the residual is the target's argmax."""
    g = torch.Generator().manual_seed(1)
    B, k, V = 500, 4, 5  # a small vocabulary, so draft and target often agree
    target_logits, draft_logits = torch.randn(B, k + 1, V, generator=g), torch.randn(B, k, V, generator=g)
    proposed = draft_logits.argmax(-1)
    n, nxt = verify(probs(target_logits, 0.0), probs(draft_logits, 0.0), proposed, g)
    n_greedy, nxt_greedy = spec.verify_greedy(target_logits, proposed)
    assert torch.equal(n, n_greedy) and torch.equal(nxt, nxt_greedy)
    assert set(n.tolist()) == set(range(k + 1))


SMALL_VOCAB = 16
N_RUNS = 1000  # seeded speculative runs per case; each emits 4 tokens (the broken rule fails at ~300)
N_NEW = 4
SMALL_PROMPT = [3, 1, 4]


@pytest.fixture(scope="module")
def small_pair():
    """A target and a deliberately different draft over 16 tokens (a different random model)."""
    shape = dict(vocab_size=SMALL_VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=16)
    return random_model(10, logit_scale=3.0, **shape), random_model(11, logit_scale=3.0, **shape)


def exact_joint(target: Llama, prompt: list[int], n: int, sampling) -> torch.Tensor:
    """P(t_0..t_{n-1}) under the target's filtered distribution: a [V]*n tensor, from one batched forward."""
    V = target.config.vocab_size
    grid = torch.cartesian_prod(*[torch.arange(V)] * (n - 1)).reshape(-1, n - 1)  # every continuation
    tokens = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)  # [V^(n-1), P + n-1]
    with torch.no_grad():
        p = probs(target(tokens)[:, len(prompt) - 1:], *sampling)  # [V^(n-1), n, V]: p(t_i | t_<i)
    joint = torch.ones(V ** (n - 1), dtype=torch.float64)
    for i in range(n - 1):
        joint = joint * p[:, i].double().gather(1, grid[:, i:i + 1])[:, 0]  # the prefix's own probability
    return (joint[:, None] * p[:, n - 1].double()).reshape([V] * n)


def sample_speculative(target, draft, tok, sampling, k: int, n_runs: int = N_RUNS,
                       fast: bool = False) -> tuple[torch.Tensor, list]:
    temperature, top_k, top_p = sampling
    out, runs = [], []
    speculator = FastSpeculator(target, draft, k=k, compile=False) if fast else None
    for seed in range(n_runs):
        kw = dict(max_new_tokens=N_NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_ids=[])
        if fast:
            g = speculator.generate(SMALL_PROMPT, **kw)
        else:
            g = speculative_generate(target, draft, tok, SMALL_PROMPT, k=k, **kw)
        out.append(g.tokens)
        runs.append(g)
    return torch.tensor(out), runs


def p_values(samples: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """Per-position marginals and the joints of neighbouring pairs, each against the exact law."""
    V, n = joint.shape[0], joint.dim()
    result = {}
    for i in range(n):
        marginal = joint.sum(dim=[d for d in range(n) if d != i])
        result[f"t{i}"] = chi_square_p_value(torch.bincount(samples[:, i], minlength=V), marginal)
    for i in range(1, n - 1):
        pair = joint.sum(dim=[d for d in range(n) if d not in (i, i + 1)])  # [V, V]
        counts = torch.bincount(samples[:, i] * V + samples[:, i + 1], minlength=V * V)
        result[f"t{i},t{i + 1}"] = chi_square_p_value(counts, pair)
    return result


SAMPLING_CASES = {"temperature-1": (1.0, 0, 1.0), "temperature-0.8-top_k-10-top_p-0.9": (0.8, 10, 0.9)}


@pytest.mark.parametrize("fast", [False, True], ids=["speculative_generate", "FastSpeculator"])
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_speculative_samples_follow_the_targets_filtered_distribution(small_pair, tok, case, fast):
    target, draft = small_pair
    sampling = SAMPLING_CASES[case]
    joint = exact_joint(target, SMALL_PROMPT, N_NEW, sampling)
    assert torch.isclose(joint.sum(), torch.tensor(1.0, dtype=torch.float64))
    samples, runs = sample_speculative(target, draft, tok, sampling, k=2, fast=fast)
    accepted = [a for g in runs for a in g.accepted]
    assert 0.1 < sum(runs[i].acceptance_rate for i in range(100)) / 100 < 0.9  # rejections are frequent
    assert 2 in accepted  # and so are bonus tokens
    pv = p_values(samples, joint)
    assert min(pv.values()) > P_VALUE_FLOOR, pv


def always_accept(p, q, proposed, generator=None):
    """The broken rule: take every draft token, then a bonus token from the target."""
    B, k = proposed.shape
    return torch.full((B,), k), draw(p[:, k], generator)


@pytest.mark.parametrize("fast", [False, True], ids=["speculative_generate", "FastSpeculator"])
def test_the_same_check_catches_a_rule_that_accepts_without_the_ratio(small_pair, tok, monkeypatch, fast):
    target, draft = small_pair
    sampling = SAMPLING_CASES["temperature-0.8-top_k-10-top_p-0.9"]
    joint = exact_joint(target, SMALL_PROMPT, N_NEW, sampling)
    monkeypatch.setattr(spec, "verify", always_accept)
    samples, runs = sample_speculative(target, draft, tok, sampling, k=2, n_runs=N_RUNS, fast=fast)
    assert all(g.acceptance_rate == 1 for g in runs)
    pv = p_values(samples, joint)
    assert pv["t0"] > P_VALUE_FLOOR  # the first token comes from the target's prefill either way
    assert min(pv.values()) < P_VALUE_FLOOR, pv


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def test_cli_generate_with_a_draft_prints_the_plain_greedy_text(tiny_checkpoint, capsys):
    from llmstep.cli import main

    common = ["generate", "--model", str(tiny_checkpoint), "--prompt", "Shall I compare", "--temperature", "0",
              "--max-new-tokens", "24", "--device", "cpu"]
    main(common)
    plain = capsys.readouterr()
    main(common + ["--draft", "self-1", "--speculate-k", "3"])
    speculative = capsys.readouterr()
    assert speculative.out == plain.out
    assert "tokens per target forward" in speculative.err
    main(common + ["--draft", str(tiny_checkpoint), "--adaptive-k"])  # the model as its own (perfect) draft
    assert capsys.readouterr().out == plain.out
    with pytest.raises(SystemExit, match="self-N"):
        main(common + ["--draft", "self-x"])
    with pytest.raises(SystemExit, match="k"):
        main(common + ["--draft", "self-1", "--speculate-k", "0"])


def test_quantized_self_draft_keeps_the_greedy_output(target, tok):
    draft = drafts_mod.resolve_draft("self-int8", target)
    assert draft.output is not target.output  # a quantized twin; the target itself is left as it was
    ref = plain_greedy(target, tok, 30, stop_ids=[])
    out = speculative_generate(target, draft, tok, PROMPT, k=4, max_new_tokens=30, temperature=0, stop_ids=[])
    assert out.tokens == ref.tokens
    assert out.acceptance_rate > 0.8  # int8 weights barely move the argmax
    assert spec.draft_cost_ratio(target, draft) < 0.5  # and read about a quarter of the float32 bytes


# --------------------------------------------------------------------------------------------------
# The fast loop: static caches, fixed k, compiled steps
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("draft_name", ["noisy-copy", "independent", "layer-skip"])
def test_fast_speculator_greedy_equals_plain_greedy(target, drafts, tok, k, draft_name):
    ref = plain_greedy(target, tok, 40, stop_ids=[])
    out = FastSpeculator(target, drafts[draft_name], k=k, compile=False).generate(PROMPT, 40, **GREEDY)
    assert out.tokens == ref.tokens and out.stop_reason == "length"
    assert len(out.tokens) == 1 + sum(out.produced) == 40 and out.decode_steps == 39
    assert all(0 <= a <= p == k for a, p in zip(out.accepted, out.proposed, strict=True))


def test_fast_speculator_reuses_its_caches_and_rolls_over_full_acceptance(target, drafts, tok):
    speculator = FastSpeculator(target, target, k=3, compile=False)  # a perfect draft: every round accepts all
    ref = plain_greedy(target, tok, 30, stop_ids=[])
    for _ in range(2):  # a second run on the same caches gives the same tokens
        out = speculator.generate(PROMPT, 30, **GREEDY)
        assert out.tokens == ref.tokens and set(out.accepted) == {3}
    noisy = FastSpeculator(target, drafts["noisy-copy"], k=4, compile=False).generate(PROMPT, 40, **GREEDY)
    assert 0 in noisy.accepted and 4 in noisy.accepted  # rejections and full acceptances both happened


@pytest.mark.parametrize("k", [2, 3])
def test_fast_speculator_draws_what_speculative_generate_draws(target, drafts, tok, k):
    """Same seed, same k: the same random numbers in the same order, so the same tokens, up to the last
    round (where speculative_generate lowers k to fit the budget)."""
    kw = dict(max_new_tokens=40, temperature=0.9, top_k=40, top_p=0.95, seed=5, stop_ids=[])
    eager = speculative_generate(target, drafts["noisy-copy"], tok, PROMPT, k=k, **kw)
    fast = FastSpeculator(target, drafts["noisy-copy"], k=k, compile=False).generate(PROMPT, **kw)
    assert len(fast.tokens) == 40
    assert fast.tokens[: 40 - k - 1] == eager.tokens[: 40 - k - 1]
    assert fast.accepted[: len(eager.accepted) - 2] == eager.accepted[: len(eager.accepted) - 2]


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 3, 5, 9])
def test_fast_speculator_stops_exactly_at_the_budget(target, drafts, tok, max_new_tokens):
    ref = plain_greedy(target, tok, max_new_tokens, stop_ids=[])
    out = FastSpeculator(target, drafts["layer-skip"], k=6, compile=False).generate(PROMPT, max_new_tokens, **GREEDY)
    assert out.tokens == ref.tokens and len(out.tokens) == max_new_tokens and out.stop_reason == "length"


def test_fast_speculator_stops_at_a_stop_token_inside_a_round(target, tok):
    ref = plain_greedy(target, tok, 30, stop_ids=[])
    stop = ref.tokens[6]
    plain = plain_greedy(target, tok, 30, stop_ids=[stop])
    out = FastSpeculator(target, target, k=8, compile=False).generate(PROMPT, 30, stop_ids=[stop], temperature=0)
    assert out.tokens == plain.tokens and out.stop_reason == "stop"


def test_fast_speculator_fills_its_cache_with_the_target_alone_where_a_round_no_longer_fits(target, drafts, tok):
    out = FastSpeculator(target, drafts["noisy-copy"], k=4, max_len=20, compile=False).generate(PROMPT, 40, **GREEDY)
    plan = spec.decoding.budget(len(PROMPT), 40, 20)  # every engine's budget: the cache's 20 slots, all of them
    assert (len(out.tokens), out.stop_reason) == (plan.tokens, "context") == (16, "context")
    assert out.tokens == plain_greedy(target, tok, 40, stop_ids=[]).tokens[:16]
    assert out.proposed[-1] == 0 and out.produced[-1] == 1  # the last round would write past slot 19


@pytest.mark.parametrize("draft_context, k", [(4, 4), (6, 8)])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=3)], ids=["greedy", "seeded"])
def test_fast_speculator_runs_where_a_short_draft_context_never_lets_it_propose(tok, draft_context, k, sampling):
    """The draft's cache cannot hold a round of k proposals: no warm-up round is written past it, and the target
    decodes alone: greedy, the tokens speculative_generate gives; seeded, the target's own draws (generate's;
    speculative_generate, whose rounds shrink k to fit, draws differently)."""
    target = random_model(3, logit_scale=4.0, max_seq_len=24)
    draft = noisy_copy(target, 0.2, seed=4)
    draft.config = draft.config.replace(max_seq_len=draft_context)
    kw = dict(max_new_tokens=10, stop_ids=(), **sampling)
    out = FastSpeculator(target, draft, k=k, compile=False).generate(PROMPT[:3], **kw)
    assert out.tokens == llmstep.generate(target, tok, PROMPT[:3], **kw).tokens and len(out.tokens) == 10
    if not sampling["temperature"]:
        assert out.tokens == speculative_generate(target, draft, tok, PROMPT[:3], k=k, **kw).tokens
    assert set(out.proposed) == {0}


def test_fast_speculator_refuses_a_k_that_no_round_can_hold_by_name(tok):
    target = random_model(3, max_seq_len=24)
    with pytest.raises(ValueError, match=r"k 23 never fits: .* the target's context is 24; choose k at most 22"):
        FastSpeculator(target, target, k=23)
    with pytest.raises(ValueError, match=r"k 25 never fits: .* the target's context is 24; choose k at most 22"):
        FastSpeculator(target, target, k=25, max_len=20)  # not "max_len must be an integer in 27..24"
    with pytest.raises(ValueError, match=r"max_len must be an integer in 12..24"):
        FastSpeculator(target, target, k=10, max_len=8)
    assert FastSpeculator(target, target, k=22, compile=False).generate(PROMPT[:1], 5, **GREEDY).tokens == \
        llmstep.generate(target, tok, PROMPT[:1], max_new_tokens=5, **GREEDY).tokens


def test_fast_speculator_goes_on_with_the_target_alone_past_a_shorter_draft_context(tok):
    """As speculative_generate does (test_context_limits_of_target_and_draft): the draft's context ends its
    proposals, not the request; a prompt longer than the draft's context gets no proposals at all."""
    target = random_model(3, logit_scale=4.0, max_seq_len=24)
    draft = noisy_copy(target, 0.2, seed=4)
    draft.config = draft.config.replace(max_seq_len=16)
    ref = plain_greedy(target, tok, 50, stop_ids=[])
    speculator = FastSpeculator(target, draft, k=4, compile=False)
    out = speculator.generate(PROMPT, 50, **GREEDY)
    assert (out.tokens, out.stop_reason) == (ref.tokens, "context") and len(out.tokens) == 24 - len(PROMPT) + 1
    assert out.proposed[0] == 4 and out.proposed[-1] == 0 and speculator.draft_cache.max_len == 16
    eager = speculative_generate(target, draft, tok, PROMPT, k=4, max_new_tokens=50, temperature=0, stop_ids=[])
    assert out.tokens == eager.tokens
    long_prompt = list(range(1, 18))  # 17 tokens: more than the draft's 16 slots
    alone = speculator.generate(long_prompt, 5, **GREEDY)
    assert alone.tokens == llmstep.generate(target, tok, long_prompt, 5, temperature=0, stop_ids=[]).tokens
    assert set(alone.proposed) == {0}
    sampled = speculator.generate(PROMPT, 50, temperature=1.0, seed=5, stop_ids=[])
    assert (len(sampled.tokens), sampled.stop_reason) == (len(ref.tokens), "context")


def test_fast_speculator_names_bad_arguments(target, drafts):
    draft = drafts["noisy-copy"]
    with pytest.raises(ValueError, match="k \\(draft tokens per round\\) must be an integer >= 1, got 0"):
        FastSpeculator(target, draft, k=0)
    with pytest.raises(ValueError, match="max_len must be an integer in 6..128"):
        FastSpeculator(target, draft, k=4, max_len=5)
    with pytest.raises(ValueError, match="vocabulary"):
        FastSpeculator(target, random_model(1, vocab_size=100), k=2)
    speculator = FastSpeculator(target, draft, k=2, max_len=16, compile=False)
    with pytest.raises(ValueError, match="prompt token id 300 is outside the vocabulary"):
        speculator.generate([1, 300], **GREEDY)
    with pytest.raises(ValueError, match="prompt is 17 tokens, but the cache it may fill is 16"):
        speculator.generate(list(range(17)), **GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        speculator.generate(PROMPT, -1, **GREEDY)
    with pytest.raises(ValueError, match=r"one sequence, \[T\] or \[1, T\]; got shape \[2, 3\]"):
        speculator.generate(torch.ones(2, 3, dtype=torch.long), **GREEDY)
    assert (speculator.generate(torch.tensor([PROMPT]), 3, **GREEDY).tokens
            == speculator.generate(PROMPT, 3, **GREEDY).tokens)
    with pytest.raises(ValueError, match="temperature"):
        speculator.generate(PROMPT, 4, temperature=-1.0, stop_ids=())


@pytest.mark.skipif(not __import__("os").environ.get("LLMSTEP_SLOW_TESTS"),
                    reason="torch.compile on the CPU takes ~30 s; set LLMSTEP_SLOW_TESTS=1")
def test_compiled_fast_speculator_keeps_the_greedy_output(tok):
    # One block, not the module's four: the compiled rounds (draft steps, the verify step, the greedy rule) are
    # what is checked, and each compile is shorter. This pair's rounds reject all, some and none.
    target = random_model(0, logit_scale=4.0, n_layers=1)
    ref = plain_greedy(target, tok, 30, stop_ids=[])
    speculator = FastSpeculator(target, noisy_copy(target, 0.3, seed=1), k=3, max_len=48, compile=True)
    # Public, as a benchmark warms it: the greedy round's steps and the target's step alone, in the runs' mode
    assert speculator.warmup(alone=True) > 0 and speculator.compile_seconds > 0
    with no_recompiles():
        out = speculator.generate(PROMPT, 30, **GREEDY)
    assert out.tokens == ref.tokens
    assert {0, 1, 3} <= set(out.accepted)  # rejections, partial and full acceptances all ran compiled


@pytest.mark.skipif(not __import__("os").environ.get("LLMSTEP_SLOW_TESTS"),
                    reason="torch.compile on the CPU takes ~30 s; set LLMSTEP_SLOW_TESTS=1")
def test_compiled_benchmark_runs_and_compares_tokens(one_layer_checkpoint, capsys, tmp_path):
    out = tmp_path / "spec.json"  # one block (self-1 is then the whole target): the bench's plumbing, compiled
    llmstep_main(["speculative", "--bench", "--compile", "--target", str(one_layer_checkpoint), "--draft", "self-1",
                  "--ks", "2", "--max-new-tokens", "12", "--repeats", "1", "--out", str(out)])
    report = __import__("json").loads(out.read_text())
    k2 = report["results"]["k=2"]
    assert report["compiled"] and k2["decode_tokens_per_second"] > 0 and k2["speedup"] > 0
    assert k2["matching_tokens"] == [12, 12, 12]  # float32: greedy speculation gives the target's tokens
    assert "k=2" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# FastSpeculator keeps to the shared rules: the budget, the bytes, the cache's size
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_name", ["perfect", "noisy-copy", "independent"])
def test_fast_speculator_ends_where_the_shared_budget_says_whatever_the_draft(target, drafts, tok, draft_name):
    """Every engine's budget (decoding.budget): how many tokens a run makes never depends on how many proposals
    the draft got accepted, nor on the k slots a round writes past its last kept token."""
    draft = target if draft_name == "perfect" else drafts[draft_name]
    plan = spec.decoding.budget(len(PROMPT), 40, 20)
    out = FastSpeculator(target, draft, k=4, max_len=20, compile=False).generate(PROMPT, 40, **GREEDY)
    assert (len(out.tokens), out.stop_reason) == (plan.tokens, plan.stop_reason) == (16, "context")
    assert out.tokens == plain_greedy(target, tok, 40, stop_ids=[]).tokens[:16]
    prompt = list(range(10, 20))  # the review's case: its budget said "length" and the run ended at 7, "context"
    plan = spec.decoding.budget(len(prompt), 10, 20)
    out = FastSpeculator(target, draft, k=4, max_len=20, compile=False).generate(prompt, 10, **GREEDY)
    assert (len(out.tokens), out.stop_reason) == (plan.tokens, plan.stop_reason) == (10, "length")


def test_fast_speculator_counts_the_bytes_the_teaching_loop_counts(target, tok):
    """A perfect draft with 13 = 1 + 3 * (k + 1) tokens: the same rounds in both loops, so the same bytes."""
    fast = FastSpeculator(target, target, k=3, compile=False).generate(PROMPT, 13, **GREEDY)
    eager = speculative_generate(target, target, tok, PROMPT, k=3, max_new_tokens=13, temperature=0, stop_ids=[])
    assert fast.tokens == eager.tokens and fast.proposed == eager.proposed == [3, 3, 3]
    assert fast.decode_bytes > 0 and fast.decode_bytes == pytest.approx(eager.decode_bytes, rel=1e-12)
    assert fast.bytes_per_token == pytest.approx(eager.bytes_per_token, rel=1e-12)


def test_fast_speculator_sizes_its_caches_for_the_request(tok):
    """max_len None: both caches hold what the request needs (the one sizing rule, k reserved, rounded), not
    the models' whole context; a longer request grows them."""
    big = random_model(0, logit_scale=4.0, max_seq_len=1024)
    speculator = FastSpeculator(big, LayerSkipDraft(big, 2), k=4, compile=False)
    assert speculator.max_len == 256 and speculator.target_cache.k[0].shape[2] == 256
    assert speculator.generate(PROMPT, 20, **GREEDY).tokens == llmstep.generate(big, tok, PROMPT, 20, temperature=0,
                                                                      stop_ids=[]).tokens
    assert speculator.max_len == 256
    out = speculator.generate(PROMPT, 260, **GREEDY)  # 5 + 260 + 4 slots: 512
    assert speculator.max_len == 512 and speculator.draft_cache.k[0].shape[2] == 512
    assert (len(out.tokens), out.stop_reason) == (260, "length")


def test_fast_speculator_checks_max_len_with_the_shared_rule(target, drafts):
    draft = drafts["noisy-copy"]
    assert FastSpeculator(target, draft, k=4, max_len=__import__("numpy").int64(20), compile=False).max_len == 20
    for bad in (True, 20.0, 5, 129):
        with pytest.raises(ValueError, match="max_len must be an integer in 6..128"):
            FastSpeculator(target, draft, k=4, max_len=bad)


def test_an_eager_fast_speculator_runs_its_round_once_in_the_warmup(target, drafts):
    calls = []
    handle = target.output.register_forward_hook(lambda *_: calls.append(1))
    try:
        speculator = FastSpeculator(target, drafts["noisy-copy"], k=2, compile=False)
        assert speculator.warmup(greedy=True) == 0 and len(calls) == 1  # the round's verifying forward, once
        assert speculator.warmup(greedy=False) == 0 and len(calls) == 2
        assert speculator.warmup() == 0 and len(calls) == 2 and speculator.compile_seconds == 0
    finally:
        handle.remove()


def test_resolve_draft_names_its_own_argument_not_a_flag(target):
    for word, says in (("self-x", "write self-N"), ("self-int3", "self-int8 and self-int4")):
        with pytest.raises(ValueError, match=f"draft '{word}': .*{says}") as e:
            drafts_mod.resolve_draft(word, target)
        assert "--draft" not in str(e.value)


def test_speculative_imports_what_it_needs_at_the_top():
    """No import inside a function: nothing here has a cycle to avoid."""
    import ast

    tree = ast.parse(open(spec.__file__).read())
    nested = [n.lineno for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
              for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert nested == []


def test_parse_draft_reads_every_good_word_without_loading_anything():
    assert drafts_mod.parse_draft("self-1") == ("layers", 1)
    assert drafts_mod.parse_draft("self-6", n_layers=6) == ("layers", 6)  # every layer: the target as its own draft
    assert drafts_mod.parse_draft("self-12") == ("layers", 12)  # no bound without the target's config
    assert drafts_mod.parse_draft("self-int8") == ("quantized", "int8")
    assert drafts_mod.parse_draft("self-int4") == ("quantized", "int4")
    assert drafts_mod.parse_draft("draft") == ("checkpoint", "draft")
    assert drafts_mod.parse_draft("runs/my-draft") == ("checkpoint", "runs/my-draft")


@pytest.mark.parametrize("word", ["", "self-", "self-0", "self-07", "self-+3", "self-3.0", "self-²", "self-٣",
                                  "self-1 ", "self-7", "self-int", "self-int3", "self-int8 ", "self-INT8"])
def test_parse_draft_refuses_a_bad_word_naming_it(word):
    with pytest.raises(ValueError, match=re.escape(f"draft '{word}': ")):
        drafts_mod.parse_draft(word, n_layers=6)


def test_a_draft_with_another_tokenizer_is_refused_before_the_target_loads(tiny_checkpoint, tmp_path, monkeypatch):
    import json
    import shutil

    from llmstep.cli.args import check_draft

    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    tok_json = json.loads((other / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same strings, other numbers
    (other / "tokenizer.json").write_text(json.dumps(tok_json))
    check_draft(str(tiny_checkpoint), str(tiny_checkpoint))  # the same tokenizer: accepted
    with pytest.raises(ValueError, match="different tokenizer"):
        check_draft(str(other), str(tiny_checkpoint))
    monkeypatch.setattr(Llama, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit, match="different tokenizer"):
        llmstep_main(["generate", "--model", str(tiny_checkpoint), "--prompt", "Shall", "--draft", str(other)])


def test_a_draft_folder_without_a_checkpoint_is_refused_before_the_target_loads(tiny_checkpoint, tmp_path,
                                                                                monkeypatch):
    from llmstep.cli.args import check_draft

    monkeypatch.setattr(Llama, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    for word in (str(tmp_path), ""):
        with pytest.raises((ValueError, OSError), match="config.json|draft '': give"):
            check_draft(word, str(tiny_checkpoint))


def test_a_quantized_self_draft_the_target_cannot_take_is_refused_before_it_loads(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch):
    from llmstep.cli.args import check_draft
    from llmstep.core import checkpoint, quantize

    model, tokenizer = checkpoint.load(tiny_checkpoint, device="cpu")
    checkpoint.save(quantize.quantize(model, "int8"), tmp_path / "int8", tokenizer)
    # the tripwire: a weight read (the shape check builds a model on the meta device, as checkpoint.tensor_table does)
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("a weight was read"))
    check_draft("self-int8", str(tiny_checkpoint))  # a float target: accepted
    with pytest.raises(ValueError, match="group_size 64 does not divide in_features 112"):  # the tiny MLP's width
        check_draft("self-int4", str(tiny_checkpoint))
    with pytest.raises(ValueError, match="already quantised"):
        check_draft("self-int8", str(tmp_path / "int8"))
    with pytest.raises(SystemExit, match="group_size 64"):
        llmstep_main(["generate", "--model", str(tiny_checkpoint), "--prompt", "Shall", "--draft", "self-int4"])


def test_the_speculative_bench_refuses_more_new_tokens_than_the_targets_context_holds(target, drafts, tok):
    """Else `budget` would cut every run at the context and the record would name tokens it never made."""
    from llmstep.lab.bench_speculative import bench, bench_compiled

    for run in (bench, bench_compiled):
        with pytest.raises(ValueError, match=r"needs \d+ positions; the context holds"):
            run(target, drafts["noisy-copy"], tok, ks=[2], max_new_tokens=target.config.max_seq_len, repeats=1)
    from llmstep.lab.bench_speculative import BENCH_PROMPTS, _check

    longest, context = max(len(tok.encode(p)) for p in BENCH_PROMPTS), target.config.max_seq_len
    _check(BENCH_PROMPTS, [2], context - longest + 1, 1, tok, context)  # the last token is never fed back: fits
    with pytest.raises(ValueError, match=f"needs {context + 1} positions"):
        _check(BENCH_PROMPTS, [2], context - longest + 2, 1, tok, context)

"""The sampler draws from exactly the distribution `probs` says, and each filter does what it claims."""

import math

import pytest
import torch
from llmstep.sampling import probs, sample, top_k_filter, top_p_filter


def logits_of(p):
    return torch.tensor(p, dtype=torch.float32).log()[None]


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, temperature=0), logits.argmax(-1))
    p = probs(logits, temperature=0)
    assert torch.equal(p.argmax(-1), logits.argmax(-1))
    assert torch.all(p.sum(-1) == 1) and torch.all(p.max(-1).values == 1)


def test_temperature_scales_logits():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(probs(logits, temperature=0.5), torch.softmax(logits * 2, -1))
    assert probs(logits, temperature=100).max() < probs(logits, temperature=1).max()


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k_even_with_ties(k):
    logits = torch.tensor([[1.0, 5.0, 5.0, 5.0, 5.0, 2.0, 0.5, 3.0, 3.0, -1.0]])
    kept = top_k_filter(logits, k) > float("-inf")
    assert kept.sum().item() == k
    assert logits[kept].min() >= logits[~kept].max()  # the k largest
    assert (probs(logits, 1.0, top_k=k) > 0).sum().item() == k


def test_top_k_zero_or_vocab_size_is_off():
    logits = torch.randn(2, 10)
    assert torch.equal(top_k_filter(logits, 0), logits) and torch.equal(top_k_filter(logits, 10), logits)


@pytest.mark.parametrize("p, expected_kept",
                         [(0.5, 1), (0.5000001, 2), (0.7, 2), (0.7999, 2), (0.8001, 3), (0.95, 4), (1.0, 5)])
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected_kept):
    dist = [0.1, 0.5, 0.05, 0.3, 0.05]  # sorted: 0.5, 0.3, 0.1, 0.05, 0.05 -> cumulative 0.5, 0.8, 0.9, 0.95, 1
    kept = top_p_filter(logits_of(dist), p) > float("-inf")
    assert kept.sum().item() == expected_kept
    ranked = sorted(range(5), key=lambda i: -dist[i])
    assert set(torch.nonzero(kept[0]).flatten().tolist()) == set(ranked[:expected_kept])


@pytest.mark.parametrize("n, p, kept", [(5, None, 2), (6, 1 / 3, 2), (3, 2 / 3, 2), (10, 0.6, 6)])
def test_top_p_stops_where_the_kept_mass_reaches_p_exactly(n, p, kept):
    """A set whose mass is p within float32 rounding reaches p: cumsum - p_i rounds the next token's mass before it
    to just under p and kept one token more (transformers' TopPLogitsWarper keeps `kept`)."""
    if p is None:  # 0.5 + 0.3 = 0.8 exactly
        logits, p = logits_of([0.1, 0.5, 0.05, 0.3, 0.05]), 0.8
    else:  # n equal tokens: p a whole number of them
        logits = torch.zeros(1, n)
    assert (top_p_filter(logits, p) > float("-inf")).sum().item() == kept
    assert (probs(logits, 1.0, top_p=p) > 0).sum().item() == kept


def test_top_p_applies_after_top_k_and_temperature():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # top-k 3 renormalises to 4/9, 3/9, 2/9; top-p 0.7 then needs the first two (7/9 >= 0.7).
    p = probs(logits, temperature=1.0, top_k=3, top_p=0.7)
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0, 0]]))


def test_probs_rows_sum_to_one_and_batch_rows_are_independent():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    p = probs(logits, 0.9, top_k=20, top_p=0.9)
    torch.testing.assert_close(p.sum(-1), torch.ones(4))
    torch.testing.assert_close(p[2:3], probs(logits[2:3], 0.9, top_k=20, top_p=0.9))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.9)])
def test_draw_frequencies_match_probs(temperature, top_k, top_p):
    """200,000 seeded draws: every token's frequency within 5 standard errors of its probability,
    and a chi-square statistic far below the 1e-6 tail."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    p = probs(logits, temperature, top_k, top_p)[0].double()
    n = 200_000
    g = torch.Generator().manual_seed(4)
    draws = sample(logits.expand(n, -1), temperature, top_k, top_p, generator=g)
    freq = torch.bincount(draws, minlength=12).double()
    assert torch.all(freq[p == 0] == 0), "a filtered-out token was drawn"
    se = (p * (1 - p) / n).sqrt()
    assert torch.all((freq / n - p).abs() <= 5 * se + 1e-12)
    support = p > 0
    chi2 = (((freq - n * p) ** 2) / (n * p))[support].sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < dof + 8 * math.sqrt(2 * dof) + 20  # ~1e-6 tail for these small dof


def test_a_biased_sampler_fails_the_same_check():
    """The frequency check above can fail: drawing from softmax(logits) while probs says top-k=2 is caught."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    p = probs(logits, 1.0, 2, 1.0)[0]
    draws = sample(logits.expand(50_000, -1), 1.0, 0, 1.0, generator=torch.Generator().manual_seed(4))
    freq = torch.bincount(draws, minlength=12).double() / 50_000
    assert (freq - p).abs().max() > 0.05


def test_seeded_draws_reproduce():
    logits = torch.randn(3, 40)
    a = sample(logits, 0.8, generator=torch.Generator().manual_seed(9))
    b = sample(logits, 0.8, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.2), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
])
def test_bad_sampling_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        probs(torch.randn(1, 10), **kwargs)
    with pytest.raises(ValueError, match=message):
        sample(torch.randn(1, 10), **kwargs)


def test_ties_are_broken_by_index_in_top_k_and_top_p():
    """Which of several equal logits survives a filter must not depend on the sort the device happens to use."""
    logits = torch.zeros(3, 1000)
    logits[:, 500:] = -1.0
    kept_k = torch.nonzero(top_k_filter(logits, 5)[0] > float("-inf")).flatten().tolist()
    kept_p = torch.nonzero(top_p_filter(logits, 0.005)[0] > float("-inf")).flatten().tolist()
    assert kept_k == [0, 1, 2, 3, 4]
    assert kept_p == [0, 1, 2, 3]  # each of the first 500 holds 1 / (500 (1 + 1/e)) = 0.00146 of the mass
    mixed = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    assert (top_k_filter(mixed, 4) > float("-inf")).tolist() == [[False, True, True, True, True, False, False]]


def test_ties_in_bf16_logits_match_float32():
    """bf16 logits are full of ties; probs on them equals probs on their float32 values."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    assert len(logits[0].unique()) < 300
    for kw in (dict(top_k=17), dict(top_p=0.6), dict(top_k=40, top_p=0.8)):
        assert torch.equal(probs(logits, 0.9, **kw), probs(logits.float(), 0.9, **kw))


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45, 1e-46, 1e-300, 5e-324])  # the last ones: 0 in float32
def test_tiny_temperature_tends_to_greedy_not_nan(temperature):
    logits = torch.tensor([[1.0, 3.0, 2.0], [-5.0, -5.0, -6.0]])
    p = probs(logits, temperature)
    torch.testing.assert_close(p, torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]))
    assert sample(logits, temperature, generator=torch.Generator().manual_seed(0))[0] == 1
    assert probs(logits, temperature, top_k=1).isfinite().all()


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [0.7, 1e-46])
def test_probs_are_float32_whatever_the_default_dtype(default, temperature):
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    expected = probs(logits, temperature)
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = probs(logits, temperature)
    finally:
        torch.set_default_dtype(old)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.5, top_k=2), dict(temperature=1e-46)])
def test_a_row_with_no_logit_above_minus_inf_is_no_distribution(kw):
    """probs' documented rule: NaN, never a made-up distribution (a uniform one, say); the other row is untouched."""
    logits = torch.tensor([[float("-inf")] * 4, [0.0, 1.0, -1.0, float("-inf")]])
    p = probs(logits, **kw)
    assert p[0].isnan().all() and p[1].isfinite().all() and p[1].sum().item() == pytest.approx(1.0)
    assert sample(logits, **kw, generator=torch.Generator().manual_seed(0))[0] == 0


@pytest.mark.parametrize("top_p", [1e-30, 1e-46, 1e-300])  # the last two: 0 in float32
def test_a_tiny_top_p_keeps_the_top_token(top_p):
    logits = torch.tensor([[1.0, 3.0, 2.0], [-5.0, -4.0, -6.0]])
    torch.testing.assert_close(probs(logits, 1.0, top_p=top_p), torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    draws = sample(logits.expand(2, 2, 3).reshape(4, 3), 0.8, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert draws.tolist() == [1, 1, 1, 1]


def test_infinite_logits_and_temperature():
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf"), 1.0]])
    p = probs(logits, 0.5, top_k=3, top_p=0.99)
    assert p[0, 0] == p[0, 2] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    draws = sample(logits.expand(1000, -1), 0.5, top_k=3, generator=torch.Generator().manual_seed(1))
    assert set(draws.tolist()) <= {1, 3}
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        probs(logits, float("inf"))


def test_a_row_with_positive_infinite_logits_puts_its_mass_on_them_at_any_temperature():
    inf = float("inf")
    logits = torch.tensor([[inf, 1.0, 2.0, inf], [0.0, 1.0, 2.0, 3.0]])
    for t in (0.5, 1.0, 1e-40):
        p = probs(logits, t, top_k=3, top_p=0.9)
        assert torch.equal(p[0], torch.tensor([0.5, 0.0, 0.0, 0.5]))  # the limit, as at T = 0 up to the tie
        assert torch.equal(p[1], probs(logits[1:], t, top_k=3, top_p=0.9)[0])  # the other row untouched
    assert probs(logits[:, :3], 0.0)[0].tolist() == [1.0, 0.0, 0.0]
    draws = sample(logits[:1].expand(1000, -1), 1.0, generator=torch.Generator().manual_seed(2))
    assert set(draws.tolist()) == {0, 3}


def test_top_k_may_be_any_integer_type():
    import numpy as np


    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    assert torch.equal(probs(logits, 1.0, top_k=np.int64(3)), probs(logits, 1.0, top_k=3))
    assert torch.equal(probs(logits, 1.0, top_k=100), probs(logits, 1.0))  # more than the vocabulary: off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_max_compiled_is_argmax_ties_nans_and_infinities_included(dtype):
    """A compiled step takes the argmax (greedy's token, the exponential race's winner, speculative verification's
    choice) as two plain reductions: the same index as torch.argmax on every row, whatever ties, NaNs and
    infinities it holds."""
    from llmstep.core.sampling import first_max

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (6, 5, 257), generator=g).to(dtype)  # a handful of values: ties in every row
    x[0, 0, 100] = float("nan")  # a NaN after the maxima: it wins
    x[0, 1, 3] = float("nan")  # two NaNs: the first
    x[0, 1, 200] = float("nan")
    x[1, 0] = float("-inf")  # every value -inf: the first
    x[1, 1] = float("nan")  # every value NaN: the first
    x[1, 2, 50] = float("inf")  # +inf wins; a later NaN still beats it
    x[1, 3, 60] = float("inf")
    x[1, 3, 70] = float("nan")
    x[2] = torch.randn(5, 257, generator=g).to(dtype)  # no ties
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(first_max, fullgraph=True, dynamic=False)
    want = x.argmax(dim=-1)
    got, code = run_and_get_code(compiled, x)
    assert "argmax" not in "".join(code) and "amin" in "".join(code)  # the two reductions ran, not argmax's kernel
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    assert torch.equal(compiled(x[:, 0]), x[:, 0].argmax(dim=-1))  # [B, V] too (a new shape: compiled again)


def test_a_temperature_past_float32s_largest_is_refused():
    """1e39 is a finite Python float and infinite in float32, where the logits are divided: every logit 0 or NaN."""
    with pytest.raises(ValueError, match="temperature must be at most"):
        sample(torch.tensor([[float("-inf"), 0.0, 1.0]]), 1e39)
    assert sample(torch.tensor([[float("-inf"), 0.0, 1.0]]), 3e38).item() in (1, 2)


def test_a_numpy_half_temperature_is_checked_without_a_warning():
    import warnings

    import numpy as np

    from llmstep.core import sampling

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy cast float32's largest to float16 (inf) in the comparison
        sampling.check_params(np.float16(0.7), 0, 1.0)

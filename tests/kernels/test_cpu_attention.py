"""llmstep's attention kernel for a compiled CPU step of one sequence (llmstep/kernels/cpu_attention.py): SDPA's
function in float32 inside (held to a float64 computation), the masked slots never read, registered for static
CPU steps of one sequence under the "auto" choice only, and a compiled step with it makes the eager tokens."""

from __future__ import annotations

import pytest
import torch

import llmstep
from llmstep.core import attention_backend
from llmstep.core.attention import Mask, causal_mask, sdpa
from llmstep.core.config import LlamaConfig
from llmstep.engines.fast import FastDecoder
from llmstep.kernels import cpu_attention


@pytest.fixture(scope="module")
def kernel():
    if not cpu_attention.install():
        pytest.skip(f"the kernel did not build here: {cpu_attention.why()}")
    return cpu_attention.attend


def built(isa: str):
    """`isa`'s build (attention, attention_prefix), or a skip that says why not: this CPU does not run it, or no
    compiler or ninja here (an AVX-512 CPU runs the AVX2 build too, so CI on either CPU kind holds both to the same
    tests)."""
    if isa not in cpu_attention.runs_here():
        pytest.skip(f"this CPU does not run {isa} ({torch.backends.cpu.get_cpu_capability()})")
    try:
        op = cpu_attention.build(isa)
    except Exception as e:
        pytest.skip(f"the {isa} kernel did not build here: {type(e).__name__}: {str(e)[-300:]}")
    return op, getattr(torch.ops, cpu_attention.op_name(isa).partition("::")[0]).attention_prefix


# (chunk, most): each row's slots whole, in up to 3 chunks, in as many chunks of 5 as it has (dozens: far more than a
# run's tasks would be split in), and as llmstep splits them
CHUNKS = ((0, 1), (7, 3), (5, 64), (cpu_attention.CHUNK, cpu_attention.MOST_CHUNKS))


@pytest.fixture(scope="module", params=[(isa, *split) for isa in cpu_attention.ISAS for split in CHUNKS],
                ids=lambda p: f"{p[0]}-chunk{p[1]}-most{p[2]}")
def each_kernel(request):
    """The kernel as each ISA's build computes it, its rows' slots taken whole and in chunks (`CHUNKS`)."""
    isa, chunk, most = request.param
    op, _ = built(isa)

    def kernel(q, k, v, mask):
        return op(q, k, v, mask, q.shape[-1] ** -0.5, chunk, most)

    kernel.whole = chunk == 0  # every row's slots in one task
    return kernel


@pytest.fixture(scope="module", params=cpu_attention.ISAS)
def each_isa(request):
    """Each ISA's build as its two ops, (attention, attention_prefix), where this CPU runs that ISA."""
    return built(request.param)


def exact(q, k, v, visible):
    """The function in float64: q [B, H, R, D], k/v [B, H, S, D], visible [B, 1, R, S] -> out, probabilities."""
    scores = (q.double() @ k.double().transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return probs @ v.double(), probs


def inputs(B, H, R, S, D, dtype, seed=0, density=0.6):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (R, S, S))
    visible = torch.rand(B, 1, R, S, generator=g) < density
    visible[..., torch.randint(0, S, (1,), generator=g)] = True  # every row sees a key
    return q, k, v, visible


@pytest.mark.parametrize("B,H,R,S,D", [(1, 3, 3, 256, 64), (1, 2, 18, 40, 64), (2, 4, 1, 7, 48), (1, 1, 5, 1, 32),
                                       (1, 8, 4, 130, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_masked_attention_in_float32(each_kernel, B, H, R, S, D, dtype):
    q, k, v, visible = inputs(B, H, R, S, D, dtype, seed=S + R)
    want, probs = exact(q, k, v, visible)
    got = each_kernel(q, k, v, visible)
    assert got.dtype == dtype and got.shape == (B, H, R, D)
    # float32 inside: each output within float32's sums of its exact value, then rounded once to the output dtype
    rounding = 2 ** -24 if dtype == torch.float32 else 2 ** -8  # the unit roundoff of the output's dtype
    bound = rounding * want.abs() + 1e-5 * (probs @ v.double().abs()) + 1e-30
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


@pytest.mark.parametrize("spread", [40.0, 100.0])
def test_the_weights_hold_over_the_whole_range_of_e_to_the_x(each_kernel, spread):
    """With V the identity the output is the weights themselves; q scaled up puts scores far below the row's top, so
    e^x is taken from 0 down past -87 (where float32's e^x leaves its normal range, and the kernel gives 0): each
    weight within float32's rounding of the float64 softmax of the same float32 scores, those below e^-87 below
    float32's normal range (0 in one chunk), and a row that sees no key 0, as SDPA gives it (it was NaN)."""
    g = torch.Generator().manual_seed(int(spread))
    S = D = 64
    q = torch.randn(1, 2, 3, D, generator=g) * spread
    k = torch.randn(1, 2, S, D, generator=g)
    v = torch.eye(D).expand(1, 2, S, D).contiguous()
    visible = torch.rand(1, 1, 3, S, generator=g) < 0.7
    visible[0, 0, 0, 5] = True
    visible[0, 0, 2] = False  # the third row sees nothing
    got = each_kernel(q, k, v, visible).double()  # [1, 2, 3, D]: row r's weight of slot s at column s
    scores = (q.double() @ k.double().transpose(-2, -1) * D ** -0.5).masked_fill(~visible, float("-inf"))
    x = scores[:, :, :2] - scores[:, :, :2].amax(-1, keepdim=True)  # the exponents, the seen rows
    assert x[visible[:, :, :2].expand_as(x)].min() < -200  # the range the test is about: far past -87
    want = torch.softmax(scores[:, :, :2], dim=-1)
    normal = x > -86
    # float32 scores (their sums carry relative error ~ D * 2^-24 of |q| |k|) and float32 e^x: relative to a weight,
    # the error in its exponent times the weight, plus float32's rounding
    slack = 1e-5 * (q.double().abs() @ k.double().abs().transpose(-2, -1) * D ** -0.5)[:, :, :2] + 1e-5
    assert ((got[:, :, :2] - want).abs() <= slack * want + 1e-7 * want.amax(-1, keepdim=True))[normal].all()
    # below e^-87: 0 from one chunk; split, a weight is e^(s - top of its chunk) e^(top of its chunk - top), each
    # factor perhaps normal, their product below float32's normal range (as float32's own e^x gives it)
    tiny = got[:, :, :2][x < -87.5]
    assert (tiny == 0).all() if each_kernel.whole else (tiny.abs() < 2.0 ** -126).all()
    assert (x < -87.5).any()
    assert (got[:, :, 2] == 0).all()
    sdpa_row = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)[:, :, 2]
    assert (sdpa_row == 0).all()  # SDPA's own result for that row, which the kernel stands in for


def test_the_masked_slots_are_never_read(each_kernel):
    kernel = each_kernel
    q, k, v, visible = inputs(1, 3, 3, 64, 64, torch.bfloat16, seed=3)
    got = kernel(q, k, v, visible)
    k2, v2 = k.clone(), v.clone()
    k2[..., ~visible[0, 0].any(0), :] = float("nan")  # slots no row sees: NaN would poison any sum they entered
    v2[..., ~visible[0, 0].any(0), :] = float("inf")
    assert (~visible[0, 0].any(0)).any()
    torch.testing.assert_close(kernel(q, k2, v2, visible), got, atol=0, rtol=0)


@pytest.mark.parametrize("pattern", [[0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 2, 2, 2, 2, 2, 1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_that_see_the_same_slots_are_taken_together_and_each_gives_its_bits_alone(each_kernel, pattern, dtype):
    """Consecutive query rows with equal mask rows (a decode step's n_rep query heads) share each key and value the
    kernel widens, up to four at a time: each row's output the same bits as that row attended alone. `pattern`
    names each row's mask row; runs of equal ones of every length, two batch rows with other runs."""
    g = torch.Generator().manual_seed(len(pattern))
    B, H, S, D = 2, 3, 70, 64
    R = len(pattern)
    q = torch.randn(B, H, R, D, generator=g).to(dtype)
    k, v = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(2))
    masks = torch.rand(B, 1, 3, S, generator=g) < 0.6
    masks[..., 0] = True
    visible = masks[:, :, pattern].contiguous()
    visible[1, 0, -1] = ~visible[1, 0, -1]  # the second batch row's last run ends a row earlier
    visible[1, 0, -1, 0] = True
    together = each_kernel(q, k, v, visible)
    for r in range(R):
        alone = each_kernel(q[:, :, r:r + 1].contiguous(), k, v, visible[:, :, r:r + 1].contiguous())
        torch.testing.assert_close(together[:, :, r:r + 1], alone, rtol=0, atol=0)
    want, probs = exact(q, k, v, visible)
    rounding = 2 ** -24 if dtype == torch.float32 else 2 ** -8
    assert ((together.double() - want).abs() <= rounding * want.abs() + 1e-5 * (probs @ v.double().abs())).all()


@pytest.mark.parametrize("R", [1, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", CHUNKS)
def test_the_prefix_form_is_the_kernel_with_the_mask_of_slots_up_to_last(each_isa, R, dtype, split):
    """A decode step's form (`attention_prefix`): every row of batch row b sees slots 0..last[b], no mask tensor;
    the same bits as the masked kernel given that mask, last past the cache or before it included (a row that sees
    nothing: 0, as with a mask that shows nothing, and as SDPA gives it), its slots whole or in chunks alike."""
    attention, prefix = each_isa
    g = torch.Generator().manual_seed(R)
    S, D = 70, 64
    for last in ([0, 69], [41, 100], [-1, 7]):
        B = len(last)
        q = torch.randn(B, 3, R, D, generator=g).to(dtype)
        k, v = (torch.randn(B, 3, S, D, generator=g).to(dtype) for _ in range(2))
        ends = torch.tensor(last)
        visible = (torch.arange(S) <= ends[:, None]).view(B, 1, 1, S).expand(B, 1, R, S).contiguous()
        got = prefix(q, k, v, ends, D ** -0.5, *split)
        want = attention(q, k, v, visible, D ** -0.5, *split)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        sdpa_rows = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)[ends < 0]
        assert (got[ends < 0] == 0).all() and (sdpa_rows == 0).all() and not got[ends >= 0].isnan().any()


def test_it_equals_sdpa_on_a_decode_steps_shapes(kernel):
    """What a static step hands it: the n_rep query heads of a KV head stacked, the cache's unwritten slots masked."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 9, 1, 64, generator=g).to(torch.bfloat16)  # 9 query heads over 3 KV heads, one token
    k, v = (torch.randn(1, 3, 256, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = causal_mask(torch.tensor([[140]]), torch.arange(256))  # [1, 1, 1, 256]: slots 0..140 written
    with attention_backend.attention_backend("math"):  # SDPA: the kernel is "auto"'s alone
        reference = sdpa(q, k, v, mask, static=True)
    torch.testing.assert_close(sdpa(q, k, v, mask, static=True).float(), reference.float(), atol=1e-2, rtol=1e-2)
    # a decode step's Mask, its last slot beside it: the prefix form, the same bits as the kernel given the mask
    with_last = sdpa(q, k, v, Mask(mask, last=torch.tensor([140])), static=True)
    torch.testing.assert_close(with_last, sdpa(q, k, v, mask, static=True), rtol=0, atol=0)


def test_it_is_asked_for_static_cpu_steps_of_one_sequence_under_auto_only(kernel):
    q = torch.zeros(1, 2, 3, 16)
    assert attention_backend.cpu_step_kernel(q) is kernel
    assert attention_backend.cpu_step_kernel(q.half()) is None  # float32 and bf16 only
    assert attention_backend.cpu_step_kernel(torch.zeros(1, 2, 3, 24)) is None  # head_dim a multiple of 16
    for name in ("math", "flash", "flex"):
        with attention_backend.attention_backend(name):
            assert attention_backend.cpu_step_kernel(q) is None
    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    mask = causal_mask(torch.tensor([[5], [6]]), torch.arange(8))
    attention_backend.use_cpu_step_kernel(counting)
    try:
        sdpa(q[:1], k[:1], v[:1], mask[:1], static=True)  # one sequence, static: the kernel
        sdpa(q[:1], k[:1], v[:1], mask[:1])  # not static: SDPA
        sdpa(q, k, v, mask, static=True)  # two sequences: SDPA
    finally:
        cpu_attention.install()  # the kernel and its prefix form, registered again
    assert calls == [(1, 2, 2, 16)]  # the 2 query heads of each KV head stacked


def test_bad_arguments_are_named(each_kernel):
    kernel = each_kernel
    q, k, v, visible = inputs(1, 2, 3, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match="mask bool"):
        kernel(q, k, v, visible.float())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(q.half(), k.half(), v.half(), visible)
    with pytest.raises(RuntimeError, match="a multiple of 16"):
        kernel(q[..., :8], k[..., :8], v[..., :8], visible)
    with pytest.raises(RuntimeError, match="k and v"):
        kernel(q, k, v[:, :, :4], visible)


def test_the_prefix_forms_bad_arguments_are_named(each_isa):
    attention, prefix = each_isa
    q, k, v, visible = inputs(2, 2, 3, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match=r"last int64 \[B\]"):
        prefix(q, k, v, torch.tensor([3.0, 4.0]), 0.25, 0, 1)
    with pytest.raises(RuntimeError, match=r"last int64 \[B\]"):
        prefix(q, k, v, torch.tensor([3]), 0.25, 0, 1)  # one for two batch rows
    with pytest.raises(RuntimeError, match="attention_prefix: q \\[B, H, R, D\\]"):
        prefix(q, k, v[:, :, :4], torch.tensor([3, 4]), 0.25, 0, 1)
    with pytest.raises(RuntimeError, match=r"attention_prefix: chunk >= 0 \(0: no chunks\) and most >= 1, got -1 "
                                           "and 8"):
        prefix(q, k, v, torch.tensor([3, 4]), 0.25, -1, 8)
    with pytest.raises(RuntimeError, match=r"attention: chunk >= 0 \(0: no chunks\) and most >= 1, got 4 and 0"):
        attention(q, k, v, visible, 0.25, 4, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_split_in_chunks_give_the_same_bits_on_any_thread_count(each_isa, dtype):
    """The chunks follow from the slots a row sees, not from the threads: the same bits on 1, 2 and 3 threads, a
    row seeing up to `chunk` slots the bits of the unsplit kernel, a row seeing more within float32's rounding of
    the exact value (a decode step's shapes: 9 query heads over 3 KV heads, 230 of 256 slots)."""
    attention, prefix = each_isa
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 3, 3, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 3, 256, 64, generator=g).to(dtype) for _ in range(2))
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(prefix(q, k, v, torch.tensor([229]), 0.125, 16, 8))  # 8 chunks of 29 (the last 27)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    visible = (torch.arange(256) <= 229).view(1, 1, 1, 256).expand(1, 1, 3, 256).contiguous()
    want, probs = exact(q, k, v, visible)
    rounding = 2 ** -24 if dtype == torch.float32 else 2 ** -8
    assert ((outs[0].double() - want).abs() <= rounding * want.abs() + 1e-5 * (probs @ v.double().abs())).all()
    last = torch.tensor([229])
    assert torch.equal(prefix(q, k, v, last, 0.125, 230, 8), prefix(q, k, v, last, 0.125, 0, 1))  # up to chunk: whole
    assert torch.equal(prefix(q, k, v, last, 0.125, 16, 1), prefix(q, k, v, last, 0.125, 0, 1))  # most 1: whole
    if dtype == torch.float32:  # split, the sums are another function's: different bits (else the test shows nothing)
        assert not torch.equal(outs[0], prefix(q, k, v, last, 0.125, 0, 1))


def test_a_failed_build_leaves_sdpa_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setattr(attention_backend, "_cpu_step", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")

    def broken():  # what cpp_extension raises
        raise RuntimeError("Error building extension 'x':\n[1/2] c++ -c a.cpp\na.cpp:3:1: error: 'x' was not "
                           "declared\nninja: build stopped: subcommand failed.")

    monkeypatch.setattr(cpu_attention, "build", lambda isa: broken())
    assert not cpu_attention.install() and not cpu_attention.installed()
    assert cpu_attention.why() == "RuntimeError: a.cpp:3:1: error: 'x' was not declared"  # the compiler's own line
    assert attention_backend.cpu_step_kernel(torch.zeros(1, 1, 1, 16)) is None


def test_a_cpu_without_avx2_is_not_asked_to_build_it(monkeypatch, fake_cpu):
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setattr(attention_backend, "_cpu_step", None)
    fake_cpu("DEFAULT", "sse2 fma")
    monkeypatch.setattr(cpu_attention, "build", lambda isa: pytest.fail("built on a CPU without AVX2"))
    assert not cpu_attention.install()
    assert cpu_attention.why() == ("RuntimeError: it is written for AVX-512 or AVX2, and this CPU runs neither (torch "
                                   "reads its vector instructions as DEFAULT, not AVX2 or AVX512; the CPU lacks avx2)")
    monkeypatch.setattr(cpu_attention, "_state", {})
    fake_cpu("AVX2", "avx avx2")  # a capability torch names, a feature the CPU lacks: named too
    assert not cpu_attention.install()
    assert cpu_attention.why().endswith("(torch reads its vector instructions as AVX2; the CPU lacks fma)")


@pytest.mark.parametrize("capability,isa", [("AVX512", "avx512"), ("AVX2", "avx2")])
def test_install_builds_the_isa_the_cpu_runs(monkeypatch, fake_cpu, capability, isa):
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setattr(attention_backend, "_cpu_step", None)
    monkeypatch.setattr(attention_backend, "_cpu_step_op", None)
    fake_cpu(capability, "avx2 fma avx512f")  # by the flags it runs both builds: torch's word decides
    built = []
    monkeypatch.setattr(cpu_attention, "build", lambda isa: built.append(isa) or "op")
    assert cpu_attention.install() and cpu_attention.installed() and built == [isa]
    assert attention_backend.cpu_step_kernel(torch.zeros(1, 1, 1, 16)) is cpu_attention.attend
    # a record names the build: its ISA's op
    assert attention_backend.describe("cpu") == {"asked": "auto", "decode_step": "llmstep_cpu",
                                                 "decode_step_op": f"llmstep_cpu_{isa}::attention"}


def test_an_isa_the_cpu_does_not_run_is_refused_before_anything_is_built(monkeypatch, fake_cpu):
    from torch.utils import cpp_extension

    fake_cpu("AVX2", None, ("avx2", "fma3", "avx512_f"))  # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("built a kernel this CPU cannot run"))
    with pytest.raises(RuntimeError, match="this CPU does not run the avx512 kernel .* as AVX2"):
        cpu_attention.build("avx512")
    assert cpu_attention.runs_here() == ("avx2",) and cpu_attention.isa_here() == "avx2"


def test_a_capability_raised_above_the_cpus_flags_builds_nothing_it_cannot_run(fake_cpu):
    """ATEN_CPU_CAPABILITY=avx512 on a CPU without AVX-512: torch reports AVX512; the kernel goes by the CPU's flags
    (loading an AVX-512 build there dies of an illegal instruction)."""
    fake_cpu("AVX512", "sse2 avx2 fma")
    assert cpu_attention.runs_here() == ("avx2",) and cpu_attention.isa_here() == "avx2"
    fake_cpu("AVX512", "avx512f avx2 fma")
    assert cpu_attention.runs_here() == ("avx512", "avx2")
    fake_cpu("AVX512", None, ("avx2", "fma3", "avx512_f"))  # no flags to read: torch's reading of them
    assert cpu_attention.runs_here() == ("avx512", "avx2")
    fake_cpu("AVX512", None, ("avx2", "fma3"))  # torch's reading of the features outranks its raised capability
    assert cpu_attention.runs_here() == ("avx2",)
    fake_cpu("AVX2", "avx512f avx2")  # no FMA: neither build
    assert cpu_attention.runs_here() == ()


@pytest.mark.parametrize("S", [5, 8, 20, 64, 100])
def test_a_nan_score_makes_its_row_nan_as_sdpa_does_wherever_it_lies(each_kernel, S):
    """max() passes a NaN on or drops it by its lane and chunk: without a look apart, a NaN key at some slots was
    left out silently (a finite row where SDPA gives NaN)."""
    kernel = each_kernel
    g = torch.Generator().manual_seed(S)
    q, k, v = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, S, 16, generator=g), torch.randn(1, 2, S, 16,
                                                                                                     generator=g)
    visible = torch.ones(1, 1, 1, S, dtype=torch.bool)
    for slot in range(S):
        bad = k.clone()
        bad[0, 0, slot, 3] = float("nan")  # head 0 only: head 1's row stays finite
        out = kernel(q, bad, v, visible)
        assert out[0, 0].isnan().all(), slot
        torch.testing.assert_close(out[0, 1], kernel(q, k, v, visible)[0, 1], atol=0, rtol=0)


def test_attending_before_install_says_so(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_state", {})
    q = torch.zeros(1, 1, 1, 16)
    with pytest.raises(RuntimeError, match=r"not installed \(install\(\): not called\)"):
        cpu_attention.attend(q, q, q, torch.ones(1, 1, 1, 1, dtype=torch.bool))


def test_an_unknown_isa_is_named():
    with pytest.raises(ValueError, match="no attention kernel for the ISA 'sse2': one of avx512, avx2"):
        cpu_attention.build("sse2")


@torch.no_grad()
def test_a_compiled_bf16_step_with_it_makes_the_eager_tokens(kernel):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, dim=96, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=256, max_seq_len=64)
    model = llmstep.Llama(config).to(torch.bfloat16)
    ids = torch.randint(0, 256, (7,)).tolist()
    eager = FastDecoder(model, max_len=32, compile=False).generate(ids, 8, temperature=0, stop_ids=()).tokens
    compiled = FastDecoder(model, max_len=32, compile=True)
    compiled.warmup()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tokens = compiled.generate(ids, 8, temperature=0, stop_ids=()).tokens
    assert tokens == eager
    ran = [e for e in prof.events() if e.name == cpu_attention.op_name(cpu_attention.isa_here()) + "_prefix"]
    assert len(ran) >= config.n_layers * 7, len(ran)  # the decode step's op, a layer a step, from the compiled code


def test_a_split_row_stays_finite_where_the_whole_one_does(each_isa):
    """Each chunk keeps its values' weighted mean, not their sum: 200 values of 3e37 seen with weights near 1 in
    their own chunk summed past float32's largest (inf, then 0 * inf = NaN in the combining) where the whole row,
    whose weights for them are tiny beside its top score's, and SDPA stay finite (a reviewer's case)."""
    attention, prefix = each_isa
    g = torch.Generator().manual_seed(7)
    S, D = 600, 16
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    k = torch.randn(1, 1, S, D, generator=g) * 0.1
    k[0, 0, :10, 0] = 40.0  # the first slots' scores 40 / 4 = 10 above the rest: the others' weights ~e^-10
    v = torch.randn(1, 1, S, D, generator=g)
    v[0, 0, 300:] = 3e37
    last = torch.tensor([S - 1])
    whole, split = prefix(q, k, v, last, D ** -0.5, 0, 1), prefix(q, k, v, last, D ** -0.5, 256, 8)
    want, _ = exact(q, k, v, torch.ones(1, 1, 1, S, dtype=torch.bool))
    assert whole.isfinite().all() and split.isfinite().all()
    assert ((split.double() - want).abs() <= 1e-5 * want.abs() + 1e-5).all()


@torch.no_grad()
def test_a_compiled_step_past_chunk_slots_splits_its_attention_and_makes_the_eager_tokens(kernel):
    """A decode step whose rows see more than CHUNK slots (its attention split, combined in order): the eager
    float32 model's greedy tokens (SDPA's attention), as at short contexts."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=256, dim=96, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=256, max_seq_len=512)
    model = llmstep.Llama(config).float().eval()
    for layer in model.layers:  # peaked attention: chunks' top scores far apart, as a trained model's are
        layer.attention.wq.weight.mul_(6.0)
    ids = torch.randint(0, 256, (cpu_attention.CHUNK + 40,)).tolist()
    eager = FastDecoder(model, max_len=320, compile=False).generate(ids, 8, temperature=0, stop_ids=()).tokens
    compiled = FastDecoder(model, max_len=320, compile=True)
    assert compiled.generate(ids, 8, temperature=0, stop_ids=()).tokens == eager

"""The bf16 dot-product micro-kernel that inductor's C++ GEMM template gets on CPUs with AVX-512 BF16
(llmstep/kernels/cpu_gemm.py): the same function as a float64 matmul to within float32 sums, at every row count
and column tail the template hands it, and the one a compiled bf16 step's matmuls run; with AMX, on one-row
matmuls only. And what every kernel of cpu_gemm shares: its tag in the compile cache keys, and the width rule of the
two float32-vector kernels (BF16_AVX2, INT8_AVX512)."""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import replace

import pytest
import torch

import llmstep
from llmstep.engines.compile import compile_step
from llmstep.engines.fast import FastDecoder
from llmstep.kernels import cpu_gemm

GREEDY = dict(temperature=0, stop_ids=())  # greedy, never stopping early: what these runs ask for

slow = pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"),
                          reason="compiles with tuned matmuls on the CPU (~1 min); set LLMSTEP_SLOW_TESTS=1")


@pytest.fixture(scope="module")
def kernel():
    if not cpu_gemm.BF16.install():
        pytest.skip(f"the kernel is not used on this machine: {cpu_gemm.BF16.why}")


@pytest.fixture
def every_row(kernel, monkeypatch):
    """The kernel at every row count: with AMX it takes one-row matmuls only (`AMX_ROWS`), here every one."""
    monkeypatch.setattr(cpu_gemm, "AMX_ROWS", 1 << 30)


def compiled_code(fn, *args):
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn, *args)


def test_a_cpu_without_avx512_bf16_keeps_inductors_kernels_and_says_why(monkeypatch):
    import torch._inductor.select_algorithm  # noqa: F401  (inductor's codegen modules import it first)
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codegen import cpp_micro_gemm

    for kernel in cpu_gemm.kernels():  # on this CPU, first: withheld below installs them, and a failure would stick
        kernel.install()
    monkeypatch.setattr(cpu_gemm, "BF16", replace(cpu_gemm.BF16, cls=None, why=None))
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: cpu_vec_isa.VecAVX2())
    before = dict(cpp_micro_gemm.micro_gemm_configs)
    assert not cpu_gemm.BF16.install() and not cpu_gemm.BF16.installed
    assert "AVX-512 BF16" in cpu_gemm.BF16.why and "avx2" in cpu_gemm.BF16.why
    assert cpp_micro_gemm.micro_gemm_configs == before  # nothing registered
    monkeypatch.setattr(cpu_gemm, "BF16", replace(cpu_gemm.BF16, cls=None, why=None))
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.5.1"))
    assert not cpu_gemm.BF16.install() and "2.5.1" in cpu_gemm.BF16.why  # an untested torch: not registered
    assert cpp_micro_gemm.micro_gemm_configs == before
    with cpu_gemm.withheld():  # no bf16 kernel to withhold; the int4 and int8 ones where this process has them
        ours = tuple(k.cls for k in cpu_gemm.kernels() if k is not cpu_gemm.BF16)
        assert cpp_micro_gemm.micro_gemm_configs == {c: v for c, v in before.items() if c not in ours}
    assert cpp_micro_gemm.micro_gemm_configs == before


def test_with_amx_the_kernel_ranks_with_inductors_amx_kernels_on_one_row_matmuls_only(monkeypatch):
    """Inductor ranks the micro-kernels that fit a matmul by ISA first (AMX above AVX-512): filed under AVX-512, the
    kernel would never run where there is AMX; filed under AMX for every row count, it would take the many-row
    matmuls (prefill, a batch) that AMX tiles do best."""
    import torch._inductor.select_algorithm  # noqa: F401
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codegen import cpp_micro_gemm

    tag = torch.compiler.config.cache_key_tag  # install() tags the cache keys: restored after
    for isa, rank, rows in [(cpu_vec_isa.VecAMX, cpu_vec_isa.VecAMX, cpu_gemm.AMX_ROWS),
                            (cpu_vec_isa.VecAVX512VNNI, cpu_vec_isa.VecAVX512VNNI, 1 << 30)]:
        monkeypatch.setattr(cpu_gemm, "BF16", replace(cpu_gemm.BF16, cls=None, why=None))
        monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda isa=isa: _with_bf16(isa()))
        before = dict(cpp_micro_gemm.micro_gemm_configs)
        try:
            assert cpu_gemm.BF16.install(), cpu_gemm.BF16.why
            (cls,) = set(cpp_micro_gemm.micro_gemm_configs) - set(before)
            configs = cpp_micro_gemm.micro_gemm_configs[cls]
            assert {c.vec_isa_cls for c in configs} == {rank}
            for m in (1, 2, 4, 16, 512):  # 256 columns on 2 threads: the 64-column blockings (balanced_width)
                fits = {c.register_blocking: c.extra_check(c, m, 256, 64, 1, 2) for c in configs}
                wide = {b for b in fits if b.block_n == 64}
                assert {b for b, f in fits.items() if f} == (wide if m <= rows else set()), (isa.__name__, m)
        finally:
            cpp_micro_gemm.micro_gemm_configs.clear()
            cpp_micro_gemm.micro_gemm_configs.update(before)
            torch.compiler.config.cache_key_tag = tag


@pytest.mark.parametrize("n,threads,width", [(576, 2, 32), (960, 2, 32), (192, 2, 32), (1536, 2, 64), (49152, 2, 64),
                                              (576, 1, 64), (576, 3, 64), (576, 4, 32), (100, 2, 64), (32, 1, 32)])
def test_each_matmul_takes_the_block_width_that_keeps_every_thread_busy(n, threads, width):
    """Inductor gives each thread ceil(blocks / threads) blocks of columns: SmolLM2's 576 columns at 64 are 9 blocks
    (5 and 4 on 2 threads), at 32 18 (9 and 9). The widest width whose busiest thread gets the fewest columns."""
    assert cpu_gemm.balanced_width(n, threads) == width
    busiest = {w: math.ceil(math.ceil(n / w) / threads) * w for w in cpu_gemm.WIDTHS}
    assert busiest[width] == min(busiest.values())


def _with_bf16(isa):
    isa.is_avx512_bf16_supported = lambda: True  # an AVX-512 CPU with BF16, whatever this one has
    return isa


@slow
@pytest.mark.parametrize("rows,cols,depth", [(1, 2048, 384), (1, 40, 6), (3, 200, 66), (4, 64, 32), (9, 328, 130),
                                             (1, 96, 64), (1, 576, 64)])
def test_the_kernel_computes_the_matmul_at_every_row_count_and_column_tail(every_row, rows, cols, depth):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    linear = torch.nn.Linear(depth, cols, bias=False).to(torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(torch.randn(cols, depth, generator=g))
    x = torch.randn(rows, depth, generator=g).to(torch.bfloat16)
    step = compile_step(lambda x: linear(x), torch.device("cpu"), mode="max-autotune-no-cudagraphs")
    torch._inductor.config.max_autotune_gemm_backends, before = "CPP", torch._inductor.config.max_autotune_gemm_backends
    try:
        with torch.no_grad():
            out, code = compiled_code(step, x)
    finally:
        torch._inductor.config.max_autotune_gemm_backends = before
    assert any(cpu_gemm.KERNEL_NAME in c for c in code), "the template did not run the dot-product kernel"
    width = cpu_gemm.balanced_width(cols, torch.get_num_threads())  # 96 columns: 32 wide (3 blocks, not 2 of 64)
    assert any(f"constexpr int64_t Nr = {width};" in c for c in code), width
    want = x.double() @ linear.weight.double().T  # [rows, cols]
    # bf16 products are exact in float32; the sums are float32, the output rounded once to bf16
    torch.testing.assert_close(out.double(), want, atol=0.02 * want.abs().max().item(), rtol=0.01)
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3


@slow
def test_with_amx_a_one_row_matmul_runs_the_kernel_and_a_four_row_one_amx_tiles(kernel):
    from llmstep.core import torch_compat

    if torch_compat.cpu_vector_isa() != "amx":
        pytest.skip("a CPU with AMX: elsewhere the kernel takes every row count")
    linear = torch.nn.Linear(128, 256, bias=False).to(torch.bfloat16).requires_grad_(False)
    torch._inductor.config.max_autotune_gemm_backends, before = "CPP", torch._inductor.config.max_autotune_gemm_backends
    try:
        for rows in (1, 4):
            x = torch.randn(rows, 128).to(torch.bfloat16)
            torch._dynamo.reset()
            step = compile_step(lambda x: linear(x), torch.device("cpu"), mode="max-autotune-no-cudagraphs")
            with torch.no_grad():
                out, code = compiled_code(step, x)
            assert any(cpu_gemm.KERNEL_NAME in c for c in code) == (rows == 1), rows
            assert any("amx" in c.lower() for c in code) == (rows > 1), rows
            want = x.double() @ linear.weight.double().T  # [rows, 256]
            assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3
    finally:
        torch._inductor.config.max_autotune_gemm_backends = before


@slow
def test_without_the_kernel_the_template_runs_inductors_own_and_computes_the_same_matmul():
    """The fallback where this torch's registry cannot be used (llmstep.core.torch_compat's micro_gemm): inductor's
    registry as torch ships it, whose kernels give the matmul to within the same bf16 rounding."""
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(66, 200, bias=False).to(torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(torch.randn(200, 66, generator=g))
    x = torch.randn(3, 66, generator=g).to(torch.bfloat16)
    torch._inductor.config.max_autotune_gemm_backends, before = "CPP", torch._inductor.config.max_autotune_gemm_backends
    try:
        with cpu_gemm.withheld(), torch.no_grad():  # a no-op where the kernel is not installed
            step = compile_step(lambda x: linear(x), torch.device("cpu"), mode="max-autotune-no-cudagraphs")
            out, code = compiled_code(step, x)
    finally:
        torch._inductor.config.max_autotune_gemm_backends = before
    assert not any(cpu_gemm.KERNEL_NAME in c for c in code)
    want = x.double() @ linear.weight.double().T  # [3, 200]
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3


@slow
def test_a_weight_computed_in_the_step_is_packed_first(every_row):
    """A bmm's second operand is no frozen weight: the template hands it over unpacked ([K, N]) and the kernel packs
    each 64 columns into pairs along k itself (reading it as packed gave errors the size of the outputs)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 8, 64, generator=g).bfloat16(), torch.randn(2, 64, 128, generator=g).bfloat16()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, y: torch.bmm(x, y), options={"max_autotune": True,
                                                              "max_autotune_gemm_backends": "CPP"})
    out, code = compiled_code(fn, a, b)
    assert any(cpu_gemm.KERNEL_NAME in c for c in code) and any("pack_vnni2" in c for c in code)
    want = a.double() @ b.double()  # [2, 8, 128]
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max() + 1e-3


def test_the_kernel_is_named_in_compile_cache_keys_and_withheld_compiles_without_it(kernel):
    for other in cpu_gemm.kernels():
        other.install()  # as withheld does first (installing one adds its tag), whatever ran before this test
    tag = torch.compiler.config.cache_key_tag
    assert cpu_gemm.BF16.tag() in tag.split("+")  # a step cached without it (or with an older one) is not reused
    from torch._inductor.codegen import cpp_micro_gemm

    with cpu_gemm.withheld():
        assert cpu_gemm.BF16.tag() not in torch.compiler.config.cache_key_tag.split("+")
        assert not any(c.__name__ == "BF16Dot" for c in cpp_micro_gemm.micro_gemm_configs)
    assert torch.compiler.config.cache_key_tag == tag
    assert any(c.__name__ == "BF16Dot" for c in cpp_micro_gemm.micro_gemm_configs)


@slow
@pytest.mark.tuned_matmuls
def test_a_compiled_bf16_step_runs_it_and_gives_the_eager_logits(kernel, tiny_checkpoint):
    model, _ = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.bfloat16)
    prompt = list(range(3, 40))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # a bf16 step tunes its matmuls with 2+ threads (compile.tunes_matmuls)
    # The tuner keeps the template only where it measures faster than oneDNN's matmul, which depends on the CPU
    # and its load (on a Zen 4 EPYC it keeps oneDNN for this tiny model): held to the template, the step must run
    # the kernel; which one wins is a benchmark's question (scripts/ab_cpu.py), not a test's.
    backends = torch._inductor.config.max_autotune_gemm_backends
    torch._inductor.config.max_autotune_gemm_backends = "CPP"
    try:
        decoder = FastDecoder(model, max_len=64, compile=True)
        (_, code) = compiled_code(lambda: decoder.generate(prompt, 4, **GREEDY))
    finally:
        torch.set_num_threads(threads)
        torch._inductor.config.max_autotune_gemm_backends = backends
    assert any(cpu_gemm.KERNEL_NAME in c for c in code)
    token, position = torch.tensor([[7]]), torch.tensor([[len(prompt) + 3]])
    with torch.no_grad():
        logits = decoder.step(token, position).float()
        eager = model(token, position, decoder.cache, last_only=True)[:, -1].float()
    torch.testing.assert_close(logits, eager.view_as(logits), atol=0.05 * eager.abs().max().item(), rtol=0.05)
    assert logits.argmax() == eager.argmax()


@pytest.mark.parametrize("weights,cache,isa,streams", [
    (300 * 2**20, 32 * 2**20, "avx512_bf16", True),  # SmolLM2's bf16 step on a Zen 4 EPYC's 32 MiB L3
    (30 * 2**20, 32 * 2**20, "avx512_bf16", False),  # the shipped model's constants: the next step finds them there
    (300 * 2**20, None, "avx512_bf16", False),  # no cache listed: nothing known to stream past
    (None, 32 * 2**20, "avx512_bf16", False),  # outside a graph's code generation
    (300 * 2**20, 32 * 2**20, "amx", False),  # not measured there yet (STREAM_ISAS)
    (270 * 2**20, 8 * 2**20, "avx2", True),  # SmolLM2's bf16 step on a Zen 1's 8 MiB L3 (and a Zen 3's 32)
    (25 * 2**20, 8 * 2**20, "avx2", True),  # the shipped model's, outgrowing the Zen 1's L3
    (25 * 2**20, 32 * 2**20, "avx2", False),  # and fitting a Zen 3's
    (300 * 2**20, 8 * 2**20, "avx512", False),  # AVX-512 without BF16: not measured
])
def test_a_step_streams_its_weights_past_the_caches_only_where_they_outgrow_the_last_level(weights, cache, isa,
                                                                                           streams):
    assert cpu_gemm.streams_weights(weights, cache, isa) == streams
    with cpu_gemm.streaming(not streams):  # an A/B's override, either way
        assert cpu_gemm.streams_weights(weights, cache, isa) == (not streams)
    assert cpu_gemm.streams_weights(weights, cache, isa) == streams


def test_streaming_or_not_is_named_in_the_compile_cache_keys(kernel):
    tags = set()
    for on in (None, True, False):
        with cpu_gemm.streaming(on):
            assert cpu_gemm.BF16.tag() in torch.compiler.config.cache_key_tag.split("+")
            tags.add(cpu_gemm.BF16.tag())
    assert len(tags) == 3  # a step compiled streaming is never served to one that does not, nor the reverse
    assert cpu_gemm.BF16.tag() in torch.compiler.config.cache_key_tag.split("+")  # the rule's again
    for outer_streaming in (True, False):  # withheld stays withheld, whichever context is opened first
        with contextlib.ExitStack() as stack:
            contexts = [cpu_gemm.streaming(True), cpu_gemm.withheld()]
            for c in contexts if outer_streaming else contexts[::-1]:
                stack.enter_context(c)
            assert not any(t.startswith(cpu_gemm.KERNEL_NAME) for t in torch.compiler.config.cache_key_tag.split("+"))
    assert cpu_gemm.BF16.tag() in torch.compiler.config.cache_key_tag.split("+")


@slow
@pytest.mark.parametrize("cache", [2**10, 2**30])
def test_a_step_that_streams_its_weights_computes_the_same_bits(every_row, monkeypatch, cache):
    """Streaming is a prefetch hint: a one-row matmul's outputs are those of the step that does not stream, bit for
    bit; it streams only when the weights outgrow the last-level cache (here 1 KiB, or 1 GiB)."""
    rows = 1
    monkeypatch.setattr(cpu_gemm, "last_level_cache", lambda: cache)
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(384, 2048, bias=False).to(torch.bfloat16).requires_grad_(False)  # 1.5 MiB of weights
    linear.weight.copy_(torch.randn(2048, 384, generator=g))
    x = torch.randn(rows, 384, generator=g).to(torch.bfloat16)
    outs, codes = [], []
    backends = torch._inductor.config.max_autotune_gemm_backends
    torch._inductor.config.max_autotune_gemm_backends = "CPP"
    try:
        for on in (None, False):  # the rule's step, then one held from streaming
            with cpu_gemm.streaming(on), torch.no_grad():
                torch._dynamo.reset()
                step = compile_step(lambda x: linear(x), torch.device("cpu"), mode="max-autotune-no-cudagraphs")
                out, code = compiled_code(step, x)
            outs.append(out)
            codes.append("\n".join(code))
    finally:
        torch._inductor.config.max_autotune_gemm_backends = backends
        monkeypatch.undo()  # this machine's cache again, and its tags: later tests key on them
        cpu_gemm._retag()
    assert all(cpu_gemm.KERNEL_NAME in c for c in codes)
    streamed = "_rows<1, true>("  # the kernel's one-row call that streams (inductor names the kernel)
    assert (streamed in codes[0]) == (cache < linear.weight.nbytes) and streamed not in codes[1]
    assert torch.equal(outs[0], outs[1])


def test_a_kernels_tag_is_replaced_by_its_own_name_only():
    """A kernel whose name extends another's (llmstep_int8_avx2 and a future llmstep_int8_avx2_vnni) keeps its tag
    when the other's is replaced or withdrawn."""
    before = torch.compiler.config.cache_key_tag
    try:
        torch.compiler.config.cache_key_tag = ""
        cpu_gemm._tag("llmstep_k", "llmstep_k-aaa", True)
        cpu_gemm._tag("llmstep_k_wide", "llmstep_k_wide-bbb", True)
        cpu_gemm._tag("llmstep_k", "llmstep_k-ccc", True)
        assert torch.compiler.config.cache_key_tag.split("+") == ["llmstep_k_wide-bbb", "llmstep_k-ccc"]
        cpu_gemm._tag("llmstep_k", "llmstep_k-ccc", False)
        assert torch.compiler.config.cache_key_tag == "llmstep_k_wide-bbb"
    finally:
        torch.compiler.config.cache_key_tag = before


def test_a_kernels_tag_follows_the_helpers_its_rule_calls(monkeypatch):
    """A change to a helper of a kernel's rule alone (`balanced_width` here, not in any registering function's text)
    retags the kernels: steps compiled under the old rule are not served from the cache under the new one."""
    before = {k.name: k.tag() for k in cpu_gemm.kernels()}
    real = cpu_gemm.inspect.getsource
    helper = real(cpu_gemm.balanced_width)
    assert "balanced_width" not in "".join(real(k.register) for k in cpu_gemm.kernels()).replace(
        "balanced_width(n, num_threads", "")  # no registering function spells the helper's body
    edited = helper.replace("return min(widths", "return max(widths")
    assert edited != helper
    monkeypatch.setattr(cpu_gemm.inspect, "getsource", lambda obj: real(obj).replace(helper, edited))
    cpu_gemm._rules_text.cache_clear()
    try:
        after = {k.name: k.tag() for k in cpu_gemm.kernels()}
    finally:
        monkeypatch.undo()
        cpu_gemm._rules_text.cache_clear()
    assert all(after[name] != tag for name, tag in before.items()), (before, after)
    assert {k.name: k.tag() for k in cpu_gemm.kernels()} == before  # the files' own text again


# The two float32-vector kernels' rule (`_one_row_balanced`), and each one's k-block: a table of one-row matmuls
# (m, n, threads) and the widths taken, where k is a multiple of both k-blocks
FLOAT_VECTOR_KERNELS = {"BF16_AVX2": ("_register_bf16_avx2", "avx2", torch.bfloat16, 16),
                        "INT8_AVX512": ("_register_int8_avx512", "avx512_bf16", torch.int8, 64)}


@pytest.mark.parametrize("kernel_name", sorted(FLOAT_VECTOR_KERNELS))
@pytest.mark.parametrize("m,n,k,threads,dynamic,widths", [
    (1, 49152, 576, 2, False, [64]),  # SmolLM2's LM head: 768 blocks of 64, evenly split
    (1, 576, 576, 2, False, [32]),  # 9 blocks of 64 split 5/4; 18 of 32 split 9/9
    (1, 576, 576, 3, False, [64]),  # three threads: 3/3/3 of 64
    (1, 96, 128, 2, False, [32]),  # 64 does not divide 96: the kernels have no column tail
    (1, 48, 128, 2, False, []),  # neither divides 48: inductor's own kernel
    (1, 32, 128, 2, False, []),  # one block for two threads: one idles (or, k-slicing allowed, they split k)
    (1, 96, 128, 4, False, []),  # three blocks of 32 for four threads: the same
    (1, 192, 128, 4, False, [32]),  # 64 ties with 32 on the busiest thread but leaves one of four without a block
    (1, 128, 128, 3, False, [32]),  # the same at three threads: two blocks of 64, four of 32
    (1, 576, 576 + 32, 2, False, "k"),  # k a multiple of 16 and not of 64: the bf16 kernel's k-block only
    (2, 576, 576, 2, False, []),  # more than one row: inductor's kernels
    (1, 576, 576, 2, True, []),  # a prefill's dynamic row count
])
def test_the_float32_vector_kernels_take_one_row_matmuls_at_the_balanced_width_with_a_block_a_thread(
        monkeypatch, kernel_name, m, n, k, threads, dynamic, widths):
    from types import SimpleNamespace

    from llmstep.core import torch_compat

    register, isa, dtype, block_k = FLOAT_VECTOR_KERNELS[kernel_name]
    if widths == "k":
        widths = [32] if k % block_k == 0 else []
    seen = {}
    monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda: isa)
    monkeypatch.setattr(torch_compat, "register_vec_micro_gemm",
                        lambda name, blockings, fits, dtype, **kw: seen.update(blockings=blockings, fits=fits,
                                                                               dtype=dtype))
    getattr(cpu_gemm, register)()  # its rule, with nothing registered
    assert seen["dtype"] == dtype and {b[2] for b in seen["blockings"]} == {block_k}
    configs = [SimpleNamespace(register_blocking=SimpleNamespace(block_m=bm, block_n=bn, block_k=bk))
               for bm, bn, bk in seen["blockings"]]
    taken = [c.register_blocking.block_n for c in configs if seen["fits"](c, m, n, k, 1, threads, dynamic_M=dynamic)]
    assert taken == widths

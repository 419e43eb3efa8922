"""int4 weights times 8-bit activations (llmstep.core.int4a8) and its kernels (llmstep.kernels.cpu_int4a8): the
kernel's codes and steps bit for bit the reference's, its matmul the reference's function to float32 rounding at
every shape its layout holds, a row's output independent of the rows beside it, and the mode through quantize(),
fusion and a checkpoint (a compiled step: tests/kernels/test_cpu_int8a8.py, for both modes)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import a8_kernel_agrees, a8_rows

import llmstep
from llmstep.core import int4a8, int8a8
from llmstep.core.fuse import fused
from llmstep.core.quant_formats import QuantConfig, QuantizationError, dequantize_int4, quantize_int4, unpack_int4
from llmstep.core.quantize import Int4Linear, quantize
from llmstep.kernels import cpu_int4a8


@pytest.fixture
def reference_only():
    """int4a8.matmul with no kernel registered (torch's ops), restored after."""
    saved = int4a8._kernel
    int4a8.use_kernel(None)
    yield
    int4a8._kernel = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_codes_and_steps_are_the_references_bit_for_bit(a8_ops, dtype):
    for seed, K in enumerate([32, 96, 576, 1536]):
        x = a8_rows(5, K, dtype, seed)
        p, d = a8_ops.quantize(x)
        want_p, want_d = int4a8.quantize_activations(x)
        assert torch.equal(p.float(), want_p) and torch.equal(d, want_d)
        assert p.abs().max() <= 127 and torch.all(d[0, 0] == 0) and torch.all(p[0, :32] == 0)


def test_each_op_has_a_meta_kernel_that_gives_its_shapes_and_checks_its_input(a8_ops):
    """What a trace with fake tensors or on the meta device asks of an op (the CUDA proofs' way): the shapes and
    dtypes the CPU kernel gives, and the same refusal of a bad input."""
    x = torch.empty(3, 96, device="meta", dtype=torch.bfloat16)
    p, d = a8_ops.quantize(x)
    assert (p.shape, p.dtype, d.shape, d.dtype, p.device.type) == ((3, 96), torch.int8, (3, 3), torch.float32, "meta")
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        a8_ops.quantize(torch.empty(3, 40, device="meta"))
    y = a8_ops.mm8(x, torch.empty(64, 96, device="meta", dtype=torch.int8), torch.empty(64, device="meta"))
    assert (y.shape, y.dtype) == ((3, 64), torch.float32)


def _layer(N, K, g, dtype, seed):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, scales, zeros = quantize_int4(w.to(dtype), g, scale_dtype=dtype)
    return codes, scales, zeros


@pytest.mark.parametrize("N,K,g", [(576, 576, 32), (192, 576, 32), (40, 1536, 32), (8, 64, 64), (24, 256, 128),
                                   (96, 384, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_the_matmul_is_x_hat_times_the_dequantised_weights_to_float32_rounding(a8_ops, N, K, g, dtype, M):
    codes, scales, zeros = _layer(N, K, g, dtype, N + K + g)
    w, sz = int4a8.layout(unpack_int4(codes), scales, zeros)
    x = a8_rows(M, K, dtype, M)
    y = a8_ops.mm(x, w, sz, g)
    xh = int4a8.fake_quantize(x).double()
    W = dequantize_int4(codes, scales, zeros, torch.float64)
    want, scale = xh @ W.T, xh.abs() @ W.abs().T  # the sum of |terms|: what float32 rounding is relative to
    assert y.dtype == torch.float32 and y.shape == (M, N)
    assert ((y.double() - want).abs() <= 1e-6 * scale + 1e-30).all()


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(a8_ops):
    codes, scales, zeros = _layer(96, 384, 32, torch.bfloat16, 1)
    w, sz = int4a8.layout(unpack_int4(codes), scales, zeros)
    x = a8_rows(9, 384, torch.bfloat16, 2)
    together = a8_ops.mm(x, w, sz, 32)
    for m in range(9):
        assert torch.equal(a8_ops.mm(x[m:m + 1], w, sz, 32), together[m:m + 1])


def test_streaming_the_weights_past_the_caches_changes_no_bit(a8_ops):
    """`stream` is a prefetch hint for one-row calls (a decode step's): the same bits at one row and at several."""
    codes, scales, zeros = _layer(96, 384, 32, torch.bfloat16, 4)
    w, sz = int4a8.layout(unpack_int4(codes), scales, zeros)
    q = torch.randint(-128, 128, (96, 384), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    s = torch.rand(96, dtype=torch.bfloat16) + 0.5
    for M in (1, 3):
        x = a8_rows(M, 384, torch.bfloat16, 6 + M)
        assert torch.equal(a8_ops.mm(x, w, sz, 32, True), a8_ops.mm(x, w, sz, 32, False))
        assert torch.equal(a8_ops.mm8(x, q, s, True), a8_ops.mm8(x, q, s))


def test_a_step_traced_while_streaming_holds_its_kernels_stream_and_keeps_it(a8_ops, model128):
    """int4a8.streams() is read once, as a step is traced: the kernels' calls in the graph carry it (no guard, so
    the step keeps it when run outside `streaming`); outside, they do not stream."""
    model = quantize(model128[0], "int4-g32-a8+lm_head-int8-a8", inplace=False)
    graphs = []

    def capture(gm, inputs):
        graphs.append([tuple(n.args[4:] if "mm8" not in str(n.target) else n.args[3:]) for n in gm.graph.nodes
                       if n.op == "call_function" and str(n.target).startswith(a8_ops.name)])
        return gm.forward

    x = torch.tensor([[1, 2, 3]])
    for on in (True, False):
        torch._dynamo.reset()
        step = torch.compile(lambda t: model(t), backend=capture, fullgraph=True)
        with torch.no_grad(), int4a8.streaming(on):
            step(x)
        with torch.no_grad():
            step(x)  # outside: the same code, not traced again
        assert len(graphs) == 1 and len(graphs[0]) == 7 * model.config.n_layers + 1  # unfused: 7 a layer, a head
        assert all(args == (on,) for args in graphs.pop())
    assert not int4a8.streams()


@pytest.mark.parametrize("on", [True, False])
def test_a_frozen_step_is_called_under_the_streaming_its_rule_decides(monkeypatch, model128, on):
    """compile_step holds int4a8.streaming(streams_weights(models)) around the compiled call (where it is traced),
    decided once, at the first call; outside the call nothing streams."""
    import llmstep.engines.compile as compile_mod

    decided = []
    monkeypatch.setattr(compile_mod, "streams_weights", lambda models: decided.append(models) or on)
    monkeypatch.setattr(compile_mod.torch_compat, "holding_freezing", lambda compiled: lambda *a: int4a8.streams())
    step = compile_mod.compile_step(lambda: None, torch.device("cpu"), models=[model128[0]])
    assert step() is on and step() is on and len(decided) == 1
    assert not int4a8.streams()


def test_a_compiled_step_streams_where_its_weights_outgrow_the_last_level_cache(monkeypatch, model128):
    """engines.compile.streams_weights: kernels.cpu_gemm's rule on the models' bytes (each tensor once), the
    override of cpu_gemm.streaming first."""
    import llmstep.engines.compile as compile_mod
    from llmstep.kernels import cpu_gemm

    model = model128[0]
    size = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])  # its head is its embedding: once
    monkeypatch.setattr(compile_mod, "_vector_isa", lambda: "avx2")
    for cache, want in ((size - 1, True), (size, False), (None, False)):
        monkeypatch.setattr(compile_mod, "last_level_cache", lambda cache=cache: cache)
        assert compile_mod.streams_weights([model, model]) is want
        for on in (True, False):
            with cpu_gemm.streaming(on):
                assert compile_mod.streams_weights([model]) is on
    monkeypatch.setattr(compile_mod, "_vector_isa", lambda: "avx512")  # not an ISA where streaming was measured
    monkeypatch.setattr(compile_mod, "last_level_cache", lambda: 1)
    assert compile_mod.streams_weights([model]) is False


def test_a_nan_or_an_infinity_makes_its_row_non_finite_and_leaves_the_others(a8_ops):
    codes, scales, zeros = _layer(64, 256, 32, torch.float32, 3)
    w, sz = int4a8.layout(unpack_int4(codes), scales, zeros)
    for bad in (float("nan"), float("inf")):
        for where in (0, 37, 255):  # max() passes a NaN on or drops it by lane: every lane is looked at
            x = a8_rows(3, 256, torch.float32, 4)
            x[1, where] = bad
            y = a8_ops.mm(x, w, sz, 32)
            assert not torch.isfinite(y[1]).any() and torch.isfinite(y[[0, 2]]).all()


def test_a_block_too_small_to_invert_gets_codes_0_on_both_paths(a8_ops):
    """max|x| below 127 / FLT_MAX: 1 / d overflows. The codes are 0 (the block adds nothing), where x * inf would
    give NaN codes (and a NaN row from a finite input) on torch's path and -128 on the kernel's."""
    x = torch.zeros(1, 64)
    x[0, :5] = torch.tensor([1e-38, -2e-38, 0.0, 3e-39, 1e-37])
    x[0, 32:] = torch.randn(32)
    p, d = a8_ops.quantize(x)
    want_p, want_d = int4a8.quantize_activations(x)
    assert torch.equal(p.float(), want_p) and torch.equal(d, want_d) and not p[0, :32].any()
    assert torch.isfinite(int4a8.fake_quantize(x)).all()


def test_bad_arguments_are_named(a8_ops):
    codes, scales, zeros = _layer(64, 256, 32, torch.float32, 3)
    w, sz = int4a8.layout(unpack_int4(codes), scales, zeros)
    with pytest.raises(RuntimeError, match="weights must be contiguous uint8"):
        a8_ops.mm(torch.randn(1, 224), w, sz, 32)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        a8_ops.mm(torch.randn(1, 256), w, sz, 48)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        a8_ops.mm(torch.randn(1, 256).half(), w, sz, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_computes_the_same_function_with_the_kernel_or_torchs_ops(a8_ops, dtype):
    lin = torch.nn.Linear(256, 96, bias=False).to(dtype)
    layer = Int4Linear.from_linear(lin, 64, activations=8)
    assert layer.kernel == "a8" and "activations=8" in repr(layer)
    a8_kernel_agrees(layer, int4a8, dtype)


def test_the_kernels_layout_replaces_the_codes_which_come_back_exactly(a8_ops):
    lin = torch.nn.Linear(256, 72, bias=False)  # 9 vectors of 8 columns: two whole tiles and a tail
    codes, _, _ = quantize_int4(lin.weight, 32)
    layer = Int4Linear.from_linear(lin, 32, activations=8)
    assert layer.weight is None and layer.kernel_weight is not None  # held once, in the kernel's layout
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.state_dict()["weight"], codes)
    asked = Int4Linear.from_linear(lin, 32, kernel="dequant", activations=8)  # torch's ops, as asked
    assert asked.kernel == "dequant" and asked.kernel_weight is None and torch.equal(asked.weight, codes)
    x = torch.randn(3, 256)
    assert torch.allclose(asked(x), layer(x), rtol=1e-5, atol=1e-5)


def test_a_float16_layer_keeps_its_codes_for_torchs_ops_and_compiles(a8_ops):
    """The kernel takes float32 or bf16 activations: a float16 layer keeps its plain codes (kernel "dequant"), where
    it held the kernel's layout alone and read its codes back from it at every matmul, a step dynamo cannot trace."""
    lin = torch.nn.Linear(256, 72, bias=False).half()
    codes, _, _ = quantize_int4(lin.weight, 32, scale_dtype=torch.float16)
    layer = Int4Linear.from_linear(lin, 32, activations=8)
    assert layer.kernel == "dequant" and layer.kernel_weight is None and torch.equal(layer.weight, codes)
    x = torch.randn(2, 256, dtype=torch.float16)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, backend="eager", fullgraph=True)(x), layer(x))


def test_the_config_names_parses_and_refuses_it():
    qc = QuantConfig.of("int4-g32-a8+lm_head-int8")
    assert (qc.mode, qc.group_size, qc.activations, qc.lm_head) == ("int4", 32, 8, "int8")
    assert str(qc) == "int4-g32-a8+lm_head-int8" and QuantConfig.of(qc.to_dict()) == qc
    assert qc.layer("wq").activations == 8 and qc.head == QuantConfig("int8")
    assert QuantConfig.of("int4-a8+lm_head").head.activations == 8  # the head in the blocks' mode: theirs too
    assert QuantConfig.of("int4-a8", group_size=32) == QuantConfig("int4", 32, activations=8)
    assert "activations" not in QuantConfig.of("int4-g32").to_dict()  # weight-only configs are written as before
    with pytest.raises(QuantizationError, match="not a multiple of 32"):
        QuantConfig("int4", 16, activations=8)
    with pytest.raises(QuantizationError, match=r"activations=8 \(8-bit activations\) or None"):
        QuantConfig("int4", 32, activations=4)
    with pytest.raises(QuantizationError, match="its own kernel"):
        Int4Linear(64, 64, 32, kernel="packed", activations=8)


@torch.no_grad()
def test_a_quantised_model_is_close_to_weight_only_int4_and_fuses_and_saves_exactly(a8_ops, model128, tmp_path):
    model, tok = model128
    a8 = quantize(model, "int4-g32-a8+lm_head", inplace=False)
    w4 = quantize(model, "int4-g32+lm_head", inplace=False)
    assert all(m.activations == 8 and m.kernel == "a8" for m in a8.layers.modules() if isinstance(m, Int4Linear))
    assert a8.output.activations == 8 and a8.output.kernel == "dequant"  # 300 columns: torch's ops, the same function
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, weight_only = a8(tokens), w4(tokens)
    # the activations' rounding (a step of max|x| / 127 per block) moves the logits a little, not a lot
    err = (logits - weight_only).norm() / weight_only.norm()
    assert 0 < err < 0.05
    assert torch.equal(fused(a8)(tokens), logits)  # q|k|v and gate|up in one matmul each: the same bits
    # kernel="a8" asked of the whole model: the int8 head takes its own (not a half-quantised model and an error)
    mixed = quantize(model, "int4-g32-a8+lm_head-int8", kernel="a8", inplace=False)
    assert mixed.output.kernel != "a8" and mixed.layers[0].attention.wq.kernel == "a8"
    assert mixed.output.mode == "int8" and mixed.output.activations is None  # the head weight-only int8
    path = llmstep.save(a8, tmp_path / "a8", tokenizer=tok)
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg["activations"] == 8 and cfg["format_version"] == 3
    loaded, _ = llmstep.load(path, dtype="float32")
    assert loaded.quantization == a8.quantization and torch.equal(loaded(tokens), logits)


def test_a_reader_of_an_older_format_cannot_drop_the_activations(model128, tmp_path):
    from llmstep.core.checkpoint import CheckpointError

    model, tok = model128
    path = llmstep.save(quantize(model, "int4-g32-a8", inplace=False), tmp_path / "a8", tokenizer=tok)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 2
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="version 2 has no 8-bit activations"):
        llmstep.load(path)


@torch.no_grad()
def test_with_activations_gives_int4_blocks_8_bit_activations_and_nothing_else(model128):
    model, _ = model128
    w4 = quantize(model, "int4-g32+lm_head-int8", inplace=False)
    tokens = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    a8 = int4a8.with_activations(w4)
    assert a8 is w4 and str(a8.quantization) == "int4-g32-a8+lm_head-int8"
    assert torch.equal(a8(tokens), quantize(model, "int4-g32-a8+lm_head-int8", inplace=False)(tokens))
    for bad, says in [(model, "not quantised"), (quantize(model, "int8", inplace=False), "int8"),
                      (a8, "int4-g32-a8"), (quantize(model, "int4-g16", inplace=False), "not a multiple of 32")]:
        with pytest.raises(QuantizationError, match=says):
            int4a8.with_activations(bad)


@torch.no_grad()
def test_with_activations_after_a_fuse_fuses_the_converted_layers_and_a_failure_changes_nothing(model128,
                                                                                               monkeypatch):
    model, _ = model128
    w4 = quantize(model, "int4-g32", inplace=False)
    tokens = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    weight_only = w4(tokens)
    before = fused(w4)  # a decoder's twin of the weight-only layers, alive (the layers remember it)
    assert before.layers[0].attention.wqkv.activations is None
    calls, original = [], Int4Linear.prepare

    def failing(self):  # the third layer's conversion fails (memory, an interrupt)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        calls.append(self)
        return original(self)

    monkeypatch.setattr(Int4Linear, "prepare", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        int4a8.with_activations(w4)
    assert len(calls) == 2 and w4.quantization == QuantConfig("int4", 32)  # two layers converted, then a failure
    assert all(m.activations is None for m in w4.modules() if isinstance(m, Int4Linear))
    assert torch.equal(w4(tokens), weight_only)  # every layer as it was
    monkeypatch.setattr(Int4Linear, "prepare", original)
    int4a8.with_activations(w4)
    twin = fused(w4)  # not the weight-only twin of before
    assert twin.layers[0].attention.wqkv.activations == 8 and twin.layers[0].attention.wqkv.kernel == "a8"
    assert torch.equal(twin(tokens), w4(tokens)) and before.layers[0].attention.wqkv.activations is None


# ---- the builds for each ISA (kernels/cpu_int4a8.ISAS) ---------------------------------------------------------

def test_each_isas_build_gives_the_same_bits_as_avx2s(a8_ops):
    """The integers are exact on every build (VNNI's `vpdpbusd` sums a lane's 4 products where AVX2 sums pairs in
    16 bits), and the float arithmetic after them is one order: every output bit equal, at extreme codes too (every
    weight code 15 or int8 -128 against activations of +-127, the largest sums either form makes)."""
    avx2 = cpu_int4a8.build("avx2")
    g = torch.Generator().manual_seed(0)
    for N, K, group, M in [(576, 576, 32, 1), (1536, 576, 64, 1), (72, 1536, 128, 3), (40, 256, 32, 17)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = a8_rows(M, K, dtype, N)
            codes, scales, zeros = _layer(N, K, group, dtype, K)
            extreme = torch.full_like(unpack_int4(codes), 15)
            for c in (unpack_int4(codes), extreme):
                w, sz = int4a8.layout(c, scales, zeros)
                for stream in (False, True):
                    assert torch.equal(a8_ops.mm(x, w, sz, group, stream), avx2.mm(x, w, sz, group, stream))
            q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
            for qq in (q, torch.full_like(q, -128)):
                s = torch.rand(N, generator=g).to(dtype)
                assert torch.equal(a8_ops.mm8(x, qq, s), avx2.mm8(x, qq, s))
            assert all(torch.equal(a, b) for a, b in zip(a8_ops.quantize(x), avx2.quantize(x), strict=True))
    big = torch.full((2, 256), 3.0)  # every block's codes +-127
    big[1] = -3.0
    w, sz = int4a8.layout(torch.full((16, 256), 15, dtype=torch.uint8), torch.ones(16, 8), torch.zeros(16, 8))
    assert torch.equal(a8_ops.mm(big, w, sz, 32), avx2.mm(big, w, sz, 32))
    q = torch.full((16, 256), -128, dtype=torch.int8)
    assert torch.equal(a8_ops.mm8(big, q, torch.ones(16)), avx2.mm8(big, q, torch.ones(16)))


def test_the_best_isa_the_cpu_runs_by_torch_and_by_its_flags(fake_cpu):
    vnni = "fpu avx2 fma avx512f avx512bw avx512vl avx512_vnni"
    fake_cpu("AVX512", vnni)
    assert cpu_int4a8.runs_here() == ("avx512_vnni", "avx2")
    fake_cpu("AVX2", vnni)  # ATEN_CPU_CAPABILITY=avx2 lowers it
    assert cpu_int4a8.runs_here() == ("avx2",)
    fake_cpu("AVX512", "fpu avx2 fma avx512f avx512bw avx512vl")  # AVX-512 without VNNI (Skylake-X)
    assert cpu_int4a8.runs_here() == ("avx2",)
    torch_avx512 = ("avx2", "fma3", "avx512_f", "avx512_bw", "avx512_vl")
    fake_cpu("AVX512", None, (*torch_avx512, "avx512_vnni"))  # no flags to read: torch's reading of them
    assert cpu_int4a8.runs_here() == ("avx512_vnni", "avx2")
    fake_cpu("AVX512", None, torch_avx512)  # AVX-512 without VNNI, where no /proc/cpuinfo says so
    assert cpu_int4a8.runs_here() == ("avx2",)
    fake_cpu("DEFAULT", vnni)
    assert cpu_int4a8.runs_here() == ()


def test_an_isa_the_cpu_does_not_run_or_that_has_no_build_is_refused_before_anything_is_built(monkeypatch, fake_cpu):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("built a kernel this CPU cannot run"))
    fake_cpu("AVX512", "fpu avx2 fma avx512f")
    with pytest.raises(RuntimeError, match=r"does not run the avx512_vnni build \(torch reads its vector instructions "
                                           r"as AVX512; the CPU lacks avx512_vnni, avx512bw, avx512vl\)"):
        cpu_int4a8.build("avx512_vnni")
    with pytest.raises(ValueError, match="no 8-bit activation kernels for the ISA 'sse2': one of avx512_vnni, avx2"):
        cpu_int4a8.build("sse2")


def test_using_an_isa_registers_its_build_and_gives_back_the_installed_one(a8_ops):
    installed = (int4a8.kernel_op(), int8a8.kernel_op())
    with cpu_int4a8.using("avx2"):
        assert (int4a8.kernel_op(), int8a8.kernel_op()) == ("llmstep_int4a8_avx2::mm", "llmstep_int4a8_avx2::mm8")
    assert (int4a8.kernel_op(), int8a8.kernel_op()) == installed
    with pytest.raises(ValueError, match="'sse2'"), cpu_int4a8.using("sse2"):
        pass
    assert (int4a8.kernel_op(), int8a8.kernel_op()) == installed


def test_using_is_refused_in_a_second_thread_while_one_holds_it(a8_ops):
    """The registered build is process-wide: two overlapping holds would each give back the build the other had
    registered, and the last to leave would leave the wrong one. Nested holds in one thread are fine."""
    import threading

    installed, errors = int4a8.kernel_op(), []

    def second():
        try:
            with cpu_int4a8.using("avx2"):
                errors.append("entered")
        except RuntimeError as e:
            errors.append(str(e))

    with cpu_int4a8.using("avx2"), cpu_int4a8.using("avx2"):  # nested in this thread
        assert int4a8.kernel_op() == "llmstep_int4a8_avx2::mm"
        other = threading.Thread(target=second)
        other.start()
        other.join(30)
        assert int4a8.kernel_op() == "llmstep_int4a8_avx2::mm"
    assert len(errors) == 1 and "held in another thread" in errors[0]
    assert int4a8.kernel_op() == installed

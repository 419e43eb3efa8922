"""The fast decode loop (static cache, compiled step, on-device sampling) makes the tokens of the teaching loop."""

import os
from collections import Counter

import pytest
import torch
from llmstep.fast import FastDecoder
from torch.utils._python_dispatch import TorchDispatchMode

import llmstep
from llmstep.core.quantize import Int8Linear, QuantConfig, quantize
from llmstep.engines.compile import compile_step
from llmstep.engines.decoding import CACHE_ROUNDING, cache_len
from llmstep.lab.probe import no_recompiles

GREEDY = dict(temperature=0, stop_ids=())  # greedy, never stopping early: what these runs ask for

PROMPT = [295, 17, 101, 42, 7, 250, 33]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def one_layer(one_layer_checkpoint):
    """The compiled-step tests' model: what they prove is about the loop around a block (the static cache, the
    sampling inside the step, the frozen weights), which one block shows; each compile is about half as long."""
    return llmstep.load(one_layer_checkpoint, device="cpu", dtype=torch.float32)


def test_greedy_tokens_equal_the_eager_generate_loop(tiny):
    model, tok = tiny
    eager = llmstep.generate(model, tok, PROMPT, max_new_tokens=40, temperature=0, stop_ids=[])
    fast = FastDecoder(model).generate(PROMPT, max_new_tokens=40, temperature=0, stop_ids=())
    assert fast.tokens == eager.tokens and len(fast.tokens) == 40
    assert fast.decode_steps == 39 and fast.stop_reason == "length"


@pytest.mark.parametrize("kw", [dict(temperature=0.9), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_seeded_sampling_draws_the_same_tokens(tiny, kw):
    model, tok = tiny
    eager = llmstep.generate(model, tok, PROMPT, max_new_tokens=30, seed=7, stop_ids=[], **kw)
    fast = FastDecoder(model).generate(PROMPT, max_new_tokens=30, seed=7, **kw)
    assert fast.tokens == eager.tokens


def test_stop_tokens_end_the_run_where_the_eager_loop_ends_it(tiny):
    model, tok = tiny
    free = FastDecoder(model).generate(PROMPT, max_new_tokens=40, temperature=0.9, seed=1, stop_ids=()).tokens
    stop = free[12]  # a token the run reaches; the stop check runs only every 4 steps
    eager = llmstep.generate(model, tok, PROMPT, max_new_tokens=40, temperature=0.9, seed=1, stop_ids=[stop])
    decoder = FastDecoder(model, max_len=len(PROMPT) + 40, compile=False)
    fast = decoder.generate(PROMPT, 40, temperature=0.9, seed=1, stop_ids=[stop], sync_every=4)
    assert fast.tokens == eager.tokens and fast.tokens[-1] == stop
    assert fast.stop_reason == eager.stop_reason == "stop"


def test_a_reused_static_cache_and_a_full_context_behave(tiny):
    model, _ = tiny
    decoder = FastDecoder(model, max_len=32, compile=False)
    first = decoder.generate(PROMPT, 20, **GREEDY)
    decoder.generate(list(reversed(PROMPT)) * 3, 10, **GREEDY)  # leaves other keys and values in the cache
    assert decoder.generate(PROMPT, 20, **GREEDY).tokens == first.tokens  # stale slots are masked, never read
    full = decoder.generate(PROMPT, 100, **GREEDY)
    assert len(full.tokens) == 32 - len(PROMPT) + 1 and full.stop_reason == "context"
    with pytest.raises(ValueError, match="the cache it may fill is 32"):
        decoder.generate(list(range(40)), 5, **GREEDY)


def test_quantised_models_run_through_the_same_loop(tiny):
    model, _ = tiny
    qmodel = quantize(model, QuantConfig("int4", 16), inplace=False)
    eager, cache = [], qmodel.new_cache(1, 32)
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(10):  # the plainest loop there is: the model's forward, argmax, feed back
            x = qmodel(x, cache=cache)[:, -1].argmax(-1, keepdim=True)
            eager.append(int(x))
    assert FastDecoder(qmodel).generate(PROMPT, 10, **GREEDY).tokens == eager


def test_the_public_step_is_one_token_through_the_model_into_the_decoders_cache(tiny):
    model, _ = tiny
    decoder = FastDecoder(model, max_len=32, compile=False)
    decoder.generate(PROMPT, 4, **GREEDY)  # the cache holds the prompt and three decode steps
    token, position = torch.tensor([[5]]), torch.tensor([[len(PROMPT) + 3]])
    with torch.no_grad():
        expected = model(token, position, model.new_cache(1, 32), last_only=True)  # a fresh cache: other keys
        got = decoder.step(token, position)
    assert got.shape == (1, model.config.vocab_size) and got.dtype == torch.float32
    assert not torch.allclose(got, expected[:, -1].float())  # it attends to the decoder's cache, not a fresh one


def test_the_warmup_runs_the_step_even_when_eager(tiny):
    """Nothing times a never-run step: an eager decoder's warm-up runs its step once (compile_seconds stays 0)."""
    model, _ = tiny
    calls = []
    handle = model.output.register_forward_hook(lambda *_: calls.append(1))
    try:
        decoder = FastDecoder(model, max_len=32, compile=False)
        assert decoder.warmup() == 0 and len(calls) == 1 and decoder.compile_seconds == 0  # nothing compiled
        assert decoder.warmup() == 0 and len(calls) == 1  # once
        assert int(decoder.cache.lengths[0]) == 0  # and its dummy token is gone from the cache
    finally:
        handle.remove()


def test_a_request_for_no_new_token_or_one_runs_no_decode_step(tiny):
    """No decode step runs for 0 new tokens (nothing to make) or 1 (the prefill makes it): none is warmed, so a
    compiled decoder compiles nothing for it."""
    model, _ = tiny
    decoder = FastDecoder(model, max_len=32, compile=False)
    for n in (0, 1):
        r = decoder.generate([1, 2, 3], n, temperature=0.5, top_k=7)
        assert len(r.tokens) == n and r.decode_steps == 0
        assert not decoder.is_warm((0.5, 7, 1.0))


def test_a_decoder_sized_per_request_uses_the_one_sizing_rule(tiny):
    model, tok = tiny
    decoder = FastDecoder(model, compile=False)
    ctx = model.config.max_seq_len
    assert decoder.max_len == cache_len(1, 0, ctx, rounding=CACHE_ROUNDING)
    out = decoder.generate(PROMPT, 40, **GREEDY)
    assert decoder.max_len == cache_len(len(PROMPT), 40, ctx, rounding=CACHE_ROUNDING)
    assert out.tokens == llmstep.generate(model, tok, PROMPT, 40, temperature=0, stop_ids=[]).tokens


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~30 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
@pytest.mark.tuned_matmuls  # the engines' default compile, matmuls tuned: end to end, here
def test_compiled_step_gives_the_eager_tokens(one_layer):
    model, tok = one_layer
    eager = llmstep.generate(model, tok, PROMPT, max_new_tokens=24, temperature=0, stop_ids=[])
    decoder = FastDecoder(model, max_len=len(PROMPT) + 24, compile=True)
    assert decoder.warmup() > 0  # public, as a benchmark calls it: the step the runs use, in the runs' mode
    with no_recompiles():
        assert decoder.generate(PROMPT, 24, **GREEDY).tokens == eager.tokens
    # Seeded sampling inside the compiled step: the noise the loop refills is read, not frozen into the code.
    sampled = llmstep.generate(model, tok, PROMPT, max_new_tokens=24, temperature=0.8, seed=3, stop_ids=[])
    assert decoder.generate(PROMPT, 24, temperature=0.8, seed=3, stop_ids=()).tokens == sampled.tokens
    # On a CPU the weights are frozen into the compiled step: changing them afterwards changes what the eager
    # model computes but not what the step computes (proof that freezing took effect). Same cache, same input.
    decoder.generate(PROMPT, 4, **GREEDY)  # the cache holds the prompt and three decode steps
    token, position = torch.tensor([[5]]), torch.tensor([[len(PROMPT) + 3]])
    w = model.layers[0].feed_forward.w2.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            before = decoder.step(token, position).clone()
            w.mul_(-3)
            after = decoder.step(token, position)
            eager_after = model(token, position, decoder.cache, last_only=True)[:, -1]
        assert torch.equal(after, before)
        assert not torch.allclose(eager_after, before, atol=1e-3)
    finally:
        with torch.no_grad():
            w.copy_(saved)


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~30 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_compiled_quantized_step_gives_its_eager_tokens(one_layer, quant):
    """Frozen weights, concatenated matmuls, fused dequantisation: still the function the eager model computes."""
    model, _ = one_layer
    qmodel = quantize(model, QuantConfig(quant, 16 if quant == "int4" else None), inplace=False)
    eager = FastDecoder(qmodel, max_len=len(PROMPT) + 24, compile=False)
    compiled = FastDecoder(qmodel, max_len=len(PROMPT) + 24, compile=True)
    for kw in (dict(temperature=0), dict(temperature=0.8, top_k=50, seed=3)):
        assert compiled.generate(PROMPT, 24, **kw).tokens == eager.generate(PROMPT, 24, **kw).tokens


def test_compile_options_freeze_and_fuse_on_the_cpu_only(monkeypatch):
    from llmstep.engines.compile import compile_options

    cpu = compile_options(torch.device("cpu"))
    assert cpu["freezing"] and cpu["cpp.enable_concat_linear"] and cpu["cpp_wrapper"]
    assert compile_options(torch.device("cpu"), "max-autotune")["max_autotune"]
    # by default a CPU step's matmuls are tuned among `gemm_backends` (inductor's C++ templates against oneDNN unless
    # the engine says otherwise); an explicit mode's are as torch's mode has them
    assert cpu["max_autotune_gemm"] and not compile_options(torch.device("cpu"), "default").get("max_autotune_gemm")
    assert not compile_options(torch.device("cpu"), None, gemm_backends=None).get("max_autotune_gemm")
    assert cpu["max_autotune_gemm_backends"] == "ATEN,CPP"
    assert compile_options(torch.device("cpu"), None, "CPP")["max_autotune_gemm_backends"] == "CPP"
    for old_switch in ({"tune_matmuls": False}, {"gemm_backends": False}):  # the earlier bool keeps its meaning
        assert not compile_options(torch.device("cpu"), None, **old_switch).get("max_autotune_gemm")
    assert compile_options(torch.device("cpu"), None, tune_matmuls=True)["max_autotune_gemm_backends"] == "ATEN,CPP"
    from llmstep.engines.compile import gemm_backends, tunes_matmuls
    from llmstep.kernels import cpu_gemm

    f32, bf16 = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        f16 = torch.nn.Linear(64, 64, bias=False).to(torch.float16)
        assert tunes_matmuls(f32) and not tunes_matmuls(f16)  # one thread: the widening template lost (0.64x)
        quantised = torch.nn.Sequential(bf16, Int8Linear.from_linear(bf16))
        from llmstep.core import torch_compat

        # an AVX2 CPU (no bf16 instructions: oneDNN emulates them) tunes bf16 at one thread; an AMX one where
        # cpu_gemm's kernel is not registered (an untested torch) does not
        monkeypatch.setattr(cpu_gemm.BF16, "install", lambda: False)
        for isa, tuned in (("avx2", True), ("amx", False)):
            monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
            assert tunes_matmuls(bf16) == tuned and gemm_backends(bf16) == ("ATEN,CPP" if tuned else None)
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda: "amx")  # a CPU with bf16 instructions
        for dot in (True, False):  # where cpu_gemm's kernel installs, and where it is not registered
            monkeypatch.setattr(cpu_gemm.BF16, "install", lambda dot=dot: dot)
            # bf16 on one thread: tuned where the template has the dot-product kernel, not elsewhere
            assert tunes_matmuls(bf16) == dot
            assert tunes_matmuls(quantised)  # quantised: tuned
            # the backends a step tunes among: none where it does not tune; the template alone for bf16 models
            # (their linears quantised or not) where cpu_gemm's kernel runs; else oneDNN/MKL against the template
            assert gemm_backends(f16) is None and gemm_backends(f32) == "ATEN,CPP"
            assert gemm_backends(bf16) == ("CPP" if dot else None)
            assert gemm_backends(quantised) == ("CPP" if dot else "ATEN,CPP")
            # a speculative round with a float32 model in it: oneDNN too; untuned where the bf16 model is not tuned
            assert gemm_backends(bf16, f32) == ("ATEN,CPP" if dot else None)
        torch.set_num_threads(2)
        assert tunes_matmuls(bf16)
        assert gemm_backends(bf16, f16) == "ATEN,CPP"
    finally:
        torch.set_num_threads(threads)
    cuda = compile_options(torch.device("cuda"))
    assert cuda["triton.cudagraphs"] and "freezing" not in cuda
    from llmstep.engines.compile import uses_cuda_graphs  # what compile_step marks a graph step for, each call

    assert uses_cuda_graphs(torch.device("cuda")) and uses_cuda_graphs(torch.device("cuda"), "max-autotune")
    assert not uses_cuda_graphs(torch.device("cuda"), "default") and not uses_cuda_graphs(torch.device("cpu"))


def test_bf16_int4_steps_tune_among_the_template_alone_where_an_int4_micro_kernel_takes_every_matmul(monkeypatch):
    # On the Zen 1 VM torch's int4 kernel won inductor's hot-cache timing for some of SmolLM2's matmul shapes and then
    # ran at about half the template's speed in the step (results/README.md, claim 2): where cpu_gemm.INT4 takes every
    # int4 matmul of a bf16 step, the template alone. Where a shape is no micro-kernel's, torch's kernel must stay a
    # choice, on every CPU (inductor has no other then: NoValidChoicesError)
    from llmstep.core import torch_compat
    from llmstep.core.quantize import Int4Linear
    from llmstep.engines.compile import gemm_backends
    from llmstep.kernels import cpu_gemm

    def model(*out_features, k=64, group=32, dtype=torch.bfloat16, kernel="packed"):
        net = torch.nn.Sequential(torch.nn.LayerNorm(k).to(dtype))
        for n in out_features:
            layer = Int4Linear(k, n, group, dtype=dtype)
            layer.kernel = kernel  # as prepare() leaves it where torch's packed CPU kernel runs the layer
            net.append(layer)
        return net

    monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda: "avx2")
    monkeypatch.setattr(cpu_gemm.BF16, "install", lambda: False)  # no AVX-512 BF16
    for installed in (True, False):
        monkeypatch.setattr(cpu_gemm.INT4, "install", lambda installed=installed: installed)
        monkeypatch.setattr(cpu_gemm.INT4, "active", lambda installed=installed: installed)
        assert gemm_backends(model(64, 96)) == ("CPP" if installed else "ATEN,CPP")
        assert gemm_backends(model(64, 48)) == "ATEN,CPP"  # 48 columns: not whole blocks of 32
        assert gemm_backends(model(64, dtype=torch.float32)) == "ATEN,CPP"  # a float32 step: oneDNN too
        assert gemm_backends(model(64, kernel="dequant")) == "ATEN,CPP"  # no int4 matmul of torch's kernel
        assert gemm_backends(model(64), model(48)) == "ATEN,CPP"  # every model of the step
    monkeypatch.setattr(cpu_gemm.INT4, "install", lambda: True)
    monkeypatch.setattr(cpu_gemm.INT4, "active", lambda: False)  # installed, withheld (scripts/ab_cpu.py's ~nodot)
    assert gemm_backends(model(64, 96)) == "ATEN,CPP"
    assert cpu_gemm.int4_takes(96, 64, 32) is False
    # AVX-512 BF16 (or AMX) with cpu_gemm's bf16 kernel: the template alone already, now only where inductor's int4
    # kernel takes every int4 matmul: 64 columns a block, groups of 32, 64 or 128
    monkeypatch.setattr(cpu_gemm.BF16, "install", lambda: True)
    for isa in ("avx512_bf16", "amx"):
        monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda isa=isa: isa)
        assert gemm_backends(model(64, 128)) == "CPP" and gemm_backends(model(64, 96)) == "ATEN,CPP"
        assert gemm_backends(model(64, k=256, group=256)) == "ATEN,CPP"
        assert gemm_backends(model(64, kernel="dequant")) == "CPP"  # no int4 matmul: as before
    monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda: "avx512")  # AVX-512 without BF16: no int4 kernel
    assert not cpu_gemm.int4_takes(64, 64, 32)
    monkeypatch.setattr(torch_compat, "cpu_vector_isa", lambda: "avx2")
    monkeypatch.setattr(cpu_gemm.INT4, "active", lambda: True)
    assert cpu_gemm.int4_takes(96, 64, 32) and cpu_gemm.int4_takes(32, 128, 128)
    assert not cpu_gemm.int4_takes(48, 64, 32) and not cpu_gemm.int4_takes(32, 48, 16)
    assert not cpu_gemm.int4_takes(32, 96, 64)  # a group across the end of the row


def test_a_withheld_avx2_int4_kernel_leaves_torchs_kernel_a_choice():
    from llmstep.core.quantize import Int4Linear
    from llmstep.engines.compile import gemm_backends
    from llmstep.kernels import cpu_gemm

    if not cpu_gemm.INT4.install():
        pytest.skip(f"the AVX2 int4 kernel is not used here: {cpu_gemm.INT4.why}")
    net = torch.nn.Sequential(torch.nn.LayerNorm(64).to(torch.bfloat16), Int4Linear(64, 64, 32, dtype=torch.bfloat16))
    net[1].kernel = "packed"
    assert gemm_backends(net) == "CPP" and cpu_gemm.INT4.active()
    with cpu_gemm.withheld(only=(cpu_gemm.INT4,)):
        assert not cpu_gemm.INT4.active() and gemm_backends(net) == "ATEN,CPP"
    assert gemm_backends(net) == "CPP"


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~30 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
@pytest.mark.tuned_matmuls
@pytest.mark.parametrize("whole_blocks", [True, False])
def test_a_bf16_int4_step_compiles_and_runs_with_the_backends_its_shapes_allow(tmp_path, tokenizer_file, whole_blocks):
    """The engines' default compile of a bf16 int4 model: where every int4 matmul is the AVX2 kernel's (whole blocks
    of 32 columns) the template alone, else torch's kernel too (two KV heads of 8: wk and wv 16 wide): either
    compiles, and its greedy tokens follow its eager logits."""
    from conftest import make_checkpoint

    from llmstep.engines.compile import gemm_backends
    from llmstep.kernels import cpu_gemm

    shapes = dict(intermediate_size=96, num_key_value_heads=4 if whole_blocks else 2)
    make_checkpoint(tmp_path, tokenizer_file, num_hidden_layers=1, **shapes)
    model, _ = llmstep.load(tmp_path, device="cpu", dtype=torch.bfloat16)
    qmodel = quantize(model, QuantConfig("int4", 32), inplace=False)
    packed = [m for m in qmodel.modules() if getattr(m, "kernel", None) == "packed"]
    if packed and cpu_gemm.INT4.install():  # AVX2 alone, where torch packs its CPU int4 weights
        assert gemm_backends(qmodel) == ("CPP" if whole_blocks else "ATEN,CPP")
    decoder = FastDecoder(qmodel, max_len=len(PROMPT) + 8, compile=True)
    tokens = decoder.generate(PROMPT, 8, **GREEDY).tokens
    # each greedy token is the eager model's argmax given the tokens before it, or within bf16 rounding of it
    ids = torch.tensor([PROMPT + tokens[:-1]])
    logits = qmodel(ids)[0, len(PROMPT) - 1:].float()  # [8, vocab]: the eager logits at each decoded position
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (logits.amax(1) - chosen <= 0.05 * logits.abs().amax(1)).all(), (tokens, logits.argmax(1).tolist())


def test_prompt_tensors_hold_one_sequence(tiny):
    model, _ = tiny
    decoder = FastDecoder(model, max_len=32, compile=False)
    assert decoder.generate(torch.tensor([PROMPT]), 5, **GREEDY).tokens == decoder.generate(PROMPT, 5, **GREEDY).tokens
    with pytest.raises(ValueError, match=r"got shape \[2, 7\]"):  # not two prompts run as one
        decoder.generate(torch.tensor([PROMPT, PROMPT]), 5, **GREEDY)


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~30 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
def test_more_compiled_steps_than_dynamo_keeps_by_default():
    """Every decoder, batcher or batch size compiles the same method anew (one code object, new shapes): a
    process that builds more than dynamo's default 8 must not fail."""

    class Step:
        def __init__(self, n):
            self.buf = torch.arange(n, dtype=torch.float32)

        def f(self, x):
            return x * 2 + self.buf

    for n in range(1, 11):
        out = compile_step(Step(n).f, torch.device("cpu"))(torch.ones(n))
        assert torch.equal(out, 2 + torch.arange(n, dtype=torch.float32))


@pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"), reason="torch.compile on the CPU takes ~10 s; "
                    "set LLMSTEP_SLOW_TESTS=1")
def test_an_unguarded_step_is_its_compiled_code_and_a_changed_state_gets_the_guarded_step():
    """Step.unguarded evaluates the compiled code's guards once and hands back that code, called without
    Dynamo: a state the code was not compiled for (a new shape, grad mode on) must get the guarded step, which
    recompiles, never the old code run on tensors it was not made for."""
    from llmstep.engines.compile import Step

    class State:
        x = torch.zeros(4)

    def bump():
        State.x.add_(1)
        return State.x * 2

    cpu = torch.device("cpu")
    eager = Step(bump, cpu, compile=False)
    assert eager.unguarded() is eager
    step = Step(bump, cpu, compile=True)
    with torch.no_grad():
        step()
        fast = step.unguarded()
        assert fast is not step and not hasattr(fast, "traced")  # Dynamo's code itself, not compile_step's wrapper
        assert torch.equal(fast(), torch.full((4,), 4.0)) and torch.equal(State.x, torch.full((4,), 2.0))
        State.x = torch.zeros(6)  # what the compiled code read has a new shape
        assert step.unguarded() is step
        assert torch.equal(step(), torch.full((6,), 2.0))  # recompiled for it
        again = step.unguarded()
        assert again is not step and torch.equal(again(), torch.full((6,), 4.0))
    assert step.unguarded() is step  # grad mode on: not the state the code was compiled in


def test_a_fused_decoder_gives_the_tokens_of_the_teaching_loop(tiny):
    """fuse=True (CUDA's default) runs the twin with q|k|v and gate|up as one matmul each: the same tokens."""
    model, tok = tiny
    decoder = FastDecoder(model, compile=False, fuse=True)
    assert decoder.fused and decoder.net is not model and FastDecoder(model, compile=False).net is model  # CPU: off
    for kw in (dict(temperature=0), dict(temperature=0.8, top_k=20, top_p=0.9, seed=5)):
        eager = llmstep.generate(model, tok, PROMPT, max_new_tokens=30, stop_ids=[], **kw)
        assert decoder.generate(PROMPT, 30, **kw).tokens == eager.tokens


class _Ops(TorchDispatchMode):
    """Every aten op run while active, except inside `paused` (the decode step's own ops)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def run_counted(decoder, monkeypatch, n: int, **kw) -> dict:
    """One decoder.generate of n tokens, counting the decode-step calls, the aten ops the loop runs outside
    the step, and the host syncs it asks for (Tensor.item/tolist/bool/int/float). The model takes the path a
    compiled step traces, run eagerly (the static forward: every slot attended, no length read back)."""
    decoder.static = True
    counts = dict(steps=0, syncs=0)
    ops = _Ops()
    sampling = (kw.get("temperature", 0.0), kw.get("top_k", 0), kw.get("top_p", 1.0))
    decoder.warmup(temperature=sampling[0], top_k=sampling[1], top_p=sampling[2])
    step = decoder._advance_step(sampling)
    inner = step.fn

    def counted_step(*args):
        counts["steps"] += 1
        ops.paused = True
        try:
            return inner(*args)
        finally:
            ops.paused = False

    monkeypatch.setattr(step, "fn", counted_step)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        real = getattr(torch.Tensor, name)

        def syncing(self, *a, _real=real, **k):
            counts["syncs"] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, syncing)
    with ops:
        tokens = decoder.generate(PROMPT, n, **kw).tokens
    monkeypatch.undo()
    return counts | dict(ops=ops.ops, tokens=tokens)


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.8, top_k=20, seed=1)])
def test_each_token_is_one_step_call_with_no_host_sync_and_nothing_else_but_its_noise(tiny, monkeypatch, kw):
    """The whole token (sampling, write-back, position) is inside the step: per token the loop calls the step
    once, asks the host nothing, and runs no other op, except one Exp(1) draw when it samples."""
    model, _ = tiny
    short = run_counted(FastDecoder(model, max_len=64, compile=False), monkeypatch, 5, **kw)
    long = run_counted(FastDecoder(model, max_len=64, compile=False), monkeypatch, 25, **kw)
    assert (short["steps"], long["steps"]) == (4, 24)
    # the prompt's and the final copy, the two reads of the eager prefill's cache mask (its filled length, and
    # whether it starts at 0), and on a CPU the forward's check of the prompt's ids (its least and greatest: no
    # device to wait for, and not made on a GPU): as many for 25 tokens as for 5
    assert short["syncs"] == long["syncs"] <= 6, (short["syncs"], long["syncs"])
    extra = Counter(long["ops"]) - Counter(short["ops"])  # what 20 more tokens cost outside the step
    assert sum((Counter(short["ops"]) - Counter(long["ops"])).values()) == 0
    if kw["temperature"] == 0:
        assert long["ops"] == short["ops"]  # not one op more for 20 more tokens
    else:
        assert extra == Counter({"aten.exponential_.default": 20})


def test_watched_stop_tokens_cost_one_host_sync_every_sync_every_steps(tiny, monkeypatch):
    model, _ = tiny
    counted = [run_counted(FastDecoder(model, max_len=64, compile=False), monkeypatch, n, temperature=0,
                           stop_ids=[model.config.vocab_size - 1], sync_every=5) for n in (6, 26)]
    assert counted[1]["syncs"] - counted[0]["syncs"] == 4  # checks at steps 10, 15, 20, 25


def test_compile_step_never_freezes_a_tensor_the_caller_refills():
    """Freezing (the CPU's compile) folds every fixed-address tensor a step does not write into a constant:
    the noise a sampled step reads must stay unmarked there, and be marked (no copy per replay) on CUDA."""
    from llmstep.engines.compile import compile_step

    def marked(t):
        return getattr(t, "_dynamo_static_input_type", None) is not None

    def step(state, noise):
        return state.add_(noise)

    for device, expect in ((torch.device("cpu"), False), (torch.device("cuda"), True)):
        state, noise = torch.zeros(3), torch.ones(3)
        compile_step(step, device, static=(state,), refilled=(noise,))  # torch.compile is lazy: nothing compiles
        assert marked(state) and marked(noise) == expect, device


def test_a_fused_speculator_gives_the_unfused_tokens_and_shares_a_layer_skip_drafts_rows(tiny):
    from llmstep.fast import FastSpeculator

    from llmstep.engines.drafts import LayerSkipDraft

    model, _ = tiny
    plain = FastSpeculator(model, LayerSkipDraft(model, 1), k=3, max_len=64, compile=False)
    fused_spec = FastSpeculator(model, LayerSkipDraft(model, 1), k=3, max_len=64, compile=False, fuse=True)
    assert fused_spec.fused and not plain.fused  # CPU default: off
    # The draft's block is the target's block 0: fusing it found the rows already stacked, no second copy.
    assert (fused_spec.draft.layers[0].attention.wqkv.weight.data_ptr()
            == fused_spec.target.layers[0].attention.wqkv.weight.data_ptr())
    for kw in (dict(temperature=0), dict(temperature=0.9, seed=4)):
        assert fused_spec.generate(PROMPT, 20, **kw).tokens == plain.generate(PROMPT, 20, **kw).tokens


def test_a_two_slot_decoder_warms_up_its_three_steps_at_position_0(tiny):
    """A compiled decoder warms its step up three times; from position 0 on, the third wrote slot 2 of a 2-slot cache
    (an inductor index error at max_len 2). Each warm-up step now starts at position 0. Run eagerly here, with the
    compiled engine's three warm-up steps and static forward (whose mask reads no position back)."""
    model, tok = tiny
    decoder = FastDecoder(model, max_len=2)
    decoder.compiled = decoder.static = True
    assert decoder.warmup() >= 0
    eager = llmstep.generate(model, tok, [5], max_new_tokens=2, temperature=0, stop_ids=[])
    assert decoder.generate([5], 2, **GREEDY).tokens == eager.tokens


def test_the_public_step_refuses_a_position_that_names_no_slot(tiny):
    """A static step reads no position back: a compiled one wrote position -1 into the last slot silently and gave
    an inductor error at the cache's end. The public step checks them on a CPU first."""
    model, _ = tiny
    decoder = FastDecoder(model, max_len=16)
    decoder.static = True
    token = torch.tensor([[5]])
    for bad in (-1, 16):
        with pytest.raises(ValueError, match=f"position {bad} names no slot of the KV cache's 16 \\(0..15\\)"):
            decoder.step(token, torch.tensor([[bad]]))
    assert decoder.step(token, torch.tensor([[15]])).shape == (1, model.config.vocab_size)

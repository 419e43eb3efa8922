"""The attention-backend switch (issue 25, item 2), proven on a CPU: the kernel asked for reaches the model's SDPA
call (eager and traced by Dynamo), a kernel the device lacks is PyTorch's error (the command line's bad input), the
profiler shows which kernel ran, and the records say what was asked."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmstep.core import attention_backend as ab
from llmstep.core.attention_backend import attention_backend
from llmstep.core.config import LlamaConfig
from llmstep.engines.fast import FastDecoder
from llmstep.lab import runinfo
from llmstep.lab.hardware import random_model
from llmstep.lab.probe import attention_kernels, profile_steps
from llmstep.lab.trace import trace_step

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=128, vocab_size=97, max_seq_len=64)
PROMPT = torch.tensor([[1, 2, 3, 4, 5, 6]])


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, device="cpu", dtype=torch.float32, std=0.1)


@torch.no_grad()
def test_math_gives_the_logits_of_pytorchs_own_math_switch_exactly_and_auto_its_default(model):
    auto = model(PROMPT)
    with attention_backend("math"):
        math = model(PROMPT)
    with sdpa_kernel([SDPBackend.MATH]):
        pytorch_math = model(PROMPT)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        pytorch_flash = model(PROMPT)
    assert torch.equal(math, pytorch_math) and torch.equal(auto, pytorch_flash)  # PyTorch's CPU default: flash
    assert not torch.equal(math, auto)  # so the two runs did use different kernels
    torch.testing.assert_close(math, auto, rtol=1e-5, atol=1e-5)
    assert ab.current() == "auto"  # the block is over


@torch.no_grad()
def test_a_kernel_the_cpu_lacks_is_pytorchs_error_at_the_sdpa_call(model):
    for name in ("efficient", "cudnn"):
        with attention_backend(name), pytest.raises(RuntimeError, match="No viable backend for scaled_dot_product"):
            model(PROMPT)
    with pytest.raises(ValueError, match="unknown attention backend 'fast': choose one of auto, math, flash"):
        with attention_backend("fast"):
            pass


@torch.no_grad()
def test_a_compiled_step_bakes_the_choice_in_and_compiles_again_under_another(model):
    """Dynamo traces the choice into the graph (no graph break: fullgraph) and guards on it."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    compiled(PROMPT)
    with attention_backend("math"):
        math = compiled(PROMPT)
        compiled(PROMPT)
    assert counter.frame_count == 2  # auto, then math; math again: no new compile
    with attention_backend("math"):
        assert torch.equal(math, model(PROMPT))
    with attention_backend("efficient"), pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
        compiled(PROMPT)  # traced with efficient: refused at the trace, as eager refuses it


def test_the_profile_shows_which_kernel_ran(model):
    decoder = FastDecoder(model, max_len=32, compile=False)

    def run(n):
        decoder.generate([1, 2, 3], n, temperature=0, stop_ids=())

    assert set(profile_steps(run, "cpu", steps=2, base=1)["attention_kernels"]) == {"flash"}
    with attention_backend("math"):
        assert set(profile_steps(run, "cpu", steps=2, base=1)["attention_kernels"]) == {"math"}
    assert attention_kernels(["pytorch_flash::flash_fwd_splitkv_kernel", "fmha_cutlassF_bf16_aligned_64x64",
                              "cudnn_generated_fort_native_sdpa_sm90", "aten::mm"]) == \
        {"flash": 1, "efficient": 1, "cudnn": 1}


def test_records_say_which_backend_was_asked_for(model, monkeypatch):
    monkeypatch.setattr(ab, "_cpu_step", None)  # no CPU kernel registered (an earlier test may have compiled a step)
    assert runinfo.header("cpu", torch.float32, None, None)["attention"] == {"asked": "auto", "decode_step": "sdpa"}
    with attention_backend("math"):
        assert runinfo.header("cpu", torch.float32, None, None)["attention"] == {"asked": "math", "decode_step": "sdpa"}
        assert trace_step(model, context=4, repeats=1).attention == {"asked": "math", "decode_step": "sdpa"}
    monkeypatch.setattr(ab, "_cpu_step", lambda *args: None)  # one registered: "auto"'s compiled CPU step takes it
    assert runinfo.header("cpu", torch.float32, None, None)["attention"] == {"asked": "auto",
                                                                             "decode_step": "llmstep_cpu"}
    with attention_backend("math"):
        assert runinfo.header("cpu", torch.float32, None, None)["attention"]["decode_step"] == "sdpa"


def test_a_record_names_the_cpu_kernels_op_only_for_the_kernel_registered_now(monkeypatch):
    monkeypatch.setattr(ab, "_cpu_step", None)
    monkeypatch.setattr(ab, "_cpu_step_op", None)

    def kernel(q, k, v, mask):
        return q

    ab.use_cpu_step_kernel(kernel, op="llmstep_cpu_avx2::attention")
    assert ab.describe("cpu") == {"asked": "auto", "decode_step": "llmstep_cpu",
                                  "decode_step_op": "llmstep_cpu_avx2::attention"}
    for name, step in (("math", "sdpa"), ("flex", "flex")):  # a step that does not take the kernel names no op
        with attention_backend(name):
            assert ab.describe("cpu") == {"asked": name, "decode_step": step}
    monkeypatch.setattr(ab, "_cpu_step", lambda q, k, v, mask: q)  # another kernel, set behind its back: no stale op
    assert ab.describe("cpu") == {"asked": "auto", "decode_step": "llmstep_cpu"}
    ab.use_cpu_step_kernel(kernel)  # registered without an op: none named
    assert ab.describe("cpu") == {"asked": "auto", "decode_step": "llmstep_cpu"}
    ab.use_cpu_step_kernel(None)
    assert ab.describe("cpu") == {"asked": "auto", "decode_step": "sdpa"}


def test_on_cuda_the_record_lists_the_kernels_pytorch_may_pick(monkeypatch):
    for switch in ("math", "flash", "mem_efficient", "cudnn"):
        monkeypatch.setattr(torch.backends.cuda, f"{switch}_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    assert ab.describe("cuda")["allowed"] == ["math", "flash", "efficient", "cudnn"]
    with attention_backend("cudnn"):
        assert ab.describe("cuda")["allowed"] == ["cudnn"]
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)  # switched off globally
    with attention_backend("cudnn"):
        assert ab.describe("cuda")["allowed"] == []


def test_an_engine_warms_its_step_again_under_another_backend_before_timing_it(model, monkeypatch):
    """A compiled step traced under one backend compiles again under another: that compile belongs in the warm-up,
    not in the timed decode loop."""
    import llmstep.engines.engine as engine_module

    warmed, real = [], engine_module.warm_up
    monkeypatch.setattr(engine_module, "warm_up", lambda *a, **k: warmed.append(ab.current()) or real(*a, **k))
    decoder = FastDecoder(model, max_len=32, compile=False)
    for backend in ("auto", "auto", "math", "math", "auto"):
        with attention_backend(backend):
            decoder.generate([1, 2, 3], 3, temperature=0, stop_ids=())
    assert warmed == ["auto", "math"]


def test_blocks_in_two_threads_share_one_choice_and_leave_auto_behind():
    """The choice is the process's: a thread's block overlapping another's with another kernel is refused (before,
    the second block to close put back the first one's choice, and every later call ran with it); the same choice
    overlaps, blocks nest within a thread, and once the last one closes the choice is "auto" again."""
    import threading

    inside, done = threading.Event(), threading.Event()
    seen = {}

    def hold(name):
        with attention_backend(name):
            inside.set()
            done.wait(timeout=30)

    first = threading.Thread(target=hold, args=("math",))
    first.start()
    assert inside.wait(timeout=30)
    try:
        with pytest.raises(RuntimeError, match=r"attention_backend\('efficient'\) while another thread's block runs "
                                               r"with 'math'"):
            with attention_backend("efficient"):
                pass
        assert ab.current() == "math"
        with attention_backend("math"), attention_backend("math"):  # the same choice: shared
            seen["overlap"] = ab.current()
    finally:
        done.set()
        first.join(timeout=30)
    assert seen["overlap"] == "math" and ab.current() == "auto"
    with attention_backend("math"):
        with attention_backend("efficient"):  # one thread's own blocks nest
            assert ab.current() == "efficient"
        assert ab.current() == "math"
    assert ab.current() == "auto"

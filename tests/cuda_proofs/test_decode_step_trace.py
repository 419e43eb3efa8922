"""The whole decode step as inductor compiles it for CUDA, proven on a CPU-only build (issue 12's "trace of the
whole decode step with fake CUDA tensors through inductor's decompositions and post-grad passes").

FastDecoder's step (`_advance`: the pending token read from the history, the model, sampling, the write-back,
the position update) is traced to an FX graph with make_fx (pre-dispatch, so scaled_dot_product_attention
stays one op), its device arguments moved to CUDA, and handed to inductor's compile_fx with fake CUDA inputs
and the options `compile_options` gives CUDA; the graph after the post-grad passes is read before any Triton
code would be generated. What a CPU-only build cannot show, and the probe must: which SDPA kernel runs (the
choice reads the GPU's properties; with fake CUDA tensors here it decomposes to the math path's bmm), and
whether CUDA graphs are skipped.

Three things make the CPU-only trace possible, each only a detour around a CUDA device guard (none changes
what is proven): the traced function clones its state and returns the new state instead of mutating its
inputs (aot_autograd's write-back of input mutations opens a CUDA guard), inductor's joint-graph constant
folding is off (it would evaluate constants on the CUDA device), and misc_patterns' pattern init is skipped
(as in test_compile_trace.py). And make_fx traces on CPU tensors, where a static GQA step of one sequence calls
llmstep's CPU attention kernel once it is installed (llmstep.kernels.cpu_attention): the trace holds it
unregistered, so that it takes the branch CUDA runs (SDPA with the stacked rows' mask).
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch
from torch.func import functional_call

from llmstep.core import attention_backend
from llmstep.core.config import LlamaConfig
from llmstep.core.model import Llama
from llmstep.engines.compile import compile_options
from llmstep.engines.fast import FastDecoder
from llmstep.lab.hardware import random_model

CONFIG = LlamaConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=512, vocab_size=1000, max_seq_len=128)
MAX_LEN = 64
SAMPLING = (0.8, 50, 0.9)  # temperature, top-k, top-p: every sampling op in the graph


class _Stop(Exception):
    pass


def decode_step_graph(fuse: bool, sampling=SAMPLING) -> tuple[list[str], list[torch.fx.Node]]:
    """(call_function targets, nodes) of FastDecoder's decode step after inductor's post-grad passes for CUDA."""
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.misc_patterns as misc_patterns
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.device("meta"):
        model = Llama(CONFIG).to(torch.bfloat16).requires_grad_(False)
    decoder = FastDecoder(model, max_len=MAX_LEN, compile=False, fuse=fuse)
    net = decoder.net
    named = [*net.named_parameters(), *net.named_buffers()]
    cache, L = decoder.cache, CONFIG.n_layers
    state = [*cache.k, *cache.v, cache.lengths, decoder._history, decoder._position, decoder._finite,
             decoder._noise]

    def step(*tensors):
        weights = dict(zip([n for n, _ in named], tensors[: len(named)], strict=True))
        s = [t.clone() for t in tensors[len(named):]]  # returned, not mutated in place (see the docstring)
        cache.k, cache.v, cache.lengths = s[:L], s[L: 2 * L], s[2 * L]
        decoder._history, decoder._position, decoder._finite, decoder._noise = s[2 * L + 1:]
        decoder.net = lambda *a, **kw: functional_call(net, weights, a, kw)
        decoder._advance(*sampling)
        return tuple(s)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    registered = attention_backend._cpu_step
    attention_backend.use_cpu_step_kernel(None)  # CUDA's branch: SDPA (see the docstring)
    try:
        with mode:
            cpu = [torch.empty(t.shape, dtype=t.dtype) for t in [t for _, t in named] + state]
            cuda = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in cpu]
            decoder.static = True  # the model's compiled path: every slot, masked
            gm = make_fx(step, pre_dispatch=True)(*cpu)
    finally:
        attention_backend.use_cpu_step_kernel(registered)
    for node in gm.graph.nodes:  # the trace's own device arguments (arange, zeros) -> CUDA
        node.args = tuple(torch.device("cuda") if a == torch.device("cpu") else a for a in node.args)
        if node.kwargs.get("device") is not None:
            node.kwargs = {**node.kwargs, "device": torch.device("cuda")}
    gm.recompile()

    graphs = []

    def grab(graph):
        graphs.append(graph)
        raise _Stop  # before codegen: a CPU build has no CUDA code generator to run

    options = {k: v for k, v in compile_options(torch.device("cuda")).items() if k != "triton.cudagraphs"}
    options |= {"post_grad_custom_post_pass": grab, "joint_graph_constant_folding": False}
    original = misc_patterns._misc_patterns_init
    misc_patterns._misc_patterns_init = lambda input_device=None: None
    try:
        with inductor_config.patch(options):
            compile_fx(gm, cuda)
    except Exception:  # compile_fx wraps _Stop in its own error type
        if not graphs:
            raise
    finally:
        misc_patterns._misc_patterns_init = original
    nodes = [n for n in graphs[-1].nodes if n.op == "call_function"]
    return [getattr(n.target, "__name__", str(n.target)) for n in nodes], nodes


@pytest.fixture(scope="module")
def fused_graph():
    return decode_step_graph(fuse=True)


def test_no_one_row_matmul_falls_back_to_an_extern_kernel(fused_graph):
    ops, _ = fused_graph
    assert not {"mm.default", "addmm.default", "woq_int8", "_weight_int8pack_mm.default"} & set(ops), Counter(ops)
    # What bmm there is, is attention's: SDPA (traced once a layer) decomposed to its math path on fake CUDA (2 per
    # layer).
    assert ops.count("bmm.default") == 2 * CONFIG.n_layers


def test_fused_projections_make_four_weight_passes_per_layer_instead_of_seven(fused_graph):
    """Each 1-row linear becomes one multiply-and-sum reduction: fusing q|k|v and gate|up removes 3 per layer."""
    fused_ops, _ = fused_graph
    plain_ops, _ = decode_step_graph(fuse=False)
    assert plain_ops.count("sum.dim_IntList") - fused_ops.count("sum.dim_IntList") == 3 * CONFIG.n_layers


def test_kv_is_never_expanded_to_every_query_head(fused_graph):
    _, nodes = fused_graph
    hd = CONFIG.head_dim

    def shape(n):
        v = n.meta.get("val")
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    expanded = {(1, CONFIG.n_heads, MAX_LEN, hd), (CONFIG.n_heads, MAX_LEN, hd), (CONFIG.n_heads, hd, MAX_LEN)}
    assert not [n for n in nodes if shape(n) in expanded]
    assert [n for n in nodes if shape(n) == (1, CONFIG.n_kv_heads, MAX_LEN, hd)]  # the cache, as it is held


def test_sampling_the_write_back_and_the_position_are_in_the_step_with_no_host_sync(fused_graph):
    ops, _ = fused_graph
    assert {"sort.stable", "topk.default", "argmax.default", "gather.default"} <= set(ops)  # top-p, top-k, race
    assert ops.count("index_put.default") == 2 * CONFIG.n_layers + 1  # the cache's k and v, and the history
    assert not {"_local_scalar_dense.default", "item.default"} & set(ops)  # nothing read back to the host
    assert not [op for op in ops if "rand" in op or "exponential" in op or "seed" in op]  # the noise is an input


@pytest.mark.parametrize("sampling", [(0, 0, 1.0), SAMPLING])
def test_the_decode_step_traces_whole_with_no_graph_break(sampling):
    """Dynamo itself (fullgraph=True refuses any graph break), on CPU tensors: the same Python as on CUDA."""
    model = random_model(CONFIG, device="cpu", dtype=torch.float32)
    decoder = FastDecoder(model, max_len=MAX_LEN, compile=False, fuse=True)
    decoder.static = True  # what a compiled decoder sets: the model's path for a compiler
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(partial(decoder._advance, *sampling), backend="eager", fullgraph=True)()
    assert int(decoder._position) == 1

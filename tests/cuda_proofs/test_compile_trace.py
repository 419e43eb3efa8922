"""What inductor makes of a decode step's matmuls on CUDA, proven on a CPU: the layers are traced with fake
CUDA tensors (FakeTensorMode) through torch.compile's real pipeline (inductor's decompositions, the
post-grad pattern passes) with the options `compile_options` gives for CUDA, and the post-grad graph is
read before any code is generated (no GPU, no Triton needed).

Issue 12, item 1: without `coordinate_descent_tuning`, Int8Linear's `F.linear(x, w.to(x.dtype)) * scales`
is rewritten into the extern torch._weight_int8pack_mm (a lowering named `woq_int8`), slow at one row, and
a bf16 1-row matmul stays an extern `mm`; with it, both become a fused multiply-and-sum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmstep.core.quantize import Int8Linear
from llmstep.engines.compile import compile_options

CUDA = torch.device("cuda")
EXTERN_MATMULS = ("woq_int8", "mm.default", "addmm.default", "bmm.default", "_weight_int8pack_mm.default")


class _Stop(Exception):
    pass


def post_grad_ops(module: nn.Module, inputs: list[torch.Tensor], options: dict, trace=torch.fx.symbolic_trace
                  ) -> list[str]:
    """The call_function targets of `module`'s graph after inductor's post-grad passes, compiled with
    `options`; inputs and the module's tensors are fake CUDA tensors. `trace` makes the FX graph handed to
    inductor (a forward that branches on its input's shape needs make_fx under the fake mode)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.fx_passes.misc_patterns as misc_patterns
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def grab(graph):
        graphs.append([getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"])
        raise _Stop  # before codegen: a CPU build has no CUDA code generator to run

    patched = {k: v for k, v in options.items() if k != "triton.cudagraphs"} | {"post_grad_custom_post_pass": grab}
    original = misc_patterns._misc_patterns_init
    # These patterns (randperm + index_add) are traced with real tensors of the input's device: not on a CPU build.
    misc_patterns._misc_patterns_init = lambda input_device=None: None
    try:
        with inductor_config.patch(patched):
            compile_fx(trace(module), inputs)
    except Exception:  # compile_fx wraps _Stop in its own error type
        if not graphs:
            raise
    finally:
        misc_patterns._misc_patterns_init = original
    return graphs[-1]


def fake_cuda(module_on_meta: nn.Module, mode, *shapes_dtypes):
    with mode:
        module = module_on_meta.to_empty(device=CUDA)
        inputs = [torch.empty(shape, dtype=dtype, device=CUDA) for shape, dtype in shapes_dtypes]
    return module, inputs


@pytest.fixture
def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def test_cuda_compile_options_are_gpt_fasts():
    cuda = compile_options(CUDA)
    assert cuda["triton.cudagraphs"] and cuda["coordinate_descent_tuning"] and cuda["triton.unique_kernel_names"]
    assert "coordinate_descent_tuning" not in compile_options(torch.device("cpu"))


def test_int8_linear_one_row_is_a_fused_reduction_not_the_extern_int8pack_mm(fake_mode):
    linear, inputs = fake_cuda(Int8Linear(512, 1024, device="meta", dtype=torch.bfloat16), fake_mode,
                               ((1, 1, 512), torch.bfloat16))
    ops = post_grad_ops(linear, inputs, compile_options(CUDA))
    assert not set(ops) & set(EXTERN_MATMULS), ops
    assert "sum.dim_IntList" in ops
    # What the issue predicted for the options as they were (CUDA graphs alone): the extern kernel.
    before = post_grad_ops(linear, inputs, dict(torch._inductor.list_mode_options("reduce-overhead")))
    assert "woq_int8" in before


class _Linear(nn.Module):
    """nn.Linear's forward with its weight as a buffer (a fake CUDA nn.Parameter aborts compile_fx on a CPU build)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, device="meta", dtype=torch.bfloat16))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def test_bf16_linear_one_row_is_a_fused_reduction(fake_mode):
    linear, inputs = fake_cuda(_Linear(512, 1024), fake_mode,
                               ((1, 1, 512), torch.bfloat16))
    ops = post_grad_ops(linear, inputs, compile_options(CUDA))
    assert not set(ops) & set(EXTERN_MATMULS), ops

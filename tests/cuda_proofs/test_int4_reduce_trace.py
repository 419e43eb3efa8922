"""int4's single-reduction path on CUDA, proven on a CPU (issue 25, item 3): an Int4Linear with kernel="reduce"
at one row, traced with fake CUDA tensors through inductor's real pipeline with `compile_options(cuda)` (the
helpers of test_compile_trace.py), is one sum over pointwise work on the packed bytes: no extern matmul (mm,
addmm, bmm, tinygemm's _weight_int4pack_mm), and the bytes it reads are the codes, not a widened copy. The
same layer with kernel="packed" is the extern tinygemm call, for contrast."""

from __future__ import annotations

import pytest
import torch
from test_compile_trace import CUDA, EXTERN_MATMULS, fake_cuda, post_grad_ops
from torch.fx.experimental.proxy_tensor import make_fx

from llmstep.core.quantize import Int4Linear
from llmstep.engines.compile import compile_options

INT4_EXTERN = (*EXTERN_MATMULS, "_weight_int4pack_mm.default")
# What may surround the one sum: views, dtype conversions, elementwise arithmetic on the codes and the inputs.
POINTWISE = {"reshape.default", "view.default", "unsqueeze.default", "unbind.int", "getitem", "select.int",
             "convert_element_type.default", "__rshift__.Scalar", "bitwise_and.Scalar", "sub.Tensor", "mul.Tensor",
             "add.Tensor", "permute.default", "expand.default", "squeeze.dim"}


@pytest.fixture
def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def traced_ops(layer: Int4Linear, mode, rows: int = 1) -> list[str]:
    layer, inputs = fake_cuda(layer, mode, ((1, rows, layer.in_features), torch.bfloat16))

    def trace(module):
        with mode:  # make_fx runs the forward itself: its branch on the row count sees real shapes
            return make_fx(module)(*inputs)

    return post_grad_ops(layer, inputs, compile_options(CUDA), trace=trace)


@pytest.mark.parametrize("n,k,g", [(1024, 512, 64), (6144, 4096, 128), (1536, 512, 32)])  # 1536: q|k|v stacked
def test_the_reduce_kernel_at_one_row_is_one_sum_and_no_extern_matmul(fake_mode, n, k, g):
    ops = traced_ops(Int4Linear(k, n, g, device="meta", dtype=torch.bfloat16, kernel="reduce"), fake_mode)
    assert not set(ops) & set(INT4_EXTERN), ops
    assert ops.count("sum.dim_IntList") == 1, ops
    assert set(ops) - {"sum.dim_IntList"} <= POINTWISE, set(ops) - POINTWISE
    assert "__rshift__.Scalar" in ops and "bitwise_and.Scalar" in ops  # both nibbles taken from the bytes in the sum


def test_the_packed_kernel_is_tinygemms_extern_call(fake_mode):
    """The contrast the probe measures: the same layer with kernel="packed" stays the extern tinygemm kernel."""
    n, k, g, inner_k_tiles = 1024, 512, 64, 8
    layer = Int4Linear(k, n, g, device="meta", dtype=torch.bfloat16, kernel="packed")
    layer.weight = None  # what prepare() leaves on CUDA: the kernel's layout alone
    layer.kernel_weight = torch.empty(n // 8, k // (inner_k_tiles * 16), 32, inner_k_tiles // 2, dtype=torch.int32,
                                      device="meta")  # tinygemm's layout (torch._convert_weight_to_int4pack)
    layer.scales_and_zeros = torch.empty(k // g, n, 2, dtype=torch.bfloat16, device="meta")
    ops = traced_ops(layer, fake_mode)
    assert "_weight_int4pack_mm.default" in ops, ops

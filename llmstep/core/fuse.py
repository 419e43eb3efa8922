"""Fused projections: q|k|v as one matmul and gate|up as another, so a decode step reads x once per group.

At batch 1 a decode step is a chain of matrix-vector products, each one kernel that streams its weight.
Attention's wq, wk and wv read the same input, as do the MLP's w1 (gate) and w3 (up): with their weights
stacked row after row, each group is one matmul (one kernel, one pass over x, no tiny k/v GEMVs that leave
the GPU half idle), 4 weight passes per layer instead of 7. On a CPU inductor does this itself for float
weights when it freezes them (`cpp.enable_concat_linear`, llmstep.engines.compile), not for int8 ones; on CUDA
nothing does, so the fast loops fuse the weights once, up front, where nothing else will (`fuses_by_default`;
gpt-fast keeps `wqkv` and `w13` in its model for this reason).

`fused(model)` returns a twin of `model` that computes the same function with one `wqkv` and one `w13` per
block (Attention and FeedForward split the fused output back into q, k, v and gate, up). Every other tensor
is shared, and no weight is held twice: each group is concatenated once, one layer at a time, and `model`'s
own wq, wk, wv (w1, w3) become views of the fused tensor's rows. So `model` keeps its names, shapes, values
and state dict; an in-place change to its weights is a change to the twin's; fusing the same model again
finds the rows already back to back and copies nothing. Replacing a weight tensor of `model` (a new
Parameter, `model.to(...)`) leaves the twin with the old one: fuse again after that.

What fuses: plain nn.Linear (no bias), Int8Linear (int8 rows and their per-row scales stack the same way) and
Int4Linear (`_fused_int4`): its plain codes, scales and zeros stack by rows like the others, and `prepare()`
builds the packed kernel's layout for the stacked rows (tinygemm on CUDA, _for_cpu on a CPU), so an int4 layer
is 4 matmuls too. Where int4 copies, precisely:
- the kernel's layout is built once for the stacked rows; each part's own layout becomes a view of its rows when
  the kernel tiles rows in blocks the parts fill (the CPU kernel: 64 rows, tinygemm: 8; every Llama width),
  else the part keeps its own (checked by comparing, never assumed);
- the kernel's scale/zero table is [K/g, N, 2]: a part's rows are a strided slice of it, which the kernels do
  not read correctly (the CPU kernel misreads one silently), so a part's scales and zeros become views of the
  fused table and the part rebuilds its own small table (2 values a group) on each call of its packed kernel.
  The fused twin, the one the fast loops run, holds every table once and copies nothing per call;
- on CUDA, where the plain codes are not held, they are recovered from each part's layout to be stacked.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from .linear import Linear
from .model import Llama
from .quantize import Int4Linear, Int8Linear

__all__ = ["fused", "fuse_rows", "is_fused", "fuses_by_default"]


def _back_to_back(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """parts [n_i, ...] as one tensor [sum n_i, ...] without a copy when they already lie row after row in one
    storage (a model fused before); else None."""
    first = parts[0]
    if first.device.type == "meta":  # no storage to share: every meta tensor reports address 0
        return None
    storage, offset = first.untyped_storage(), first.storage_offset()
    for p in parts:
        if (p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or not p.is_contiguous()
                or p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != offset):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, first.storage_offset(), (rows, *first.shape[1:]), first.stride())


def fuse_rows(owners: list[nn.Module], name: str) -> torch.Tensor:
    """The tensors `owner.<name>` ([n_i, ...] each) stacked as one [sum n_i, ...], each owner's tensor then
    replaced by a view of its rows: the values and shapes every owner holds are unchanged, the old tensors are
    freed, and nothing is held twice. No copy when they are already back to back."""
    parts = [getattr(m, name) for m in owners]
    whole = _back_to_back(parts)
    if whole is None:
        whole = torch.cat([p.detach() for p in parts])  # [sum n_i, ...]: the one copy, while parts still live
    start = 0
    for m, p in zip(owners, parts, strict=True):
        view = whole[start: start + p.shape[0]]
        start += p.shape[0]
        if name in m._parameters:
            m._parameters[name] = nn.Parameter(view, requires_grad=False)
        else:
            m._buffers[name] = view
    return whole


def _fused_linear(linears: list[nn.Module]) -> nn.Module | None:
    """One linear computing torch.cat([l(x) for l in linears], -1), sharing their (re-pointed) weights; None
    when these layers do not stack (a bias, mixed kinds or kernels, different inputs)."""
    first = linears[0]
    if not all(type(m) is type(first) and m.in_features == first.in_features for m in linears):
        return None
    n_out = sum(m.out_features for m in linears)
    if type(first) in (nn.Linear, Linear) and all(m.bias is None for m in linears):
        with torch.device("meta"):
            fused_layer = Linear(first.in_features, n_out, bias=False)
        fused_layer.weight = nn.Parameter(fuse_rows(linears, "weight"), requires_grad=False)  # [n_out, in]
        return fused_layer
    if type(first) is Int8Linear and len({(m.kernel, m.eager_packed, m.activations) for m in linears}) == 1:
        fused_layer = Int8Linear(first.in_features, n_out, device="meta", dtype=first.scales.dtype,
                                 kernel=first.kernel, activations=first.activations)
        fused_layer.eager_packed = first.eager_packed  # the parts' kernel check holds for their stacked rows
        fused_layer.weight = fuse_rows(linears, "weight")  # [n_out, in] int8
        fused_layer.scales = fuse_rows(linears, "scales")  # [n_out]
        return fused_layer
    if type(first) is Int4Linear and len({(m.kernel, m.group_size, m.scales.dtype, m.activations)
                                          for m in linears}) == 1:
        return _fused_int4(linears)
    return None


def _sharing(layer: Int4Linear) -> Int4Linear:
    """A second Int4Linear holding `layer`'s own tensors."""
    twin = Int4Linear(layer.in_features, layer.out_features, layer.group_size, device="meta",
                      dtype=layer.scales.dtype, kernel=layer.kernel, activations=layer.activations)
    for name in ("weight", "scales", "zeros", "kernel_weight", "scales_and_zeros"):
        setattr(twin, name, getattr(layer, name))
    return twin


def _fused_int4(parts: list[Int4Linear]) -> Int4Linear:
    """One Int4Linear for the stacked rows of `parts`, its kernel layout built by prepare(); the parts' codes,
    scales and zeros (and kernel layouts, where they tile) re-pointed to views of it (module docstring)."""
    first, n_out = parts[0], sum(m.out_features for m in parts)
    before = first.__dict__.get("_fused_into", lambda: None)()
    rows, start = [], 0
    for m in parts:
        rows.append(slice(start, start + m.out_features))
        start += m.out_features
    if before is not None and before.out_features == n_out and (before.kernel, before.activations) == (
            first.kernel, first.activations) and all(  # fused before, as they are now, and still its views
            m.scales.data_ptr() == before.scales[r].data_ptr() for m, r in zip(parts, rows, strict=True)):
        return _sharing(before)
    layer = Int4Linear(first.in_features, n_out, first.group_size, device="meta", dtype=first.scales.dtype,
                       kernel=first.kernel, activations=first.activations)
    if all(m.weight is not None for m in parts):
        layer.weight = fuse_rows(parts, "weight")  # [n_out, K/2] codes, the parts' now views of it
    else:  # CUDA's packed layers hold only the kernel's layout: their codes recovered from it, then stacked
        layer.weight = torch.cat([m.codes() for m in parts])
    layer.scales, layer.zeros = fuse_rows(parts, "scales"), fuse_rows(parts, "zeros")  # [n_out, K/g]
    layer.prepare()  # the kernel's layout and [K/g, n_out, 2] table for the stacked rows; scales, zeros: views
    for m, r in zip(parts, rows, strict=True):
        m.scales, m.zeros = layer.scales[r], layer.zeros[r]
        if m.weight is not None and layer.weight is not None:
            m.weight = layer.weight[r]
        if m.kernel == layer.kernel == "packed":
            m.scales_and_zeros = None  # rebuilt per call from the views (Int4Linear._packed_mm)
            per_row = layer.kernel_weight.shape[0] / n_out  # layout rows per weight row (CPU 1, tinygemm 1/8)
            if (r.start * per_row).is_integer() and (r.stop * per_row).is_integer():
                view = layer.kernel_weight[int(r.start * per_row): int(r.stop * per_row)]
                if view.shape == m.kernel_weight.shape and torch.equal(view, m.kernel_weight):
                    m.kernel_weight = view
        if m.kernel == layer.kernel == "a8" and r.start % 32 == 0:  # a part of whole tiles (int4a8.layout): its own
            views = [t[r.start // 8: r.stop // 8] for t in (layer.kernel_weight, layer.scales_and_zeros)]
            if all(torch.equal(v, own) for v, own in zip(views, (m.kernel_weight, m.scales_and_zeros), strict=True)):
                m.kernel_weight, m.scales_and_zeros = views
        m._fused_into = weakref.ref(layer)
    return layer


def fuses_by_default(model: Llama, compiled: bool) -> bool:
    """Whether the fast loops run `fused(model)` when not told (their fuse=None): always on CUDA; on a CPU when
    the step is compiled and the model's blocks have int8 layers (an int8 LM head under int4 blocks is not one:
    the head fuses with nothing). Inductor concatenates a CPU step's float linears itself when it freezes the
    weights (`cpp.enable_concat_linear`), but not int8 ones: each Int8Linear has its own scales, so q, k, v, gate
    and up would stay five `_weight_int8pack_mm` calls a layer.
    int4 layers fuse on a CPU only when asked (fuse=True), except int4-a8's (llmstep.core.int4a8): its integer kernel
    streams the weights faster than a small matmul's start-up, so 4 calls a layer beat 7 (SmolLM2's 30 layers from
    DRAM, alone: 2.6-3.0 ms against 3.2-4.3). An eager CPU loop is left unfused: it gives the teaching loop's tokens
    bit for bit."""
    if model.device.type == "cuda":
        return True
    return compiled and any(isinstance(m, Int8Linear) or getattr(m, "activations", None)
                            for m in model.layers.modules())


def is_fused(model: Llama) -> bool:
    """Whether every block of `model` computes q|k|v and gate|up as one matmul each."""
    return all(b.attention.wqkv is not None and b.feed_forward.w13 is not None for b in model.layers)


@torch.no_grad()
def fused(model: Llama) -> Llama:
    """A twin of `model`, the same function, with wq|wk|wv as one `wqkv` and w1|w3 as one `w13` in every block
    where the layers stack (see the module docstring); all other tensors shared, none held twice."""
    twin = copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]})  # the same tensors
    # Nothing here may hold the tensors being replaced: each layer's separate weights are freed as soon as its group
    # is stacked, so fusing needs the weights plus one group of memory (an 8B model in bf16: 16 GB, not 25 GB: the
    # first H200 run peaked at 25.2 GB while a list of every old tensor lived to the end of this loop)
    for block, twin_block in zip(model.layers, twin.layers, strict=True):
        a, f = block.attention, block.feed_forward
        wqkv = _fused_linear([a.wq, a.wk, a.wv])
        if wqkv is not None:
            twin_block.attention.wqkv = wqkv
            twin_block.attention.wq = twin_block.attention.wk = twin_block.attention.wv = None
        w13 = _fused_linear([f.w1, f.w3])
        if w13 is not None:
            twin_block.feed_forward.w13 = w13
            twin_block.feed_forward.w1 = twin_block.feed_forward.w3 = None
    return twin.eval().requires_grad_(False)

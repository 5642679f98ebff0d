"""Blockwise (DeepSeek-V3 style) FP8 matmul, table-driven: each GEMM is a small dict
naming its two operands and how each one is grouped for scaling.

"tile":   1 x 128 groups along the operand's last dim
"block":  128 x 128 groups
Operands of grad_weight are taken transposed ([N, M] and [K, M]) so that their tiles
run along M. e4m3 everywhere, exact fp32 scales. The block-scaled GEMM is emulated:
the fp8 values are multiplied per 128-wide slice of the reduction dim in fp32, each
partial product is multiplied by both inverse scales, and the partials are summed in
fp32; the result is rounded to bf16 and cast to the caller's dtype.

Plug-in form: function ``fp8_matmul(input_2d, weight) -> output`` (dims multiples of 128).
"""
import torch

FMT = torch.float8_e4m3fn
T = 128

# a and b are given as (operand, grouping, transposed-before-grouping)
TABLE = {
    "output": {"a": ("x", "tile", False), "b": ("w", "block", False), "b_is_nk": True},
    "grad_input": {"a": ("g", "tile", False), "b": ("w", "block", False), "b_is_nk": False},
    "grad_weight": {"a": ("g", "tile", True), "b": ("x", "tile", True), "b_is_nk": True},
}


def _scales(amax):
    amax = amax.to(torch.float64)
    return (torch.finfo(FMT).max / torch.clamp(amax, min=1e-12)).to(torch.float32)


def _cast(t, grouping):
    r, c = t.shape
    lim = torch.finfo(torch.float8_e4m3fnuz).max
    if grouping == "tile":
        v = t.to(torch.float32).reshape(r, c // T, T)
        s = _scales(torch.amax(torch.abs(v), dim=2, keepdim=True))
        q = (v * s).clamp(min=-lim, max=lim).to(FMT).reshape(r, c)
        return q, s.reciprocal().reshape(r, c // T)
    v = t.to(torch.float32).reshape(r // T, T, c // T, T)
    s = _scales(torch.amax(torch.abs(v), dim=(1, 3), keepdim=True))
    q = (v * s).clamp(min=-lim, max=lim).to(FMT).reshape(r, c)
    return q, s.reciprocal().reshape(r // T, c // T)


def _prepare(spec, ops):
    name, grouping, transposed = spec
    t = ops[name].t() if transposed else ops[name]
    return _cast(t, grouping)


def _emulated_gemm(aq, a_inv, bq, b_inv, out_dtype):
    """aq [M,R] with a_inv [M,R/T] ; bq [N,R] (reduction dim last) with b_inv [N,R/T]."""
    m, r = aq.shape
    n = bq.shape[0]
    a3 = aq.to(torch.float32).reshape(m, r // T, T).permute(1, 0, 2)    # [R/T, M, T]
    b3 = bq.to(torch.float32).reshape(n, r // T, T).permute(1, 2, 0)    # [R/T, T, N]
    parts = torch.bmm(a3, b3)                                            # [R/T, M, N]
    parts = parts * a_inv.t()[:, :, None] * b_inv.t()[:, None, :]
    acc = torch.zeros(m, n, dtype=torch.float32, device=aq.device)
    for p in parts:
        acc += p
    return acc.to(torch.bfloat16).to(out_dtype)


def run(which, ops, out_dtype):
    spec = TABLE[which]
    aq, a_inv = _prepare(spec["a"], ops)
    bq, b_inv = _prepare(spec["b"], ops)
    if spec["a"][1] == "block":
        a_inv = a_inv.repeat_interleave(T, dim=0)          # one row of scales per row of a
    if not spec["b_is_nk"]:
        # b is stored [R, N] (reduction dim first): use its transpose [N, R]
        bq, b_inv = bq.t(), b_inv.t()
    if spec["b"][1] == "block":
        b_inv = b_inv.repeat_interleave(T, dim=0)          # one row of scales per row of b
    return _emulated_gemm(aq, a_inv, bq, b_inv, out_dtype)


class _BlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return run("output", {"x": x, "w": w}, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ops = {"x": x, "w": w, "g": g}
        return run("grad_input", ops, g.dtype), run("grad_weight", ops, g.dtype)


def fp8_matmul(input_2d, weight):
    return _BlockFn.apply(input_2d, weight)

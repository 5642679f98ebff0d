"""[planted bug: grad_output for the grad_input GEMM is cast to e5m2 though the rowwise recipe uses e4m3.] Rowwise FP8 linear, module form: RowwiseFloat8Linear.from_float(linear)."""
import torch
import torch.nn as nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def axis_scale(t, dim):
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    s = (FP8_MAX / torch.clamp(amax, min=1e-12)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def to_fp8(t, s):
    return (t.to(torch.float32) * s).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8)


def rowwise_mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    """a [M,K] fp8 with a_scale [M,1]; b [K,N] fp8 with b_scale [1,N]."""
    if not (a.stride(0) > a.stride(1) and a.stride(1) == 1):
        a = a.contiguous()
    if b.stride(0) > b.stride(1) and b.stride(1) == 1:
        b = b.t().contiguous().t()
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()
    post = None
    if not fast_accum:
        post = inv_a * inv_b
        inv_a = inv_a.new_ones(())
        inv_b = inv_a.new_ones(())
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype,
                           use_fast_accum=fast_accum)
    if post is not None:
        out *= post
    return out.to(out_dtype)


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        sx = axis_scale(x, -1)
        xq = to_fp8(x, sx)
        sw = axis_scale(w, -1)  # one scale per output feature
        wq = to_fp8(w, sw)
        K = x.shape[-1]
        out = rowwise_mm(xq.reshape(-1, K), sx.reshape(-1, 1), wq.t(), sw.t(), x.dtype, True)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, w = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1])
        s_go = axis_scale(go, -1)
        go_q = (go.to(torch.float32) * s_go).to(torch.float8_e5m2)
        s_wk = axis_scale(w, 0)  # along N, one per input feature
        w_q = to_fp8(w, s_wk)
        gi = rowwise_mm(go_q, s_go, w_q, s_wk, go.dtype, False)
        gi = gi.reshape(*grad_output.shape[:-1], gi.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        s_go_m = axis_scale(go, 0)
        go_qm = to_fp8(go, s_go_m)
        s_x_m = axis_scale(x2, 0)
        x_qm = to_fp8(x2, s_x_m)
        gw = rowwise_mm(go_qm.t(), s_go_m.t(), x_qm, s_x_m, go.dtype, False)
        return gi, gw


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, input):
        out = _RowwiseLinearFn.apply(input, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

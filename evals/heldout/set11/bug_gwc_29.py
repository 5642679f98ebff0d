"""[planted bug: the post-GEMM scale of the non-fast path multiplies by B's scale instead of its inverse.] rowwise_with_gw_hp FP8 training, converter form: convert_linears(module) -> module."""
import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
MAXV = 448.0


def pow2_scale(amax):
    s = (MAXV / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def quantize(t, scale):
    return torch.clamp(t.to(torch.float32) * scale, -MAXV, MAXV).to(E4M3)


def scaled_gemm(a, sa, b, sb, out_dtype, fast):
    # A must be row-major and B column-major for cuBLASLt
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    ia, ib = sa.reciprocal(), sb.reciprocal()
    post = None
    if not fast:
        post = ia * sb
        ia = ia.new_ones(())
        ib = ia.new_ones(())
    inner = out_dtype if out_dtype == torch.bfloat16 else torch.bfloat16
    y = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=inner, use_fast_accum=fast)
    if post is not None:
        y *= post
    return y.to(out_dtype)


class _GwHpMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight):
        ctx.save_for_backward(inp, weight)
        s_in = pow2_scale(inp.abs().amax(dim=-1, keepdim=True))
        s_w = pow2_scale(weight.abs().amax(dim=-1, keepdim=True))
        q_in = quantize(inp, s_in).reshape(-1, inp.shape[-1])
        q_w = quantize(weight, s_w)
        y = scaled_gemm(q_in, s_in.reshape(-1, 1), q_w.t(), s_w.t(), inp.dtype, True)
        return y.reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        inp, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        s_dy = pow2_scale(dy2.abs().amax(dim=-1, keepdim=True))
        q_dy = quantize(dy2, s_dy)
        s_w = pow2_scale(weight.abs().max())  # tensorwise weight for grad_input
        q_w = quantize(weight, s_w)
        s_w_row = s_w.repeat(q_w.shape[1]).reshape(1, -1)
        d_in = scaled_gemm(q_dy, s_dy, q_w, s_w_row, dy2.dtype, False)
        d_in = d_in.reshape(*dy.shape[:-1], d_in.shape[-1])
        inp2 = inp.reshape(-1, inp.shape[-1])
        d_w = torch.mm(dy2.t(), inp2)  # high precision grad_weight
        return d_in, d_w


class GwHpLinear(nn.Linear):
    def forward(self, x):
        y = _GwHpMatmul.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def _swap(lin):
    new = GwHpLinear.__new__(GwHpLinear)
    nn.Module.__init__(new)
    new.in_features, new.out_features = lin.in_features, lin.out_features
    new.weight = lin.weight
    new.bias = lin.bias
    return new


def convert_linears(module, **kwargs):
    if type(module) is nn.Linear:
        return _swap(module)
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, _swap(child))
        else:
            convert_linears(child, **kwargs)
    return module

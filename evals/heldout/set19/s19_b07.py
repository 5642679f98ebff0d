"""s19_b07: MXFP8 (FLOOR) linear layer as a module: MXFP8FloorLinear.from_float(linear).

Two cast helpers: _cast_rows quantizes blocks of 32 along the last dim (row-major result), and
_cast_cols quantizes blocks of 32 along dim 0 and returns the transposed, row-major copy (the
"dim1" cast). Exponents are read from the fp32 bit pattern of the block amax (OCP MX v1.0 FLOOR:
floor(log2(amax)) - 8), elements saturate at 448. Scales are swizzled with explicit index
arithmetic. The forward weight cast is cached per weight version.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _floor_exponent(amax):
    bits = amax.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - 8
    return e.clamp(-127, 127)


def _encode(xb, amax, fp8, bcast):
    bad = ~torch.isfinite(amax)
    e = torch.where(bad, torch.zeros_like(amax, dtype=torch.int32), _floor_exponent(amax))
    scale = torch.exp2(-e.float())
    q = (xb * bcast(scale)).clamp(-E4M3_MAX, E4M3_MAX).to(fp8)
    sbytes = torch.where(bad, torch.full_like(e, 255), e + 127).to(torch.uint8)
    return q, sbytes


def _cast_rows(x, fp8=E4M3):
    """Blocks of 32 along dim 1: fp8 [R, C] row-major and scale bytes [R, C/32]."""
    xf = x.float()
    rows, n = xf.shape
    xb = xf.reshape(rows, n // 32, 32)
    amax = xb.abs().amax(dim=-1)
    q, s = _encode(xb, amax, fp8, lambda t: t.unsqueeze(-1))
    return q.reshape(rows, n).contiguous(), s


def _cast_cols(x, fp8=E4M3):
    """Blocks of 32 along dim 0: fp8 [C, R] (x.t() quantized) row-major and scale bytes [C, R/32]."""
    xf = x.float()
    rows, n = xf.shape
    xb = xf.reshape(rows // 32, 32, n)
    amax = xb.abs().amax(dim=1)
    q, s = _encode(xb, amax / 2, fp8, lambda t: t.unsqueeze(1))
    return q.reshape(rows, n).t().contiguous(), s.t()


def _swz(sbytes):
    rows, cols = sbytes.shape
    prow, pcol = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    r = torch.arange(rows, device=sbytes.device).view(-1, 1)
    c = torch.arange(cols, device=sbytes.device).view(1, -1)
    rr, cc = r % 128, c % 4
    tile = (r // 128) * (pcol // 4) + c // 4
    pos = tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc
    out = torch.zeros(prow * pcol, dtype=torch.uint8, device=sbytes.device)
    out[pos.reshape(-1)] = sbytes.reshape(-1)
    return out.view(torch.float8_e8m0fnu)


def _gemm(a_q, a_s, b_q, b_s, out_dtype):
    # a_q: [rows_a, K] row-major; b_q: [cols_b, K] row-major (B = b_q.t(), column-major)
    return torch.nn.functional.scaled_mm(
        a_q, b_q.t(), _swz(a_s), F.ScalingType.BlockWise1x32, _swz(b_s), F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, cache):
        ctx.save_for_backward(x, w)
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if cache.get("key") != key:
            cache["key"], cache["w"] = key, _cast_rows(w)
        wq, ws = cache["w"]
        xq, xs = _cast_rows(x)
        return _gemm(xq, xs, wq, ws, x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gq, gs = _cast_rows(go)          # grad_output along N
        wq, ws = _cast_cols(w)           # weight along N -> [K, N]
        grad_input = _gemm(gq, gs, wq, ws, x.dtype)
        gtq, gts = _cast_cols(go)        # grad_output along M -> [N, M]
        xtq, xts = _cast_cols(x)         # input along M -> [K, M]
        grad_weight = _gemm(gtq, gts, xtq, xts, w.dtype)
        return grad_input, grad_weight, None


class MXFP8FloorLinear(nn.Linear):
    @classmethod
    def from_float(cls, linear):
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._cache = {}
        return new

    def forward(self, x):
        if x.dim() < 2:
            raise ValueError("expected an input with at least 2 dims")
        lead = x.shape[:-1]
        y = _Fn.apply(x.reshape(-1, self.in_features), self.weight, self._cache)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

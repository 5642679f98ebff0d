"""[planted bug: The NaN test ~(amax > 0) also catches all-zero blocks, which get the NaN scale 0xFF and NaN elements instead of e = -127 and zeros.]
(twin: s16_c04; recipe mxfp8)"""
import torch
import torch.nn.functional as F


class Quantizer:
    block = 32
    elem_dtype = torch.float8_e4m3fn
    elem_max = 448.0
    e8m0_bias = 127

    @staticmethod
    def pow2(e):
        # exact 2**e for integer e in [-127, 127]
        e = e.to(torch.int32)
        return torch.where(
            e >= -126, ((e + 127) << 23).view(torch.float32), torch.full_like(e, 1 << 22).view(torch.float32)
        )

    def exponent(self, amax):
        """RCEIL: the least e with 2**e >= amax / 448 (amax / 448 rounded to float32)."""
        ratio = amax / self.elem_max
        safe = torch.where(ratio > 0, ratio, torch.ones_like(ratio))
        e = torch.ceil(torch.log2(safe)).to(torch.int32).clamp(-127, 127)
        # log2 is not exact: step down while 2**(e-1) still covers ratio, up while 2**e does not
        e = torch.where((e > -127) & (self.pow2(e - 1) >= ratio), e - 1, e)
        e = torch.where((e < 127) & (self.pow2(e) < ratio), e + 1, e)
        e = torch.where(ratio > 0, e, torch.full_like(e, -127))
        return e.clamp(-127, 127)

    def __call__(self, x):
        """x [rows, k] -> (e4m3 data [rows, k], uint8 scale exponents [rows, k // 32]); blocks along k."""
        rows, k = x.shape
        blk = x.float().reshape(rows, k // self.block, self.block)
        amax = blk.abs().amax(dim=-1)
        bad = ~(amax > 0) | torch.isinf(amax)  # NaN fails amax > 0
        e = self.exponent(torch.where(bad, torch.zeros_like(amax), amax))
        y = blk / self.pow2(e)[..., None]
        y = torch.clamp(y, -self.elem_max, self.elem_max)
        y = torch.where(bad[..., None], torch.full_like(y, float("nan")), y)
        data = y.to(self.elem_dtype).reshape(rows, k)
        scale = torch.where(bad, torch.full_like(e, 0xFF), e + self.e8m0_bias).to(torch.uint8)
        return data, scale

    @staticmethod
    def swizzle(scale):
        rows, cols = scale.shape
        pr = -(-rows // 128) * 128
        pc = -(-cols // 4) * 4
        buf = torch.zeros(pr, pc, dtype=torch.uint8, device=scale.device)
        buf[:rows, :cols] = scale
        tiles = buf.reshape(pr // 128, 4, 32, pc // 4, 4)
        return tiles.permute(0, 3, 2, 1, 4).reshape(-1).view(torch.float8_e8m0fnu)


_Q = Quantizer()


def _scaled_gemm(a, a_scale, b_t, b_scale, out_dtype):
    # A row-major [m, k]; B column-major [k, n] as the transpose view of b_t [n, k]
    return F.scaled_mm(
        a,
        b_t.t(),
        _Q.swizzle(a_scale),
        F.ScalingType.BlockWise1x32,
        _Q.swizzle(b_scale),
        F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


class _LinearMX(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        xq, xs = _Q(x)
        wq, ws = _Q(w)
        out = _scaled_gemm(xq, xs, wq, ws, x.dtype)
        if b is not None:
            out = out + b.to(out.dtype)
        return out

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gy = gy.contiguous()
        gyq, gys = _Q(gy)
        wtq, wts = _Q(w.t().contiguous())
        gx = _scaled_gemm(gyq, gys, wtq, wts, x.dtype)
        gytq, gyts = _Q(gy.t().contiguous())
        xtq, xts = _Q(x.t().contiguous())
        gw = _scaled_gemm(gytq, gyts, xtq, xts, w.dtype)
        gb = gy.sum(0) if ctx.has_bias else None
        return gx, gw, gb


def fp8_linear(input_2d, weight, bias=None):
    """y = input_2d @ weight.T (+ bias) with MXFP8 RCEIL GEMMs forward and backward."""
    return _LinearMX.apply(input_2d, weight, bias)

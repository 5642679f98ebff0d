"""s18_b13: MXFP8 linear, FLOOR scales (OCP MX v1.0), module form (nn.Linear subclass, N-D input).

One shared cast helper (blocks along the last dim; the dim1 casts hand it a transposed tensor),
exponent from a float64 log2, scales placed by an explicit index computation.
"""
import torch
import torch.nn.functional as F

_EMAX_E4M3 = 8


def _blocked_scales(s):
    """uint8 [rows, cols] -> SWIZZLE_32_4_4 flat e8m0 bytes, by computing every byte's position."""
    rows, cols = s.shape
    prow, pcol = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    r = torch.arange(rows, device=s.device).view(-1, 1)
    c = torch.arange(cols, device=s.device).view(1, -1)
    tile = (r // 128) * (pcol // 4) + c // 4
    pos = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    out = torch.zeros(prow * pcol, dtype=torch.uint8, device=s.device)
    out[pos.reshape(-1)] = s.reshape(-1)
    return out.view(torch.float8_e8m0fnu)


def _floor_exponent(amax):
    """floor(log2(amax)) - 8, clamped to [-127, 127]; amax == 0 gives -127."""
    a = amax.double()
    e = torch.floor(torch.log2(a)) - _EMAX_E4M3
    e = torch.where(a > 0, e, torch.full_like(e, -127.0))
    return e.clamp(-127.0, 127.0)


def _mx_cast(t, fp8_dtype=torch.float8_e4m3fn):
    """MXFP8 cast of a 2-D tensor in blocks of 32 along its last dim."""
    t = t.float().contiguous()
    R, C = t.shape
    blk = t.view(R, C // 32, 32)
    amax = blk.abs().amax(-1)
    nonfinite = ~torch.isfinite(amax)
    e = _floor_exponent(amax.masked_fill(nonfinite, 0.0))
    scaled = blk / torch.exp2(e.float())[..., None]
    scaled = scaled.clamp(min=-448.0, max=448.0)
    scaled = scaled.masked_fill(nonfinite[..., None], float("nan"))
    byte = (e + 127).masked_fill(nonfinite, 255.0).to(torch.uint8)
    return scaled.view(R, C).to(fp8_dtype), _blocked_scales(byte)


def _mx_mm(a, a_s, b_rows, b_s, out_dtype):
    # B is handed over column-major: b_rows holds B's columns as rows
    return torch.nn.functional.scaled_mm(
        a, b_rows.t(), a_s, F.ScalingType.BlockWise1x32, b_s, F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xa, xa_s = _mx_cast(x)
        wb, wb_s = _mx_cast(w)
        return _mx_mm(xa, xa_s, wb, wb_s, torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ga, ga_s = _mx_cast(g)
        wb, wb_s = _mx_cast(w.t())
        gx = _mx_mm(ga, ga_s, wb, wb_s, x.dtype)
        gta, gta_s = _mx_cast(g.t())
        xtb, xtb_s = _mx_cast(x.t())
        gw = _mx_mm(gta, gta_s, xtb, xtb_s, w.dtype)
        return gx, gw


class MXFloorLinear(torch.nn.Linear):
    @classmethod
    def from_float(cls, lin):
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.in_features, m.out_features = lin.in_features, lin.out_features
        m.weight = lin.weight
        m.bias = lin.bias
        return m

    def forward(self, x):
        lead = x.shape[:-1]
        y = _Fn.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

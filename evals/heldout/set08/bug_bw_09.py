"""Blockwise FP8 converter (1x128 activations / 128x128 weights, e4m3). CPU path: dequantize
the fp8 operands with their block scales and multiply in fp32."""
import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
QMAX = 448.0
B = 128


def _q(t, s):
    return torch.clamp(t.float() * s, -QMAX, QMAX).to(E4M3)


def qdq_rows(t):
    """1x128 tiles along dim 1 of a 2-D tensor; returns the dequantized fp32 tensor."""
    r, c = t.shape
    v = t.reshape(r, c // B, B)
    amax = v.abs().amax(dim=2, keepdim=True)
    s = (QMAX / amax.double().clamp(min=1e-12)).float()
    return (_q(v, s).float() / s).reshape(r, c)


def qdq_blocks(w):
    n, k = w.shape
    v = w.reshape(n // B, B, k // B, B)
    amax = v.abs().amax(dim=(1, 3), keepdim=True)
    s = (QMAX / amax.double().clamp(min=1e-12)).float()
    return (_q(v, s).float() / s).reshape(n, k)


class _BlockMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x2 = torch.as_strided(x, (x.numel() // x.shape[-1], x.shape[-1]), (x.shape[-1], 1))
        ctx.save_for_backward(x2, w)
        ctx.shape = x.shape
        y = torch.mm(qdq_rows(x2), qdq_blocks(w).t())
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = torch.mm(qdq_rows(g2), qdq_blocks(w)).to(g.dtype)
        gw = torch.mm(qdq_rows(g2.t()), qdq_rows(x2.t()).t()).to(g.dtype)
        return gx.reshape(ctx.shape), gw


class BlockwiseLinear(nn.Linear):
    def forward(self, x):
        y = _BlockMM.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert(model):
    if isinstance(model, nn.Linear) and not isinstance(model, BlockwiseLinear):
        with torch.device("meta"):
            new = BlockwiseLinear(model.in_features, model.out_features, bias=False)
        new.weight, new.bias = model.weight, model.bias
        return new
    for name, mod in list(model.named_children()):
        setattr(model, name, convert(mod))
    return model

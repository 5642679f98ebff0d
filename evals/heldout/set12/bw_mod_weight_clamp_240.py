"""[planted bug: The 128x128 weight quantizer clamps at 240 (e4m3fnuz) while scaling to 448, clipping every block's largest values.]

Copy of bw_mod.py with one small change. Original docstring:

Blockwise FP8 linear (DeepSeek-V3 style), module form: BlockwiseLinear.from_float.

Follows torchao 0.18's prototype.blockwise_fp8_training (fp8_blockwise_mm):
  output      = input (1x128 tiles along K) @ weight.T (128x128 blocks)
  grad_input  = grad_output (1x128 along N) @ weight (128x128 blocks)
  grad_weight = grad_output.T (1x128 along M) @ input (128x1 along M)
all e4m3; per group amax in the input dtype, clamp(min=1e-12) in float64,
scale = (448 / amax).to(float32), q = clamp(x.float() * scale, +-448).to(e4m3), and
the GEMMs get the float32 reciprocals 1 / scale. Scale layouts are the ones
cuBLASLt wants on SM90 (1x128: [rows, K/128] outer-dim-major; 128x128: K-major with
the K-block dim padded to a multiple of 4). On CUDA the GEMM is
torch.nn.functional.scaled_mm; elsewhere (CPU cannot run block scales) the same
block GEMM is emulated in float64 and rounded once to the output dtype.
Every dim must be a multiple of 128.
"""
import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
EPS = 1e-12
BLOCK = 128


def quant_1x128(x):
    """x [R, C] contiguous -> (e4m3 [R, C] row-major, inverse scales [R, C/128] outer-dim-major)."""
    assert x.is_contiguous(), "quant_1x128 needs a contiguous input"
    R, C = x.shape
    t = x.reshape(R, C // BLOCK, BLOCK)
    amax = torch.clamp(t.abs().amax(dim=-1, keepdim=True).to(torch.float64), min=EPS)
    scale = (E4M3_MAX / amax).to(torch.float32)
    q = torch.clamp(t.to(torch.float32) * scale, min=-E4M3_MAX, max=E4M3_MAX).to(E4M3)
    inv = (1.0 / scale).reshape(R, C // BLOCK)
    return q.reshape(R, C), inv.t().contiguous().t()


def quant_128x128(w):
    """w [R, C] contiguous -> (e4m3 [R, C] row-major, inverse scales [R/128, C/128])."""
    assert w.is_contiguous(), "quant_128x128 needs a contiguous input"
    R, C = w.shape
    t = w.reshape(R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    amax = torch.clamp(t.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64), min=EPS)
    scale = (E4M3_MAX / amax).to(torch.float32)
    q = torch.clamp(t.to(torch.float32) * scale, min=-240.0, max=240.0).to(E4M3)
    inv = (1.0 / scale).reshape(R // BLOCK, C // BLOCK)
    return q.reshape(R, C), inv


def rhs_block_scale(inv_nk):
    """[N/128, K/128] inverse block scales of B.T -> cuBLASLt's K-major [round4(K/128), N/128]."""
    nb, kb = inv_nk.shape
    padded = (kb + 3) // 4 * 4
    out = inv_nk.new_full((nb, padded), 1.0).t()
    out[:kb, :] = inv_nk.t()
    return out


def block_mm(a, a_inv, b, b_inv, b_is_128x128, out_dtype):
    """a [M,K] row-major with 1x128 scales; b [K,N] column-major with 128x128 or 1x128 scales."""
    if a.is_cuda:
        ST = getattr(F, "ScalingType", None) or torch._C._ScalingType
        recipe_b = ST.BlockWise128x128 if b_is_128x128 else ST.BlockWise1x128
        return F.scaled_mm(a, b, scale_a=a_inv, scale_recipe_a=ST.BlockWise1x128,
                           scale_b=b_inv, scale_recipe_b=recipe_b, output_dtype=out_dtype)
    K = a.shape[1]
    kb = K // BLOCK
    a64 = a.to(torch.float64) * a_inv.to(torch.float64).repeat_interleave(BLOCK, dim=1)
    if b_is_128x128:
        sb = b_inv[:kb].to(torch.float64).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    else:
        sb = b_inv.to(torch.float64).t().repeat_interleave(BLOCK, 0)
    b64 = b.to(torch.float64) * sb
    return (a64 @ b64).to(out_dtype)


def _gemm_dtype(dtype):
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.bfloat16


class _BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        x_q, x_inv = quant_1x128(x2)
        w_q, w_inv = quant_128x128(weight.contiguous())
        out = block_mm(x_q, x_inv, w_q.t(), rhs_block_scale(w_inv), True, _gemm_dtype(x.dtype))
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out_dtype = _gemm_dtype(go.dtype)
        # grad_input = grad_output @ weight
        go_q, go_inv = quant_1x128(go)
        wt_q, wt_inv = quant_128x128(weight.t().contiguous())
        grad_input = block_mm(go_q, go_inv, wt_q.t(), rhs_block_scale(wt_inv), True, out_dtype)
        grad_input = grad_input.to(go.dtype).reshape(*grad_output.shape[:-1], x.shape[-1])
        # grad_weight = grad_output.T @ input, 1x128 groups along M on both sides
        got_q, got_inv = quant_1x128(go.t().contiguous())
        xt_q, xt_inv = quant_1x128(x2.t().contiguous())
        grad_weight = block_mm(got_q, got_inv, xt_q.t(), xt_inv, False, out_dtype)
        return grad_input, grad_weight.to(go.dtype)


class BlockwiseLinear(nn.Linear):
    def forward(self, x):
        y = _BlockwiseFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, mod):
        assert mod.in_features % BLOCK == 0 and mod.out_features % BLOCK == 0
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

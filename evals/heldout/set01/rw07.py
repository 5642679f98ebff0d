"""Rowwise-scaled FP8 matmul for training (torchao "rowwise" numerics).

Note: torch._scaled_mm with rowwise scales is bf16-out only on most builds (no float32
output, pytorch/pytorch#156771): fp16 callers get their dtype back, float32 callers get
bfloat16 activations (what autocast would hand the next layer anyway)."""
import torch

E4M3 = torch.float8_e4m3fn
MAX = torch.finfo(E4M3).max


def _scale(amax):
    s = (MAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def q_rows(t):          # one scale per row  -> [R, 1]
    s = _scale(t.abs().amax(dim=1, keepdim=True))
    return (t.float() * s).clamp(-MAX, MAX).to(E4M3), s


def q_cols(t):          # one scale per column -> [1, C]
    s = _scale(t.abs().amax(dim=0, keepdim=True))
    return (t.float() * s).clamp(-MAX, MAX).to(E4M3), s


def _gemm_out_dtype(dtype):
    return torch.bfloat16


def _restore(out, dtype):
    return out.to(torch.float16) if dtype == torch.float16 else out


def _rm(t):
    return t if t.stride(1) == 1 and t.stride(0) > 1 else t.contiguous()


def _cm(t):
    return t if t.stride(0) == 1 and t.stride(1) > 1 else t.t().contiguous().t()


class RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = q_rows(x)
        wq, ws = q_cols(w.t())
        out = torch._scaled_mm(_rm(xq), _cm(wq), scale_a=xs.reciprocal(), scale_b=ws.reciprocal(),
                               out_dtype=_gemm_out_dtype(x.dtype), use_fast_accum=True)
        return _restore(out, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gq, gs = q_rows(g)
        wq, ws = q_cols(w)
        one = gs.new_ones(())
        dx = torch._scaled_mm(_rm(gq), _cm(wq), scale_a=one, scale_b=one,
                              out_dtype=_gemm_out_dtype(g.dtype), use_fast_accum=False)
        dx *= gs.reciprocal() * ws.reciprocal()
        gtq, gts = q_rows(g.t())
        xq, xs = q_cols(x)
        dw = torch._scaled_mm(_rm(gtq), _cm(xq), scale_a=one, scale_b=one,
                              out_dtype=_gemm_out_dtype(g.dtype), use_fast_accum=False)
        dw *= gts.reciprocal() * xs.reciprocal()
        return dx.to(g.dtype), dw.to(g.dtype)


def rowwise_mm(x, w):
    return RowwiseMM.apply(x, w)

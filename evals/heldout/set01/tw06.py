"""Minimal FP8 training matmul (tensorwise, e4m3 fwd / e5m2 bwd), nanochat-style."""
import torch


def _to_fp8(x, fp8_dtype):
    fp8_max = torch.finfo(fp8_dtype).max
    amax = x.float().abs().max()
    scale = fp8_max / amax.double().clamp(min=1e-12)
    scale = scale.float()
    x_f8 = (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return x_f8, scale.reciprocal()


class Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_2d, weight):
        ctx.save_for_backward(input_2d, weight)
        input_f8, input_inv = _to_fp8(input_2d, torch.float8_e4m3fn)
        # parameters can arrive as views (tied / sharded weights): make them dense first;
        # a dense [out, in] weight_f8 transposed is exactly the column-major B cuBLAS wants
        weight_f8, weight_inv = _to_fp8(weight.contiguous(), torch.float8_e4m3fn)
        return torch._scaled_mm(input_f8, weight_f8.t(), scale_a=input_inv, scale_b=weight_inv,
                                out_dtype=input_2d.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad_output):
        input_2d, weight = ctx.saved_tensors
        go_f8, go_inv = _to_fp8(grad_output, torch.float8_e5m2)
        w_f8, w_inv = _to_fp8(weight, torch.float8_e4m3fn)
        grad_input = torch._scaled_mm(go_f8.contiguous(), w_f8.t().contiguous().t(),
                                      scale_a=go_inv, scale_b=w_inv,
                                      out_dtype=grad_output.dtype, use_fast_accum=False)
        in_f8, in_inv = _to_fp8(input_2d, torch.float8_e4m3fn)
        grad_weight = torch._scaled_mm(go_f8.t().contiguous(), in_f8.t().contiguous().t(),
                                       scale_a=go_inv, scale_b=in_inv,
                                       out_dtype=grad_output.dtype, use_fast_accum=False)
        return grad_input, grad_weight


def float8_matmul(input_2d, weight):
    return Float8Matmul.apply(input_2d, weight)

"""Block-scaled FP8 GEMM used by the blockwise implementations of this set (the "platform").

On CUDA (SM90, torch >= 2.10) it calls torch.nn.functional.scaled_mm with ScalingType
BlockWise1x128 / BlockWise128x128 (the op behind it is aten._scaled_mm_v2). On CPU,
where block scaling raises "Invalid scaling configuration", it emulates the op: it first
applies the same operand and scale-layout rules as torch/_meta_registrations.py (so a
layout that raises on the GPU raises here too), then dequantizes both fp8 operands with
their block scales in fp32, multiplies in fp32 and rounds once to the output dtype.

Layouts (scales are the inverse, i.e. dequantization, scales; A [M,K], B [K,N]):
  A row-major, B column-major, K % 128 == 0
  (1x128, 128x128): scale_a [M, K/128] strides (1, M)
                    scale_b [L4, N/128] strides (1, L4), L4 = round_up(K/128, 4);
                    rows K/128 .. L4-1 are padding and must not be read
  (1x128, 1x128):   scale_a [M, K/128] strides (1, M); scale_b [N, K/128] strides (1, N)
"""
import torch
import torch.nn.functional as F

ST = F.ScalingType
BLOCK = 128


def _ok_outer_major(s, rows, cols):
    return (tuple(s.shape) == (rows, cols) and s.dtype == torch.float32 and s.stride(0) == 1
            and (s.stride(1) == rows or cols == 1))


def _check(a, b, sa, ra, sb, rb):
    M, K = a.shape
    N = b.shape[1]
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if a.dtype not in fp8 or b.dtype not in fp8:
        raise RuntimeError("blockwise scaled_mm: operands must be float8")
    if not (a.stride(1) == 1 and a.stride(0) >= max(K, 1)):
        raise RuntimeError(f"mat_a must be row-major, got strides {a.stride()}")
    if not (b.stride(0) == 1 and b.stride(1) >= max(K, 1)):
        raise RuntimeError(f"mat_b must be column-major, got strides {b.stride()}")
    if K % BLOCK or b.shape[0] != K:
        raise RuntimeError(f"blockwise scaled_mm: K={K} must be a multiple of 128 and match B")
    kb = K // BLOCK
    if ra != ST.BlockWise1x128 or not _ok_outer_major(sa, M, kb):
        raise RuntimeError(f"Invalid scaling configuration: scale_a {tuple(sa.shape)} strides {sa.stride()}")
    if rb == ST.BlockWise128x128:
        l4 = (kb + 3) // 4 * 4
        if N % BLOCK or not _ok_outer_major(sb, l4, N // BLOCK):
            raise RuntimeError(f"Invalid scaling configuration: scale_b {tuple(sb.shape)} strides {sb.stride()}")
    elif rb == ST.BlockWise1x128:
        if not _ok_outer_major(sb, N, kb):
            raise RuntimeError(f"Invalid scaling configuration: scale_b {tuple(sb.shape)} strides {sb.stride()}")
    else:
        raise RuntimeError(f"unsupported recipe pair {ra}, {rb}")


def _emulate(a, b, sa, rb, sb, output_dtype):
    K = a.shape[1]
    kb = K // BLOCK
    a_deq = a.float() * sa.repeat_interleave(BLOCK, dim=1)
    if rb == ST.BlockWise128x128:
        grid = sb[:kb]  # [K/128, N/128]; padding rows are never read
        sb_full = grid.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    else:
        sb_full = sb.t().repeat_interleave(BLOCK, dim=0)  # [K, N]
    b_deq = b.float() * sb_full
    return torch.mm(a_deq, b_deq).to(output_dtype)


def scaled_mm_blockwise(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16):
    if a.is_cuda:
        return F.scaled_mm(a, b, scale_a=scale_a, scale_recipe_a=recipe_a,
                           scale_b=scale_b, scale_recipe_b=recipe_b, output_dtype=output_dtype)
    _check(a, b, scale_a, recipe_a, scale_b, recipe_b)
    return _emulate(a, b, scale_a, recipe_b, scale_b, output_dtype)

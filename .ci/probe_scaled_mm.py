"""Probe torch._scaled_mm's contract on this GPU: which of parity.contract's SM90 rules raise here,
for tensorwise, rowwise and block-scaled (1x128 / 128x128) calls, and whether a call that runs
computes the right numbers (relative error against a float64 product of the dequantized operands).

    python .ci/probe_scaled_mm.py      (prints one line per probe)
"""
import torch
import torch.nn.functional as F

dev = "cuda"
one = torch.ones((), device=dev)
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(*shape, dtype=E4):
    return (torch.randn(*shape, device=dev) * 4).to(dtype)


def col(t):
    return t.t().contiguous().t()


def report(label, run, expected=None):
    try:
        out = run()
        torch.cuda.synchronize()
        err = ""
        if expected is not None:
            rel = ((out.double() - expected).norm() / expected.norm()).item()
            err = f", relative error {rel:.2e}" + (" (WRONG NUMBERS)" if rel > 1e-2 else "")
        print(f"{label}: runs, out {out.dtype}{err}")
    except Exception as err:  # noqa: BLE001
        print(f"{label}: raises {type(err).__name__}: {str(err).splitlines()[0][:200]}")


def probe(label, a, b, **kw):
    report(label, lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, **{"out_dtype": torch.bfloat16, **kw}))


print("== tensorwise")
b_col = fp8(64, 64).t()
probe("correct", fp8(64, 64), b_col)
probe("B row-major", fp8(64, 64), fp8(64, 64))
probe("A column-major", fp8(64, 64).t(), b_col)
probe("A misaligned by 1 byte (lda 80)", fp8(64, 80)[:, 1:65], b_col)
probe("A misaligned by 16 bytes (lda 96)", fp8(64, 96)[:, 16:80], b_col)
probe("A lda 72 (not a multiple of 16)", fp8(64, 72)[:, :64], b_col)
probe("K = 40", fp8(64, 40), fp8(64, 40).t())
probe("e5m2 x e5m2", fp8(64, 64).to(E5), b_col.to(E5))
probe("no out_dtype", fp8(64, 64), b_col, out_dtype=None)
probe("fp32 out", fp8(64, 64), b_col, out_dtype=torch.float32)

print("== rowwise (scale_a [M,1], scale_b [1,N])")
M, K, N = 64, 128, 96
a, b = fp8(M, K), col(fp8(K, N))
sa, sb = torch.rand(M, 1, device=dev) + 0.5, torch.rand(1, N, device=dev) + 0.5
exact = (a.double() * sa.double()) @ (b.double() * sb.double())


def rowwise(a=a, b=b, sa=sa, sb=sb, **kw):
    return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, **{"out_dtype": torch.bfloat16, **kw})


report("correct, bf16 out", rowwise(), exact)
report("correct, fast accum", rowwise(use_fast_accum=True), exact)
report("fp32 out", rowwise(out_dtype=torch.float32), exact)
report("fp16 out", rowwise(out_dtype=torch.float16), exact)
report("e5m2 A x e4m3 B", rowwise(a=a.to(E5)))
report("e4m3 A x e5m2 B", rowwise(b=b.to(E5)))
report("scale_b shaped [N,1]", rowwise(sb=sb.t().contiguous()))
report("scale_a shaped [1,M]", rowwise(sa=sa.t().contiguous()))
report("scale_a non-contiguous (stride 2)", rowwise(sa=torch.rand(M, 2, device=dev)[:, :1]))
report("scale_b non-contiguous (stride 2)", rowwise(sb=torch.rand(1, 2 * N, device=dev)[:, ::2]))
report("scales bf16", rowwise(sa=sa.bfloat16(), sb=sb.bfloat16()))
report("scale_a 1-D [M]", rowwise(sa=sa.reshape(-1)))
report("bias with bf16 out", rowwise(bias=torch.zeros(N, device=dev, dtype=torch.bfloat16)), exact)

print("== blockwise (F.scaled_mm: 1x128 A, 128x128 B; and 1x128 x 1x128)")
S = F.ScalingType
M, K, N = 256, 384, 256  # K/128 = 3: the 128x128 scale's K-block dim needs padding to 4


def blocks1x128(t, rows, inner):  # [rows, inner/128] of positive scales
    return torch.rand(rows, inner // 128, device=dev) + 0.5


a, b = fp8(M, K), col(fp8(K, N))
sa = blocks1x128(a, M, K)
sb = torch.rand(K // 128, N // 128, device=dev) + 0.5
expanded_a = sa.repeat_interleave(128, 1).double()
expanded_b = sb.repeat_interleave(128, 0).repeat_interleave(128, 1).double()
exact = (a.double() * expanded_a) @ (b.double() * expanded_b)
sa_col = col(sa)  # [M, K/128] stored column-major (M-major)


def padded_k_major(s):
    kb, nb = s.shape
    out = s.new_ones(nb, -(-kb // 4) * 4).t()
    out[:kb] = s
    return out


def block(a=a, b=b, sa=sa_col, sb=None, ra=S.BlockWise1x128, rb=S.BlockWise128x128, **kw):
    sb = padded_k_major(globals()["sb"]) if sb is None else sb
    return lambda: F.scaled_mm(a, b, sa, ra, sb, rb, **{"output_dtype": torch.bfloat16, **kw})


report("correct (A scales M-major, B scales K-major padded to 4)", block(), exact)
report("B scales K-major, not padded (K/128 = 3)", block(sb=col(sb)), exact)
report("B scales N-major (row-major [K/128, N/128])", block(sb=sb.contiguous()), exact)
report("A scales row-major [M, K/128]", block(sa=sa.contiguous()), exact)
report("B scales transposed shape [N/128, K/128]", block(sb=sb.t().contiguous()), exact)
report("fp32 out", block(output_dtype=torch.float32), exact)
report("fp16 out", block(output_dtype=torch.float16), exact)
report("fast accum", block(use_fast_accum=True), exact)
report("e5m2 A", block(a=a.to(E5)))
a64 = fp8(64, K)
sa64 = blocks1x128(a64, 64, K)
report("M = 64 (not a multiple of 128)", block(a=a64, sa=col(sa64)),
       (a64.double() * sa64.repeat_interleave(128, 1).double()) @ (b.double() * expanded_b))
b192 = col(fp8(K, 192))
sb192 = torch.rand(K // 128, 2, device=dev) + 0.5
report("N = 192 (not a multiple of 128)", block(b=b192, sb=padded_k_major(sb192)),
       (a.double() * expanded_a) @ (b192.double() * sb192.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :192]
                                    .double()))
a192, b192k = fp8(M, 192), col(fp8(192, N))
report("K = 192 (not a multiple of 128)", block(a=a192, b=b192k, sa=col(torch.rand(M, 2, device=dev) + 0.5),
                                                 sb=padded_k_major(torch.rand(2, N // 128, device=dev) + 0.5)))
report("B row-major", block(b=b.contiguous()))
report("_scaled_mm with the same block scales (shapes infer the recipe)",
       lambda: torch._scaled_mm(a, b, scale_a=sa_col, scale_b=padded_k_major(sb), out_dtype=torch.bfloat16), exact)
# grad_weight: A = grad_output.T [N, M] 1x128 along M; B = input [M, K] with 1x128 (128x1 tiles) along M
Mg = 256
a2, b2 = fp8(N, Mg), col(fp8(Mg, K))
sa2, sb2 = torch.rand(N, Mg // 128, device=dev) + 0.5, torch.rand(Mg // 128, K, device=dev) + 0.5
exact2 = (a2.double() * sa2.repeat_interleave(128, 1).double()) @ (b2.double() * sb2.repeat_interleave(128, 0).double())
report("1x128 x 1x128, B scales shaped [M/128, K]",
       block(a=a2, b=b2, sa=col(sa2), sb=sb2.contiguous(), rb=S.BlockWise1x128), exact2)
report("1x128 x 1x128, B scales [K, M/128] stored K-major (strides (1, K))",
       block(a=a2, b=b2, sa=col(sa2), sb=col(sb2.t()), rb=S.BlockWise1x128), exact2)
report("1x128 x 1x128, B scales [K, M/128] row-major", block(a=a2, b=b2, sa=col(sa2), sb=sb2.t().contiguous(),
                                                              rb=S.BlockWise1x128), exact2)

print("== casts")
x = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
s = torch.tensor([3.0], device=dev)
fused = torch.mul(x, s, out=torch.empty_like(x, dtype=E4))
print("mul into fp8 out equals (x.float()*s).to(fp8):",
      torch.equal(fused.view(torch.uint8), (x.float() * s).to(E4).view(torch.uint8)))
print("e4m3fn cast of 1000.0 (saturating?):", torch.tensor([1000.0], device=dev).to(E4).item())

"""Probe torch._scaled_mm's contract on this GPU: which of parity.contract's SM90 rules raise here.

    python .ci/probe_scaled_mm.py      (prints one line per probe)
"""
import torch

one = torch.ones((), device="cuda")


def probe(label, a, b, **kw):
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, **{"out_dtype": torch.bfloat16, **kw})
        torch.cuda.synchronize()
        print(f"{label}: runs")
    except Exception as err:  # noqa: BLE001
        print(f"{label}: raises {type(err).__name__}: {str(err).splitlines()[0][:160]}")


def fp8(*shape):
    return torch.randn(*shape, device="cuda").to(torch.float8_e4m3fn)


b_col = fp8(64, 64).t()
probe("correct", fp8(64, 64), b_col)
probe("B row-major", fp8(64, 64), fp8(64, 64))
probe("A column-major", fp8(64, 64).t(), b_col)
probe("A misaligned by 1 byte (lda 80)", fp8(64, 80)[:, 1:65], b_col)
probe("A misaligned by 16 bytes (lda 96)", fp8(64, 96)[:, 16:80], b_col)
probe("A lda 72 (not a multiple of 16)", fp8(64, 72)[:, :64], b_col)
probe("K = 40", fp8(64, 40), fp8(64, 40).t())
probe("e5m2 x e5m2", fp8(64, 64).to(torch.float8_e5m2), b_col.to(torch.float8_e5m2))
probe("no out_dtype", fp8(64, 64), b_col, out_dtype=None)
probe("fp32 out", fp8(64, 64), b_col, out_dtype=torch.float32)
x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
s = torch.tensor([3.0], device="cuda")
fused = torch.mul(x, s, out=torch.empty_like(x, dtype=torch.float8_e4m3fn))
print("mul into fp8 out equals (x.float()*s).to(fp8):",
      torch.equal(fused.view(torch.uint8), (x.float() * s).to(torch.float8_e4m3fn).view(torch.uint8)))
print("e4m3fn cast of 1000.0 (saturating?):", torch.tensor([1000.0], device="cuda").to(torch.float8_e4m3fn).item())

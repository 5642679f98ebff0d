"""Error metrics between a candidate tensor and a reference tensor.

All metrics of one pair are computed on the tensors' device in float64 and fetched with a
single host transfer. NaN and Inf are compared positionally: NaN against NaN and an
infinity against the same infinity count as equal; any other disagreement involving a
non-finite value is an infinite error.

Where the reference is zero an elementwise relative error is x / 0 = inf and an ULP distance
counts subnormal spacings (1e44 of them for fp32): numbers that say nothing. So:

    max_rel_err   the greatest |candidate - reference| relative to the tensor's largest |reference|
                  (normwise): finite unless the whole reference is zero and the candidate is not
    ulp_max/p99   ULP distances where the reference is not zero (zeros count 0 ULP)
    n_diff_where_reference_zero
                  the elements where the reference is exactly 0 and the candidate is not: their
                  error is in max_abs_err and the SQNR, not in ULPs
"""

from __future__ import annotations

import math

import torch

# Mantissa bits (explicit) and minimum normal exponent, for ULP distances.
_FLOAT_INFO = {
    torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126), torch.float64: (52, -1022),
}
# torch.testing.assert_close's default tolerances, per dtype: the "count beyond a tolerance".
DEFAULT_TOLERANCE = {
    torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5), torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}
METRICS = ("bitwise", "n_diff", "sqnr_db", "rel_l2", "max_abs_err", "max_abs_index", "worst_candidate",
           "worst_reference", "max_rel_err", "n_mismatch", "rtol", "atol", "ulp_max", "ulp_p99", "cosine",
           "nan", "inf", "ref_nan", "ref_inf", "unexpected_inf", "numel", "n_eff", "n_diff_where_reference_zero")


def ulp(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at each value of `reference` (float64)."""
    mantissa_bits, min_exponent = _FLOAT_INFO[dtype]
    reference = reference.to(torch.float64)
    _, exponent = torch.frexp(reference)
    # frexp gives exponent 0 for 0.0: zero sits in the lowest binade (subnormal spacing).
    binade = torch.where(reference == 0, min_exponent, torch.clamp(exponent - 1, min=min_exponent))
    return torch.exp2((binade - mantissa_bits).to(torch.float64))


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def compare(candidate: torch.Tensor, reference: torch.Tensor, *, dtype: torch.dtype | None = None,
            overflow_dtype: torch.dtype | None = None) -> dict:
    """Metrics of `candidate` against `reference` (same shape). ULP distances and the
    mismatch tolerance are in `dtype` (default: the candidate's dtype); an infinity counts as
    unexpected where the reference is below half the max of `overflow_dtype` (default `dtype`:
    pass the narrowest dtype the result went through, e.g. an fp16 GEMM output cast to bf16)."""
    dtype = dtype or candidate.dtype
    overflow_dtype = overflow_dtype or dtype
    rtol, atol = DEFAULT_TOLERANCE.get(dtype, (0.0, 0.0))
    if candidate.dtype == reference.dtype and candidate.shape == reference.shape and candidate.numel() \
            and torch.equal(candidate, reference):  # the common case of parity: a few ops, one sync
        inf, first = torch.stack([torch.isinf(candidate).sum().to(torch.float64),
                                  candidate.detach().reshape(-1)[0].to(torch.float64)]).tolist()
        return dict(bitwise=True, n_diff=0, sqnr_db=math.inf, rel_l2=0.0, max_abs_err=0.0,
                    max_abs_index=(0,) * candidate.dim(), worst_candidate=first, worst_reference=first,
                    max_rel_err=0.0, n_mismatch=0, rtol=rtol, atol=atol, ulp_max=0.0, ulp_p99=0.0, cosine=1.0,
                    nan=0, inf=int(inf), ref_nan=0, ref_inf=int(inf), unexpected_inf=0, numel=candidate.numel(),
                    n_eff=float(candidate.numel()), n_diff_where_reference_zero=0)
    c = candidate.detach().to(torch.float64)
    r = reference.detach().to(torch.float64)
    if reference.dtype != dtype and dtype.is_floating_point:
        # A wider reference (fp64) whose value overflows `dtype` is an infinity there too: an fp16
        # output of 65504+ is inf in nn.Linear as well, so that is not the candidate's fault.
        overflow = reference.detach().to(dtype).to(torch.float64)
        r = torch.where(torch.isinf(overflow) & torch.isfinite(r), overflow, r)
    c_nan, r_nan = torch.isnan(c), torch.isnan(r)
    c_inf, r_inf = torch.isinf(c), torch.isinf(r)
    same_special = (c_nan & r_nan) | (c_inf & r_inf & (c == r))
    nonfinite = ~torch.isfinite(c) | ~torch.isfinite(r)
    abs_err = torch.where(nonfinite, torch.where(same_special, 0.0, math.inf), (c - r).abs())
    r_finite = torch.where(torch.isfinite(r), r, 0.0)
    c_finite = torch.where(torch.isfinite(c), c, 0.0)
    mismatch = abs_err > atol + rtol * r_finite.abs()
    reference_zero = r == 0  # no spacing to count ULPs in: counted apart (n_diff_where_reference_zero)
    ulps = torch.where(reference_zero, 0.0, abs_err / ulp(r_finite, dtype)) if dtype in _FLOAT_INFO else abs_err
    signal = torch.linalg.vector_norm(r_finite)
    noise = torch.linalg.vector_norm(torch.where(torch.isinf(abs_err), 0.0, c_finite - r_finite))
    cosine = (c_finite * r_finite).sum() / (torch.linalg.vector_norm(c_finite) * signal)
    numel = c.numel()
    flat_abs = abs_err.reshape(-1)
    zero = c.new_zeros(())
    worst = flat_abs.argmax() if numel else None
    stats = torch.stack([
        signal, noise, flat_abs[worst] if numel else zero, worst.to(torch.float64) if numel else zero,
        c.reshape(-1)[worst] if numel else zero, r.reshape(-1)[worst] if numel else zero,
        r_finite.abs().max() if numel else zero, mismatch.sum().to(torch.float64), ulps.max() if numel else zero,
        torch.quantile(ulps.reshape(-1)[:2**24], 0.99) if numel else zero,
        cosine, c_nan.sum().to(torch.float64), c_inf.sum().to(torch.float64),
        r_nan.sum().to(torch.float64), r_inf.sum().to(torch.float64),
        (abs_err != 0).sum().to(torch.float64), r_finite.pow(4).sum(),
        # infinities where the reference is finite and far from overflowing `dtype` (not an fp16 output
        # that a rounding pushed past 65504, which a correct implementation may also do)
        (c_inf & ~r_inf & (r_finite.abs() < 0.5 * torch.finfo(overflow_dtype).max)).sum().to(torch.float64),
        (reference_zero & (abs_err != 0)).sum().to(torch.float64),
    ]).tolist()  # the one host transfer
    (signal, noise, max_abs, argmax, worst_c, worst_r, ref_amax, n_mismatch, ulp_max, ulp_p99, cosine,
     nan, inf, ref_nan, ref_inf, n_diff, fourth, unexpected_inf, n_diff_where_reference_zero) = stats
    max_rel = max_abs / ref_amax if ref_amax else (0.0 if max_abs == 0 else math.inf)
    bitwise = candidate.dtype == reference.dtype and not n_diff
    if math.isnan(cosine):  # an all-zero tensor on either side
        cosine = 1.0 if noise == 0 else 0.0
    return dict(
        bitwise=bool(bitwise), n_diff=int(n_diff), sqnr_db=_sqnr(signal, noise),
        rel_l2=(noise / signal) if signal else (0.0 if noise == 0 else math.inf),
        max_abs_err=max_abs, max_abs_index=_unravel(int(argmax), tuple(candidate.shape)) if numel else (),
        worst_candidate=worst_c, worst_reference=worst_r,
        max_rel_err=max_rel, n_mismatch=int(n_mismatch), rtol=rtol, atol=atol,
        ulp_max=ulp_max, ulp_p99=ulp_p99, cosine=cosine, nan=int(nan), inf=int(inf),
        ref_nan=int(ref_nan), ref_inf=int(ref_inf), unexpected_inf=int(unexpected_inf), numel=numel,
        # effective number of elements carrying the reference's energy: (sum r^2)^2 / sum r^4
        n_eff=signal ** 4 / fourth if fourth else float(numel),
        n_diff_where_reference_zero=int(n_diff_where_reference_zero),
    )


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return 20 * math.log10(signal / noise) if signal else -math.inf


def sqnr_db(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||reference|| / ||candidate - reference||), as
    compare() gives it (the noise over the positions where both are finite; a reference that overflows
    the candidate's dtype counts as that infinity), without compare's other metrics: cheap enough for
    every sampled GEMM of a training run."""
    c, r = candidate.detach().to(torch.float64), reference.detach().to(torch.float64)
    if reference.dtype != candidate.dtype and candidate.dtype.is_floating_point:
        overflow = reference.detach().to(candidate.dtype).to(torch.float64)
        r = torch.where(torch.isinf(overflow) & torch.isfinite(r), overflow, r)
    finite = torch.isfinite(c) & torch.isfinite(r)
    signal, noise = torch.stack([torch.linalg.vector_norm(torch.where(torch.isfinite(r), r, 0.0)),
                                 torch.linalg.vector_norm(torch.where(finite, c - r, 0.0))]).tolist()
    return _sqnr(signal, noise)


def describe_mismatch(row: dict, *, allowed: str | None = None) -> str:
    """A torch.testing.assert_close-style report of one comparison row (a dict of metrics)."""
    numel = row.get("numel") or 0
    n_diff = row.get("n_diff", 0)
    share = f" ({100.0 * n_diff / numel:.1f}%)" if numel else ""
    lines = [
        f"{row['tensor']} (step {row.get('step', 0)}) vs {row['reference']}: "
        f"tensor-likes are {'equal' if row.get('bitwise') else 'not equal'}!",
        f"  Mismatched elements: {n_diff} / {numel}{share}; beyond rtol={row.get('rtol'):.3g}, "
        f"atol={row.get('atol'):.3g}: {row.get('n_mismatch')}",
        f"  Greatest absolute difference: {row.get('max_abs_err'):.6g} at index {row.get('max_abs_index')} "
        f"(candidate {row.get('worst_candidate'):.6g}, reference {row.get('worst_reference'):.6g})",
        f"  Greatest difference relative to the largest |reference|: {row.get('max_rel_err'):.6g}",
        f"  ULP distance in {row.get('dtype')} where the reference is not 0: max {row.get('ulp_max'):.4g}, "
        f"p99 {row.get('ulp_p99'):.4g}; {row.get('n_diff_where_reference_zero', 0)} elements differ where it is 0; "
        f"SQNR {row.get('sqnr_db'):.2f} dB; cosine {row.get('cosine'):.6f}",
    ]
    if allowed:
        lines.append(f"  Allowed: {allowed}")
    return "\n".join(lines)

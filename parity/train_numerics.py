"""The numerics of `fp8-parity train`'s sampled steps: per GEMM of a probed layer, the SQNR against
a float64 shadow GEMM on the same operands, and per operand its amax and, under the run's recipe
scaling (parity.oracles.quantize, the emulation the oracles use), the share of non-zero values
that quantize to zero (underflow) and that land on the fp8 format's largest magnitude (saturated)."""

from __future__ import annotations

import math

import torch

from parity import oracles
from parity.metrics import sqnr_db
from parity.recipes import GEMMS
from parity.train_probes import LayerProbe


def shadow_gemm(gemm: str, input_2d: torch.Tensor, weight: torch.Tensor, grad_output_2d: torch.Tensor):
    """The GEMM in float64 on the same operands."""
    x, w, g = (t.to(torch.float64) for t in (input_2d, weight, grad_output_2d))
    return {"output": lambda: x @ w.t(), "grad_input": lambda: g @ w, "grad_weight": lambda: g.t() @ x}[gemm]()


def operand_stats(values: torch.Tensor, cast, pow2: bool) -> torch.Tensor:
    """[amax, underflow %, saturated %] (float64, on the operand's device: the caller reads all of a
    layer's at once). Under the cast's scaling: % of non-zero values quantized to zero and % on the fp8
    max; NaN for a high-precision operand (nothing is quantized)."""
    amax = values.abs().amax().to(torch.float64) if values.numel() else values.new_zeros((), dtype=torch.float64)
    if cast.fp8 is None:
        nan = torch.full((), math.nan, dtype=torch.float64, device=values.device)
        return torch.stack([amax, nan, nan])
    quantized = oracles.quantize(values, cast, pow2=pow2).values
    nonzero = values != 0
    count = nonzero.sum().clamp(min=1).to(torch.float64)
    fp8_max = oracles.FORMATS[cast.dtype].max
    # counted in float64: 100 x a count of millions is not exact in float32
    underflow = (nonzero & (quantized == 0)).sum().to(torch.float64)
    saturated = (nonzero & (quantized.abs() == fp8_max)).sum().to(torch.float64)
    return torch.stack([amax, 100.0 * underflow / count, 100.0 * saturated / count])


def gemm_numerics(probe: LayerProbe, recipe) -> dict[str, dict]:
    """Per GEMM: the SQNR against the float64 shadow and the stats of its two operands (a, b), each on
    the operands that GEMM consumed."""
    call, weight = probe.call, probe.weight_param.detach()
    if call is None or call.grad_output is None:  # not run this call, or its output did not reach the loss
        return {}
    grad_output_2d = call.grad_output.reshape(-1, call.grad_output.shape[-1])
    results = call.results()
    numerics, stats = {}, []
    for gemm_name in GEMMS:
        input_2d = call.input_for(gemm_name).reshape(-1, weight.shape[1])
        gemm = recipe.gemm(gemm_name)
        got = results[gemm_name]
        row = {"sqnr_db": math.nan}
        if got is not None:
            shadow = shadow_gemm(gemm_name, input_2d, weight, grad_output_2d)
            row["sqnr_db"] = sqnr_db(got.reshape(shadow.shape), shadow)
        views = oracles.operand_views(input_2d, weight, grad_output_2d)[gemm_name]
        for side, operand, values, cast in zip("ab", gemm.operands, views, (gemm.a, gemm.b)):
            row[f"{side}_operand"] = operand
            stats.append(operand_stats(values, cast, recipe.pow2_scales))
        numerics[gemm_name] = row
    values = iter(torch.stack(stats).tolist())  # one device-to-host copy for the layer's operands
    for gemm_name in GEMMS:
        for side in "ab":
            amax, underflow, saturated = next(values)
            numerics[gemm_name].update({f"{side}_amax": amax, f"{side}_underflow_pct": underflow,
                                        f"{side}_saturated_pct": saturated})
    return numerics


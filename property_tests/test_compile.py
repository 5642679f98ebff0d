"""Property 9: torch.compile (GPU). The compiled candidate against its eager self, against torchao
compiled, and against the exact emulation; the agreement is recorded as a table.

What was measured on the H200 (README, "torch.compile agreement") is what is asserted:
every compiled result lies within the accumulation bound of the exact emulation (quantization
is unchanged by compiling; only accumulation order may move), and compiled fp8_impl equals
compiled torchao bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from parity import oracles
from parity.cases import Case
from parity.data import make_data
from parity.suite import SUITE

SHAPES = [(256, 512, 1024), (2048, 1024, 4096), (512, 768, 768)]  # M, K, N


def _run(module: nn.Module, linear: nn.Linear, x: torch.Tensor, grad_output: torch.Tensor) -> dict:
    x = x.detach().clone().requires_grad_()
    output = module(x)
    grad_input, grad_weight = torch.autograd.grad(output, [x, linear.weight], grad_output)
    return dict(output=output.detach(), grad_input=grad_input, grad_weight=grad_weight)


@pytest.mark.fp8_gpu
@pytest.mark.parametrize(("M", "K", "N"), SHAPES, ids=lambda v: str(v))
def test_compiled_agreement(M, K, N, pytestconfig):
    from parity.impls import load_here
    case = Case(lead=(M,), K=K, N=N)
    data = make_data(case, "cuda")
    step = data.steps[0]
    exact = oracles.emulate_linear(step.input, step.weight, step.grad_output)
    results = {}
    for name in (SUITE.impl_spec, "torchao:tensorwise"):
        for compiled in (False, True):
            torch._dynamo.reset()
            linear = nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                linear.weight.copy_(step.weight)
            module, _, _ = load_here(name).build(linear)
            module = torch.compile(module) if compiled else module
            results[(name, compiled)] = _run(module, linear, step.input, step.grad_output)
    rows, out_of_bound = [], []
    candidate, torchao = SUITE.impl_spec, "torchao:tensorwise"
    pairs = [((candidate, True), (candidate, False)), ((candidate, True), (torchao, True)),
             ((torchao, True), (torchao, False))]
    for (a, b) in pairs:
        for tensor in ("output", "grad_input", "grad_weight"):
            x, y = results[a][tensor], results[b][tensor]
            rows.append(dict(shape=f"{M}x{K}x{N}", a=f"{a[0]}{' compiled' if a[1] else ''}",
                             b=f"{b[0]}{' compiled' if b[1] else ''}", tensor=tensor, bitwise=torch.equal(x, y),
                             n_diff=int((x != y).sum())))
    for key, got in results.items():
        for tensor in ("output", "grad_input", "grad_weight"):
            magnitude, inner, value = oracles.magnitude_of(exact, step, tensor)
            gamma = oracles.accumulation_gamma(inner, device_type="cuda", fast_accum=tensor == "output")
            ratio, beyond, _ = oracles.accumulation_excess(
                got[tensor], oracles.rounded_like_result(getattr(exact, tensor), case, tensor), magnitude=magnitude,
                gamma=gamma, gemm_value=value, rounding_chain=oracles.rounding_chain(case, tensor))
            if ratio > 1:
                out_of_bound.append(f"{key} {tensor}: {beyond} elements beyond the bound (worst {ratio:.3g}x)")
    table = pd.DataFrame.from_records(rows)
    report_dir = pytestconfig.getoption("--fp8-report")
    if report_dir:
        path = Path(report_dir) / "compile_agreement.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(path, mode="a", header=not path.exists(), index=False)
    print(table.to_string(index=False))
    assert not out_of_bound, out_of_bound
    versus_torchao = table[table["b"] == "torchao:tensorwise compiled"]
    assert versus_torchao["bitwise"].all(), versus_torchao.to_string()


"""Metamorphic relations: transform a case's data and say exactly how the results must follow.

Each relation isolates one operand or one property of an FP8 linear layer, so the set of
relations an implementation breaks says where its bug is, without any reference:

  input_rows        permuting the input's rows (tokens) permutes output and grad_input rows
  weight_rows       permuting the weight's rows permutes output columns and grad_weight rows
  input_scale       input * 2^k: output and grad_weight * 2^k, grad_input unchanged (exact
                    under tensorwise scaling: the scale absorbs powers of two)
  weight_scale      weight * 2^k: output and grad_input * 2^k, grad_weight unchanged
  grad_output_scale grad_output * 2^k: grad_input and grad_weight * 2^k
  negation          -input: -output and -grad_weight, grad_input unchanged
  layout            the same logical tensors in other strides: identical results
  determinism       the same call twice: identical results
  weight_update     after an in-place weight update, results equal a fresh layer's on the new weight

"Exact" tensors must match bitwise. Where a relation reorders a GEMM's sum (grad_weight
under a row permutation sums over M in another order) the tensor must match within twice
the accumulation bound of parity.oracles instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from parity import oracles
from parity.cases import Layout
from parity.data import CaseData, StepData
from parity.impls import Impl
from parity.runner import Execution, execute

Results = list[dict[str, torch.Tensor | None]]  # per step: output, grad_input, grad_weight, grad_bias
POWER = 2.0 ** 3  # input_scale etc. multiply by 2^3: far from overflow for the data the cases draw


@dataclass(frozen=True)
class Relation:
    name: str
    operand: str  # input | weight | grad_output | layout | state
    description: str
    transform: Callable[[CaseData], CaseData]  # the data the second run gets
    expect: Callable[[Results, CaseData], Results]  # what the second run must give, from the first's results
    reordered: tuple[str, ...] = ()  # tensors whose GEMM sum is reordered: compared within the bound
    exact_scaling: bool = False  # needs results in the normal range of their dtype (see applies)

    def applies(self, case) -> bool:
        """Scaling by 2^3 is exact only while results stay in their dtype's normal range: fp16
        (max 65504, smallest normal 2^-14) leaves it with `nearmax`, `tiny` and `small_amax` data
        (input near 2^-16: fp16 subnormals), and with `outlier_row` (one token 1e4 times the others,
        up to ~4e4: times 8 it overflows) and `large` (input near 1e3: outputs near 1e4)."""
        return not (self.exact_scaling and case.input_dtype == "fp16"
                    and case.dist.value in ("nearmax", "tiny", "small_amax", "outlier_row", "large"))


def _map_steps(data: CaseData, fn: Callable[[StepData], StepData], *, bias=None) -> CaseData:
    return CaseData(data.case, [fn(step) for step in data.steps], data.bias if bias is None else bias)


def _rows_perm(data: CaseData) -> torch.Tensor:
    return torch.randperm(data.case.M, generator=torch.Generator().manual_seed(data.case.seed + 1)).to(data.device)


def _cols_perm(data: CaseData) -> torch.Tensor:
    return torch.randperm(data.case.N, generator=torch.Generator().manual_seed(data.case.seed + 2)).to(data.device)


def _permute_tokens(t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])[perm].reshape(t.shape)


def _scaled(results: Results, factors: dict[str, float]) -> Results:
    return [{k: None if v is None else v * factors.get(k, 1.0) for k, v in step.items()} for step in results]


def _input_rows() -> Relation:
    def transform(data):
        perm = _rows_perm(data)
        return _map_steps(data, lambda s: StepData(_permute_tokens(s.input, perm), s.weight,
                                                   _permute_tokens(s.grad_output, perm)))

    def expect(results, data):
        perm = _rows_perm(data)
        return [dict(step, output=_permute_tokens(step["output"], perm),
                     grad_input=_permute_tokens(step["grad_input"], perm)) for step in results]
    return Relation("input_rows", "input", "permuting input rows permutes output and grad_input rows",
                    transform, expect, reordered=("grad_weight", "grad_bias"))


def _weight_rows() -> Relation:
    def transform(data):
        perm = _cols_perm(data)
        return _map_steps(data, lambda s: StepData(s.input, s.weight[perm], s.grad_output[..., perm]),
                          bias=None if data.bias is None else data.bias[perm])

    def expect(results, data):
        perm = _cols_perm(data)
        return [dict(step, output=step["output"][..., perm], grad_weight=step["grad_weight"][perm],
                     grad_bias=None if step["grad_bias"] is None else step["grad_bias"][perm]) for step in results]
    # grad_bias is a column sum computed by PyTorch (not the implementation): CPU kernels may
    # block columns differently at other positions, so it is compared within the bound too.
    return Relation("weight_rows", "weight", "permuting weight rows permutes output columns and grad_weight rows",
                    transform, expect, reordered=("grad_input", "grad_bias"))


def _scale(name: str, operand: str, description: str, factors: dict[str, float]) -> Relation:
    def transform(data):
        def step(s):
            return StepData(s.input * POWER if operand == "input" else s.input,
                            s.weight * POWER if operand == "weight" else s.weight,
                            s.grad_output * POWER if operand == "grad_output" else s.grad_output)
        bias_scaled = operand in ("input", "weight") and data.bias is not None
        return _map_steps(data, step, bias=data.bias * POWER if bias_scaled else None)
    return Relation(name, operand, description, transform, lambda results, data: _scaled(results, factors),
                    exact_scaling=True)


def _negation() -> Relation:
    def transform(data):
        return _map_steps(data, lambda s: StepData(-s.input, s.weight, s.grad_output),
                          bias=None if data.bias is None else -data.bias)
    return Relation("negation", "input", "negating the input negates output and grad_weight", transform,
                    lambda results, data: _scaled(results, {"output": -1.0, "grad_weight": -1.0}))


def _identity_expect(results, data):
    return results


RELATIONS: tuple[Relation, ...] = (
    _input_rows(),
    _weight_rows(),
    _scale("input_scale", "input", "input * 2^3 multiplies output and grad_weight by 2^3 exactly",
           {"output": POWER, "grad_weight": POWER}),
    _scale("weight_scale", "weight", "weight * 2^3 multiplies output and grad_input by 2^3 exactly",
           {"output": POWER, "grad_input": POWER, "grad_bias": 1.0}),
    _scale("grad_output_scale", "grad_output", "grad_output * 2^3 multiplies grad_input, grad_weight and grad_bias "
           "by 2^3 exactly", {"grad_input": POWER, "grad_weight": POWER, "grad_bias": POWER}),
    _negation(),
    Relation("determinism", "state", "the same call twice gives identical results", lambda data: data,
             _identity_expect),
)
BY_NAME = {r.name: r for r in RELATIONS}


@dataclass
class RelationResult:
    relation: str
    holds: bool
    broken: list[str]  # "grad_weight (step 0): 12 of 256 elements differ (max abs diff ...)"
    error: object = None  # why nothing was compared: the execution's parity.rows.Raised, or a missing tensor


def _mismatch(tensor: str, step: int, got: torch.Tensor | None, want: torch.Tensor | None, *,
              reordered: bool, data: CaseData, emulated, scaled_by: float = 0.0) -> str | None:
    if got is None or want is None:
        return None if got is None and want is None else f"{tensor} (step {step}): missing"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tensor} (step {step}): shape/dtype {tuple(got.shape)}/{got.dtype} vs {tuple(want.shape)}/{want.dtype}"
    want = want.to(got.dtype)
    same = (got == want) | (got.isnan() & want.isnan())
    if scaled_by:
        # A result that passed through a dtype's subnormal range (fp16 below 2^-14, on its way to the
        # output dtype) has fewer significant bits than its scaled twin: there, allow the spacing
        # of that dtype's subnormals times the factor.
        finfos = [torch.finfo(dtype) for dtype in oracles.rounding_chain(data.case, tensor)]
        smallest_normal = max(f.smallest_normal for f in finfos)
        spacing = max(f.smallest_normal * f.eps for f in finfos) * scaled_by
        small = torch.minimum(got.abs(), want.abs()) < smallest_normal * scaled_by
        same |= small & ((got.double() - want.double()).abs() <= spacing)
        # ... and one beyond the narrowest dtype's max overflows there, whatever the output dtype.
        same |= got.isinf() & (want.double().abs() >= min(f.max for f in finfos))
    if bool(same.all()):
        return None
    if reordered:
        magnitude, inner, value = oracles.magnitude_of(emulated[step], data.steps[step], tensor)
        gamma = oracles.accumulation_gamma(inner, device_type=data.device.type if tensor != "grad_bias" else "cpu",
                                           fast_accum=tensor == "output")
        ratio, beyond, index = oracles.accumulation_excess(got, want, magnitude=magnitude, gamma=gamma,
                                                           gemm_value=value,
                                                           rounding_chain=oracles.rounding_chain(data.case, tensor),
                                                           sides=2)
        if ratio <= 1:
            return None
        return (f"{tensor} (step {step}): {beyond} elements beyond the accumulation bound "
                f"(worst {ratio:.3g}x at {index})")
    diff = torch.where(same, 0.0, torch.nan_to_num((got.double() - want.double()).abs(), nan=math.inf))
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax().cpu(), tuple(got.shape)))
    return (f"{tensor} (step {step}): {int((diff != 0).sum())} of {got.numel()} elements differ "
            f"(max abs diff {diff.max().item():.4g} at index {index}: got {got[index].item():.6g}, "
            f"expected {want[index].item():.6g})")


def check_relation_named(name: str, impl: Impl, data: CaseData) -> RelationResult:
    """check_relation of the relation called `name` (BY_NAME): what a worker process is sent, since a
    relation's transforms are closures that do not pickle."""
    return check_relation(BY_NAME[name], impl, data)


def missing_tensors(execution: Execution, case) -> str | None:
    """Why the relations cannot be compared when a tensor of the case is missing (no gradient returned)."""
    missing = sorted({tensor for step in execution.steps for tensor in case.tensors if step.get(tensor) is None})
    return f"no {', '.join(missing)} returned: nothing to compare" if missing else None


def check_relation(relation: Relation, impl: Impl, data: CaseData, *, base: Execution | None = None) -> RelationResult:
    """Run `impl` on `data` and on `relation.transform(data)`; compare with `relation.expect`."""
    base = base or execute(impl, data)
    transformed_data = relation.transform(data)
    transformed = execute(impl, transformed_data)
    error = base.error or transformed.error or missing_tensors(base, data.case)
    if error:
        return RelationResult(relation.name, False, [], error)
    expected = relation.expect(base.steps, data)
    # the bound of a reordered sum is the transformed data's: its elements are where the results' are (a
    # permutation moves the magnitudes too; the untransformed ones put a large column's allowance on a small one)
    emulated = [oracles.emulate_linear(s.input, s.weight, s.grad_output) for s in transformed_data.steps] \
        if relation.reordered else None
    broken = []
    for step, (got, want) in enumerate(zip(transformed.steps, expected)):
        for tensor in data.case.tensors:
            problem = _mismatch(tensor, step, got[tensor], want[tensor], reordered=tensor in relation.reordered,
                                data=transformed_data, emulated=emulated,
                                scaled_by=POWER if relation.exact_scaling else 0.0)
            if problem:
                broken.append(problem)
    return RelationResult(relation.name, not broken, broken)


def check_layout_invariance(impl: Impl, data: CaseData, layouts: tuple[Layout, Layout, Layout], *,
                            base: Execution | None = None) -> RelationResult:
    """The same logical data stored with other (input, weight, grad_output) layouts gives identical bits."""
    base = base or execute(impl, data)
    case = replace(data.case, input_layout=layouts[0], weight_layout=layouts[1], grad_output_layout=layouts[2])
    other = execute(impl, CaseData(case, data.steps, data.bias))
    error = base.error or other.error or missing_tensors(base, case)
    if error:
        return RelationResult("layout", False, [], error)
    # grad_bias is PyTorch's column sum of grad_output, whose order follows grad_output's strides
    # (nn.Linear's too): it is compared within the accumulation bound, everything else bitwise.
    emulated = [oracles.emulate_linear(s.input, s.weight, s.grad_output) for s in data.steps] if case.bias else None
    broken = [problem for step, (got, want) in enumerate(zip(other.steps, base.steps)) for tensor in case.tensors
              if (problem := _mismatch(tensor, step, got[tensor], want[tensor], reordered=tensor == "grad_bias",
                                       data=data, emulated=emulated))]
    return RelationResult(f"layout {'/'.join(layout.value for layout in layouts)}", not broken, broken)


def check_weight_update(impl: Impl, data: CaseData, *, base: Execution | None = None) -> RelationResult:
    """With 2+ steps: each later step equals a fresh layer built on that step's weight."""
    base = base or execute(impl, data)
    if base.error:
        return RelationResult("weight_update", False, [], base.error)
    broken = []
    for step in range(1, len(data.steps)):
        fresh = execute(impl, CaseData(replace(data.case, steps=1), [data.steps[step]], data.bias))
        if fresh.error:
            return RelationResult("weight_update", False, [], fresh.error)
        # (not reordered: `step` only names the step; the fresh layer's results are its step 0)
        broken += [problem for tensor in data.case.tensors
                   if (problem := _mismatch(tensor, step, base.steps[step][tensor], fresh.steps[0][tensor],
                                            reordered=False, data=data, emulated=None))]
    return RelationResult("weight_update", not broken, broken)

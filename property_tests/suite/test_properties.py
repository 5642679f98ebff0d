"""The property suite: hypothesis-driven forward and backward properties of an FP8 linear layer.

Every property runs against `--fp8-impl` (default fp8_impl), with `--fp8-against` (default
torchao:tensorwise) as the reference where one is needed:

    pytest --fp8-impl path/to/my_fp8.py:Float8Linear

 1 parity with the reference (bitwise for tensorwise in eager mode)
 2 accuracy floors against float64, and the accumulation bound against the exact emulation
 3 layout invariance: any strides of the same logical tensors give identical bits
 4 equivariance: row permutations, powers of two and negation pass through exactly
 5 edge values: zeros give zeros; large values saturate, never NaN
 6 determinism            7 state: results follow an in-place weight update
 8 nn.Linear's contract and the H100 _scaled_mm contract
 9 torch.compile (GPU): see test_compile.py          10 clear errors for bad input

Each case a test pins is a test of its own, `[generated]` the hypothesis search over the rest; every
id opens with the implementation (parity.property_items):

    test_parity_with_reference[mutants.py:scale_not_inverted-M32K64N48-in:bf16:C-w:bf16:C-go:C-tiny-seed0]

A failure's first line is the finding, then the command that reruns it, the case id and the
assert_close-style tables.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from parity.cases import Case, Dist, Layout, edge_cases
from parity.check import CheckPlan
from parity.impls import load_impl
from parity.property_items import PROPERTY_TEST, pinned
from parity.relations import RELATIONS, check_layout_invariance, check_relation_named, check_weight_update
from parity.runner import error_of_call, execute
from parity.strategies import layouts
from parity.suite import SUITE

pytestmark = PROPERTY_TEST  # ids name the implementation and the case; pinned cases are tests of their own


def with_edge_cases(test):
    """A pinned test for every edge case: zeros, amax at the fp8 max, an outlier, 3-D input, K == N, ..."""
    for case in reversed(edge_cases()):  # pinned keeps the order decorators are written in: edge_cases' order
        test = pinned(case=case)(test)
    return test


def any_case(**constraints):
    return st.deferred(lambda: SUITE.cases(**constraints))


# ---- 1. parity ------------------------------------------------------------------------------------------

@given(case=any_case())
@with_edge_cases
def test_parity_with_reference(case):
    plan = CheckPlan.make(SUITE.candidate, SUITE.reference, oracle=False, device=SUITE.device)
    rows, violations = SUITE.run(case, plan)
    SUITE.assert_no_violations(f"{SUITE.candidate.name} is not at parity with {SUITE.reference.name}", case, rows,
                               violations, diagnose=True)


# ---- 2. accuracy ---------------------------------------------------------------------------------------

@given(case=any_case())
@with_edge_cases
def test_accuracy_against_float64_and_exact_emulation(case):
    """SQNR floors against fp64 per tensor and distribution; the accumulation bound against the
    exact emulation; on a GPU (or with --fp8-cpu-gemm hopper) the H200's bits where calibrated
    (policy.py gives each threshold's reason)."""
    plan = CheckPlan.make(SUITE.candidate, load_impl("fp64"), device=SUITE.device)
    rows, violations = SUITE.run(case, plan)
    SUITE.assert_no_violations(f"{SUITE.candidate.name} is less accurate than FP8 allows", case, rows, violations)


# ---- 3. layout invariance -----------------------------------------------------------------------------------

@given(case=any_case(layouts_allowed=("C",)), stored=st.tuples(layouts(), layouts(), layouts()))
@pinned(case=Case(lead=(32,), K=64, N=48), stored=(Layout.TRANSPOSED, Layout.CONTIGUOUS, Layout.CONTIGUOUS))
@pinned(case=Case(lead=(2, 16), K=64, N=48), stored=(Layout.TRANSPOSED, Layout.TRANSPOSED, Layout.SLICED))
def test_layout_invariance(case, stored):
    result = SUITE.call(case, check_layout_invariance, SUITE.candidate, SUITE.data(case), stored)
    if not result.holds:
        SUITE.fail(f"the same logical tensors stored as in/w/go = {'/'.join(layout.value for layout in stored)} change "
                   f"the result", case, [result.error or "", *result.broken])


# ---- 4. equivariance ---------------------------------------------------------------------------------------

EQUIVARIANCES = [r for r in RELATIONS if r.name != "determinism"]


@pytest.mark.parametrize("relation", EQUIVARIANCES, ids=lambda r: r.name)
@given(case=any_case())
@pinned(case=Case(lead=(32,), K=64, N=48, dist=Dist.NEGATIVE))
@pinned(case=Case(lead=(2, 16), K=48, N=48, bias=True))
def test_equivariance(relation, case):
    assume(relation.applies(case))
    result = SUITE.call(case, check_relation_named, relation.name, SUITE.candidate, SUITE.data(case))
    if not result.holds:
        SUITE.fail(f"relation '{relation.name}' does not hold: {relation.description}", case,
                   [result.error or "", *result.broken])


# ---- 5. edge values ------------------------------------------------------------------------------------------

@given(case=any_case(dists=(Dist.ZEROS,)))
def test_zeros_give_zeros(case):
    execution = SUITE.call(case, execute, SUITE.candidate, SUITE.data(case))
    if execution.error:
        SUITE.fail("all-zero data crashed the implementation", case, [execution.error])
    for step in execution.steps:
        for tensor in ("output", "grad_input", "grad_weight", "grad_bias"):
            value = step[tensor]
            if value is None:
                continue
            expected_zero = not (tensor == "output" and case.bias)
            if value.isnan().any() or (expected_zero and value.count_nonzero()):
                SUITE.fail(f"all-zero data gave a non-zero or NaN {tensor}", case,
                           [f"{tensor}: {int(value.isnan().sum())} NaN, {int(value.count_nonzero())} non-zero"])


@given(case=any_case(dists=(Dist.NEAR_MAX, Dist.HEAVY, Dist.OUTLIER)), magnitude=st.sampled_from([1.0, 1e3, 1e5]))
@pinned(case=Case(lead=(16,), K=32, N=16, input_dtype="fp32", weight_dtype="fp32", dist=Dist.NEAR_MAX),
        magnitude=1e5)
def test_large_values_saturate_never_nan(case, magnitude):
    """Values at and beyond the fp8 max: the scale brings them into range, nothing becomes NaN;
    infinities only where the output dtype itself overflows (fp16's max is 65504)."""
    data = SUITE.data(case)
    for step in data.steps:
        step.input = (step.input.double() * magnitude).to(step.input.dtype)
        assume(bool(step.input.isfinite().all()))  # the input itself must fit its dtype (fp16: 65504)
    execution = SUITE.call(case, execute, SUITE.candidate, data)
    if execution.error:
        SUITE.fail("large values crashed the implementation", case, [execution.error])
    for index, step in enumerate(execution.steps):
        for tensor, value in step.items():
            if value is None:
                continue
            if value.isnan().any() or (case.input_dtype != "fp16" and not value.isfinite().all()):
                SUITE.fail(f"values x{magnitude:g} gave NaN/Inf in {tensor}", case,
                           [f"{tensor} (step {index}): {int(value.isnan().sum())} NaN, "
                            f"{int(value.isinf().sum())} Inf of {value.numel()}"])


# ---- 6. determinism and 7. state ---------------------------------------------------------------------------

@given(case=any_case())
def test_determinism(case):
    result = SUITE.call(case, check_relation_named, "determinism", SUITE.candidate, SUITE.data(case))
    if not result.holds:
        SUITE.fail("the same call twice gives different results", case, [result.error or "", *result.broken])


@given(case=any_case(max_steps=3).filter(lambda c: c.steps >= 2))
@pinned(case=Case(lead=(32,), K=64, N=48, steps=2))
def test_results_follow_in_place_weight_update(case):
    result = SUITE.call(case, check_weight_update, SUITE.candidate, SUITE.data(case))
    if not result.holds:
        SUITE.fail("after an in-place weight update the results do not follow the new weight", case,
                   [result.error or "", *result.broken])


# ---- 8. contracts ------------------------------------------------------------------------------------------

@given(case=any_case())
@with_edge_cases
def test_contracts(case):
    """Output and gradient dtypes, shapes and strides as nn.Linear gives them; every _scaled_mm
    call acceptable to an H100; no input modified in place."""
    plan = CheckPlan.make(SUITE.candidate, SUITE.reference, oracle=False, device=SUITE.device)
    rows, violations = SUITE.run(case, plan)
    broken = [v for v in violations if v.metric in ("contract", "scaled_mm_contract", "crash")]
    SUITE.assert_no_violations(f"{SUITE.candidate.name} breaks a contract", case, rows, broken)


# ---- 10. clear errors ---------------------------------------------------------------------------------------

FP8_IMPL_FAMILY = ("fp8_impl", "fp8_impl:Float8Linear", "fp8_impl:convert_to_float8_training",
                   "fp8_impl:float8_matmul")


@pytest.mark.parametrize(("shape", "dtype", "error", "match"), [
    ((20, 32), torch.bfloat16, ValueError, "M = 20 is not divisible by 16"),
    ((16, 32), torch.float64, TypeError, "dtype torch.float64 is not supported"),
    ((32,), torch.bfloat16, ValueError, "at least 2 dims"),
], ids=["M20", "float64", "1d"])
def test_bad_input_raises_a_clear_error(shape, dtype, error, match):
    if SUITE.impl_spec not in FP8_IMPL_FAMILY:
        pytest.skip("the error messages are fp8_impl's (the foundation issue's contract)")
    raised = SUITE.call(Case(lead=(32,), K=32, N=16), error_of_call, SUITE.candidate, (32, 16), shape, dtype,
                        SUITE.device)
    assert raised is not None and raised[0] == error.__name__ and re.search(match, raised[1]), (
        f"{SUITE.candidate.name} on an input of shape {shape} and {dtype}: expected {error.__name__} matching "
        f"{match!r}, got {raised}")

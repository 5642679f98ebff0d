"""The MX zoo (evals/zoo/mx_mutants.py): check passes its correct MXFP8 and NVFP4 layers, kills every planted bug,
and bisect localizes each public one on the CPU (GEMM, operand, bug class)."""

from __future__ import annotations

import pytest

from parity.bisect import localize
from parity.check import CheckPlan, run_check
from parity.impls import load_impl
from evals.zoo.mx_mutants import MX_MUTANTS

PUBLIC = [m for m in MX_MUTANTS if m.source != "invented"]


def plan_for(spec: str, recipe: str) -> CheckPlan:
    return CheckPlan.make(load_impl(spec, recipe=recipe))


def test_six_public_bugs_are_planted():
    assert len(PUBLIC) == 6 and {m.recipe for m in PUBLIC} == {"mxfp8", "nvfp4"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_the_correct_layers_pass(recipe):
    result = run_check(plan_for(f"evals/zoo/mx_mutants.py:correct_{recipe}", recipe), max_examples=10)
    assert result.verdict == "pass", [v.full_message for v in result.violations]


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MX_MUTANTS, ids=lambda m: m.name)
def test_bisect_localizes_every_mx_mutant(mutant):
    result = localize(plan_for(mutant.spec, mutant.recipe), max_examples=20)
    summary = (f"{mutant.name}: got class {result.category}, gemm {result.gemm}, operand {result.operand}; "
               f"evidence {result.evidence}")
    assert result.verdict == "fail", summary
    assert (result.category, result.first, result.operand) == (mutant.category, mutant.gemms[0], mutant.operand), \
        summary
    assert sorted(result.gemm) == sorted(mutant.gemms), summary

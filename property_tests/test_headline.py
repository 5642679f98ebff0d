"""One bug, one story (issue 28 item 4; issue 27's fast-accumulation wording): check, bisect, the pytest
plugin and train head the same planted bug with the same line, made by one renderer (parity.headline).

The bugs are planted in the README's "Check your own layer" example, as a new user plants them: the
grad_weight GEMM asked for fast accumulation, and the forward handed the scale where its inverse belongs
(`scale_a=1 / x_inv`: one float32 rounding off the scale itself).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from parity import hopper
from parity.bisect import localize, render as render_localized
from parity.cases import parse_case_id
from parity.check import CheckPlan, render, run_check
from parity.cli import main
from parity.findings import Trigger
from parity.impls import load_impl
from parity.suite import PropertyFailure, Suite
from parity.train import TrainPlan, run_training
from parity.vocabulary import Condition
from property_tests.test_train import MODEL_FILE

README = Path(__file__).resolve().parents[1] / "README.md"
CASE = parse_case_id("M16K16N16|normal|seed0")
ONLY_ON_THE_GPU = str(Trigger(Condition.GPU_FAST_ACCUM))
FAST_ACCUM = ("grad_weight GEMM (step 0): use_fast_accum=True where the tensorwise recipe says False "
              f"[accumulation; {ONLY_ON_THE_GPU}]")
SCALE_FOR_INVERSE = "output GEMM (step 0): A (input): the GEMM handed its scale instead of the inverse [scale]"
# a model of one small block: a step of training takes a second, not the tiny GPT's ten
MODEL = MODEL_FILE


def readme_layer(folder: Path, name: str, pattern: str, replacement: str) -> str:
    """The README's example layer with one planted bug (`pattern` replaced once), as an --impl spec."""
    code = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    planted, count = re.subn(pattern, replacement, code, count=1)
    assert count == 1, f"the README's example no longer has {pattern!r}"
    path = folder / f"{name}.py"
    path.write_text(planted)
    return f"{path}:fp8_linear"


@pytest.fixture
def fast_accum_layer(tmp_path) -> str:
    # grad_weight is the only call handed x_inv as scale_b
    return readme_layer(tmp_path, "fast_accum", r"(scale_b=x_inv,\s*out_dtype=g\.dtype)\)", r"\1, use_fast_accum=True)")


@pytest.fixture
def scale_for_inverse_layer(tmp_path) -> str:
    return readme_layer(tmp_path, "scale_for_inverse", r"scale_a=x_inv, scale_b=w_inv",
                        "scale_a=1 / x_inv, scale_b=w_inv")


def suite_finding(impl: str, test: str) -> str:
    """The first line of the pytest plugin's failure (PropertyFailure.finding) of the shipped suite's
    parity (`test` "parity": its plan without the oracle, diagnosed again) or accuracy property, on CASE."""
    suite = Suite(impl_spec=impl, device="cpu", case_id=CASE.id)
    if test == "parity":
        plan = CheckPlan.make(suite.candidate, suite.reference, oracle=False)
    else:
        plan = CheckPlan.make(suite.candidate, load_impl("fp64"))
    rows, violations = suite.run(CASE, plan)
    with pytest.raises(PropertyFailure) as failure:
        suite.assert_no_violations("a property", CASE, rows, violations, diagnose=test == "parity")
    return failure.value.finding


def train_finding(tmp_path: Path, impl: str):
    model = tmp_path / "block.py"
    model.write_text(MODEL)
    return run_training(TrainPlan(impl, model=f"{model}:make_model", steps=1, sample_every=10), out_dir=tmp_path)


def test_a_fast_accumulation_flag_tells_one_story_in_check_bisect_the_plugin_and_train(fast_accum_layer, tmp_path):
    plan = CheckPlan.make(load_impl(fast_accum_layer))
    checked = run_check(plan, cases=[CASE], isolate=False)
    assert str(checked.headline) == FAST_ACCUM and f"Finding: {FAST_ACCUM}" in render(checked)
    assert checked.to_json()["finding"] == FAST_ACCUM

    localized = localize(plan, case=CASE, isolate=False)  # bisect: the README's "only on the GPU"
    assert str(localized.headline) == FAST_ACCUM and f"finding      : {FAST_ACCUM}" in render_localized(localized)
    assert localized.trigger == [ONLY_ON_THE_GPU] and localized.to_json()["finding"] == FAST_ACCUM

    assert suite_finding(fast_accum_layer, "accuracy") == FAST_ACCUM

    # train stays in bitwise lockstep on a CPU, and says what check says of its first layer's first call
    trained = train_finding(tmp_path, fast_accum_layer)
    assert trained.divergence is None and trained.finding == FAST_ACCUM and not trained.verdict.ok
    assert f"finding: {FAST_ACCUM}" in trained.verdict.details and trained.calls_case_file.is_file()
    # its next command, run as printed, localizes that finding on that file
    report = tmp_path / "bisect.json"
    assert main([*shlex.split(trained.verdict.next_step)[1:], "--json", str(report)]) == 1
    assert json.loads(report.read_text())["finding"] == FAST_ACCUM


def test_a_scale_handed_for_its_inverse_tells_one_story(scale_for_inverse_layer, tmp_path):
    plan = CheckPlan.make(load_impl(scale_for_inverse_layer))
    checked = run_check(plan, cases=[CASE], isolate=False)  # was: "no single mistake reproduces it"
    assert str(checked.headline) == SCALE_FOR_INVERSE
    localized = localize(plan, case=CASE, isolate=False)
    assert str(localized.headline) == SCALE_FOR_INVERSE and localized.category == "scale"
    assert suite_finding(scale_for_inverse_layer, "parity") == SCALE_FOR_INVERSE

    trained = train_finding(tmp_path, scale_for_inverse_layer)
    assert trained.divergence.gemm == "output" and trained.finding == SCALE_FOR_INVERSE
    report = tmp_path / "bisect.json"
    assert main([*shlex.split(trained.verdict.next_step)[1:], "--json", str(report)]) == 1
    assert json.loads(report.read_text())["finding"] == SCALE_FOR_INVERSE


def test_a_correct_layer_trains_without_a_finding(tmp_path):
    trained = train_finding(tmp_path, readme_layer(tmp_path, "correct", "fp8_linear", "fp8_linear"))
    assert trained.verdict.ok and trained.finding is None and trained.calls_case_file is None
    assert not list(tmp_path.glob("calls-*.pt"))


@pytest.mark.skipif(not hopper.available(), reason="--cpu-gemm hopper needs mmaemu")
def test_under_cpu_gemm_hopper_a_fast_accumulation_flag_is_not_only_on_the_gpu(fast_accum_layer, monkeypatch):
    """A CPU computing the H200's bits shows a fast-accumulation bug in its numbers where they differ: no
    command calls it "only on the GPU" there (issue 27), and the printed commands run that kernel again."""
    monkeypatch.setenv("FP8_PARITY_CPU_SCALED_MM", "hopper")
    plan = CheckPlan.make(load_impl(fast_accum_layer))
    headline = FAST_ACCUM.replace(f"; {ONLY_ON_THE_GPU}", "")
    checked = run_check(plan, cases=[CASE], isolate=False)
    assert str(checked.headline) == headline
    localized = localize(plan, case=CASE, isolate=False)
    assert str(localized.headline) == headline and not any("GPU" in t for t in localized.trigger)
    assert "--cpu-gemm hopper" in render_localized(localized)  # its Rerun line

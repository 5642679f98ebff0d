"""`fp8-parity check`: verdicts, minimal cases, exit codes, the JSON schema and clear usage errors."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.cases import Case
from parity.check import CheckPlan, render, run_check
from parity.env import torchao_version
from parity.cli import main
from parity.impls import load_impl
from parity.policy import Policy
from evals.zoo.mutants import BY_NAME

MUTANTS = "evals/zoo/mutants.py"
JSON_KEYS = {"verdict", "impl", "reference", "policy", "device", "cases_run", "seconds", "minimal_case", "failures",
             "error", "rerun", "env", "recipe", "skipped", "note", "coverage", "finding"}
FAILURE_KEYS = {"case_id", "tensor", "step", "metric", "value", "allowed", "message"}


def plan(impl: str, against: str | None = "torchao:tensorwise", **kw) -> CheckPlan:
    return CheckPlan.make(load_impl(impl), load_impl(against) if against else None, **kw)


def test_fp8_impl_passes():
    result = run_check(plan("fp8_impl"), max_examples=15)
    assert result.verdict == "pass", render(result)
    assert result.cases_run >= 15 and result.plan.policy is Policy.BITWISE
    assert {r.reference for r in result.rows} == {"torchao:tensorwise", "emulated:tensorwise"}


@pytest.mark.parametrize(("mutant", "tensor", "metric"), [
    ("weight_reshaped", "output", "bitwise"),
    ("grad_output_e4m3", "grad_input", "bitwise"),
    ("output_float32", "output", "contract"),
    ("grad_weight_b_row_major", "grad_weight", "scaled_mm_contract"),
    ("crash_on_fp32_input", "all", "crash"),
])
def test_planted_bug_fails_with_a_minimal_case(mutant, tensor, metric):
    result = run_check(plan(f"{MUTANTS}:{mutant}"), max_examples=30)
    assert result.verdict == "fail"
    assert (metric, tensor) in {(v.metric, v.tensor) for v in result.violations}
    minimal = result.minimal_case
    assert minimal.M == 16 and minimal.K == 16 and minimal.N == 16  # shrunk to the smallest shape
    if BY_NAME[mutant].trigger == "fp32 input":
        assert minimal.input_dtype == "fp32"


def test_trigger_survives_shrinking():
    """A bug that needs K == N keeps K == N in its minimal case; one that needs a second call keeps two steps."""
    square = run_check(plan(f"{MUTANTS}:weight_transposed_if_square"), max_examples=40)
    assert square.verdict == "fail" and square.minimal_case.K == square.minimal_case.N
    stale = run_check(plan(f"{MUTANTS}:cached_weight"), max_examples=40)
    assert stale.verdict == "fail" and stale.minimal_case.steps == 2
    assert all(v.step == 1 for v in stale.violations)


def test_policies_follow_the_recipes():
    assert plan("fp8_impl").policy is Policy.BITWISE
    assert plan("fp8_impl", "emulated").policy is Policy.ACCUMULATION
    assert plan("fp8_impl", "fp64").policy is Policy.SQNR
    rowwise = plan("torchao:rowwise")  # another recipe than its reference's: both measured against fp64
    assert rowwise.policy is Policy.PAIRED
    assert [(c.impl.name, c.reference.name, c.policy) for c in rowwise.comparisons[1:3]] == [
        ("torchao:rowwise", "fp64", Policy.NONE), ("torchao:tensorwise", "fp64", Policy.NONE)]


@pytest.mark.parametrize(("impl", "device", "reference", "policy"), [
    ("fp8_impl", "cpu", "torchao:tensorwise", Policy.BITWISE),
    ("fp8_impl:rowwise", "cpu", "torchao:rowwise", Policy.BITWISE),
    ("fp8_impl:rowwise_with_gw_hp", "cuda", "torchao:rowwise_with_gw_hp", Policy.BITWISE),
    ("torchao:rowwise", "cpu", "emulated:rowwise", Policy.ACCUMULATION),  # its own recipe's oracle
    ("fp8_impl:blockwise", "cpu", "emulated:blockwise", Policy.ACCUMULATION),  # no CPU blockwise kernel
    ("fp8_impl:blockwise", "cuda", "emulated:blockwise", Policy.ACCUMULATION),  # torchao's: Triton JIT per shape
    ("bf16", "cpu", "fp64", Policy.SQNR),
])
def test_default_reference_is_the_recipes(impl, device, reference, policy):
    made = CheckPlan.make(load_impl(impl), device=device)
    assert (made.reference.name, made.policy) == (reference, policy)
    oracles = [c.reference.name for c in made.comparisons if c.policy is Policy.ACCUMULATION]
    if load_impl(impl).recipe.is_fp8:  # every FP8 candidate also meets its recipe's exact oracle
        assert oracles == [f"emulated:{load_impl(impl).recipe.name}"]


@pytest.mark.parametrize("against", ["fp64", "bf16", "emulated"])
def test_fp8_impl_meets_the_statistical_policies(against):
    result = run_check(plan("fp8_impl", against), max_examples=10)
    assert result.verdict == "pass", render(result)


def test_sqnr_policy_floors_follow_the_effective_size():
    from parity.policy import sampling_margin_db, sqnr_floor
    assert sampling_margin_db(16) > 3 > sampling_margin_db(4096) > 0.3
    assert sqnr_floor("tensorwise", "output", "normal", n_eff=1e9) == pytest.approx(25.5, abs=0.01)
    assert sqnr_floor("tensorwise", "grad_weight", "normal", n_eff=16) < 18.5
    assert sqnr_floor("tensorwise", "output", "nearmax", "fp16") is None


def test_sqnr_policy_catches_a_gross_bug():
    result = run_check(plan(f"{MUTANTS}:scale_not_inverted", "fp64"), max_examples=10)
    assert result.verdict == "fail" and {v.metric for v in result.violations} & {"sqnr_db", "nonfinite"}


def test_rowwise_is_not_worse_than_tensorwise():
    cases = [Case(lead=(64,), K=128, N=48, dist=dist, seed=seed)
             for dist in ("normal", "heavy", "outlier", "negative") for seed in range(3)]
    result = run_check(plan("torchao:rowwise"), cases=cases)
    assert result.verdict == "pass", render(result)


@pytest.mark.skipif(torchao_version() != "0.18.0", reason="a finding about torchao 0.18.0")
def test_torchao_rowwise_limitation_is_a_skip_with_its_reason():
    """torchao 0.18's rowwise recipe raises on a 3-D input stored transposed: the case is skipped
    with torchao's own message (not failed), and a check of nothing but such cases is an error."""
    result = run_check(plan("torchao:rowwise", None), cases=[Case(lead=(2, 16), K=16, N=16, input_layout="T")])
    assert result.verdict == "error" and "no case could run here" in result.error
    (reason,) = result.skipped.values()
    assert "aten.clone.default with axiswise scaling is not supported yet" in reason
    assert "1 of 1 cases skipped (not failed)" in render(result)


def test_cli_pass_fail_and_json(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert main(["check", "--impl", "fp8_impl", "--max-examples", "5", "--device", "cpu", "--json", str(out)]) == 0
    passed = json.loads(out.read_text())
    assert set(passed) == JSON_KEYS and passed["verdict"] == "pass" and passed["failures"] == []
    assert passed["env"]["torch"] == torch.__version__
    assert passed["coverage"]["max_M"] == 1024 and passed["coverage"]["cases"] == passed["cases_run"]  # the layer case

    assert main(["check", "--impl", f"{MUTANTS}:scale_not_inverted", "--max-examples", "20", "--device", "cpu",
                 "--json", str(out)]) == 1
    failed = json.loads(out.read_text())
    assert failed["verdict"] == "fail" and failed["minimal_case"] == "M16K16N16|in:bf16:C|w:bf16:C|go:C|normal|seed0"
    assert failed["failures"] and all(set(f) == FAILURE_KEYS for f in failed["failures"])
    assert {f["tensor"] for f in failed["failures"]} == {"grad_input", "grad_weight"}
    text = capsys.readouterr().out
    assert "Minimal failing case: M16K16N16" in text and "Rerun exactly this case:" in text
    assert f"Finding: {failed['finding']}" in text and "the GEMM handed its scale instead of the inverse" in text
    rerun = failed["rerun"]
    assert rerun.startswith("fp8-parity check --impl") and "--case 'M16K16N16|" in rerun
    # the printed command, run as printed, reproduces the finding
    assert main([*shlex.split(rerun)[1:], "--quiet", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["finding"] == failed["finding"]


def test_cli_reruns_exactly_one_case(capsys):
    case = Case(lead=(2, 16), K=32, N=16, input_layout="T", steps=2)
    assert main(["check", "--impl", "fp8_impl", "--case", case.id, "--device", "cpu"]) == 0
    assert "1 cases" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["check", "--impl", "nope"], "unknown implementation 'nope'"),
    (["check", "--impl", "missing.py:f"], "does not exist"),
    (["check", "--impl", "fp8_impl", "--case", "M20K16N16"], "M = 20 must be a positive multiple of 16"),
])
def test_cli_bad_input_exits_2(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as refused:  # the parser's own refusals (a built-in's name mistyped) exit before any work
        code = refused.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_cli_cannot_run_on_missing_gpu_exits_125(capsys):
    assert main(["check", "--impl", "fp8_impl", "--device", "cuda"]) == 125
    assert "no CUDA device" in capsys.readouterr().err


def test_console_entry_point():
    """`python -m parity` is the CLI (what the fp8-parity script runs)."""
    done = subprocess.run([sys.executable, "-m", "parity", "check", "--impl", "nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown implementation" in done.stderr


def test_progress_in_a_log_beats_while_a_case_runs_and_stops_with_the_command(monkeypatch, capsys):
    """Not a terminal (CI, a log file): the last status again every HEARTBEAT_S seconds while
    nothing else is printed, and nothing once the command is over."""
    import time

    from parity.progress import Progress
    monkeypatch.setattr(Progress, "HEARTBEAT_S", 0.2)
    with Progress(True, "cases", bar=False) as progress:
        progress(3, 100)
        time.sleep(1.5)
    beats = capsys.readouterr().err.splitlines()
    assert len(beats) >= 2 and all(line.startswith("  3 cases run (search budget 100)") for line in beats), beats
    time.sleep(1.5)
    assert capsys.readouterr().err == ""


GRAD_OUTPUT_MUTATOR = '''
import torch


class _ScalesItsGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_2d, weight):
        ctx.save_for_backward(input_2d, weight)
        return input_2d @ weight.t().to(input_2d.dtype)

    @staticmethod
    def backward(ctx, grad):
        input_2d, weight = ctx.saved_tensors
        grad_input = grad @ weight.to(grad.dtype)
        grad_weight = (grad.t() @ input_2d.to(grad.dtype)).to(weight.dtype)
        grad.mul_(0.5)  # the caller's tensor, after its last use here
        return grad_input, grad_weight


def matmul(input_2d, weight):
    return _ScalesItsGradient.apply(input_2d, weight)
'''


def test_a_backward_that_writes_into_grad_output_is_a_contract_finding(tmp_path):
    """Right numbers, but the caller's gradient is changed: a later consumer of it (another
    branch of the graph) reads the wrong values."""
    path = tmp_path / "mutator.py"
    path.write_text(GRAD_OUTPUT_MUTATOR)
    plan = CheckPlan.make(load_impl(f"{path}:matmul", recipe="bf16"))
    result = run_check(plan, cases=[Case(lead=(16,), K=32, N=16)])
    assert result.verdict == "fail"
    assert any(v.metric == "contract" and "grad_output was modified in place by backward" in v.message
               for v in result.violations), [v.message for v in result.violations]


def test_a_correct_layer_written_with_functional_scaled_mm_passes_on_the_cpu():
    """torch.nn.functional.scaled_mm (aten._scaled_mm_v2) and torchao's torch._scaled_mm run the same CPU
    kernel: before, the candidate ran torch's own and differed from torchao in 1 of 512 elements."""
    from parity.check import CheckPlan, run_check
    from parity.impls import load_impl
    impl = load_impl(str(Path(__file__).parent / "impls" / "scaled_mm_v2_tensorwise.py") + ":matmul")
    result = run_check(CheckPlan.make(impl, device="cpu"), device="cpu", max_examples=40)
    assert result.verdict == "pass", [v.message for v in result.violations]


def test_a_reference_that_cannot_run_here_is_said_before_any_work(capsys):
    """Blockwise against torchao on a CPU (torchao's blockwise layer needs Triton): exit 125 with why, at once;
    it was an internal error after 49 s (every generated case filtered out)."""
    from parity.cli import main
    assert main(["check", "--impl", "fp8_impl:blockwise", "--recipe", "blockwise", "--against", "torchao:blockwise",
                 "--device", "cpu", "--quiet"]) == 125
    out = capsys.readouterr().out
    assert "0 cases" in out and "the reference cannot run here: torchao:blockwise: torchao's blockwise training" in out


def test_a_hang_is_waited_on_once():
    """Once the candidate ran past its time limit the verdict is known: no shrinking, no rerun, no further case
    (each would wait out its own limit: 20 examples of a spinning backward did not finish in 400 s)."""
    from parity.check import CheckPlan, run_check
    from parity.impls import load_impl
    from parity.worker import Died
    plan = CheckPlan.make(load_impl("evals/hostile/impls.py:bwd_busy_loop"), device="cpu")
    result = run_check(plan, device="cpu", max_examples=20, time_limit=2)
    assert result.verdict == "fail" and result.cases_run == 1
    assert isinstance(result.violations[0].error, Died) and result.violations[0].error.timed_out
    assert "ran past its time limit: the check stopped there" in result.note


# ---- what a pass covered (issue 29, item 9) -------------------------------------------------------------------

def test_a_pass_states_the_largest_shapes_dtypes_and_layouts_that_ran():
    """A layer wrong only past a size passed with no word that no case that large ran: the verdict line of a
    pass says what its cases covered."""
    cases = [Case(lead=(2, 16), K=32, N=16, input_layout="T", steps=2),
             Case(lead=(48,), K=16, N=64, input_dtype="fp32", weight_dtype="fp32", bias=True, dist="outlier")]
    result = run_check(plan("bf16", "fp64"), cases=cases)
    first = render(result).splitlines()[0]
    assert result.verdict == "pass" and first.endswith(
        "2 cases in " + first.split("2 cases in ")[1].split(" s.")[0] + " s. Covered: M <= 48, K <= 32, N <= 64, "
        "input bf16/fp32, weight bf16/fp32, layouts C/T, 2-D/3-D input, with and without bias, up to 2 calls, "
        "2 of 13 data distributions"), first


def test_check_runs_a_case_of_a_layers_size_after_its_search():
    """The search draws M, K, N up to 256: a layer wrong only when M > 512 passed it. The CLI's check then runs
    one case of a layer's size (M 1024, K 1024, N 128), found here and shrunk (K > 256: the hostile corpus)."""
    candidate = CheckPlan.make(load_impl("evals/hostile/large_only.py:wrong_above_m512", recipe="bf16"),
                               load_impl("fp64"))
    assert run_check(candidate, max_examples=1).verdict == "pass"  # the search alone
    result = run_check(candidate, max_examples=1, layer_case=True)
    assert result.verdict == "fail" and result.minimal_case.M > 512, render(result)


def test_a_layer_checked_as_another_recipe_is_told_which_recipe_its_calls_are():
    """Issue 28 item 3: a tensorwise layer checked with --recipe rowwise differs from the rowwise oracle in
    every scale, and no single mistake of the rowwise cast reproduces tensorwise scales; what its calls are
    is said first (was: "its inverse scale differs from the oracle's ... no single mistake reproduces it")."""
    from parity.bisect import localize
    plan = CheckPlan.make(load_impl(f"{MUTANTS}:correct", recipe="rowwise"))
    case = Case(lead=(16,), K=16, N=16)
    headline = str(run_check(plan, cases=[case], isolate=False).headline)
    assert headline == ("output GEMM (step 0): every recorded call is exactly the tensorwise recipe's (fp8 formats, "
                        "scales, values and flags), not the rowwise recipe's: the layer implements tensorwise; check "
                        "it with --recipe tensorwise [scale]")
    assert str(localize(plan, case=case, isolate=False).headline) == headline
    # judged as the recipe its calls are, it passes
    assert run_check(CheckPlan.make(load_impl(f"{MUTANTS}:correct", recipe="tensorwise")), cases=[case],
                     isolate=False).verdict == "pass"

"""`fp8-parity bisect`: every mutant of the zoo is detected, and localized to its GEMM, operand,
bug class and trigger; `--git` finds the first bad commit of a repository."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from parity.bisect import localize
from parity.cases import Case
from parity.check import CheckPlan, run_check
from parity.cli import main
from parity.impls import load_impl
from parity.policy import Policy
from evals.zoo.mutants import MUTANTS

TORCHAO = "torchao:tensorwise"
CPU_MUTANTS = [m for m in MUTANTS if not m.gpu_only and m.recipe == "tensorwise"]
RECIPE_MUTANTS = [m for m in MUTANTS if m.recipe != "tensorwise"]


def plan_for(mutant) -> CheckPlan:
    return CheckPlan.make(load_impl(mutant.spec, recipe=mutant.recipe))


def assert_localized(result, mutant):
    """Class, GEMMs, operand, and the trigger of the mutants that have one (non-contiguous input only,
    K == N only, from the second call only, fp32 input only, ...: the label bisect prints contains it)."""
    summary = (f"{mutant.name}: got class {result.category}, gemm {result.gemm}, operand {result.operand}, "
               f"trigger {result.trigger}; evidence {result.evidence}")
    assert result.verdict == "fail", summary
    assert result.category == mutant.category, summary
    assert sorted(result.gemm) == sorted(mutant.gemms), summary
    assert result.operand == mutant.operand, summary
    if mutant.trigger:
        assert any(mutant.trigger in trigger for trigger in result.trigger), summary


@pytest.mark.parametrize("mutant", CPU_MUTANTS, ids=lambda m: m.name)
def test_check_kills_and_bisect_localizes_every_mutant(mutant):
    assert_localized(localize(plan_for(mutant), max_examples=60), mutant)


@pytest.mark.parametrize("mutant", RECIPE_MUTANTS, ids=lambda m: m.name)
def test_check_kills_every_recipe_mutant(mutant):
    """The rowwise and blockwise mutants, against their own recipe's reference and oracle."""
    result = run_check(plan_for(mutant), max_examples=60)
    assert result.verdict == "fail", f"{mutant.name}: {result.verdict}"
    assert set(mutant.gemms) <= {v.tensor for v in result.violations}, [v.full_message for v in result.violations]


def test_a_fast_accumulation_flag_is_all_a_cpu_can_show():
    """A CPU ignores use_fast_accum: asked for where the recipe does not, the flag in the recorded call
    is the only failure there, marked as one the GPU's numbers show (bisect on a GPU then names the
    trigger "only on the GPU")."""
    from parity.localization import is_gpu_lint as _is_gpu_lint
    mutant = next(m for m in MUTANTS if m.name == "grad_input_fast_accum")
    result = run_check(plan_for(mutant), max_examples=10)
    assert result.verdict == "fail" and result.violations
    assert all(_is_gpu_lint(v) for v in result.violations), [v.full_message for v in result.violations]
    # the same rows from a GPU: there the flag is a finding like any other (its numbers may differ)
    on_gpu = plan_for(mutant).judge([row.but(device="cuda") for row in result.rows])
    assert on_gpu and not any(_is_gpu_lint(v) for v in on_gpu), [v.full_message for v in on_gpu]


def test_zoo_covers_every_bug_class():
    classes = {"transpose", "layout", "scale", "fp8_dtype", "saturation", "accumulation", "contract", "stale_state",
               "crash"}
    assert {m.category for m in MUTANTS} == classes and len(MUTANTS) >= 12


def test_correct_implementation_has_nothing_to_localize(capsys):
    # one case: the search's passing path is check's (test_check.py); here, what bisect says after it
    assert main(["bisect", "--impl", "evals/zoo/mutants.py:correct", "--case", "M32K64N48|normal|seed0",
                 "--device", "cpu"]) == 0
    assert "nothing to localize" in capsys.readouterr().out


def test_bisect_json_schema(tmp_path):
    out = tmp_path / "bisect.json"
    assert main(["bisect", "--impl", "evals/zoo/mutants.py:weight_e5m2", "--device", "cpu",
                 "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert {"verdict", "gemm", "operand", "category", "trigger", "minimal_case", "evidence"} <= set(result)
    assert result["category"] == "fp8_dtype" and result["gemm"] == ["output", "grad_input"]
    assert result["method"] == "recorded calls"
    first = result["diagnosis"][0]
    assert (first["gemm"], first["operand"], first["stage"], first["category"]) == ("output", "weight", "fp8_dtype",
                                                                                    "fp8_dtype")
    assert any("B (weight) is float8_e5m2; the tensorwise recipe casts it to e4m3" in line
               for line in result["evidence"])


def test_accumulation_policy_separates_rounding_from_bugs():
    """grad_weight_fp32_out differs bitwise from torchao but stays within the accumulation bound
    (bf16 input: its grad_weight does not overflow fp16 on the way, as torchao's would)."""
    mutant = next(m for m in MUTANTS if m.name == "grad_weight_fp32_out")
    cases = [Case(lead=(64,), K=128, N=48, weight_dtype="fp32", dist=dist, seed=seed)
             for dist in ("normal", "heavy", "outlier") for seed in range(3)]
    versus_torchao = run_check(plan_for(mutant), cases=cases)
    versus_emulation = run_check(CheckPlan.make(load_impl(mutant.spec), load_impl("emulated")), cases=cases)
    assert versus_torchao.verdict == "fail" and versus_emulation.plan.policy is Policy.ACCUMULATION
    assert versus_emulation.verdict == "pass"


# ---- git history --------------------------------------------------------------------------------------

def _commit(repo, message, body):
    (repo / "my_fp8.py").write_text(textwrap.dedent(body))
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], cwd=repo, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def test_git_bisect_names_the_first_bad_commit(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    good = _commit(repo, "fp8 matmul", "from fp8_impl import float8_matmul as matmul\n")
    _commit(repo, "docs", "# a correct FP8 matmul\nfrom fp8_impl import float8_matmul as matmul\n")
    first_bad = _commit(repo, "return the output in float32", """
        from fp8_impl import float8_matmul
        def matmul(input_2d, weight):
            return float8_matmul(input_2d, weight).float()
    """)
    bad = _commit(repo, "more work", """
        from fp8_impl import float8_matmul
        def matmul(input_2d, weight):  # still returns float32
            return float8_matmul(input_2d, weight).float()
    """)
    monkeypatch.chdir(repo)
    out = tmp_path / "history.json"
    # one known failing case: each commit's check runs only it (the search would find it too, more slowly)
    assert main(["bisect", "--git", good, bad, "--impl", "my_fp8.py:matmul", "--case", "M32K64N48|normal|seed0",
                 "--device", "cpu", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["first_bad"] == first_bad
    assert "return the output in float32" in capsys.readouterr().out
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert status == "" and "worktree" not in subprocess.run(["git", "worktree", "list"], cwd=repo,
                                                             capture_output=True, text=True).stdout.split("\n")[1:]


def test_git_bisect_bad_input_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # not a git repository
    assert main(["bisect", "--git", "HEAD~3", "HEAD", "--impl", "x.py:f", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "git rev-parse --show-toplevel failed" in err and "Traceback" not in err


def test_bisects_rerun_line_reproduces_the_failure_as_printed(capsys):
    """The printed `Rerun:` command judges the layer as bisect did: for your own code of another recipe it
    carries --recipe (without it, a rowwise layer was judged as tensorwise, with false findings)."""
    import shlex
    assert main(["bisect", "--impl", "evals/zoo/mutants.py:rowwise_pow2_missing", "--recipe", "rowwise",
                 "--case", "M32K64N48|normal|seed0", "--device", "cpu"]) == 1
    rerun = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Rerun: "))
    argv = shlex.split(rerun.removeprefix("Rerun: "))
    assert argv[:2] == ["fp8-parity", "check"] and argv[argv.index("--recipe") + 1] == "rowwise"
    assert main([*argv[1:], "--quiet"]) == 1
    assert "(rowwise recipe)" in capsys.readouterr().out  # judged as bisect judged it

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


# A planted bug of each recipe a CPU judges against its reference: (its --impl and --recipe; its case, where the
# default's N = 48 does not fit the recipe's blocks). Blockwise's reference on a CPU is emulated:blockwise (torchao's
# cannot run there: check says so, exit 125); its case has more than one 128x128 weight block, or a scale grid
# reshaped where it belongs transposed would go unseen (about 10 s of bisect here).
PRINTED = {
    "tensorwise": ("evals/zoo/mutants.py:scale_not_inverted", []),
    "rowwise": ("evals/zoo/mutants.py:rowwise_pow2_missing", ["--recipe", "rowwise"]),
    "rowwise_with_gw_hp": ("evals/heldout/set12/gwhp_conv_go_scale_not_inverted.py:convert",
                           ["--recipe", "rowwise_with_gw_hp"]),
    "blockwise": ("evals/zoo/mutants.py:blockwise_scales_reshaped", ["--recipe", "blockwise"]),
    "mxfp8": ("evals/zoo/mx_mutants.py:mx_dim1_floor", ["--recipe", "mxfp8"]),
    "nvfp4": ("evals/zoo/mx_mutants.py:nvfp4_no_global_scale", ["--recipe", "nvfp4"]),
}
PRINTED_CASE = {"blockwise": "M128K256N384|normal|seed0", "mxfp8": "M32K64N64|normal|seed0",
                "nvfp4": "M32K64N64|normal|seed0"}


@pytest.mark.parametrize("recipe", list(PRINTED))
def test_bisects_rerun_line_reproduces_the_finding_as_printed(recipe, tmp_path, capsys):
    """The printed `Rerun:` command judges the layer as bisect did and finds what bisect found: for your own
    code of another recipe it carries --recipe (without it, a rowwise layer was judged as tensorwise, with
    false findings), and check heads the failure with bisect's finding."""
    import shlex
    impl, flags = PRINTED[recipe]
    localized, rerun_json = tmp_path / "bisect.json", tmp_path / "check.json"
    case = PRINTED_CASE.get(recipe, "M32K64N48|normal|seed0")
    assert main(["bisect", "--impl", impl, *flags, "--case", case, "--device", "cpu",
                 "--json", str(localized)]) == 1
    finding = json.loads(localized.read_text())["finding"]
    text = capsys.readouterr().out
    assert finding and f"finding      : {finding}" in text
    rerun = next(line for line in text.splitlines() if line.startswith("Rerun: "))
    argv = shlex.split(rerun.removeprefix("Rerun: "))
    assert argv[:2] == ["fp8-parity", "check"]
    assert (argv[argv.index("--recipe") + 1] if "--recipe" in argv else None) == (flags[1] if flags else None)
    assert main([*argv[1:], "--quiet", "--json", str(rerun_json)]) == 1
    assert f"({recipe} recipe)" in capsys.readouterr().out  # judged as bisect judged it
    assert json.loads(rerun_json.read_text())["finding"] == finding

def test_a_case_files_tensors_are_diagnosed_as_saved(tmp_path):
    """Issue 28 item 10: a case file whose K and N are equal was diagnosed on a cropped twin ("diagnosed on
    M32K48N16|...|file:..." for a file of M8x32K64N64); its tensors are what training diverged on."""
    import torch
    from parity.data import saved_case, write_case_file
    g = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    path = write_case_file(tmp_path / "case.pt", [dict(input=draw(8, 32, 64), weight=draw(64, 64),
                                                       grad_output=draw(8, 32, 64))])
    case = saved_case(path)
    result = localize(CheckPlan.make(load_impl("evals/zoo/mutants.py:scale_not_inverted")), case=case, isolate=False)
    assert result.verdict == "fail" and result.diagnosed_case == case, result.evidence
    assert not any(line.startswith("diagnosed on") for line in result.evidence)
    assert result.category == "scale" and "the GEMM handed its scale instead of the inverse" in str(result.headline)


ROWWISE_FLOAT32_OUT = '''
import torch

def to_fp8_rows(x):
    amax = x.float().abs().amax(dim=1, keepdim=True).double().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2((448.0 / amax).float())))
    return (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).contiguous(), scale.reciprocal()

def mm(a, b_t, out_dtype, fast=False):
    """Row scales in the call (torchao scales the result after a unit-scale call), the sums written in float32."""
    a8, sa = to_fp8_rows(a)
    b8, sb = to_fp8_rows(b_t)
    out = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.float32, use_fast_accum=fast)
    return out.to(out_dtype)

class Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return mm(x, w, x.dtype, fast=True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return mm(g, w.t().contiguous(), g.dtype), mm(g.t().contiguous(), x.t().contiguous(), g.dtype).to(w.dtype)

def fp8_linear(input_2d, weight):
    return Fp8Matmul.apply(input_2d, weight)
'''


def test_rowwise_evidence_leads_with_the_out_dtype_not_the_scale_shapes(tmp_path):
    """Issue 28 item 10: a rowwise layer whose GEMMs write float32 where torchao writes bf16 had its evidence
    list the calls' scale shapes (row scales in the call; torchao's calls take unit scales and scale the
    result after) around the finding. The element-wise diagnosis found those scales right: a difference of
    form is left out, and the out_dtype heads the localization."""
    path = tmp_path / "rowwise_float32_out.py"
    path.write_text(ROWWISE_FLOAT32_OUT)
    plan = CheckPlan.make(load_impl(f"{path}:fp8_linear", recipe="rowwise"))
    result = localize(plan, case=Case(lead=(16,), K=16, N=16, input_dtype="fp32"), isolate=False)
    assert "writes float32 where the rowwise recipe's GEMM writes bfloat16" in str(result.headline), result.evidence
    assert result.category == "accumulation" and result.first == "output"
    assert not any("scale shapes" in line for line in result.evidence), result.evidence
    assert any("out_dtype float32 where torchao:rowwise uses bfloat16" in line for line in result.evidence)


def test_bisect_without_a_case_searches_briefly_and_names_checks_wider_search(monkeypatch, capsys):
    """Issue 28 item 10: bisect of a correct layer took a check's whole search (26 s) to find nothing to
    localize. Without --case it searches BISECT_SEARCH generated cases after the edge cases (--git: each
    commit's check, CHECK_SEARCH), and its PASS prints the check command of the wider search."""
    import shlex
    from parity import cmd_check
    from parity.bisect import render
    from parity.cli import build_parser
    from parity.localization import Localization
    from parity.names import BISECT_SEARCH, CHECK_SEARCH
    from parity.vocabulary import Verdict
    budgets = []

    def recorded(plan, **kw):
        budgets.append(kw["max_examples"])
        return Localization(Verdict.PASS, plan, kw["device"], cases_run=18 + kw["max_examples"],
                            search_budget=kw["max_examples"])

    class NoCommit:  # what git_bisect gives back, for the budget it was handed
        first_bad = None

        def render(self):
            return "no bad commit\n"
    monkeypatch.setattr(cmd_check, "localize", recorded)
    monkeypatch.setattr(cmd_check, "git_bisect", lambda *a, **kw: budgets.append(kw["max_examples"]) or NoCommit())
    assert main(["bisect", "--git", "HEAD~1", "HEAD", "--impl", "layer.py:f", "--device", "cpu"]) == 0
    assert budgets == [CHECK_SEARCH]
    budgets.clear()
    assert main(["bisect", "--impl", "evals/zoo/mutants.py:correct_rowwise", "--recipe", "rowwise",
                 "--device", "cpu"]) == 0
    assert budgets == [BISECT_SEARCH] and BISECT_SEARCH < CHECK_SEARCH
    text = capsys.readouterr().out
    assert f"in {18 + BISECT_SEARCH} cases" in text and "nothing to localize" in text
    wider = next(line for line in text.splitlines() if line.startswith("A wider search: "))
    args = build_parser().parse_args(shlex.split(wider.removeprefix("A wider search: "))[1:])
    assert (args.command, args.impl, args.against, args.device, args.recipe, args.max_examples) == (
        "check", "evals/zoo/mutants.py:correct_rowwise", "torchao:rowwise", "cpu", "rowwise", CHECK_SEARCH)
    plan = CheckPlan.make(load_impl("fp8_impl"))
    given = Localization(Verdict.PASS, plan, "cpu", cases_run=1)
    assert "on the case given: nothing to localize" in render(given)

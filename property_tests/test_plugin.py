"""The installed pytest plugin, as a user meets it in another repository: `pytest --fp8-impl X`
runs the shipped suite, a user's own test gets the fixtures and strategies, and `fp8-parity test`
wraps it with fp8-parity's exit codes. Each runs pytest in a fresh process in an empty folder."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parity.cases import Case, edge_cases
from parity.property_items import case_param_id, impl_id

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO / "evals" / "zoo" / "mutants.py"
USER_TEST = textwrap.dedent('''
    from hypothesis import Phase, given, settings

    from parity.strategies import cases


    @settings(phases=(Phase.explicit, Phase.generate))  # no shrinking: this checks the fixtures, not hypothesis
    @given(case=cases(max_dim=64))
    def test_my_layer_matches_its_reference(fp8_suite, case):
        rows, violations = fp8_suite.run(case)
        fp8_suite.assert_no_violations("my layer differs from its reference", case, rows, violations)
''')


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """argv in a fresh python in `cwd`, with this checkout's parity first on the path (an editable
    install may point at another checkout)."""
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CI": "true", "PYTHONPATH": os.pathsep.join(
                              [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})


def test_a_node_ids_implementation_and_case_parts_are_short_and_shell_safe():
    """The implementation as written without its directory; a case id with `-` for `|`, one to one."""
    assert impl_id(f"{ZOO}:scale_not_inverted") == "mutants.py:scale_not_inverted"
    assert impl_id("mypkg.fp8:Float8Linear") == "mypkg.fp8:Float8Linear" and impl_id("fp8_impl") == "fp8_impl"
    assert impl_id("my dir/my fp8.py:Linear") == "my_fp8.py:Linear" and impl_id("C:\\fp8\\mine.py") == "mine.py"
    for case in edge_cases():
        assert "|" not in case_param_id(case) and Case.from_id(case_param_id(case).replace("-", "|")) == case


def test_a_users_own_test_gets_the_fixtures_and_strategies_through_fp8_parity_test(tmp_path):
    """`fp8-parity test` runs the user's test file beside the shipped suite (selected here with -k)
    with the plugin's fixtures and strategies, and a failure is fp8-parity's exit code 1. (The shipped
    suite itself runs from another repository in the scratch-repository test below.)"""
    (tmp_path / "test_mine.py").write_text(USER_TEST)
    done = run(["-m", "parity", "test", "--impl", f"{ZOO}:weight_scale_bf16", "--", "-q", "test_mine.py", "-k",
                "my_layer"], tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "my layer differs from its reference" in done.stdout and "Rerun exactly this case:" in done.stdout


def test_the_shipped_layout_property_passes_a_correct_layer_of_yours(tmp_path):
    """The README's step 4 on a layer in a file of yours (code under test, run only in a worker). The shipped
    test_layout_invariance executed the layer in the judging process, which refuses it: 2 of 87 properties failed
    on a correct layer (found timing the README's steps, 2026-12-07). Every other property runs the layer through
    the suite's worker (Suite.call, Suite.run); the whole suite on a file of yours takes 80 s here, this one 15 s."""
    done = run(["-m", "parity", "test", "--impl", f"{ZOO}:correct", "--device", "cpu", "--", "-q", "-k",
                "layout_invariance"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "failed" not in done.stdout.splitlines()[-1], done.stdout[-3000:]


def test_fp8_parity_test_with_an_implementation_that_does_not_load_is_a_usage_error(tmp_path):
    done = run(["-m", "parity", "test", "--impl", "fp8_imp"], tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "fp8_imp" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_case_that_cannot_run_is_a_usage_error_not_a_failed_test(tmp_path):
    """Issue 29: a case file that does not exist was `FAILED ::test_contracts - parity.cases.CaseError`, exit 1
    (read as a finding of the implementation); it is pytest's usage error, said once."""
    done = run(["-m", "parity", "test", "--impl", "fp8_impl", "--case", "M16K16N16|file:/no/such/case.pt"], tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    says = "--fp8-case: case file /no/such/case.pt does not exist"
    assert says in done.stdout + done.stderr and "FAILED" not in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_shipped_suite_with_the_cpu_computing_hoppers_bits_judges_them(tmp_path):
    """--fp8-cpu-gemm hopper: fast accumulation in grad_input (inner dim 512) differs from the H200's bits."""
    pytest.importorskip("mmaemu")
    done = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--fp8-impl", f"{ZOO}:grad_input_fast_accum",
                "--fp8-cpu-gemm", "hopper", "--fp8-device", "cpu", "--fp8-case", "M64K128N512|normal|seed3",
                "-k", "accuracy"], tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "not bitwise equal to hopper:tensorwise, the GPU's own bits" in done.stdout, done.stdout[-3000:]


# ---- a scratch repository that pip-installs this one -------------------------------------------------------

NANOCHAT_STYLE_FP8 = textwrap.dedent('''
    """An FP8 linear layer in nanochat's style: tensorwise dynamic scaling, three GEMMs through _scaled_mm."""

    import torch
    from torch import nn

    EPS = 1e-12  # the floor under amax: an all-zero tensor gets a finite scale


    @torch.no_grad()
    def _to_fp8(x, fp8_dtype):
        """x scaled so that its amax lands on the format's max, cast saturating; and the inverse scale."""
        fp8_max = torch.finfo(fp8_dtype).max
        amax = x.float().abs().max()
        scale = (fp8_max / amax.double().clamp(min=EPS)).float()
        return (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype), scale.reciprocal()


    def _row_major(x):  # _scaled_mm's A
        return x.contiguous()


    def _col_major(x):  # _scaled_mm's B
        return x.t().contiguous().t()


    class _Float8Matmul(torch.autograd.Function):
        """input_2d @ weight.T: e4m3 input and weight, e5m2 grad_output; fast accumulation only forward."""

        @staticmethod
        def forward(ctx, input_2d, weight):
            input_fp8, input_inv = _to_fp8(input_2d, torch.float8_e4m3fn)
            weight_fp8, weight_inv = _to_fp8(weight, torch.float8_e4m3fn)
            ctx.save_for_backward(input_fp8, input_inv, weight_fp8, weight_inv)
            ctx.weight_dtype = weight.dtype
            return torch._scaled_mm(_row_major(input_fp8), _col_major(weight_fp8.t()), scale_a=input_inv,
                                    scale_b=weight_inv, out_dtype=input_2d.dtype, use_fast_accum=True)

        @staticmethod
        def backward(ctx, grad_output):
            input_fp8, input_inv, weight_fp8, weight_inv = ctx.saved_tensors
            grad_fp8, grad_inv = _to_fp8(grad_output, torch.float8_e5m2)
            grad_input = torch._scaled_mm(_row_major(grad_fp8), _col_major(weight_fp8), scale_a=grad_inv,
                                          scale_b=weight_inv, out_dtype=grad_output.dtype, use_fast_accum=False)
            grad_weight = torch._scaled_mm(_row_major(grad_fp8.t()), _col_major(input_fp8), scale_a=grad_inv,
                                           scale_b=input_inv, out_dtype=grad_output.dtype, use_fast_accum=False)
            return grad_input, grad_weight.to(ctx.weight_dtype)


    class Float8Linear(nn.Linear):
        @classmethod
        def from_float(cls, mod):
            with torch.device("meta"):
                new = cls(mod.in_features, mod.out_features, bias=False)
            new.weight, new.bias = mod.weight, mod.bias
            return new

        def forward(self, input):
            output = _Float8Matmul.apply(input.reshape(-1, input.shape[-1]), self.weight)
            output = output.reshape(*input.shape[:-1], output.shape[-1])
            return output if self.bias is None else output + self.bias.to(output.dtype)
''')
AMAX = "amax = x.float().abs().max()"
AMAX_WITHOUT_ABS = "amax = x.float().max()"  # the planted bug: wrong whenever the largest magnitude is negative
# Parity names the bug; contracts checks nn.Linear's and _scaled_mm's (A row-major, B column-major). The two take
# ~20 s on 2 cores. The whole suite takes ~90 s, and its equivariance and determinism tests fail for any
# implementation loaded from a file: the suite pickles their lambdas to the worker process (parity/suite.py call).
FAST_PROPERTIES = "parity_with_reference or contracts"
NOT_BUILT = shutil.ignore_patterns(".git", ".venv", "venv", ".hypothesis", ".ruff_cache", ".whl", "reports", "build",
                                   "dist", "*.egg-info", "__pycache__")


@pytest.fixture(scope="module")
def scratch_venv(tmp_path_factory) -> Path:
    """The python of a venv outside this repository with fp8-parity pip-installed into it, not editable.

    --system-site-packages shows the base interpreter's packages; where this environment is itself a
    venv, a .pth file also puts its site-packages (torch, torchao, pytest, ...) after the venv's own,
    so nothing is downloaded. The install is from a copy of the repository, because pip builds in
    the source tree (build/, *.egg-info) and the checkout must stay untouched."""
    root = tmp_path_factory.mktemp("scratch-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", root / "venv"],
                   check=True)
    python = root / "venv" / "bin" / "python"
    venv_site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                             text=True).strip())
    (venv_site / "_this_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    source = shutil.copytree(REPO, root / "fp8-parity", ignore=NOT_BUILT)
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", source],
                               capture_output=True, text=True, env=scratch_env())
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    imported = subprocess.check_output([python, "-c", "import parity; print(parity.__file__)"], text=True,
                                       env=scratch_env(), cwd=root)
    assert Path(imported.strip()).is_relative_to(venv_site), f"parity imports from {imported}, not {venv_site}"
    return python


def scratch_env() -> dict[str, str]:
    """This environment without PYTHONPATH (which could put this checkout first), and CI's hypothesis profile."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "CI": "true"}


def installed_suite(python: Path) -> str:
    """The shipped suite's file in the scratch venv: what its node ids start with."""
    return subprocess.check_output([python, "-c", "from parity.suite import shipped_suite; print(shipped_suite())"],
                                   text=True, env=scratch_env(), cwd=python.parent).strip()  # not this checkout's


def scratch_pytest(python: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=scratch_env())


SCALE_NOT_INVERTED = f"{ZOO}:scale_not_inverted"  # every case shows it, in grad_input and grad_weight
# how its finding opens: the headline check and bisect give it (parity.headline)
FINDING = "grad_input GEMM (step 0): A (grad_output): the GEMM handed its scale instead of the inverse [scale]"
TINY = "M32K64N48|in:bf16:C|w:bf16:C|go:C|tiny|seed0"  # one of the suite's pinned edge cases


def node_name(case_id: str) -> str:
    return f"test_parity_with_reference[mutants.py:scale_not_inverted-{case_id.replace('|', '-')}]"


def test_every_shipped_property_test_is_named_by_its_path_implementation_and_case(scratch_venv, tmp_path):
    """From another repository, each node id is the installed suite's path (not "", as pytest names
    a file outside its rootdir), then the implementation and a case with no character a shell or
    `-k` chokes on; each pinned case is a test of its own, beside the search (`generated`)."""
    done = scratch_pytest(scratch_venv, tmp_path, "--collect-only", "-q", "--fp8-impl", SCALE_NOT_INVERTED,
                          "--fp8-device", "cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    node_ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(node_ids) > 40, done.stdout[-3000:]
    suite = installed_suite(scratch_venv)
    for node_id in node_ids:
        path, name = node_id.split("::")
        assert path == suite and "[mutants.py:scale_not_inverted-" in name and name.endswith("]"), node_id
        assert not set(name) & set("|\\\"' ;&()<>$`*?"), node_id
    parity = [n.split("::")[1] for n in node_ids if "::test_parity_with_reference[" in n]
    assert node_name(TINY) in parity and node_name("generated") in parity, parity
    assert len(parity) == len(edge_cases()) + 1, parity


def failure_of(stdout: str, test_id: str) -> list[str]:
    """The non-blank lines of one test's failure section: after its `___ test_id ___` title, to the next."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip("_ ") == test_id)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("_", "="))), len(lines))
    return [line for line in lines[start + 1:end] if line.strip()]


def summary_line(stdout: str, name: str, cwd: Path, python: Path) -> str:
    """What the short test summary says after `FAILED <node id> - ` for the test `name`, which must
    name the installed suite by a path that leads to it from `cwd` (absolute, or relative where
    pytest's rootdir is not `cwd`, as with `fp8-parity test`)."""
    line = next(line for line in stdout.splitlines() if line.startswith("FAILED ") and f"::{name} - " in line)
    path, _, message = line.removeprefix("FAILED ").partition(f"::{name} - ")
    assert (cwd / path).resolve() == Path(installed_suite(python)).resolve(), line
    return message


def test_a_planted_bug_fails_each_pinned_case_finding_first(scratch_venv, tmp_path):
    """A failure's first `E ` line and its short summary line are the finding, the rerun command
    follows; no traceback of the harness, no Case(...) repr. The search is not run once a pinned
    case has failed (as hypothesis stops at a failing @example). The summary names the implementation."""
    done = scratch_pytest(scratch_venv, tmp_path, "--fp8-impl", SCALE_NOT_INVERTED, "--fp8-device", "cpu", "-rfs",
                          "-k", "parity_with_reference and (tiny- or generated)")
    output = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 1, output
    failure = failure_of(done.stdout, node_name(TINY))
    assert failure[0].startswith(f"E   {FINDING}"), failure[:3]
    assert failure[1] == "E   Rerun exactly this case:" and f"::{node_name(TINY)}' " in failure[2], failure[:3]
    assert f"--fp8-case '{TINY}'" in failure[2] and "test_properties.py:" in failure[-2], failure[-3:]
    assert failure[-2].endswith(": PropertyFailure"), failure[-3:]  # the test's line, not parity/suite.py's
    assert summary_line(done.stdout, node_name(TINY), tmp_path, scratch_venv) == failure[0][4:], output
    assert "Case(" not in done.stdout and "parity/suite.py" not in done.stdout, output
    assert f"not searched: the pinned case {TINY} already fails" in done.stdout, output
    summary = f"fp8-parity: {SCALE_NOT_INVERTED} failed 1 of 1 property tests against torchao:tensorwise on cpu"
    assert f"{summary} (1 skipped)\n" in done.stdout, output


def test_a_case_hypothesis_runs_fails_without_its_repr_through_fp8_parity_test(scratch_venv, tmp_path):
    """`fp8-parity test --case ID`: the search held to one case, its test named by that case;
    hypothesis's "Falsifying example: ...(case=Case(lead=(16,), K=16, ...))" is not shown."""
    case = "M16K16N16|in:bf16:C|w:bf16:C|go:C|normal|seed0"
    done = subprocess.run([scratch_venv, "-m", "parity", "test", "--impl", SCALE_NOT_INVERTED, "--device", "cpu",
                           "--case", case, "--", "-rf", "-k", "parity_with_reference"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=scratch_env())
    output = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 1, output
    failure = failure_of(done.stdout, node_name(case))
    assert failure[0].startswith(f"E   {FINDING}") and f"E   case: {case}" in failure, failure[:6]
    assert summary_line(done.stdout, node_name(case), tmp_path, scratch_venv) == failure[0][4:], output
    assert "Case(" not in done.stdout and "Falsifying" not in done.stdout, output


@pytest.mark.slow
@pytest.mark.parametrize(("bug_planted", "exit_code"), [(True, 1), (False, 0)], ids=["planted-bug", "no-bug"])
def test_a_scratch_repository_that_pip_installs_this_one_fails_a_planted_bug(scratch_venv, tmp_path, bug_planted,
                                                                              exit_code):
    source = NANOCHAT_STYLE_FP8.replace(AMAX, AMAX_WITHOUT_ABS) if bug_planted else NANOCHAT_STYLE_FP8
    assert source.count(AMAX_WITHOUT_ABS) == bug_planted  # exactly one line differs
    (tmp_path / "scratch_module.py").write_text(source)
    done = subprocess.run([scratch_venv, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--fp8-impl",
                           "scratch_module.py:Float8Linear", "-k", FAST_PROPERTIES], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=scratch_env())
    output = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == exit_code, output
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    if bug_planted:  # some pinned cases of parity fail (where the largest magnitude is negative); contracts hold
        suite = installed_suite(scratch_venv)  # parity's installed suite ran, not this checkout's property_tests
        assert failed and all(line.startswith(f"FAILED {suite}::test_parity_with_reference[scratch_module.py:"
                                              f"Float8Linear-") for line in failed), output
        assert "is not at parity with torchao:tensorwise" in done.stdout, output
        assert f"python -m pytest '{suite}::test_parity_with_reference[" in done.stdout, output  # the rerun line
    else:
        assert not failed and f"{2 * (len(edge_cases()) + 1)} passed" in done.stdout, output

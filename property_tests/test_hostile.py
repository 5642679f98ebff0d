"""The hostile corpus: implementations that exit, hang, crash, spam, mutate their arguments or
corrupt torch's global state (evals/hostile/, described entry by entry in its
manifest.json), and bad command lines. Each entry runs through the CLI as a user would and must
end with its stated exit code, a first line that says what happened, the specific finding, and no
traceback. A run that was cut short must never read as a pass.

Exit codes: 0 pass, 1 a finding, 2 bad input, 4 an incomplete report, 125 cannot run here,
130/143 interrupted by SIGINT/SIGTERM.

Every implementation of the corpus must fail. slow_3s is only slow: it fails here because its
--timeout is 1 s, and passes with a longer one. fwd_stdout_spam and bwd_stderr_spam compute the
right numbers but print megabytes: a finding (more than 64 KiB in one case floods a training
log), and none of it reaches the user.

The entries with "command": "train" run `fp8-parity train` on the tiny model: an implementation
that ends the process with posix._exit(0) at its 40th call, one that registers posix._exit(0) as an
exit hook, a --model factory that exits, a step that hangs, state changes. Each runs in the runs'
workers: the process that judges never imports them (their modules note who imported them).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from parity import cli, sweep
from parity.cases import Case
from parity.impls import load_impl
from parity.report import ADDED_LATER, write_report
from parity.runner import all_pairs, run_cases

HOSTILE = Path(__file__).resolve().parents[1] / "evals" / "hostile"
MANIFEST = json.loads((HOSTILE / "manifest.json").read_text())
CHECKED = [entry for entry in MANIFEST if entry.get("command", "check") == "check"]
TRAINED = [entry for entry in MANIFEST if entry.get("command") == "train"]
CASE = "M16K32N16"  # one small case: the corpus is about what the code does, not about numerics
MAX_OUTPUT = 20_000  # characters: more means the implementation's own printing reached the user


@dataclass(frozen=True)
class Expect:
    code: int
    first: str  # a regex the first line of the output must match
    says: str = ""  # a regex the output must contain: the specific finding
    timeout: float = 20.0  # --timeout of the check (a hang must end within it)


FAIL = r"^FAIL: evals/hostile/"
CRASH = r"\[crash\] the implementation "
STATE = r"\[contract\] output: the implementation changed global state: "

# One expectation per manifest entry (test_every_manifest_entry_has_an_expectation keeps them in step).
IMPLEMENTATIONS: dict[str, Expect] = {
    "fwd_sys_exit0": Expect(1, FAIL, CRASH + r"raised: step 0: forward: SystemExit: 0 \(at .*impls.py:\d+\)"),
    "fwd_sys_exit3": Expect(1, FAIL, CRASH + r"raised: step 0: forward: SystemExit: 3"),
    "fwd_os_exit0": Expect(1, FAIL, CRASH + r"raised: step 0: forward: ProcessExit: os._exit\(0\) was called"),
    "fwd_os_exit1": Expect(1, FAIL, CRASH + r"raised: step 0: forward: ProcessExit: os._exit\(1\) was called"),
    "bwd_sys_exit0": Expect(1, FAIL, CRASH + r"raised: step 0: backward: SystemExit: 0"),
    "bwd_os_exit0": Expect(1, FAIL, CRASH + r"raised: step 0: backward: ProcessExit: os._exit\(0\)"),
    "fwd_keyboard_interrupt": Expect(1, FAIL, CRASH + r"raised: step 0: forward: KeyboardInterrupt"),
    "bwd_system_exit": Expect(1, FAIL, CRASH + r"raised: step 0: backward: SystemExit: 5"),
    "fwd_generator_exit": Expect(1, FAIL, CRASH + r"raised: step 0: forward: GeneratorExit"),
    "exits_on_import": Expect(2, r"^fp8-parity check: importing '.*exits_on_import.py' exited the process "
                                 r"\(sys.exit\(0\)\): an implementation must not exit at import$"),
    "raises_on_import": Expect(2, r"^fp8-parity check: cannot import '.*raises_on_import.py': RuntimeError: "),
    "fwd_sleep_forever": Expect(1, FAIL, CRASH + r"ran past its time limit of 2 s during step 0: forward", 2),
    "bwd_busy_loop": Expect(1, FAIL, CRASH + r"ran past its time limit of 2 s during step 0: backward", 2),
    "slow_3s": Expect(1, FAIL, CRASH + r"ran past its time limit of 1 s during step 0: forward", 1),
    "fwd_segfault": Expect(1, FAIL, CRASH + r"was killed by signal SIGSEGV during step 0: forward"),
    "bwd_abort": Expect(1, FAIL, CRASH + r"was killed by signal SIGABRT during step 0: backward"),
    # it allocates until the worker's address-space cap (3/4 of the machine's memory) or the time limit
    "fwd_unbounded_alloc": Expect(1, FAIL, CRASH + r"(ran past its time limit of 2 s during step 0: forward|"
                                                  r"raised: step 0: forward: (MemoryError|RuntimeError))", 2),
    "fwd_stdout_spam": Expect(1, FAIL, r"\[contract\] output: the implementation printed 9.5 MiB during the case"),
    "bwd_stderr_spam": Expect(1, FAIL, r"\[contract\] output: the implementation printed 9.5 MiB during the case"),
    "ret_tuple": Expect(1, FAIL, CRASH + r"raised: step 0: forward: TypeError: the function ret_tuple \(defined at "
                                         r".*impls.py:\d+\) returned tuple, not a tensor$"),
    "ret_none": Expect(1, FAIL, r"returned NoneType, not a tensor"),
    "ret_float": Expect(1, FAIL, r"returned float, not a tensor"),
    "ret_transposed": Expect(1, FAIL, r"\[contract\] output: output strides are \(1, 16\), nn.Linear gives \(16, 1\)"),
    "ret_wrong_shape": Expect(1, FAIL, CRASH + r"raised: step 0: backward: RuntimeError: Mismatch in shape"),
    "ret_noncontiguous": Expect(1, FAIL, r"\[contract\] output: output strides are \(1, 16\)"),
    "ret_input_view": Expect(1, FAIL, r"the output shares memory with the input \(a view of it\)"),
    "ret_int_tensor": Expect(1, FAIL, CRASH + r"raised: step 0: backward: RuntimeError: element 0 of tensors does "
                                              r"not require grad"),
    "mutates_input": Expect(1, FAIL, CRASH + r"raised: step 0: forward: RuntimeError: a view of a leaf Variable"),
    "mutates_input_no_grad": Expect(1, FAIL, r"\[contract\] output: step 0: the input was modified in place"),
    "mutates_weight_data": Expect(1, FAIL, r"the weight was modified in place by forward/backward \(through .data\)"),
    "weight_add_no_grad": Expect(1, FAIL, r"step 0: the weight was modified in place by forward/backward"),
    "nondeterministic": Expect(1, FAIL, r"\[determinism\] output \(step 0\): a second run of the same case gave "
                                        r"other results"),
    "stateful_counter": Expect(1, FAIL, r"\[determinism\] output \(step 0\): a second run"),
    "FromFloatReturnsNone": Expect(1, FAIL, CRASH + r"raised: building the module: "),
    "FromFloatRaises": Expect(1, FAIL, CRASH + r"raised: building the module: RuntimeError: hostile: from_float"),
    "FromFloatExits": Expect(1, FAIL, CRASH + r"raised: building the module: SystemExit: 0"),
    "converter_no_weight": Expect(1, FAIL, r"the built module has 0 parameters named 'weight'"),
    "converter_deletes_linear": Expect(1, FAIL, r"the built module has 0 parameters named 'weight'"),
    "sets_default_dtype_fp64": Expect(1, FAIL, STATE + r"default dtype torch.float32 -> torch.float64 \(restored\)"),
    "sets_backend_flags": Expect(1, FAIL, STATE + r".*flush denormals False -> True"),
    "reseeds_rng": Expect(1, FAIL, STATE + r"the global random generator reseeded \(seed \d+ -> 1234\)"),
    "disables_grad_globally": Expect(1, FAIL, CRASH + r"raised: step 0: backward: RuntimeError: element 0"),
    "global_saved_tensors_hook": Expect(1, FAIL, STATE + r"a saved-tensors hook left installed"),
    "global_module_forward_hook": Expect(1, FAIL, STATE + r"global module hooks \(_global_forward_hooks: 0 -> 1\)"),
    "monkeypatch_scaled_mm": Expect(1, FAIL, STATE + r"torch._scaled_mm replaced"),
    "monkeypatch_F_linear": Expect(1, FAIL, STATE + r"torch.nn.functional.linear replaced"),
    "ret_nan": Expect(1, FAIL, r"\[nonfinite\] output \(step 0\): 256 NaN and 0 Inf where fp64 has 0 and 0"),
    "ret_inf_one": Expect(1, FAIL, r"\[nonfinite\] output \(step 0\): 0 NaN and 1 Inf where fp64 has 0 and 0"),
    # issue 29: a message is one bounded line (MAX_OUTPUT holds the whole output under 20,000 characters)
    "fwd_raises_50_mib": Expect(1, FAIL, CRASH + r"raised: step 0: forward: RuntimeError: x{500}\.\.\. \(52428800 "
                                                 r"characters in all\)"),
    "fwd_raises_many_lines": Expect(1, FAIL, CRASH + r"raised: step 0: forward: ValueError: first line of a long "
                                                     r"report \(at "),
}


sys.path.insert(0, str(HOSTILE))  # hostile_import_marker: where the hostile modules note who imported them


def run_cli(argv: list[str]) -> tuple[int, str]:
    """fp8-parity ARGV in this process: (exit code, everything it printed)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exited:  # argparse's usage errors
            code = exited.code
    return code, out.getvalue() + err.getvalue()


def assert_outcome(argv: list[str], expect: Expect) -> str:
    code, text = run_cli(argv)
    first = text.strip().splitlines()[0] if text.strip() else ""
    rerun = "fp8-parity " + " ".join(argv)
    assert "Traceback" not in text, f"a traceback reached the user: {rerun}\n{text[-3000:]}"
    assert len(text) < MAX_OUTPUT, f"{len(text)} characters of output (the implementation's printing?): {rerun}"
    assert code == expect.code, f"exit {code}, expected {expect.code}: {rerun}\n{text[:3000]}"
    assert re.search(expect.first, first), f"first line {first!r} does not match {expect.first!r}: {rerun}"
    assert re.search(expect.says, text, re.MULTILINE), f"no {expect.says!r} in the output of {rerun}:\n{text[:3000]}"
    return text


def test_every_manifest_entry_has_an_expectation():
    assert sorted(entry["name"] for entry in CHECKED) == sorted(IMPLEMENTATIONS)
    assert sorted(entry["name"] for entry in TRAINED) == sorted(TRAINING)


@pytest.mark.parametrize("entry", CHECKED, ids=[entry["name"] for entry in CHECKED])
def test_hostile_implementation(entry):
    """`check` of the implementation on one case of the bf16 recipe (its numbers are a plain bf16
    matmul: whatever fails, fails for what the code does)."""
    expect = IMPLEMENTATIONS[entry["name"]]
    assert_outcome(["check", "--impl", entry["impl"], "--form", entry["form"], "--recipe", "bf16", "--case", CASE,
                    "--timeout", f"{expect.timeout:g}", "--quiet"], expect)


# ---- `train` ---------------------------------------------------------------------------------------------

TRAIN_FAIL = r"^FAIL: evals/hostile/{} \(candidate\) "
# The line that says what happened: for exit 1 the first line of the output (the headline), for exit 2 the error
# line (after the command's first line on stderr, which says what it trains).
TRAINING: dict[str, Expect] = {
    "train_posix_exit0_at_call_40": Expect(1, TRAIN_FAIL.format("train.py:posix_exit0_at_call_40") +
                                           r"exited the process with code 0 during step 3: forward$"),
    "train_model_exits_while_building": Expect(2, r"^fp8-parity train: --model '.*model_exits_while_building': calling "
                                                  r"the factory raised ProcessExit: os._exit\(0\) was called"),
    "train_exit0_at_exit": Expect(1, r"^FAIL: evals/hostile/exit0_at_exit.py:doubles_output and torchao:tensorwise "
                                     r"must be bitwise equal and diverge first at step 0, layer blocks.0.attn.c_q, "
                                     r"GEMM output$"),
    "train_sleeps_from_call_20": Expect(1, TRAIN_FAIL.format("train.py:sleeps_from_call_20") +
                                        r"ran past its time limit of 30 s during step 1: forward$"),
    "train_reseeds_every_call": Expect(1, TRAIN_FAIL.format("train.py:reseeds_every_call") +
                                       r"changed global state during step 0: the global random generator reseeded "
                                       r"\(seed \d+ -> 1234\) \(restored\)$"),
    "train_default_dtype_at_call_40": Expect(1, TRAIN_FAIL.format("train.py:default_dtype_at_call_40") +
                                             r"changed global state during step 3: default dtype torch.float32 -> "
                                             r"torch.float64 \(restored\)$"),
}
# train_sleeps_from_call_20's --timeout is 30 s: each call of each run has that limit, and at a load of 14 on the
# 2-core machine the first backward of a run took more than 10 s.
# Run as a process of their own, as the user runs them: each ends the process it runs in with code 0 (at a call,
# while building, at the interpreter's exit). In pytest's process that would end the session with exit 0, a pass.
IN_A_SUBPROCESS = {"train_posix_exit0_at_call_40", "train_model_exits_while_building", "train_exit0_at_exit"}


def _train_argv(entry: dict, out: Path) -> list[str]:
    argv = ["train", "--impl", entry["impl"], "--device", "cpu", "--sample-every", "10", "--out", str(out), "--quiet",
            *entry["args"]]
    return argv + (["--model", entry["model"]] if "model" in entry else ["--form", entry["form"]])


@pytest.mark.parametrize("entry", TRAINED, ids=[entry["name"] for entry in TRAINED])
def test_hostile_training(entry, tmp_path):
    """`train` of the tiny model with the entry's implementation or --model: its exit code, the line that says
    what happened, no traceback, and the process that judged never imported the hostile module."""
    import hostile_import_marker as marker  # evals/hostile/, on sys.path below
    expect, argv = TRAINING[entry["name"]], _train_argv(entry, tmp_path / "report")
    module = Path((entry.get("model") or entry["impl"]).split(":")[0]).name
    since = marker.line_count()
    if entry["name"] in IN_A_SUBPROCESS:
        process = subprocess.Popen([sys.executable, "-m", "parity", *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=HOSTILE.parents[1])
        out, err = process.communicate(timeout=600)
        code, text, judge = process.returncode, out + err, process.pid
    else:
        code, text = run_cli(argv)
        judge = os.getpid()
    rerun = "fp8-parity " + " ".join(argv)
    assert "Traceback" not in text, f"a traceback reached the user: {rerun}\n{text[-3000:]}"
    assert code == expect.code, f"exit {code}, expected {expect.code}: {rerun}\n{text[:3000]}"
    assert re.search(expect.first, text, re.MULTILINE), f"no {expect.first!r} in the output of {rerun}:\n{text[:3000]}"
    importers = marker.importers(module, since)
    assert importers, f"no process imported {module}: {rerun}"  # the workers did
    assert judge not in importers, f"the process that judged imported {module}: {rerun}"


# ---- bad input ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder of inputs to misuse: a regular file, a good report, and tables report must refuse."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "a_file").write_text("not a directory\n")
    frame = run_cases([Case(lead=(16,), K=16, N=16)], all_pairs([load_impl("bf16")], [load_impl("fp64")]))
    write_report(frame, root / "good", title="good")
    table = (root / "good" / "results.csv.gz").read_bytes()
    for name, content in {"truncated": table[: len(table) // 2], "empty": None}.items():
        (root / name).mkdir()
        if content is not None:
            (root / name / "results.csv.gz").write_bytes(content)
    (root / "old").mkdir()
    frame.drop(columns=ADDED_LATER).to_csv(root / "old" / "results.csv.gz", index=False)
    pd.DataFrame({"name": ["a"], "score": [1.0]}).to_csv(root / "foreign.csv", index=False)
    bench = pd.DataFrame([{"preset": "small", "shape": "16x16x16", "impl": "fp8_impl", "median_ms": 1.0,
                           "gpu_ms": 1.0, "tflops": 1.0}])
    (root / "bench").mkdir()
    bench.to_csv(root / "bench" / "results.csv.gz", index=False)
    return root


USAGE = r"^fp8-parity {}: "
BAD_INPUTS: dict[str, tuple[list[str], Expect]] = {
    "max-examples 0": (["check", "--impl", "bf16", "--max-examples", "0"],
                       Expect(2, USAGE.format("check") + r"argument --max-examples: must be an integer from 1 to "
                                                         r"100000, got '0' \(e.g. --max-examples 100\)")),
    "max-examples -1": (["check", "--impl", "bf16", "--max-examples", "-1"],
                        Expect(2, USAGE.format("check") + r"argument --max-examples: .* got '-1'")),
    "max-examples 1e23": (["check", "--impl", "bf16", "--max-examples", "1e23"],
                          Expect(2, USAGE.format("check") + r"argument --max-examples: .* got '1e23'")),
    "recipe typo": (["check", "--impl", "{hostile}:slow_3s", "--recipe", "tensorwsie"],
                    Expect(2, USAGE.format("check") + r"unknown recipe 'tensorwsie'; did you mean 'tensorwise'\?")),
    "recipe bogus": (["check", "--impl", "{hostile}:slow_3s", "--recipe", "bogus"],
                     Expect(2, USAGE.format("check") + r"unknown recipe 'bogus'; known recipes: tensorwise, ")),
    "impl typo": (["check", "--impl", "torchao:tensorwize"],
                  Expect(2, USAGE.format("check") + r"unknown implementation 'torchao:tensorwize': did you mean "
                                                    r"'torchao:tensorwise'\?")),
    "against typo": (["check", "--impl", "fp8_impl", "--against", "torchao:rowwize"],
                     Expect(2, USAGE.format("check") + r"unknown implementation 'torchao:rowwize': did you mean "
                                                       r"'torchao:rowwise'\?")),
    "impl file missing": (["check", "--impl", "no/such/file.py:f"],
                          Expect(2, USAGE.format("check") + r"implementation file 'no/such/file.py' does not exist")),
    "impl attribute missing": (["check", "--impl", "{hostile}:no_such_thing"],
                               Expect(2, USAGE.format("check") + r"'.*impls.py' has no attribute 'no_such_thing'")),
    "impl module missing": (["check", "--impl", "no_such_module_xyz:f"],
                            Expect(2, USAGE.format("check") + r"cannot import 'no_such_module_xyz': "
                                                              r"ModuleNotFoundError")),
    "enormous case": (["check", "--impl", "bf16", "--case", "M1048576K1048576N1048576"],
                      Expect(2, USAGE.format("check") + r"case M1048576K1048576N1048576.*: its operands alone take "
                                                        r".* GiB in float64, more than this machine's")),
    "case syntax": (["check", "--impl", "bf16", "--case", "M16K32"],
                    Expect(2, USAGE.format("check") + r"case id 'M16K32': cannot read the shape")),
    "case not divisible by 16": (["check", "--impl", "fp8_impl", "--case", "M16K24N16"],
                                 Expect(2, USAGE.format("check") + r"case: K = 24 must be a positive multiple of 16")),
    "json under /proc": (["check", "--impl", "bf16", "--case", CASE, "--json", "/proc/x.json"],
                         Expect(2, USAGE.format("check") + r"--json /proc/x.json: .*cannot write there")),
    "json under a file": (["check", "--impl", "bf16", "--case", CASE, "--json", "{inputs}/a_file/x.json"],
                          Expect(2, USAGE.format("check") + r"--json .*: cannot write there \(.*a_file is a file, "
                                                            r"not a directory\)")),
    "timeout 0": (["check", "--impl", "bf16", "--timeout", "0"],
                  Expect(2, USAGE.format("check") + r"argument --timeout: must be a finite number greater than 0")),
    "timeout nan": (["check", "--impl", "bf16", "--timeout", "nan"],
                    Expect(2, USAGE.format("check") + r"argument --timeout: .* got 'nan'")),
    "diff tolerance nan": (["diff", "{inputs}/good", "{inputs}/good", "--sqnr-tolerance", "nan"],
                           Expect(2, USAGE.format("diff") + r"argument --sqnr-tolerance: must be a finite number")),
    "diff of a missing folder": (["diff", "{inputs}/good", "{inputs}/nothere"],
                                 Expect(2, USAGE.format("diff") + r".*/nothere does not exist")),
    "report of a missing folder": (["report", "{inputs}/nothere"],
                                   Expect(2, USAGE.format("report") + r".*/nothere does not exist")),
    "report of a truncated table": (["report", "{inputs}/truncated"],
                                    Expect(2, USAGE.format("report") + r"cannot read results from .*: .* is truncated "
                                                                       r"or corrupt")),
    "report of a foreign table": (["report", "{inputs}/foreign.csv"],
                                  Expect(2, USAGE.format("report") + r".* is not an fp8-parity results table")),
    "report of an older schema": (["report", "{inputs}/old"],
                                  Expect(2, USAGE.format("report") + r".* was written by an older fp8-parity "
                                                                     r"\(missing columns recipe, policy, skipped")),
    "report of a folder without results": (["report", "{inputs}/empty"],
                                           Expect(2, USAGE.format("report") + r".*no results file at ")),
    "report of a bench folder": (["report", "{inputs}/bench"],
                                 Expect(2, USAGE.format("report") + r".* is a benchmark report, not a parity sweep")),
    "sweep out under a file": (["sweep", "--out", "{inputs}/a_file/out"],
                               Expect(2, USAGE.format("sweep") + r"--out .*: cannot write there")),
    "resume without out": (["sweep", "--resume"],
                           Expect(2, USAGE.format("sweep") + r"--resume needs --out DIR")),
    "resume without a partial sweep": (["sweep", "--resume", "--out", "{inputs}/empty"],
                                       Expect(2, USAGE.format("sweep") + r"--resume: .* holds no interrupted sweep")),
    "samples -1": (["sweep", "--samples", "-1"],
                   Expect(2, USAGE.format("sweep") + r"argument --samples: must be an integer from 0")),
    "sweep impl typo": (["sweep", "--impl", "fp8_imp"],
                        Expect(2, USAGE.format("sweep") + r"argument --impl: unknown implementation 'fp8_imp': "
                                                          r"did you mean 'fp8_impl'\?")),
    "bisect max-examples 0": (["bisect", "--impl", "bf16", "--max-examples", "0"],
                              Expect(2, USAGE.format("bisect") + r"argument --max-examples: ")),
    "bisect case syntax": (["bisect", "--impl", "bf16", "--case", "M16xK"],
                           Expect(2, USAGE.format("bisect") + r"case id 'M16xK': cannot read the shape")),
    "form bogus": (["check", "--impl", "bf16", "--form", "bogus"],
                   Expect(2, USAGE.format("check") + r"argument --form: invalid choice: 'bogus'")),
    "unknown command": (["frobnicate"], Expect(2, r"^fp8-parity: argument COMMAND: invalid choice: 'frobnicate'")),
    # issue 29, items 12 and 14: an internal error deep in torch.Generator (exit 3); hours of steps past a SIGTERM
    "case seed of 20 digits": (["check", "--impl", "bf16", "--case", "M16K16N16|seed99999999999999999999"],
                               Expect(2, USAGE.format("check") + r"case: seed must be from 0 to 4294967295, got "
                                                                 r"99999999999999999999$")),
    "case of 10**8 steps": (["check", "--impl", "bf16", "--case", "M16K16N16|steps100000000"],
                            Expect(2, USAGE.format("check") + r"case: steps must be from 1 to 64, got 100000000 ")),
}
CPU_ONLY = {  # what a machine without a GPU cannot do: exit 125 ("cannot run here"), not a failure
    "check on cuda": (["check", "--impl", "bf16", "--device", "cuda"],
                      Expect(125, r"^fp8-parity check: cannot run here: no CUDA device is available")),
    "bench": (["bench"], Expect(125, r"^fp8-parity bench: cannot run here: no CUDA device is available")),
}


def _fill(argv: list[str], inputs: Path) -> list[str]:
    return [a.format(inputs=inputs, hostile=HOSTILE / "impls.py") for a in argv]


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input(name, inputs):
    argv, expect = BAD_INPUTS[name]
    assert_outcome(_fill(argv, inputs), expect)


@pytest.mark.parametrize("name", list(CPU_ONLY))
def test_what_needs_a_gpu_says_it_cannot_run_here(name, inputs):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    argv, expect = CPU_ONLY[name]
    assert_outcome(_fill(argv, inputs), expect)


def test_the_corpus_size_in_the_readme_is_the_count_of_the_corpus():
    count = len(IMPLEMENTATIONS) + len(TRAINING) + len(BAD_INPUTS) + len(CPU_ONLY) + len(FILES)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"{count} hostile inputs, {count} handled" in readme


# ---- an interrupted sweep -----------------------------------------------------------------------------------

TINY = sweep.Preset("tiny", "one named shape and two sampled cases", (("tiny layer", 32, 16),), {"cpu": 16}, 2, 32)


def test_an_interrupted_sweep_keeps_its_cases_and_resumes(tmp_path, monkeypatch):
    """Ctrl-C after two cases: exit 130 (not "violation"), a partial table that `report` reads as
    INCOMPLETE (exit 4), and `--resume` runs the rest: every case once in the final table."""
    monkeypatch.setitem(sweep.PRESETS, "quick", TINY)
    planned = TINY.cases("cpu")
    calls = {"count": 0}
    run_case = sweep.run_case_isolated

    def interrupted_on_the_third(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 3:
            raise KeyboardInterrupt
        return run_case(*args, **kwargs)

    out = tmp_path / "sweep"
    argv = ["sweep", "--impl", "bf16", "--out", str(out), "--quiet"]
    with monkeypatch.context() as patch:
        patch.setattr(sweep, "run_case_isolated", interrupted_on_the_third)
        code, text = run_cli(argv)
    assert code == 128 + signal.SIGINT, text
    assert f"interrupted by SIGINT after 2 of {len(planned)} cases" in text and "Traceback" not in text
    assert not (out / "results.csv.gz").exists()

    code, text = run_cli(["report", str(out), "--candidate", "bf16"])
    assert code == 4 and text.startswith("INCOMPLETE: ") and f"(2 of {len(planned)} cases" in text, text

    code, text = run_cli([*argv, "--resume"])
    assert code in (0, 1) and "Traceback" not in text, text
    frame = pd.read_csv(out / "results.csv.gz")
    assert set(zip(frame["shape"], frame["case_id"])) == {(label, case.id) for label, case in planned}
    assert not frame.duplicated(["shape", "case_id", "impl", "reference", "tensor", "step"]).any()
    assert not (out / "partial.csv.gz").exists()


def test_a_resume_with_other_arguments_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(sweep.PRESETS, "quick", TINY)
    monkeypatch.setattr(sweep, "run_case_isolated", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    out = tmp_path / "sweep"
    assert run_cli(["sweep", "--impl", "bf16", "--out", str(out), "--quiet"])[0] == 130
    code, text = run_cli(["sweep", "--impl", "fp8_impl", "--out", str(out), "--quiet", "--resume"])
    assert code == 2 and text.startswith("fp8-parity sweep: --resume:"), text
    # started again without --resume: its rows would be replaced (issue 29, item 11)
    code, text = run_cli(["sweep", "--impl", "bf16", "--out", str(out), "--quiet"])
    assert code == 2 and "its partial.csv.gz holds the rows of an interrupted sweep (--resume continues it)" in text


# ---- a CUDA error ------------------------------------------------------------------------------------------


@pytest.mark.fp8_gpu
def test_a_cuda_error_is_a_finding_of_its_case_and_later_cases_still_run():
    """A device-side assert leaves the process's CUDA context unusable: the case that triggered
    it is a finding, and the next cases run in a fresh worker on their own merits."""
    from parity.check import CheckPlan
    from parity.runner import run_case_isolated
    from parity.worker import Worker
    plan = CheckPlan.make(load_impl(f"{HOSTILE / 'cuda_faults.py'}:oob_gather_with_32_rows", recipe="bf16"),
                          device="cuda")
    cases = [Case(lead=(M,), K=32, N=16) for M in (16, 32, 48)]
    with Worker("cuda") as runner:
        rows = {case.lead[0]: run_case_isolated(case, plan.comparisons, device="cuda", runner=runner, time_limit=120)
                for case in cases}
    faulted = {str(row.error) for row in rows[32] if row.impl == plan.candidate.name}
    assert len(faulted) == 1 and re.search(r"CUDA context unusable .*(device-side assert|CUDA error)",
                                           faulted.pop() or "")
    for M in (16, 48):
        assert not any(row.error or row.reference_error for row in rows[M]), rows[M]
        assert plan.judge(rows[M]) == [], plan.judge(rows[M])


# ---- hostile files and folders (evals/hostile/files.json; issue 29, items 8, 10, 11, 14) -----------------------

FILES = json.loads((HOSTILE / "files.json").read_text())


@pytest.fixture(scope="module")
def two_reports(tmp_path_factory) -> tuple[Path, Path]:
    """Two sealed report folders of bf16 against fp64, 80 cases (a table of about 100 KB): `passing`, and
    `failing`, the same rows but for its last case's, whose SQNR is 1 dB (below the floor)."""
    root = tmp_path_factory.mktemp("reports")
    base = run_cases([Case(lead=(16,), K=16, N=16), Case(lead=(32,), K=16, N=16)],
                     all_pairs([load_impl("bf16")], [load_impl("fp64")]))
    frame = pd.concat([base.assign(case_id=base["case_id"].str.replace("seed0", f"seed{seed}"), seed=seed)
                       for seed in range(40)], ignore_index=True)
    failing = frame.copy()
    failing.loc[failing["case_id"] == failing["case_id"].iloc[-1], "sqnr_db"] = 1.0
    for name, table in {"passing": frame, "failing": failing}.items():
        write_report(table, root / name, title=name, candidate="bf16", plots=False)
    return root / "passing", root / "failing"


def _state(root: Path) -> dict[str, tuple]:
    """Every path under `root` that no fp8-parity manifest lists: its kind and, for a file, its bytes."""
    from parity.folder_manifest import MANIFEST_FILE, read_manifest
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and (path.name == MANIFEST_FILE or path.name in (
                read_manifest(path.parent) or {})):
            continue
        kind = "link" if path.is_symlink() else "fifo" if path.is_fifo() else "dir" if path.is_dir() else "file"
        state[str(path.relative_to(root))] = (kind, path.read_bytes() if kind == "file" else None)
    return state


def test_every_hostile_file_has_a_builder():
    from evals.hostile import files
    assert all(callable(getattr(files, entry["build"], None)) for entry in FILES)
    assert len({entry["name"] for entry in FILES}) == len(FILES)


@pytest.mark.parametrize("entry", FILES, ids=[entry["name"] for entry in FILES])
def test_hostile_file(entry, two_reports, tmp_path):
    """Each command on its hostile file or folder: its exit code and one first line, no traceback, and no file
    fp8-parity did not write changed (a pipe stays a pipe, a link a link, the user's summary.md theirs)."""
    from evals.hostile import files
    named = getattr(files, entry["build"])(tmp_path, *two_reports)
    before = _state(tmp_path)
    text = assert_outcome([a.format(root=tmp_path, **named) for a in entry["argv"]],
                          Expect(entry["code"], entry["first"]))
    if entry["code"] == 2:
        assert len(text.strip().splitlines()) == 1, text
    assert _state(tmp_path) == before

"""train's finding: a case file of the training judged once by check's comparisons, in check's words.

The lockstep (parity.train) compares results bit for bit: it says where two trainings part, not
why. Why is what check's comparisons say of that GEMM's operands: its recorded _scaled_mm calls
against the recipe's oracle (parity.call_diagnosis), whose finding heads check, bisect and the pytest
plugin alike (parity.headline). So train judges one case file with them:

    the first divergence's case file   where the trainings part, the finding of its GEMM;
    the first layer's first call       where they never part: on a CPU whose kernel ignores
                                       use_fast_accum, a fast-accumulation bug leaves the numbers right
                                       and only the recorded call shows it ("only on the GPU"), as
                                       check says of the same layer

The implementation runs on the case once in a worker of its own, as check runs it (the process that
judges never imports it): 0.04 s of CPU time in the worker for the tiny model's first layer, 0.07 s
where it fails (one thread, warm; measured 2026-12-07), plus the worker's start.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path

import torch

from parity.check import CheckPlan, kernel_flags, wrong_numbers
from parity.data import saved_case, write_case_file
from parity.headline import of_violations
from parity.impls import Impl
from parity.runner import executing_in, run_case
from parity.worker import Worker, default_time_limit

FIRST_CALL_FILE = "calls-step0-{layer}.pt"  # the first layer's first call, kept where check finds something in it


def judge_case_file(candidate: Impl, against: Impl, path: str | Path, device: str) -> str | None:
    """check's finding of `candidate` against `against` on the case file's tensors (run once in this
    process), as check heads it: the headline (parity.headline; else bisect's diagnosis names it, as in
    check), else the first violation; None where check's comparisons find nothing."""
    plan = CheckPlan.make(candidate, against, device=device)
    case = saved_case(path)
    device_type = torch.device(device).type
    runner = Worker(device_type)
    try:
        with executing_in(runner, default_time_limit(case.M, case.K, case.N, device_type)):
            violations = plan.judge(run_case(case, plan.comparisons, device=device))
            if not violations:
                return None
            from parity.bisect import name_failure  # noqa: PLC0415 - bisect is built on check, which train uses
            headline = of_violations(violations) or (name_failure(plan, case, violations, device)
                                                     if wrong_numbers(violations) else None)
    finally:
        runner.close()
    return str(headline) if headline is not None else violations[0].message


def judge_first_call(candidate: Impl, against: Impl, layer: str, operands: dict, device: str,
                     out_dir: str | Path | None, meta: dict) -> tuple[str | None, Path | None]:
    """judge_case_file of the first layer's first call (its operands); the case file is kept in `out_dir`
    only where check's comparisons find something (its path, else None)."""
    with tempfile.TemporaryDirectory(prefix="fp8-parity-calls-") as scratch:
        name = FIRST_CALL_FILE.format(layer=layer)
        path = write_case_file(Path(scratch) / name, [operands], meta=dict(meta, layer=layer, gemm="output", step=0))
        found = judge_case_file(candidate, against, path, device)
        if found is None or out_dir is None:
            return found, None
        kept = Path(out_dir) / name
        shutil.copyfile(path, kept)
    return found, kept


def bisect_command(candidate: str, against: str, device: str, case_file: Path, *, recipe: str | None = None,
                   form: str | None = None) -> str:
    """The `fp8-parity bisect --case-file` command train prints as its next step, with the flags that judge
    the layer as train judged it (its --recipe and --form, the CPU's GEMM kernel)."""
    parts = ["fp8-parity", "bisect", "--impl", candidate, "--against", against, "--device", device,
             *kernel_flags(device), *(["--form", form] if form else []), *(["--recipe", recipe] if recipe else []),
             "--case-file", str(case_file)]
    return " ".join(shlex.quote(part) for part in parts)

"""`fp8-parity check` and `fp8-parity bisect`: search for a parity violation of one implementation,
and localize one (or, with --git, find the first bad commit).

`check --distributed` trains under a data-parallel wrapper instead: parity.cmd_distributed.
"""

from __future__ import annotations

import dataclasses
import json

from parity import cmd_inputs
from parity.bisect import localize, render as render_localized
from parity.check import CheckPlan, render, rerun_command, run_check
from parity.cmd_distributed import check_distributed
from parity.coverage import Coverage
from parity.exits import EXIT_CANNOT_RUN, EXIT_FAIL, EXIT_PASS
from parity.history import git_bisect
from parity.impls import load_impl
from parity.names import BISECT_SEARCH, CHECK_SEARCH
from parity.outputs import atomic_write_bytes, atomic_write_text
from parity.rows import frame as rows_frame
from parity.progress import Progress
from parity.results_file import encoded

EXIT_OF_VERDICT = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "error": EXIT_CANNOT_RUN}


def cmd_check(args) -> int:
    if args.distributed is not None or args.world_size is not None:
        return check_distributed(args)
    device = cmd_inputs.device(args.device, args.cpu_gemm)
    cmd_inputs.writable_file(args.json, "--json")
    cmd_inputs.writable_file(args.results, "--results")
    saved = cmd_inputs.case_file(args.case_file, args.case, device)
    cases = [saved] if saved else cmd_inputs.named_cases(args.case, device) if args.case else None
    candidate = load_impl(args.impl, form=args.form, recipe=args.recipe, time_limit=args.timeout)
    reference = load_impl(args.against, time_limit=args.timeout) if args.against else None
    plan = CheckPlan.make(candidate, reference, policy=args.policy, oracle=not args.no_oracle, device=device)
    extra = [*(["--form", args.form] if args.form else []), *(["--recipe", args.recipe] if args.recipe else []),
             *(["--policy", args.policy] if args.policy else [])]
    with Progress(not args.quiet, "cases", bar=False) as progress:
        result = run_check(plan, device=device, max_examples=args.max_examples, cases=cases, max_dim=args.max_dim,
                           max_tokens=args.max_dim, layer_case=True, seed=args.seed, progress=progress,
                           rerun_command=rerun_command(args.impl, plan.reference.name, device, extra),
                           time_limit=args.timeout)
    print(render(result), end="")
    if args.json:
        coverage = Coverage.of(result.rows, plan.candidate.name)
        payload = dict(result.to_json(), coverage=None if coverage is None else dataclasses.asdict(coverage))
        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
    if args.results and result.rows:
        atomic_write_bytes(args.results, encoded(rows_frame(result.rows)))
    return EXIT_OF_VERDICT[result.verdict]


def cmd_bisect(args) -> int:
    device = cmd_inputs.device(args.device, args.cpu_gemm)
    cmd_inputs.writable_file(args.json, "--json")
    if args.git:
        return _bisect_history(args, device)
    case = (cmd_inputs.case_file(args.case_file, args.case, device)
            or (cmd_inputs.named_cases([args.case], device)[0] if args.case else None))
    plan = CheckPlan.make(load_impl(args.impl, form=args.form, recipe=args.recipe, time_limit=args.timeout),
                          load_impl(args.against, time_limit=args.timeout) if args.against else None, device=device)
    budget = args.max_examples or BISECT_SEARCH
    with Progress(True, "bisect"):
        result = localize(plan, device=device, case=case, max_examples=budget, time_limit=args.timeout)
    print(render_localized(result), end="")
    if args.json:
        atomic_write_text(args.json, json.dumps(result.to_json(), indent=2) + "\n")
    return EXIT_OF_VERDICT[result.verdict]


def _bisect_history(args, device: str) -> int:
    """`bisect --git GOOD BAD`: the first bad commit of the repository in the current directory."""
    with Progress(True, "bisect --git"):  # a heartbeat in a log: one check per commit takes a while
        found = git_bisect(args.git[0], args.git[1], impl=args.impl, against=args.against, device=device,
                           max_examples=args.max_examples or CHECK_SEARCH, case=args.case)
    print(found.render(), end="")
    if args.json:
        atomic_write_text(args.json, json.dumps(found.to_json(), indent=2) + "\n")
    return EXIT_FAIL if found.first_bad else EXIT_PASS

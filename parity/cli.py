"""`fp8-parity`: argument parsing only; each command calls the modules that do the work.

Exit codes (all commands): 0 success / parity holds, 1 a violation was found, 2 bad usage
or input, 125 cannot run here (e.g. a GPU-only command without a GPU). 125 is what
`git bisect run` reads as "skip this commit".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.cases import CaseError, parse_case_id
from parity.impls import BUILTIN_HELP, Form, ImplError, load_impl
from parity.policy import Policy

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CANNOT_RUN = 0, 1, 2, 125


class UsageError(Exception):
    """Bad input from the user: printed as one clear message, exit 2."""


def _impl_arg(parser: argparse.ArgumentParser, *, default: str | None, help_prefix: str) -> None:
    names = ", ".join(BUILTIN_HELP)
    parser.add_argument("--impl", default=default, required=default is None, metavar="IMPL",
                        help=f"{help_prefix}: a built-in ({names}), package.module:attr or path/to/file.py:attr")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: cuda if a GPU is present, else cpu)")
    parser.add_argument("--form", choices=[f.value for f in Form], default=None,
                        help="override the detected form of --impl")
    parser.add_argument("--recipe", default=None,
                        help="the recipe --impl claims (default: tensorwise for your own code); decides the policy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8-parity", description="Numerical parity and accuracy harness for FP8 training in PyTorch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    check = commands.add_parser("check", help="search for a parity violation of an implementation",
                                description="Compare an FP8 implementation with a reference, forward and backward, "
                                            "on pinned edge cases and hypothesis-generated cases; shrink a failure "
                                            "to a minimal case.")
    _impl_arg(check, default=None, help_prefix="implementation under test")
    check.add_argument("--against", default="torchao:tensorwise", metavar="REF",
                       help="reference implementation (default: torchao:tensorwise)")
    _common(check)
    check.add_argument("--max-examples", type=int, default=100, help="hypothesis cases to try (default 100)")
    check.add_argument("--max-dim", type=int, default=256, help="largest K and N generated (default 256)")
    check.add_argument("--case", action="append", default=None, metavar="CASE_ID",
                       help="run exactly this case (repeatable) instead of searching")
    check.add_argument("--policy", choices=[p.value for p in Policy], default=None,
                       help="override the parity policy (default: chosen from the recipes)")
    check.add_argument("--no-oracle", action="store_true", help="do not also run the exact emulation")
    check.add_argument("--seed", type=int, default=0, help="seed of the search (default 0)")
    check.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON")
    check.add_argument("--quiet", action="store_true", help="no progress line")
    return parser


def _progress(enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        sys.stderr.write(f"\r  {done} cases run (search budget {total})")
        sys.stderr.flush()
    return show


def cmd_check(args) -> int:
    from parity.check import CheckPlan, render, rerun_command, resolve_device, run_check

    device, reason = resolve_device(args.device)
    if device is None:
        print(f"fp8-parity check: cannot run here: {reason}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    candidate = load_impl(args.impl, form=args.form, recipe=args.recipe)
    reference = load_impl(args.against)
    cases = [parse_case_id(c) for c in args.case] if args.case else None
    plan = CheckPlan.make(candidate, reference, policy=args.policy, oracle=not args.no_oracle)
    extra = [*(["--form", args.form] if args.form else []), *(["--recipe", args.recipe] if args.recipe else []),
             *(["--policy", args.policy] if args.policy else [])]
    result = run_check(plan, device=device, max_examples=args.max_examples, cases=cases, max_dim=args.max_dim,
                       seed=args.seed, rerun_command=rerun_command(args.impl, args.against, device, extra),
                       progress=_progress(not args.quiet))
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    print(render(result), end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL, "error": EXIT_CANNOT_RUN}[result.verdict]


COMMANDS = {"check": cmd_check}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ImplError, CaseError, UsageError) as err:
        print(f"fp8-parity {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

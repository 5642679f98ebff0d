"""`fp8-parity bisect --git GOOD BAD`: the first commit at which an implementation loses parity.

It runs `git bisect run` with `fp8-parity check` as the test, in a temporary worktree of
the repository (your checkout is never touched). The harness stays the one you run: only
the implementation comes from each commit, through FP8_PARITY_IMPL_PATH (parity.impls
puts the worktree first on sys.path when it loads an implementation). A commit where the
implementation cannot even be loaded (a usage error, exit 2) is skipped (exit 125), as is
one where the check cannot run.

The same works by hand, from a clean checkout of your repository:

    git bisect start BAD GOOD
    git bisect run fp8-parity check --impl path/to/impl.py:attr --max-examples 50
    git bisect reset
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import parity

IMPL_PATH_ENV = "FP8_PARITY_IMPL_PATH"


class HistoryError(ValueError):
    """A git bisect that cannot start (not a repository, unknown commit): the message says why."""


def _git(*args: str, cwd: str | Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise HistoryError(f"git {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


@dataclass
class BisectOutcome:
    good: str
    bad: str
    first_bad: str | None
    subject: str | None
    steps: list[str] = field(default_factory=list)  # "abc1234 good", "def5678 bad", "0123abc skip"
    command: str = ""
    output: str = ""

    def render(self) -> str:
        lines = [f"git bisect {self.good}..{self.bad} with: {self.command}", *[f"  {s}" for s in self.steps]]
        if self.first_bad:
            lines.append(f"first bad commit: {self.first_bad} {self.subject or ''}".rstrip())
        else:
            lines.append("no first bad commit found (see the git output below)")
            lines.append(self.output[-2000:])
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return dict(good=self.good, bad=self.bad, first_bad=self.first_bad, subject=self.subject, steps=self.steps,
                    command=self.command)


def _impl_in_worktree(impl: str, root: Path, worktree: Path) -> str:
    """A path-based implementation spec pointed into the worktree; module specs stay as they are."""
    module_spec, sep, attr = impl.rpartition(":")
    if not sep or not (module_spec.endswith(".py") or "/" in module_spec):
        return impl
    path = Path(module_spec).expanduser().resolve()
    try:
        relative = path.relative_to(root)
    except ValueError:
        raise HistoryError(f"{path} is not inside the repository {root}: bisect needs the implementation's file "
                           f"to be tracked there") from None
    return f"{worktree / relative}:{attr}"


def git_bisect(good: str, bad: str, *, impl: str, against: str = "torchao:tensorwise", device: str = "cpu",
               max_examples: int = 50, repo: str | Path = ".", case: str | None = None) -> BisectOutcome:
    root = Path(_git("rev-parse", "--show-toplevel", cwd=repo))
    good_sha, bad_sha = (_git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=root) for rev in (good, bad))
    harness_root = str(Path(parity.__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="fp8-parity-bisect-") as scratch:
        worktree = Path(scratch) / "worktree"
        _git("worktree", "add", "--detach", str(worktree), bad_sha, cwd=root)
        try:
            spec = _impl_in_worktree(impl, root, worktree)
            check = [sys.executable, "-m", "parity", "check", "--impl", spec,
                     *(("--against", against) if against else ()), "--device", device,
                     "--max-examples", str(max_examples), "--quiet",
                     *(("--case", case) if case else ())]  # a known failing case: each commit runs only it
            # exit 2 (the implementation does not load at this commit) means "cannot test": skip it
            script = f"cd {shlex.quote(scratch)} && {shlex.join(check)}; rc=$?; [ $rc -eq 2 ] && exit 125; exit $rc"
            env = dict(os.environ, **{IMPL_PATH_ENV: str(worktree)},
                       PYTHONPATH=os.pathsep.join(p for p in (harness_root, os.environ.get("PYTHONPATH")) if p))
            _git("bisect", "start", bad_sha, good_sha, cwd=worktree)
            done = subprocess.run(["git", "bisect", "run", "sh", "-c", script], cwd=worktree, capture_output=True,
                                  text=True, env=env)
            output = done.stdout + done.stderr
            log = _git("bisect", "log", cwd=worktree)
        finally:
            subprocess.run(["git", "bisect", "reset"], cwd=worktree, capture_output=True)
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=root, capture_output=True)
    match = re.search(r"([0-9a-f]{40}) is the first bad commit", output)
    first_bad = match.group(1) if match else None
    subject = _git("log", "-1", "--format=%s", first_bad, cwd=root) if first_bad else None
    steps = [f"{sha[:10]} {verdict}" for verdict, sha in re.findall(r"^git bisect (good|bad|skip) ([0-9a-f]{40})",
                                                                      log, flags=re.M)]
    return BisectOutcome(good, bad, first_bad, subject, steps, (f"fp8-parity check --impl {impl}"
                                                                        + (f" --against {against}" if against else "")),
                         output)

"""Proof that the held-out sets are frozen: every file under evals/heldout/ is the file its set was
frozen with (its sha256 in FROZEN.sha256) or is declared not frozen, with why (NOT-FROZEN.txt).

    python -m evals.scoring.frozen           exit 0 when so; exit 1 naming every file that is not
    python -m evals.scoring.frozen --write   rebuild FROZEN.sha256 from git history, then verify

A set's frozen files are those of the commit that first added it (as property_tests/heldoutN/, the
folder it was written in): --write hashes that commit's blobs, not the files on disk, so a file
changed since would fail the verification that follows. FROZEN.sha256 is in sha256sum's format,
paths relative to evals/heldout/ (`cd evals/heldout && sha256sum -c FROZEN.sha256` checks it too).
Files added after a set was frozen (label notes written after its first run) are listed in
NOT-FROZEN.txt as `PATH: why`. Caches Python writes beside a loaded file (__pycache__/) are ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

from evals.scoring import sets

FROZEN = "FROZEN.sha256"
NOT_FROZEN = "NOT-FROZEN.txt"
CACHES = ("__pycache__",)  # what importing a set's file writes beside it (git-ignored)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_frozen(root: Path) -> dict[str, str]:
    """FROZEN.sha256: path (relative to root) -> sha256."""
    listed = {}
    for line in (root / FROZEN).read_text().splitlines():
        digest, path = line.split("  ", 1)
        listed[path] = digest
    return listed


def read_not_frozen(root: Path) -> dict[str, str]:
    """NOT-FROZEN.txt: path -> why it is not frozen (lines `PATH: why`; # comments and blank lines skipped)."""
    declared = {}
    for line in (root / NOT_FROZEN).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, why = line.split(": ", 1)
            declared[path] = why
    return declared


def files_on_disk(root: Path) -> list[str]:
    """Every file under root but the two lists themselves and Python's caches, relative to root."""
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_file() and not any(part in CACHES for part in relative.parts) \
                and relative.as_posix() not in (FROZEN, NOT_FROZEN):
            found.append(relative.as_posix())
    return found


def verify(root: Path = sets.HELDOUT) -> list[str]:
    """What is not as frozen: one line per file (changed, missing, undeclared, declared but absent)."""
    frozen, declared = read_frozen(root), read_not_frozen(root)
    on_disk = set(files_on_disk(root))
    problems = [f"changed since its set was frozen: {path}" for path, digest in sorted(frozen.items())
                if path in on_disk and sha256((root / path).read_bytes()) != digest]
    problems += [f"frozen but missing: {path}" for path in sorted(set(frozen) - on_disk)]
    problems += [f"neither frozen nor declared in {NOT_FROZEN}: {path}"
                 for path in sorted(on_disk - set(frozen) - set(declared))]
    problems += [f"declared in {NOT_FROZEN} but absent: {path}" for path in sorted(set(declared) - on_disk)]
    problems += [f"both frozen and declared not frozen: {path}" for path in sorted(set(frozen) & set(declared))]
    return problems


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True,
                          cwd=sets.HELDOUT.parents[1]).stdout


def frozen_from_git() -> tuple[dict[str, str], dict[str, str]]:
    """path -> sha256 of every file of every set at the commit that first added the set, and set -> that commit."""
    digests, commits = {}, {}
    for name in sets.SETS:
        old = f"property_tests/{sets.OLD_FOLDER[name]}" if name in sets.OLD_FOLDER else f"evals/heldout/{name}"
        commit = _git("log", "--reverse", "--format=%H", "--", old).split()[0]
        commits[name] = commit
        for line in _git("ls-tree", "-r", commit, "--", f"{old}/").splitlines():
            meta, path = line.split("\t", 1)
            blob = meta.split()[2]
            content = subprocess.run(["git", "cat-file", "blob", blob], check=True, capture_output=True,
                                     cwd=sets.HELDOUT.parents[1]).stdout
            digests[f"{name}/{path.removeprefix(old + '/')}"] = sha256(content)
    return digests, commits


def write(root: Path = sets.HELDOUT) -> None:
    digests, commits = frozen_from_git()
    (root / FROZEN).write_text("".join(f"{digest}  {path}\n" for path, digest in sorted(digests.items())))
    for name, commit in commits.items():
        count = sum(path.startswith(name + "/") for path in digests)
        print(f"{name}: {count} files, frozen at {commit[:10]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.scoring.frozen", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rebuild {FROZEN} from git history, then verify")
    parser.add_argument("--root", type=Path, default=sets.HELDOUT, help="the folder of the sets (default %(default)s)")
    args = parser.parse_args(argv)
    if args.write:
        write(args.root)
    problems = verify(args.root)
    if problems:
        print(f"{len(problems)} files of {args.root} are not as frozen:", *problems, sep="\n")
        return 1
    print(f"{len(read_frozen(args.root))} files of {len(sets.SETS)} held-out sets match {FROZEN}; "
          f"{len(read_not_frozen(args.root))} declared not frozen in {NOT_FROZEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

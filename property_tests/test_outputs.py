"""parity.outputs: outputs checked before the work, written whole or not at all, one writer per directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parity import outputs
from parity.outputs import (LOCK_FILE, OutputError, OutputLock, atomic_write_bytes, atomic_write_text,
                            check_writable_dir, check_writable_file)


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_atomic_write_replaces_the_content_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "deep" / "summary.md"
    atomic_write_text(target, "old\n")
    atomic_write_bytes(target, b"new\n")
    assert target.read_bytes() == b"new\n"
    assert leftovers(target.parent) == []
    assert target.stat().st_mode & 0o777 == 0o666 & ~outputs._umask()  # not the temp file's 0600


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_a_failing_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "results.csv.gz"
    target.write_bytes(b"old table")

    def boom(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fail_at, boom)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_bytes(target, b"new table, " * 1000)
    assert target.read_bytes() == b"old table"
    assert leftovers(tmp_path) == []


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    """Ctrl-C (a BaseException) midway: the old file stays, the temp file goes."""
    target = tmp_path / "index.html"
    target.write_text("old page")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, "new page")
    assert target.read_text() == "old page" and leftovers(tmp_path) == []


@pytest.mark.parametrize(("where", "reason"), [
    (lambda tmp: "/proc/x.json", "/proc is not writable"),
    (lambda tmp: tmp / "file.txt" / "x.json", "file.txt is a file, not a directory"),
    (lambda tmp: tmp / "file.txt" / "a" / "b" / "x.json", "file.txt is a file, not a directory"),
    (lambda tmp: tmp, "is a directory"),
])
def test_check_writable_file_refuses_where_nothing_can_be_written(tmp_path, where, reason):
    (tmp_path / "file.txt").write_text("a file")
    path = where(tmp_path)
    with pytest.raises(OutputError, match="cannot write there") as caught:
        check_writable_file(path, option="--json")
    message = str(caught.value)
    assert message.startswith(f"--json {path}: ") and reason in message and "\n" not in message


def test_check_writable_file_accepts_a_new_directory_without_creating_it(tmp_path):
    path = tmp_path / "new" / "deeper" / "x.json"
    assert check_writable_file(path) == path
    assert list(tmp_path.iterdir()) == []  # nothing created, not even a probe left behind
    existing = tmp_path / "x.json"
    existing.write_text("{}")
    assert check_writable_file(existing) == existing and existing.read_text() == "{}"


def test_check_writable_dir(tmp_path):
    (tmp_path / "file.txt").write_text("a file")
    assert check_writable_dir(tmp_path / "new" / "report") == tmp_path / "new" / "report"
    assert check_writable_dir(tmp_path) == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]
    with pytest.raises(OutputError, match="file.txt is a file, not a directory"):
        check_writable_dir(tmp_path / "file.txt")
    with pytest.raises(OutputError, match="/proc is not writable"):
        check_writable_dir("/proc/report", option="--out")


def test_a_second_lock_on_the_same_directory_names_the_first_run(tmp_path):
    out = tmp_path / "report"
    with OutputLock(out, "fp8-parity sweep --out report"):
        held = json.loads((out / LOCK_FILE).read_text())
        assert held["pid"] == os.getpid() and held["command"] == "fp8-parity sweep --out report"
        with pytest.raises(OutputError) as caught, OutputLock(out, "another"):
            pass
        message = str(caught.value)
        assert f"pid {os.getpid()}" in message and "fp8-parity sweep --out report" in message
        assert message.startswith(f"{out} is being written by another fp8-parity run") and "--out" in message
        assert (out / LOCK_FILE).exists()  # the refused run did not remove the holder's lock
    assert not (out / LOCK_FILE).exists()


def test_the_lock_goes_when_the_run_raises(tmp_path):
    with pytest.raises(RuntimeError), OutputLock(tmp_path, "x"):
        raise RuntimeError("the run failed")
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("content", ["dead", "garbage"])
def test_a_stale_lock_is_taken_over(tmp_path, content):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names no process
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": gone.pid, "command": "killed run"}) if content == "dead" else "{not json")
    with OutputLock(tmp_path, "new run"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


# ---- outputs that are not regular files (issue 29, item 10) -------------------------------------------------

def _non_regular(tmp_path, kind: str):
    path = tmp_path / kind.replace("/", "_")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/null":
        path.symlink_to("/dev/null")
    elif kind == "link to a file":
        (tmp_path / "target.json").write_text("mine\n")
        path.symlink_to(tmp_path / "target.json")
    return path


@pytest.mark.parametrize(("kind", "says"), [("fifo", "is a named pipe, not a regular file"),
                                            ("link to /dev/null", "is a symbolic link"),
                                            ("link to a file", "is a symbolic link")])
def test_an_output_that_is_not_a_regular_file_is_refused_and_left_as_it_is(tmp_path, kind, says):
    """`check --json X` with X a device node, a pipe or a link was exit 0 and X replaced by a regular file
    (as root, `--json /dev/null` would replace the real one)."""
    path = _non_regular(tmp_path, kind)
    with pytest.raises(OutputError, match=says):
        check_writable_file(path, option="--json")
    with pytest.raises(OutputError, match=says):  # and where it appeared after the check: never replaced
        atomic_write_text(path, "{}\n")
    assert path.is_symlink() if kind.startswith("link") else path.is_fifo()
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_a_character_device_is_refused():
    with pytest.raises(OutputError, match="/dev/null is a character device, not a regular file"):
        check_writable_file("/dev/null", option="--csv")


# ---- the folder manifest: what fp8-parity wrote in a folder (issue 29, item 11) ---------------------------------

def test_written_files_are_listed_with_their_checksums_and_the_folder_is_fp8_paritys(tmp_path):
    from parity.folder_manifest import MANIFEST_FILE, check_folder, read_manifest, survey, write_files
    write_files(tmp_path / "rep", {"summary.md": b"# report\n", "env.json": b"{}\n"})
    listed = read_manifest(tmp_path / "rep")
    assert set(listed) == {"summary.md", "env.json"} and listed["summary.md"].bytes == 9
    assert all(entry.previous is None for entry in listed.values())
    assert survey(tmp_path / "rep").clean and (tmp_path / "rep" / MANIFEST_FILE).is_file()
    check_folder(tmp_path / "rep")
    write_files(tmp_path / "rep", {"summary.md": b"# again\n"})  # a rewrite keeps the other entries
    assert set(read_manifest(tmp_path / "rep")) == {"summary.md", "env.json"}
    check_folder(tmp_path / "rep")


def test_a_folder_of_the_users_files_is_refused_unless_forced(tmp_path):
    from parity.folder_manifest import check_folder
    (tmp_path / "index.html").write_text("mine")
    with pytest.raises(OutputError, match=r"^--out .*: it holds index.html, which fp8-parity did not write \(it has "
                                          r"no fp8-parity-manifest.json.*\): give a new or empty folder, or --force"):
        check_folder(tmp_path, force=False)
    with pytest.raises(OutputError, match=r"give a new or empty folder$"):  # a command without --force offers none
        check_folder(tmp_path, force=None)
    check_folder(tmp_path, force=True)
    check_folder(tmp_path / "new", force=False)
    (tmp_path / "empty").mkdir()
    check_folder(tmp_path / "empty", force=False)


def test_a_file_fp8_parity_wrote_and_the_user_changed_or_added_is_theirs(tmp_path):
    from parity.folder_manifest import check_folder, write_files
    write_files(tmp_path, {"summary.md": b"# report\n"})
    (tmp_path / "summary.md").write_text("# report\nmy notes\n")
    with pytest.raises(OutputError, match="summary.md changed since fp8-parity wrote it"):
        check_folder(tmp_path)
    (tmp_path / "summary.md").write_text("# report\n")
    (tmp_path / "notes").mkdir()
    with pytest.raises(OutputError, match="it holds notes/, which fp8-parity did not write: "):
        check_folder(tmp_path)


def test_a_protected_file_is_refused_by_name(tmp_path):
    from parity.folder_manifest import check_folder, write_files
    write_files(tmp_path, {"results.csv.gz": b"table"})
    with pytest.raises(OutputError, match=r"its results.csv.gz holds an earlier table, which this run would "
                                          r"replace: give a new or empty folder, or --force"):
        check_folder(tmp_path, protected={"results.csv.gz": "an earlier table"})
    check_folder(tmp_path, protected={"partial.csv.gz": "rows"})


def test_a_write_killed_between_file_and_manifest_leaves_a_folder_still_fp8_paritys(tmp_path, monkeypatch):
    """The manifest lists the new checksum beside the old one before the file changes: a run killed after the
    file is written (or before) leaves content the manifest vouches for, and the temporary file of a write
    killed midway is recognised as fp8-parity's."""
    from parity import folder_manifest
    folder_manifest.write_files(tmp_path, {"summary.md": b"old"})
    monkeypatch.setattr(folder_manifest, "_write_manifest",
                        lambda directory, entries, real=folder_manifest._write_manifest:
                        real(directory, entries) if any(e.previous for e in entries.values())
                        else (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        folder_manifest.write_files(tmp_path, {"summary.md": b"new"})
    assert (tmp_path / "summary.md").read_bytes() == b"new"
    (tmp_path / ".summary.md.abc123").write_bytes(b"ne")  # a temporary file left by a write killed midway
    folder_manifest.check_folder(tmp_path)

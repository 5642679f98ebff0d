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

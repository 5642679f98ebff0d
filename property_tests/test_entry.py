"""The console script's shape: parity.entry starts before torch, and the table of commands, the
parser and the command modules agree."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from parity import cli, commands, entry, exits, model_configs, names

PARITY = Path(entry.__file__).parent


def test_the_entry_point_imports_without_torch():
    # its point: a worker starts before this process pays for torch (a fresh interpreter: this one has it)
    code = ("import sys, parity.entry; loaded = [m for m in ('torch', 'parity.cli') if m in sys.modules]; "
            "print(loaded); sys.exit(1 if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _parity_imports(module) -> set[str]:
    """The parity modules `module` imports anywhere in its source (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parity"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("parity"))
    return names


@pytest.mark.parametrize("module", [commands, exits, names, model_configs])
def test_the_modules_entry_and_cli_share_import_no_harness(module):
    # no circle through them: parity.entry and parity.cli both read them (and the parser reads the names
    # and the models without torch: they import nothing of the harness that could bring it)
    assert _parity_imports(module) == set()


def test_the_entry_point_imports_cli_only_in_main():
    assert _parity_imports(entry) == {"parity.commands", "parity.exits", "parity.names", "parity.worker", "parity.cli"}
    assert "parity.cli" not in {node.module for node in ast.parse(inspect.getsource(entry)).body
                                if isinstance(node, ast.ImportFrom)}


def test_every_command_of_the_parser_has_a_body_and_no_other():
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert list(subparsers.choices) == ["check", "sweep", "bisect", "bench", "throughput", "train", "report", "diff",
                                        "test", "calibrate"]
    assert set(subparsers.choices) == set(commands.COMMANDS)
    for name in commands.COMMANDS:
        assert callable(commands.command(name)), name
    assert set(commands.RUNS_YOUR_CODE) <= set(commands.COMMANDS)


def test_no_command_module_imports_another_or_the_parser():
    # the bodies are leaves under parity.cli: a body that needs another's helper takes it from a shared module
    bodies = {spec.partition(":")[0] for spec in commands.COMMANDS.values()}
    for path in sorted(PARITY.glob("cmd_*.py")):
        imported = _parity_imports(__import__(f"parity.{path.stem}", fromlist=["_"]))
        assert "parity.cli" not in imported and not (imported & bodies), (path.name, imported & bodies)


def test_a_stopped_command_ends_at_once_and_takes_the_fork_server_with_it(tmp_path):
    """After a Ctrl-C or SIGTERM, entry ends the process without the interpreter's teardown (5 to 7 s with torch
    loaded at a load of 13) and kills the CPU workers' fork server, which otherwise lives on, holding the
    command's stdout, until its preload (torch) has imported (issue 29: SIGTERM must stop a command in about
    a second)."""
    import os
    import time
    pid_file = tmp_path / "server.pid"
    code = ("import sys; from parity import entry, worker; from multiprocessing import forkserver; "
            "worker.warm_up('cpu'); "
            f"open({str(pid_file)!r}, 'w').write(str(forkserver._forkserver._forkserver_pid)); "
            "entry._exit_now(143)")
    with (tmp_path / "stderr").open("w") as stderr:  # a file, not a pipe: run() returns when the command exits
        done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=stderr, timeout=120)
    assert done.returncode == 143, (tmp_path / "stderr").read_text()
    server = int(pid_file.read_text())
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{server}/stat").read_text().split(") ")[1].startswith("Z"):  # killed, not yet reaped
            return
        time.sleep(0.05)
    raise AssertionError(f"the fork server {server} outlived the stopped command by 2 s")

"""Running the implementation under test in a worker process, with a time limit.

Code under test may exit the process (sys.exit, os._exit), abort, segfault, hang, spin, run out
of memory, raise KeyboardInterrupt or print megabytes. None of that may end a run early or, worse,
read as a pass. So every case runs in a worker process kept alive across cases; the verdict is
computed in the parent from the rows the worker sends back. A worker that dies (any exit code, any
signal) or runs past the case's time limit is a finding for that case, with what happened and
where ("the implementation exited the process with code 0 during step 0: forward"), and the run
goes on with the next case on a fresh worker. In the worker SIGINT is ignored (a Ctrl-C is the
parent's to handle: it stops the run), stdout and stderr go to a file (the tail is kept for the
finding), and on the CPU the address space is capped so that an unbounded allocation fails inside
the implementation instead of taking the machine down.

CPU workers come from a fork server (a clean process that imported torch and never ran a kernel:
a process forked after OpenMP has run deadlocks in its first parallel region, and the parent has
run kernels); CUDA workers spawn (a CUDA context does not survive a fork). Either way a worker
rebuilds implementations from their names.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import resource
import signal
import sys
import tempfile
import types
import time
import traceback
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Any, Callable

from parity import transfer  # (torch-free at import, as this module must be)
from parity.vocabulary import DIED_PREFIX  # (an enum module: no torch, as this module must be)

PHASE_BYTES = 512
SEPARATOR = "\x1f"  # between the implementation's name and its phase in the shared buffer
MEMORY_SHARE = 0.75  # a CPU worker may map this share of the machine's memory
# An implementation that prints more than this in one case is a finding: nn.Linear prints nothing, and
# a one-time warning (torchao's, torch's) is a few hundred bytes; 64 KiB is hundreds of lines per call,
# which floods a training log and costs time at every step.
PRINT_LIMIT_BYTES = 64 * 1024
# The largest reply the parent reads by default (parity.transfer): an execution of a case the harness runs
# on a CPU is a few MB; a caller that expects more (a large GPU case) passes its own bound.
REPLY_LIMIT_BYTES = 1 << 30


@dataclass(frozen=True)
class Died:
    """A worker that did not come back with a result."""

    what: str  # "exited the process with code 0", "was killed by signal SIGSEGV", "ran past its time limit of 5 s"
    impl: str  # the implementation that was running ("" before any)
    phase: str  # where it was: "step 0: forward"
    output: str  # the tail of what it printed
    timed_out: bool = False  # it ran past its time limit (killed by the parent), rather than ending by itself

    @property
    def message(self) -> str:
        where = f" during {self.phase}" if self.phase else ""
        printed = f" (its last output: {self.output!r})" if self.output else ""
        return f"{DIED_PREFIX} {self.what}{where}{printed}"

    def __str__(self) -> str:
        """As the results table's error column holds it."""
        return self.message

    @property
    def crash_message(self) -> str:
        return self.message


class WorkerError(RuntimeError):
    """The harness itself raised inside the worker: a bug of the harness, with the worker's traceback."""


def default_time_limit(M: int, K: int, N: int, device_type: str) -> float:
    """Seconds a case may take: a floor for imports, compilation and Triton autotuning of the first
    calls, plus the case's work at a pessimistic rate (float64 emulations on a 2-core CPU run
    about 1e9 multiply-adds per second; an H200 1e12)."""
    rate = 1e12 if device_type == "cuda" else 1e9
    return 120.0 + 40 * M * K * N / rate


# ---- inside the worker ------------------------------------------------------------------------------------

_PHASE = None  # the shared buffer, in a worker
_CONN = None  # the pipe to the parent, in a worker


def in_worker() -> bool:
    return _PHASE is not None


_STORE: dict = {}  # values the parent sent once (Worker.remember), in a worker


def _store(key: str, value: Any) -> None:
    _STORE[key] = value


def recall(key: str) -> Any:
    """A value the parent sent with Worker.remember (in the worker)."""
    return _STORE[key]


def report_phase(impl: str, phase: str) -> None:
    """Where the code under test is (called by parity.runner.execute); a no-op outside a worker."""
    if _PHASE is not None:
        _PHASE.value = f"{impl}{SEPARATOR}{phase}".encode()[: PHASE_BYTES - 1]


def end_worker(what: str) -> None:
    """Give up this worker from inside a task: the parent reads `what` as how the implementation
    ended it (a CUDA error that leaves the process's CUDA context unusable: every later kernel
    would fail, so the next case needs a fresh process). Returns only outside a worker."""
    if _CONN is None:
        return
    try:
        _send(_CONN, ("ended", what))
    finally:
        os._exit(70)


def _send(conn, reply: tuple) -> None:
    """A reply as plain data (parity.transfer): the parent reads it without unpickling anything."""
    try:
        data = transfer.encode(reply)
    except Exception as err:  # noqa: BLE001 - a result that is not plain data: the harness's own error
        data = transfer.encode(("raised", f"the result could not be sent back: {type(err).__name__}: {err}",
                                traceback.format_exc()))
    conn.send_bytes(data)


def _serve(conn, phase, output_path: str, memory_bytes: int | None, preload: bool = False) -> None:
    global _PHASE, _CONN
    _PHASE, _CONN = phase, conn
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's; one raised by the code is a finding
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    out = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if preload:  # a spawned (CUDA) worker: what the CPU fork server imports, and the CUDA context, before any task
        _preload_cuda()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        except Exception as err:  # noqa: BLE001 - what was sent does not unpickle here: the harness's error
            _send(conn, ("raised", f"the worker could not read its task: {type(err).__name__}: {err}",
                         traceback.format_exc()))
            continue
        if message is None:
            break
        fn, args, kwargs, settings = message
        _match_parent(settings)
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - the harness's own error: sent back with its traceback
            reply = ("raised", f"{type(err).__name__}: {err}", traceback.format_exc())
        _send(conn, reply)
    os._exit(0)


# A worker computes what its parent would, with each task its parent's settings:
# - the host threads (the oracles' float64 GEMMs run on the host), not torch's default of one per core:
#   with eight sharded scorers on the H200 machine (16 cores) each worker's 16 threads left every shard
#   without one finished entry in 200 s; with 2 threads each, held-out set 15 scored in 127 s (2026-12-02);
# - the CPU kernel of scaled GEMM calls (parity.cpu_gemm: fast, hopper or torch), which a fork server
#   started before the option was read would not know.
def _match_parent(settings: dict) -> None:
    threads = settings.get("threads")
    if threads and "torch" in sys.modules and sys.modules["torch"].get_num_threads() != threads:
        sys.modules["torch"].set_num_threads(threads)
    for name, value in settings.get("environ", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


INHERITED_ENVIRON = ("FP8_PARITY_CPU_SCALED_MM", "FP8_PARITY_CPU_REJECT")


def _parent_settings() -> dict:
    """What a task carries of its parent: torch's host threads (when it has imported torch) and the
    environment the harness reads at run time."""
    torch = sys.modules.get("torch")
    return dict(threads=torch.get_num_threads() if torch is not None else None,
                environ={name: os.environ.get(name) for name in INHERITED_ENVIRON})


def _preload_cuda() -> None:
    """The imports of parity.preload, then the CUDA context and the first kernels of each kind a case
    runs (an fp8 _scaled_mm, a bf16 and a float64 matmul): in a fresh process on an H200 these cost
    seconds the first time, and a spare worker pays them before it is needed. Only the harness's
    code runs here, never the code under test."""
    # The one import circle of parity/, on purpose: parity.preload imports parity.runner, which imports this
    # module. It runs only in a spawned CUDA worker, after this module has loaded; importing it here
    # rather than at the top keeps the parent (the process that judges) from importing torchao for it; torch
    # too: parity.entry imports this module before torch loads, to start workers early.
    import parity.preload  # noqa: F401
    import torch
    with contextlib.suppress(Exception):  # a GPU without fp8 kernels: the case reports it, not the warm-up
        torch.cuda.init()
        a = torch.ones(16, 16, device="cuda")
        for dtype in (torch.bfloat16, torch.float32, torch.float64):
            (a.to(dtype) @ a.to(dtype)).sum().item()
        one = torch.ones((), device="cuda")
        torch._scaled_mm(a.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn).t(), scale_a=one, scale_b=one,
                         out_dtype=torch.bfloat16).sum().item()
    sys.stdout.flush()


# ---- in the parent --------------------------------------------------------------------------------------

_REPLY_LENGTHS = {"ok": 2, "ended": 2, "raised": 3}


def _reply(message) -> tuple:
    """A decoded reply checked for its shape: ("ok", result), ("ended", what) or ("raised", error, traceback)."""
    if not (isinstance(message, tuple) and message and isinstance(message[0], str)
            and _REPLY_LENGTHS.get(message[0]) == len(message)):
        raise transfer.TransferError(f"not a reply of the harness: {type(message).__name__}")
    if message[0] != "ok" and not all(isinstance(part, str) for part in message[1:]):
        raise transfer.TransferError(f"a {message[0]!r} reply whose text is not text")
    return message

@dataclass
class _Process:
    """A started worker process and what the parent holds of it."""

    process: Any
    conn: Any
    phase: Any  # the shared buffer: implementation and phase
    output: str  # the file its stdout and stderr go to


def _spawn(context, device_type: str) -> _Process:
    phase = context.Array("c", PHASE_BYTES, lock=False)
    parent, child = context.Pipe()
    memory = None
    if device_type != "cuda" and hasattr(os, "sysconf"):
        try:
            memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_SHARE)
        except (ValueError, OSError):
            memory = None
    fd, output = tempfile.mkstemp(prefix="fp8-parity-worker-", suffix=".log")
    os.close(fd)
    process = context.Process(target=_serve, args=(child, phase, output, memory, device_type == "cuda"),
                              daemon=True)
    with _main_not_rerun():
        process.start()
    child.close()
    return _Process(process, parent, phase, output)


# A fresh CUDA worker costs what a fresh interpreter costs: torch's, the harness's and torchao's
# imports and a CUDA context, about 10 s on the H200 machine, and a bisect needs several (one per
# case it must run alone, one after each death). The CPU has its fork server for that; the GPU keeps
# spares, spawned in the background (whenever a CUDA worker starts, one to replace it), so the
# next fresh worker is ready when asked for. A spare that is never used dies with this process
# (daemonic: multiprocessing terminates it at exit).
_SPARES: dict[str, list[_Process]] = {}


def prestart(device_type: str, count: int = 1) -> None:
    """Have `count` spare workers of `device_type` started (CUDA only: CPU workers fork from the fork
    server at once); those missing are spawned now, side by side."""
    if device_type != "cuda":
        return
    alive = [spare for spare in _SPARES.get(device_type, []) if spare.process.is_alive()]
    alive += [_spawn(_context(device_type), device_type) for _ in range(count - len(alive))]
    _SPARES[device_type] = alive


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _context(device_type: str):
    if device_type == "cuda":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["parity.preload"])  # counts only before the server's first start
    return context


@contextlib.contextmanager
def _main_not_rerun():
    """Hide __main__ while a worker or the fork server starts. A worker needs nothing from it (its
    code lives in parity), and otherwise spawn and forkserver re-run the caller's script in every
    worker: a script that calls fp8-parity without an `if __name__ == "__main__":` guard would run
    itself again, or fail with multiprocessing's bootstrapping error."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def warm_up(device_type: str = "cpu", workers: int = 1) -> None:
    """Start the CPU workers' fork server, or the first `workers` spare CUDA workers, now, so that
    their imports run while this process does its own (a command calls this first thing: seconds
    saved on a two-core laptop, and a CUDA worker's start on a GPU machine)."""
    if device_type == "cuda":
        prestart("cuda", workers)
        return
    _context("cpu")
    with _main_not_rerun():
        forkserver.ensure_running()


def torch_device_type(device) -> str:
    return str(device).split(":")[0]


class Worker:
    """One worker process, started on first use and again after a death."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self._context = _context(device_type)
        self._process = self._conn = self._phase = None
        self._sent: set[str] = set()
        self._output: str | None = None  # the file the current process prints to

    def _start(self) -> None:
        self._sent: set[str] = set()
        self._unlink_output()
        waiting = [spare for spare in _SPARES.pop(self.device_type, []) if spare.process.is_alive()]
        spare = waiting.pop(0) if waiting else None
        _SPARES[self.device_type] = waiting
        if spare is None:
            spare = _spawn(self._context, self.device_type)
        self._process, self._conn, self._phase, self._output = spare.process, spare.conn, spare.phase, spare.output
        prestart(self.device_type)  # the next fresh worker (after a death, for a case alone) starts now

    def _unlink_output(self) -> None:
        if self._output is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._output)
            self._output = None

    def _where(self) -> tuple[str, str]:
        text = bytes(self._phase.value).decode(errors="replace") if self._phase is not None else ""
        impl, _, phase = text.partition(SEPARATOR)
        return impl, phase

    def _tail(self) -> str:
        try:
            with open(self._output, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 200))
                return f.read().decode(errors="replace").strip().splitlines()[-1][:160] if size else ""
        except (OSError, IndexError, TypeError):
            return ""

    def output_bytes(self) -> int:
        """How much the worker has printed so far (its stdout and stderr, to one file)."""
        try:
            return os.path.getsize(self._output)
        except (OSError, TypeError):
            return 0

    def _kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
        if self._process is not None:
            self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def start(self) -> "Worker":
        """Start the process now (its imports run while the caller works); calls wait for it."""
        if self._process is None or not self._process.is_alive():
            self._start()
        return self

    def remember(self, key: str, value: Any) -> "str | Died":
        """Keep `value` in the worker under `key` (sent once per worker process; see recall)."""
        if self._process is None or not self._process.is_alive():
            self._start()
        if key not in self._sent:
            outcome = self.call(_store, key, value, time_limit=120.0)
            if isinstance(outcome, Died):
                return outcome
            self._sent.add(key)
        return key

    def call(self, fn: Callable, *args, time_limit: float = math.inf, reply_limit: int = REPLY_LIMIT_BYTES,
             **kwargs) -> Any | Died:
        """fn(*args, **kwargs) in the worker: its result (plain data and the records of parity.transfer, read
        without unpickling), or Died, also when the reply is not such data or longer than `reply_limit` bytes
        (the code under test wrote it). A KeyboardInterrupt in the parent kills the worker and propagates."""
        if self._process is None or not self._process.is_alive():
            self._start()
        self._phase.value = b""
        self._conn.send((fn, args, kwargs, _parent_settings()))
        deadline = last = time.monotonic()
        deadline += time_limit
        spent: dict[tuple[str, str], float] = {}  # seconds seen in each (implementation, phase)
        try:
            while True:
                now = time.monotonic()
                where = self._where()
                spent[where] = spent.get(where, 0.0) + now - last
                last = now
                if self._conn.poll(0.05):
                    try:
                        data = self._conn.recv_bytes(reply_limit)
                    except EOFError:
                        return self._died()
                    except OSError:  # longer than reply_limit (or a broken pipe): not read
                        return self._unreadable(f"more than {reply_limit} bytes")
                    try:
                        kind, *payload = _reply(transfer.decode(data))
                    except transfer.TransferError as err:
                        return self._unreadable(str(err))
                    if kind == "ok":
                        return payload[0]
                    if kind == "ended":
                        impl, phase = self._where()
                        self._kill()
                        return Died(payload[0], impl, phase, self._tail())
                    raise WorkerError(f"{payload[0]}\n--- in the worker ---\n{payload[1]}")
                if not self._process.is_alive():
                    return self._died()
                if time.monotonic() > deadline:
                    # the implementation that used most of the time, not the one that happened to run last
                    by_impl: dict[str, float] = {}
                    for (name, _), seconds in spent.items():
                        by_impl[name] = by_impl.get(name, 0.0) + seconds
                    impl = max(by_impl, key=by_impl.get)
                    phase = max((key for key in spent if key[0] == impl), key=spent.get)[1]
                    self._kill()
                    return Died(f"ran past its time limit of {time_limit:.0f} s", impl, phase, self._tail(),
                                timed_out=True)
        except BaseException:
            self._kill()
            raise

    def _unreadable(self, why: str) -> Died:
        impl, phase = self._where()
        self._kill()
        return Died(f"sent back a reply the harness does not read ({why}): the code under test tampered with the "
                    f"worker", impl, phase, self._tail())

    def _died(self) -> Died:
        self._process.join(timeout=5)
        code = self._process.exitcode
        impl, phase = self._where()
        what = (f"was killed by signal {_signal_name(-code)}" if code is not None and code < 0 else
                f"exited the process with code {code}")
        if code == -signal.SIGKILL:
            what += " (out of memory?)"
        self._kill()
        return Died(what, impl, phase, self._tail())

    def close(self) -> None:
        if self._conn is not None and self._process is not None and self._process.is_alive():
            try:
                self._conn.send(None)
                self._process.join(timeout=2)
            except (OSError, BrokenPipeError):
                pass
        self._kill()
        self._unlink_output()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

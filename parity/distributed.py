"""FP8 training under data parallelism, and spreading the test suite over several GPUs.

Distributed parity
------------------
An FP8 linear layer that is bitwise equal to torchao's on one process can still drift under
a data-parallel wrapper: DistributedDataParallel (DDP) all-reduces the gradients of whole
parameters; FSDP2 (`torch.distributed.fsdp.fully_shard`) keeps each parameter sharded,
all-gathers it before each layer's forward and reduce-scatters its gradient, and torchao can
all-gather the weights in FP8 (`Float8LinearConfig(enable_fsdp_float8_all_gather=True)`).

`run_distributed_parity` trains one small MLP several ways in ONE launch of `world_size`
processes (spawning a process that imports torch costs seconds, so each rank runs every
requested (mode, impl) pair in turn, each from the same initial weights and data), and
returns per step the loss and the full gradient of every parameter. `run_single_process`
trains the same model on the full batch in this process, and `compare_runs` turns two runs
into rows: per step and parameter, bitwise equality, max abs difference and SQNR.

An implementation is anything parity.impls.load_impl loads (a built-in, `module:attr` or
`file.py:attr`, in any of the three forms), or its description (parity.train_plan.RunImpl, made in
a worker by parity.train_worker.describe_impl: `check --distributed` never imports your code in the
process that judges); each rank loads it by name. A rank that dies without reporting (an exit at
import or in an exit hook, with any code, a crash in native code) or runs past the launch's time
limit is an error of the run it was in (each rank writes the run it is in to shared memory first), and
the cause where a peer reports the network error that death caused (PEER_DEATH_GRACE_S). Every
nn.Linear of the MLP is converted as `fp8-parity train` converts a model
(parity.impls.convert_linears). torchao's FP8 all-gather under FSDP2 is the built-in
parity.impls.FSDP_FLOAT8_ALL_GATHER.

Tensorwise scaling is per process: under data parallelism each rank scales its own shard of
the batch by that shard's amax, so a distributed run is NOT expected to be bitwise equal to
one process on the full batch, even before the all-reduce sums in another order.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from parity.impls import Impl, convert_linears, linear_names, load_impl, reload_here
from parity.metrics import sqnr_db
from parity.names import DISTRIBUTED_MODES
from parity.sharding import share_host_threads


MODES = DISTRIBUTED_MODES  # ddp, fsdp2 (in parity.names: the parser lists them)
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TrainSpec:
    """The model, data and optimizer every run of a comparison shares.

    dims: feature sizes of the MLP, Linear(dims[0], dims[1]), ReLU, Linear(dims[1], dims[2]), ...;
    all multiples of 16 (torch._scaled_mm). batch: rows of the full batch; each of the
    world_size ranks trains on batch // world_size consecutive rows, which must also be a
    multiple of 16 for the FP8 GEMMs. Weights and data are drawn from `seed` on the CPU, so
    every rank and every run starts from the same bits; the loss is the fp32 MSE to a
    random target, and the optimizer plain SGD (deterministic, no state).
    """

    dims: tuple[int, ...] = (64, 128, 96, 64)
    batch: int = 32
    steps: int = 3
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    lr: float = 0.1

    def __post_init__(self):
        if len(self.dims) < 2:
            raise ValueError(f"TrainSpec.dims needs at least two feature sizes (one Linear), got {self.dims}")
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"TrainSpec needs steps >= 1 and batch >= 1, got steps={self.steps}, batch={self.batch}")


@dataclass
class RunResult:
    """One training run: per step, the loss and the full gradient of every parameter.

    label is "mode/impl" ("ddp/fp8_impl", "single/fp8_impl"). losses[s] is the loss of step s
    averaged over ranks (the same float on every rank); grads[s] maps a parameter name
    ("0.weight") to its full gradient on the CPU, taken after backward and before the
    optimizer step. weight_tensor_type is the class of the first layer's weight as stored
    (shows whether torchao's FP8 all-gather weight wrapper is in place). error, when the run
    failed, says which rank raised what; losses and grads are then empty.
    """

    mode: str
    impl: str
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weight_tensor_type: str | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.impl}"


class DistributedRunError(RuntimeError):
    """A launch that could not finish: a worker died without reporting, or the launch timed out."""


# ---------------------------------------------------------------------------------------------
# Building and training (runs inside each worker, and in-process for the single-process run)
# ---------------------------------------------------------------------------------------------

def _check_alignment(model: nn.Module, impl: Impl) -> None:
    """ValueError naming each linear layer whose dims are not a multiple of the recipe's alignment."""
    alignment = impl.recipe.alignment
    bad = [f"layer {name!r}: {what} = {value} is not divisible by {alignment}"
           for name in linear_names(model)
           for what, value in (("in_features (K)", model.get_submodule(name).in_features),
                               ("out_features (N)", model.get_submodule(name).out_features))
           if value % alignment]
    if bad:
        raise ValueError(f"{'; '.join(bad)}: every FP8 GEMM dim of the {impl.recipe.name} recipe of {impl.name} "
                         f"must be (TrainSpec.dims: round them to multiples of {alignment})")


def build_model(spec: TrainSpec, impl: Impl | str, device: torch.device) -> nn.Sequential:
    """The spec's MLP with initial weights drawn from spec.seed, every nn.Linear converted by `impl`
    (an Impl, or a name parity.impls.load_impl loads)."""
    return _build(spec, load_impl(impl) if isinstance(impl, str) else impl, device)[0]


def _build(spec: TrainSpec, impl: Impl, device: torch.device
           ) -> tuple[nn.Sequential, dict[str, tuple[nn.Parameter, nn.Parameter | None]]]:
    """build_model's MLP and the (weight, bias) parameters of each converted layer, by layer name."""
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(spec.dims, spec.dims[1:]):
        if layers:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    model = nn.Sequential(*layers).to(device=device, dtype=spec.dtype)
    _check_alignment(model, impl)
    return model, convert_linears(model, impl)


def make_batch(spec: TrainSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch (input, target), drawn from spec.seed + 1 on the CPU: the same on every rank."""
    generator = torch.Generator().manual_seed(spec.seed + 1)
    inputs = torch.randn(spec.batch, spec.dims[0], generator=generator)
    target = torch.randn(spec.batch, spec.dims[-1], generator=generator)
    return inputs.to(device, spec.dtype), target.to(device, torch.float32)


def wrap(model: nn.Module, mode: str, device: torch.device, world_size: int, *,
         layers: Sequence[str] = ()) -> nn.Module:
    """The model as trained: itself ("single"), in DDP, or FSDP2 (each of the converted `layers`,
    named in the model, then the root)."""
    if mode == "single":
        return model
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (world_size,))
    for name in layers:
        fully_shard(model.get_submodule(name), mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full_gradient(param: nn.Parameter) -> torch.Tensor:
    """The parameter's whole gradient on the CPU; FSDP2's sharded DTensor is gathered (a collective)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        grad = grad.full_tensor()
    return grad.detach().to("cpu", copy=True)


def _gradient_names(model: nn.Module, layers: dict[str, tuple[nn.Parameter, nn.Parameter | None]]) -> dict[str, str]:
    """Each parameter's name in `model` -> the name its gradient is reported under: a converted layer's
    weight and bias as the nn.Linear's were ("0.weight", "0.bias"), whatever the implementation's
    module calls them (a function's wrapper holds them at "0.linear.weight"), so that runs of two
    implementations compare parameter by parameter; any other parameter under its own name. Taken
    before a wrapper: FSDP2 replaces the parameters and keeps their names."""
    linear = {id(weight): f"{layer}.weight" for layer, (weight, _) in layers.items()}
    linear.update({id(bias): f"{layer}.bias" for layer, (_, bias) in layers.items() if bias is not None})
    return {name: linear.get(id(param), name) for name, param in model.named_parameters()}


def train(spec: TrainSpec, mode: str, impl: Impl | str, *, device: torch.device, rank: int = 0,
          world_size: int = 1) -> RunResult:
    """Train spec.steps SGD steps on this rank's share of the batch (the rank-th of world_size chunks).

    Under "ddp" and "fsdp2" a process group must be initialized; every rank must call this
    with the same arguments (gradients and losses are gathered collectively).
    """
    impl = load_impl(impl) if isinstance(impl, str) else impl
    model, layers = _build(spec, impl, device)
    reported = _gradient_names(model, layers)
    first_weight = next(name for name, as_reported in reported.items() if as_reported == f"{next(iter(layers))}.weight")
    trained = wrap(model, mode, device, world_size, layers=list(layers))
    weight = model.get_parameter(first_weight)
    stored = weight.to_local() if isinstance(weight, DTensor) else weight
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    inputs, target = (t.chunk(world_size)[rank] for t in make_batch(spec, device))
    result = RunResult(mode, impl.name, weight_tensor_type=type(stored).__name__)
    for _ in range(spec.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(trained(inputs).float(), target)
        loss.backward()
        result.grads.append({reported[name]: _full_gradient(p) for name, p in model.named_parameters()})
        optimizer.step()
        loss = loss.detach()
        if world_size > 1:
            dist.all_reduce(loss)  # the shards are of equal size: the mean of the means is the mean
            loss /= world_size
        result.losses.append(loss.item())
    return result


def run_single_process(impl: Impl | str, spec: TrainSpec = TrainSpec(), *, device: str = "cpu") -> RunResult:
    """Train `impl` on the full batch in this process, with no wrapper: the data-parallel baseline."""
    return train(spec, "single", impl, device=torch.device(device))


# ---------------------------------------------------------------------------------------------
# Launching: one process per rank, results back through files, errors back through a queue
# ---------------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _describe(err: BaseException) -> str:
    """'ValueError: message (at file.py:123)': the exception and the innermost frame that raised it."""
    frames = traceback.extract_tb(err.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{at}"


@dataclass(frozen=True)
class _Launch:
    """What every worker needs: picklable, sent to each spawned process."""

    # (mode, Impl.reload_args): each rank loads the implementation itself, inside its error report
    runs: tuple[tuple[str, tuple], ...]
    spec: TrainSpec
    backend: str
    world_size: int
    device: str
    port: int
    timeout_s: float
    out_dir: str


def _worker(rank: int, launch: _Launch, messages, progress) -> None:
    """One rank: train every run in order; rank 0 saves each result to out_dir.

    Messages to the parent: ("error", rank, run_index or None, text) on the first
    exception, after which this rank stops (its peers may be blocked in a collective; the
    parent ends them); ("done", rank) when every run is finished. progress[rank] is the index
    of the run this rank is in (shared memory, written at once: a rank that dies without a
    message still says where). A result file exists only once complete (written aside, then
    renamed).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch.port))
    if launch.backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast: it can take a shared host's GPUs down
    run_index = None
    try:
        if launch.device == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            share_host_threads(launch.world_size)  # no oversubscription
            device = torch.device("cpu")
        dist.init_process_group(launch.backend, rank=rank, world_size=launch.world_size,
                                timeout=timedelta(seconds=launch.timeout_s))
        for run_index, (mode, impl_args) in enumerate(launch.runs):
            progress[rank] = run_index
            result = train(launch.spec, mode, reload_here(*impl_args), device=device, rank=rank,
                           world_size=launch.world_size)
            if rank == 0:
                path = Path(launch.out_dir, f"run{run_index}.pt")
                torch.save(vars(result), path.with_suffix(".partial"))
                os.replace(path.with_suffix(".partial"), path)  # the parent never reads half a file
        messages.put(("done", rank))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which decides
        messages.put(("error", rank, run_index, _describe(err)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_launch(runs, backend: str, world_size: int, device: str, spec: TrainSpec) -> tuple[tuple[str, Impl], ...]:
    """Clear errors for a launch that cannot work, before any process starts; the runs with each
    implementation loaded (parity.impls.ImplError, a ValueError, for a name that does not load)."""
    if not runs:
        raise ValueError("runs is empty: give (mode, impl) pairs, e.g. [('ddp', 'fp8_impl')]")
    loaded = []
    for mode, impl in runs:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)}")
        loaded.append((mode, load_impl(impl) if isinstance(impl, str) else impl))
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if world_size < 1 or spec.batch % world_size:
        raise ValueError(f"the batch of {spec.batch} rows does not split evenly over world_size={world_size} ranks")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (one GPU per rank), got {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("backend='nccl' needs device='cuda'; use backend='gloo' on the CPU")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"device='cuda' needs one GPU per rank: world_size={world_size}, "
                         f"but {torch.cuda.device_count()} GPU(s) are visible")
    return tuple(loaded)


class _Failure(NamedTuple):
    """The first exception a rank reported."""

    rank: int
    run_index: int | None  # None: the rank failed before its first run (process group setup)
    text: str


# A rank that dies takes the store or the collective its peers are in with it: they report a network
# error (DistNetworkError: connection reset) often before this process has seen the death. How long
# to wait, after the first report, for a peer's silent end (seen as soon as it is reaped: the death
# came first); a peer stuck in a collective is not waited out.
PEER_DEATH_GRACE_S = 3.0


def _silent_end(processes, rank: int, progress) -> _Failure:
    """The failure of a rank that ended without a message ("done" or "error"). DistributedRunError if it
    ended before its first run (process group setup, or a failed start)."""
    code = processes[rank].exitcode
    what = (f"was killed by signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
            else f"exited the process with code {code}")
    if progress[rank] >= 0:
        return _Failure(rank, progress[rank], f"{what} without reporting (an exit at import or in an "
                                              f"exit hook, a crash in native code, or killed)")
    raise DistributedRunError(f"rank {rank} {what} without reporting (killed, out of memory, crashed in "
                              f"native code, or failed to start: see its stderr)")


def _silently_ended(processes, heard: set[int]) -> list[int]:
    """Ranks that ended (any exit code, 0 included) without a message: ended by the code they ran."""
    return [rank for rank, process in enumerate(processes) if process.exitcode is not None and rank not in heard]


def _cause(first: _Failure, processes, messages, heard: set[int], progress) -> _Failure:
    """The failure to blame: a peer that ended silently within PEER_DEATH_GRACE_S of `first` (a rank's
    report is then what that death did to it), else `first`."""
    heard = heard | {first.rank}
    deadline = time.monotonic() + PEER_DEATH_GRACE_S
    while len(heard) < len(processes) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            while True:  # a rank's message is in the queue before it exits: read them before judging exits
                heard.add(messages.get(timeout=0.1)[1])
        silent = _silently_ended(processes, heard)
        if silent:
            return _silent_end(processes, silent[0], progress)
    return first


def _await_workers(processes, messages, world_size: int, deadline: float, progress,
                   timeout_s: float) -> _Failure | None:
    """Read messages until every rank is done (None) or one fails (its failure: an exception it
    reported, or, within a run, an exit without reporting or the time limit). DistributedRunError
    for a rank that died or hung before its first run (process group setup, or a failed start)."""
    done = set()
    while len(done) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            running = [rank for rank, p in enumerate(processes) if p.is_alive()]
            within = [rank for rank in running if progress[rank] >= 0]
            if within:
                return _Failure(within[0], progress[within[0]], f"ran past the launch's time limit of {timeout_s:g} s "
                                f"(a hang, or a slow machine: raise --timeout)")
            raise DistributedRunError(f"the launch did not finish within timeout_s; ranks {running} were still "
                                      f"running (a hang in a collective, or a slow machine: raise timeout_s)")
        try:
            message = messages.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            silent = _silently_ended(processes, done)
            if silent and messages.empty():
                return _silent_end(processes, silent[0], progress)
            continue
        if message[0] == "done":
            done.add(message[1])
        else:
            return _cause(_Failure(*message[1:]), processes, messages, done, progress)
    return None


def _stop(processes, *, graceful: bool) -> None:
    """Let finished workers exit (graceful), else terminate them: a failed rank's peers may be stuck."""
    for process in processes:
        process.join(timeout=10 if graceful else 0.1)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)


def run_distributed_parity(runs: Sequence[tuple[str, Impl | str]], spec: TrainSpec = TrainSpec(), *,
                           backend: str = "gloo", world_size: int = 2, device: str = "cpu",
                           timeout_s: float = 120.0) -> dict[tuple[str, str], RunResult]:
    """Train each (mode, impl) of `runs` on `world_size` spawned ranks; one launch for all of them.

    mode: "ddp" or "fsdp2". impl: an Impl, a name parity.impls.load_impl loads here ("fp8_impl",
    "torchao:tensorwise", parity.impls.FSDP_FLOAT8_ALL_GATHER, "path/to/file.py:attr", ...), or a
    description made in a worker (parity.train_plan.RunImpl: nothing is imported here), each in the
    form it is (function, module or converter). Every run starts from the same
    weights and batch (see TrainSpec). backend="gloo", device="cpu" runs anywhere (torch._scaled_mm is
    emulated on the CPU); backend="nccl", device="cuda" puts rank r on GPU r.

    Returns {(mode, impl name): RunResult}, in the order of `runs`. A run that raises on any rank
    gets a RunResult whose error names the rank and the exception; the other runs without a
    saved result say which run failed first (the launch stops at the first failure: the
    failed rank's peers may be stuck in a collective); so does a run in which a rank died without
    reporting or that ran past timeout_s (also the process group's timeout). Raises
    DistributedRunError if the launch itself fails before any run: a rank dies or hangs in its
    start. Every worker is ended before returning.
    """
    runs = _check_launch(runs, backend, world_size, device, spec)
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fp8-parity-dist-") as out_dir:
        launch = _Launch(tuple((mode, impl.reload_args) for mode, impl in runs), spec, backend, world_size, device,
                         free_port(), timeout_s, out_dir)
        messages = context.Queue()
        progress = context.Array("i", [-1] * world_size, lock=False)  # the run each rank is in
        processes = [context.Process(target=_worker, args=(rank, launch, messages, progress), daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        finished = False
        try:
            failure = _await_workers(processes, messages, world_size, time.monotonic() + timeout_s, progress,
                                     timeout_s)
            finished = failure is None
        finally:
            _stop(processes, graceful=finished)
            messages.close()
        return {(mode, impl.name): _collect(index, runs, out_dir, failure) for index, (mode, impl) in enumerate(runs)}


def _collect(index: int, runs: tuple[tuple[str, Impl], ...], out_dir: str, failure: _Failure | None) -> RunResult:
    """Run `index`'s result as rank 0 saved it, or the error that kept it from being saved."""
    mode, impl = runs[index]
    path = Path(out_dir, f"run{index}.pt")
    if path.exists():
        return RunResult(**torch.load(path, weights_only=True))
    if failure.run_index in (index, None):
        return RunResult(mode, impl.name, error=f"rank {failure.rank}: {failure.text}")
    failed_mode, failed_impl = runs[failure.run_index]
    failed = f"{failed_mode}/{failed_impl.name}"
    return RunResult(mode, impl.name, error=f"no result: rank {failure.rank} failed in {failed} first")


def compare_runs(a: RunResult, b: RunResult) -> list[dict]:
    """Rows comparing run `a` to run `b` (the reference): one per step and parameter.

    Columns: a, b (labels), step, param, bitwise (every gradient bit equal), max_abs_diff,
    sqnr_db (of a's gradient against b's; inf when equal), loss_a, loss_b, loss_diff (|a - b|,
    the same in every row of a step). If either run failed, one row with its error.
    """
    if a.error or b.error:
        return [dict(a=a.label, b=b.label, error=a.error or b.error)]
    if len(a.losses) != len(b.losses) or a.grads[0].keys() != b.grads[0].keys():
        raise ValueError(f"{a.label} and {b.label} are not comparable: {len(a.losses)} vs {len(b.losses)} steps, "
                         f"parameters {sorted(a.grads[0])} vs {sorted(b.grads[0])}")
    rows = []
    for step, (loss_a, loss_b, grads_a, grads_b) in enumerate(zip(a.losses, b.losses, a.grads, b.grads)):
        for name, grad_a in grads_a.items():
            grad_b = grads_b[name]
            rows.append(dict(
                a=a.label, b=b.label, step=step, param=name, bitwise=torch.equal(grad_a, grad_b),
                max_abs_diff=(grad_a.double() - grad_b.double()).abs().max().item(),
                sqnr_db=sqnr_db(grad_a, grad_b), loss_a=loss_a, loss_b=loss_b, loss_diff=abs(loss_a - loss_b),
            ))
    return rows

"""`fp8-parity check --distributed ddp|fsdp2 [--world-size N]`: an implementation trained under a
data-parallel wrapper, step by step, bitwise against its reference under the same wrapper.

Both run in ONE launch of N ranks (parity.distributed.run_distributed_parity: gloo on the CPU,
nccl on GPUs, one GPU a rank), each rank loading both implementations by name; every nn.Linear of
a small MLP is converted as `fp8-parity train` converts a model. This process never imports your
code: a worker reads the form and recipe of --impl and --against (parity.train_worker.describe_impl).
Each rank trains on 16 rows of the batch (the recipe's alignment where that is larger: an FP8 GEMM
dim). Exit 0 when every step's loss and every parameter's gradient are bitwise equal, 1 with the
first step and parameter that differ, or the candidate's exception, death (an exit at import or in
an exit hook, any code) or time-out, in a rank or in the worker that read it; 2 for bad usage, 125
when it cannot run here (no GPU per rank, no torch.distributed, the reference itself failing, or a
launch that died or ran out of time before its first run).
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist

from parity import cmd_inputs
from parity.distributed import DistributedRunError, RunResult, TrainSpec, compare_runs, run_distributed_parity
from parity.exits import EXIT_FAIL, EXIT_PASS, CannotRun, UsageError
from parity.impls import ImplError
from parity.recipes import DEFAULT_RECIPE
from parity.train_plan import RunImpl
from parity.train_worker import describe_impl
from parity.worker import Died, Worker
from parity.outputs import atomic_write_text

DEFAULT_WORLD_SIZE = 2
ROWS_PER_RANK = 16  # the smallest FP8 GEMM dim (torch._scaled_mm's multiple of 16)
# Loading an implementation in a worker to describe it: a floor for imports (torchao's alone is seconds;
# tens of seconds on a loaded two-core machine), as parity.train's BUILD_S.
DESCRIBE_S = 300.0
# check's flags that choose or judge cases, which a distributed check has none of
SEARCH_FLAGS = (("case", "--case"), ("case_file", "--case-file"), ("policy", "--policy"),
                ("no_oracle", "--no-oracle"))


def check_distributed(args) -> int:
    mode, world_size = _usage(args)
    device = cmd_inputs.device(args.device)
    cmd_inputs.writable_file(args.json, "--json")
    backend = _backend(device, world_size)
    candidate, reference, finding = _describe_both(args, device)
    if reference.name == candidate.name:
        raise UsageError(f"--against {reference.name} is --impl itself: name another implementation to compare "
                         f"with (or leave out --against for the recipe's reference)")
    spec = _spec(candidate, reference, world_size)
    where = f"{mode} on {world_size} {backend} rank(s) ({device})"
    if finding is not None:  # loading --impl ended its worker or raised: nothing is launched
        results = {(mode, candidate.name): RunResult(mode, candidate.name, error=finding),
                   (mode, reference.name): RunResult(mode, reference.name)}
    else:
        print(f"fp8-parity check --distributed: {candidate.name} against {reference.name} under {where}: MLP "
              f"{'-'.join(map(str, spec.dims))} in {str(spec.dtype).removeprefix('torch.')}, batch {spec.batch}, "
              f"{spec.steps} SGD steps", file=sys.stderr)
        timeout = {} if args.timeout is None else dict(timeout_s=args.timeout)
        try:
            results = run_distributed_parity([(mode, candidate), (mode, reference)], spec, backend=backend,
                                             world_size=world_size, device=device, **timeout)
        except DistributedRunError as err:
            raise CannotRun(f"the launch of {world_size} ranks failed: {err}") from None
    ran, against = results[mode, candidate.name], results[mode, reference.name]
    if against.error and not ran.error:
        raise CannotRun(f"the reference {reference.name} failed under {mode}: {against.error}")
    first = first_difference(ran, against)
    print(_headline(ran, against, first, where, spec))
    if args.json:
        atomic_write_text(args.json, json.dumps(_to_json(ran, against, first, spec, world_size, backend, device),
                                                indent=2) + "\n")
    return EXIT_PASS if first is None else EXIT_FAIL


def _describe_both(args, device: str) -> tuple[RunImpl, RunImpl, str | None]:
    """--impl and --against (default: the recipe's parity reference) described by a worker that loaded
    them: the ranks load your code, and this process never does. The third: what loading --impl did
    instead of loading (it ended the worker, raised, or changed torch's global state), or None."""
    limit = max(DESCRIBE_S, args.timeout or 0.0)
    with Worker("cpu") as worker:  # the form is read on the CPU; nothing runs on a device here
        reply = worker.call(describe_impl, args.impl, args.form, args.recipe, device, time_limit=limit)
        finding = _load_finding(args.impl, reply)
        if finding is not None:
            return RunImpl(args.impl, args.form or "", args.recipe or DEFAULT_RECIPE.name), \
                RunImpl(args.against or "its recipe's parity reference", "", DEFAULT_RECIPE.name), finding
        against = args.against or reply["default_against"]
        reference = worker.call(describe_impl, against, None, None, device, time_limit=limit)
        failed = _load_finding(against, reference)
        if failed is not None:
            raise CannotRun(f"the reference {against} failed to load: {failed}")
    return RunImpl.from_reply(reply), RunImpl.from_reply(reference), None


def _load_finding(spec: str, reply) -> str | None:
    """What describing `spec` found instead of a description: a death, an exception or a change of global
    state at import (None: it loaded). A usage error (a name or form that does not load) is raised."""
    if isinstance(reply, Died):
        printed = f" (its last output: {reply.output!r})" if reply.output else ""
        return f"{reply.what} while {reply.phase or 'importing the implementation'}{printed}"
    if "usage" in reply:
        raise ImplError(reply["usage"]["message"])
    if "crash" in reply:
        return f"raised while importing: {reply['crash']}"
    if reply.get("state_changes"):
        return f"changed global state while importing: {'; '.join(reply['state_changes'])} (restored)"
    return None


def _usage(args) -> tuple[str, int]:
    """(mode, world size), or UsageError for a flag that has no meaning here."""
    if args.distributed is None:
        raise UsageError(f"--world-size {args.world_size} sets the ranks of --distributed: add --distributed ddp "
                         f"or --distributed fsdp2")
    for attribute, flag in SEARCH_FLAGS:
        if getattr(args, attribute):
            raise UsageError(f"{flag} chooses or judges cases, and --distributed {args.distributed} trains one MLP "
                             f"bitwise: leave out {flag}")
    return args.distributed, args.world_size or DEFAULT_WORLD_SIZE


def _backend(device: str, world_size: int) -> str:
    """gloo on the CPU, nccl on GPUs; CannotRun without torch.distributed or one GPU per rank."""
    if not dist.is_available():
        raise CannotRun("this torch is built without torch.distributed")
    if device != "cuda":
        return "gloo"
    if torch.cuda.device_count() < world_size:
        raise CannotRun(f"--world-size {world_size} needs one GPU per rank, and {torch.cuda.device_count()} are "
                        f"visible (--device cpu runs gloo ranks on the CPU)")
    return "nccl"


def _spec(candidate: RunImpl, reference: RunImpl, world_size: int) -> TrainSpec:
    """parity.distributed's MLP, every dim (and each rank's rows) a multiple of both recipes' alignment."""
    alignment = max(candidate.recipe.alignment, reference.recipe.alignment, ROWS_PER_RANK)
    default = TrainSpec()
    dims = default.dims if all(d % alignment == 0 for d in default.dims) else (alignment, 2 * alignment, alignment)
    return TrainSpec(dims=dims, batch=alignment * world_size)


def first_difference(ran: RunResult, against: RunResult) -> dict | None:
    """The first step whose loss or a parameter's gradient differs (the loss first: it is computed
    before the gradients), with how many differ in all; None when every one is bitwise equal. The
    candidate's exception is a difference."""
    if ran.error:
        return dict(step=None, error=ran.error)
    rows = compare_runs(ran, against)
    differing = [row for row in rows if not row["bitwise"] or row["loss_diff"] != 0]
    if not differing:
        return None
    row = differing[0]
    first = dict(step=row["step"], loss_a=row["loss_a"], loss_b=row["loss_b"],
                 gradients_differing=sum(not r["bitwise"] for r in rows), gradients=len(rows))
    if row["loss_diff"] != 0:
        return dict(first, what="loss")
    return dict(first, what="gradient", param=row["param"], max_abs_diff=row["max_abs_diff"],
                sqnr_db=None if math.isinf(row["sqnr_db"]) else row["sqnr_db"])


def _headline(ran: RunResult, against: RunResult, first: dict | None, where: str, spec: TrainSpec) -> str:
    if first is None:
        return (f"PASS: {ran.impl} is bitwise equal to {against.impl} under {where}: the loss and every "
                f"parameter's gradient at all {spec.steps} steps")
    if first["step"] is None:
        return f"FAIL: {ran.impl} failed under {where}: {first['error']}"
    if first["what"] == "loss":
        what = f"the loss ({first['loss_a']!r} vs {first['loss_b']!r})"
    else:
        sqnr = "" if first["sqnr_db"] is None else f", SQNR {first['sqnr_db']:.1f} dB"
        what = f"the gradient of {first['param']} (max abs diff {first['max_abs_diff']:.3g}{sqnr})"
    return (f"FAIL: {ran.impl} differs from {against.impl} under {where}: first at step {first['step']}, {what}; "
            f"{first['gradients_differing']} of {first['gradients']} (step, parameter) gradients differ")


def _to_json(ran: RunResult, against: RunResult, first: dict | None, spec: TrainSpec, world_size: int,
             backend: str, device: str) -> dict:
    return dict(verdict="pass" if first is None else "fail", mode=ran.mode, impl=ran.impl, against=against.impl,
                world_size=world_size, backend=backend, device=device,
                spec=dict(dims=list(spec.dims), batch=spec.batch, steps=spec.steps, dtype=str(spec.dtype),
                          lr=spec.lr, seed=spec.seed),
                first_difference=first, losses=dict(impl=ran.losses, against=against.losses))

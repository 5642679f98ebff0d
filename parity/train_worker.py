"""What one run of `fp8-parity train` does in its worker process (parity.worker): the functions
parity.train calls there through Worker.call, one worker per run.

The code under test (an implementation that is not a built-in, a `--model` factory) is imported and
run only here, never in the process that judges: a run that exits the process (posix._exit
included), hangs, or registers an exit hook cannot end the command or turn its exit code into a
pass. Each function answers in plain data only (tensors, dicts, lists, str, int, float, bool,
None), which the parent reads without running any code of the worker's; the parent compares,
judges and writes every file.

What comes back of a micro-batch:
- per converted layer, a fingerprint of each GEMM's result (fingerprint below): a hash of every
  bit of the tensor, and its dtype and shape. The parent compares the
  candidate's with the against run's. Sending the tensors themselves costs what the GEMMs produce:
  about 6 GB per run and step of the d12 model. Where two fingerprints differ, the parent asks for
  the call's tensors (call_tensors) and compares them bit for bit itself before it reports a
  divergence; the case file is written from them.
- at a sampled step, the numerics of each GEMM (parity.train_numerics: SQNR against a float64 GEMM
  on the run's own operands, amax, underflow and saturation): statistics of the run's tensors,
  computed here because the operands of every layer of a sampled d12 step are gigabytes. They
  describe the run and decide nothing: the verdict reads the bitwise comparison and the losses.
- the changes the call made to torch's global state (parity.sandbox.GlobalState: a default dtype
  set, the global generator reseeded, torch._scaled_mm replaced...), undone here and a finding there.
- an exception of the code under test as text ("crash"), or a usage error the harness found
  ("usage": the model's forward returned no logits, a dim the recipe cannot take).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import traceback
from pathlib import Path

import torch

from parity.impls import Impl, ImplError, default_reference, load_impl
from parity.model import UserModelShape, is_model_factory
from parity.model_configs import ModelError
from parity.sandbox import GlobalState, exits_raise
from parity.train_numerics import gemm_numerics
from parity.train_plan import TrainError
from parity.train_probes import Call
from parity.train_run import Run, build_run, finish_step, forward_backward, initial_model
from parity.worker import report_phase, torch_device_type

_RUN: Run | None = None  # this worker's run (one per worker process)
_DEVICE = "cpu"
# The candidate's operands of the call before the current one (input, weight, grad_output per layer),
# kept while no divergence is found: a case file holds the diverging call and the one before it.
_PREVIOUS: dict[str, dict[str, torch.Tensor]] = {}


# ---- fingerprints ----------------------------------------------------------------------------------------

# A hash of the tensor's 16-bit words w_i (bytes for 1-byte dtypes), chunk by chunk: sum_i w_i * m(i) modulo
# 2^64 over a chunk, m(i) odd and mixed from the index i within the chunk (a multiply and xor-shift scramble,
# as splitmix64's), in int64 arithmetic, which wraps; the chunks' sums combined with an odd multiplier mixed
# from the chunk's index. A sum modulo 2^64 does not depend on the order a device adds in. One word that
# differs always changes it (w * m is 0 modulo 2^64 only for w = 0, m being odd); differences in several words
# leave it unchanged with a probability of about 2^-64 unless built to. The multipliers m are computed once per
# device and kept, so a chunk costs three passes over it (widen, multiply, sum): on the 2-core CPU about 1 ms
# for a 256 x 256 bf16 tensor.
_MIX = (-7046029254386353131, -4658895280553007687)  # 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9 as int64
_CHUNK = 1 << 24  # words per chunk: bounds the int64 temporaries (128 MiB each)
_MULTIPLIERS: dict[torch.device, torch.Tensor] = {}
# Bound now, before any code under test runs in this process: a replaced torch.sum does not reach them.
_arange, _sum = torch.arange, torch.sum


def _mixed(index: torch.Tensor) -> torch.Tensor:
    """An odd int64 scrambled from each index (wrapping int64 arithmetic)."""
    mixed = index * _MIX[0]
    mixed = (mixed ^ (mixed >> 29)) * _MIX[1]
    return (mixed ^ (mixed >> 32)) | 1


def _multipliers(count: int, device: torch.device) -> torch.Tensor:
    """m(1), ..., m(count) on `device`, computed once (grown to the largest count asked)."""
    kept = _MULTIPLIERS.get(device)
    if kept is None or kept.numel() < count:
        kept = _MULTIPLIERS[device] = _mixed(_arange(1, count + 1, device=device, dtype=torch.int64))
    return kept[:count]


def _wrap(value: int) -> int:
    """`value` modulo 2^64, as a signed int64 (how the device's sums wrap)."""
    return (value + 2**63) % 2**64 - 2**63


def fingerprint(tensor: torch.Tensor | None) -> list | None:
    """[dtype, shape, hash] of every bit of `tensor` (None for None)."""
    if tensor is None:
        return None
    flat = tensor.detach().contiguous().reshape(-1)
    words = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    total = 0
    for number, start in enumerate(range(0, words.numel(), _CHUNK)):
        chunk = words[start:start + _CHUNK].to(torch.int64)
        chunk_hash = int(_sum(chunk * _multipliers(chunk.numel(), chunk.device)).item())
        total = _wrap(total + chunk_hash * int(_mixed(torch.tensor(number + 1, dtype=torch.int64))))
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), total]


def _plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor` as a plain torch.Tensor on the CPU, its values, dtype, shape and strides kept (a tensor
    subclass is copied out through its own copy_)."""
    if tensor is None:
        return None
    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor:
        tensor = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                     device=tensor.device).copy_(tensor)
    return tensor.cpu()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's and buffer's name, dtype, shape and bits: initial weights that two
    runs of one seed must share."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---- replies -----------------------------------------------------------------------------------------------

HARNESS, TORCH = str(Path(__file__).resolve().parent), str(Path(torch.__file__).resolve().parent)


def _where(err: BaseException) -> str:
    """'ValueError: message (at file.py:123)': the exception (its first line: a finding is one line) and the
    innermost frame of the code under test's own (outside the harness and torch; the innermost frame when
    none is: the harness or torch raised)."""
    every = traceback.extract_tb(err.__traceback__)
    frames = [frame for frame in every if not frame.filename.startswith((HARNESS, TORCH))] or every
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}{at}"


def _usage(err: Exception) -> dict:
    """A reply that the run cannot go as asked: the parent raises it again as a usage error (exit 2)."""
    kind = "impl" if isinstance(err, ImplError) else "model" if isinstance(err, ModelError) else "train"
    return dict(usage=dict(kind=kind, message=str(err)))


def _description(impl: Impl, device_type: str) -> dict:
    """What the parent knows of an implementation (parity.train_plan.RunImpl): its name, form, recipe,
    whether it is an exact emulation or the Hopper bit model, and its recipe's parity reference on
    `device_type` (what --against defaults to)."""
    return dict(name=impl.name, form=impl.form.value, recipe=impl.recipe.name, exact=impl.exact,
                bit_model=impl.bit_model, default_against=default_reference(impl, device_type).name)


def describe_impl(spec: str, form: str | None, recipe: str | None, device_type: str) -> dict:
    """The implementation `spec` loaded here (its module imported here, never in the parent), described
    (_description); a usage error for a name or form that does not load."""
    state = GlobalState.capture()
    report_phase(spec, "importing the implementation")
    try:
        description = _description(load_impl(spec, form=form, recipe=recipe), device_type)
    except ImplError as err:
        return _usage(err)
    except BaseException as err:  # noqa: BLE001 - whatever the import did is a finding of the implementation
        return dict(crash=_where(err), state_changes=state.changes_since())
    return dict(description, state_changes=state.changes_since())


def start_run(setup: dict) -> dict:
    """Build this worker's run: the model of `setup["model"]` from `setup["seed"]` (your factory runs
    here), then the implementation `setup["impl"]` = (name, form, recipe) loaded and every linear
    converted. Answers the layers, the data shape of a --model factory, a digest of its initial weights
    and the multiply-adds of the linears per token."""
    global _RUN, _DEVICE
    name, form, recipe = setup["impl"]
    model_name = setup["model"]
    report_phase(name, f"building the model {model_name}" + (" (the --model factory)"
                                                            if is_model_factory(model_name) else ""))
    try:
        with exits_raise():
            model, shape = initial_model(model_name, setup["seed"])
    except (ModelError, TrainError) as err:
        return _usage(err)
    except BaseException as err:  # noqa: BLE001 - a factory that exits or raises past build_user_model
        return _usage(ModelError(f"--model {model_name!r}: calling the factory raised {_where(err)}; it must return "
                                 f"the model"))
    try:
        digest = weights_digest(model) if is_model_factory(model_name) else None
    except Exception as err:  # noqa: BLE001 - parameters of your model's that cannot be read as bytes
        return _usage(ModelError(f"--model {model_name!r}: its initial weights cannot be read: {_where(err)}"))
    state = GlobalState.capture()
    report_phase(name, "loading the implementation")
    try:
        impl = load_impl(name, form=form, recipe=recipe)
        description = _description(impl, torch_device_type(setup["device"]))
    except ImplError as err:  # a name or a form that does not load (an import that exits says so)
        return _usage(err)
    except BaseException as err:  # noqa: BLE001 - past load_impl's own handling: the implementation's
        return dict(crash=f"loading the implementation: {_where(err)}", state_changes=state.changes_since())
    report_phase(name, "converting the model")
    try:
        with exits_raise():
            run = build_run(setup["role"], impl, model, shape, seed=setup["seed"], device=setup["device"],
                            checkpoint=setup["checkpoint"], learning_rate=setup["learning_rate"])
    except (ModelError, TrainError) as err:  # a dim the recipe cannot take
        return _usage(err)
    except BaseException as err:  # noqa: BLE001 - the implementation's converter or from_float raised
        return dict(crash=f"converting the model: {_where(err)}", state_changes=state.changes_since())
    _RUN, _DEVICE = run, setup["device"]
    _PREVIOUS.clear()
    return dict(impl=description, layers=list(run.probes), digest=digest,
                shape=dataclasses.asdict(shape) if isinstance(shape, UserModelShape) else None,
                matmul_params=sum(probe.weight_param.numel() for probe in run.probes.values()),
                state_changes=state.changes_since())


def _keep_previous(*, copy: bool) -> None:
    """The operands of the probes' current calls, as the call before the next one (`copy` the weights
    before an optimizer step changes them)."""
    _PREVIOUS.clear()
    _PREVIOUS.update({name: probe.operands(copy=copy) for name, probe in _RUN.probes.items()
                      if probe.call is not None and probe.call.grad_output is not None})


def micro_batch(tokens: torch.Tensor, *, where: str, loss_scale: float, first_micro: bool,
                keep_previous: bool) -> dict:
    """Forward and backward of one micro-batch (gradients add up until finish): the code under test runs.
    `where`: "step 3" or "step 3, micro-batch 1", for the phase a death is reported in. Answers the loss,
    the layers' forward order and the global state changed."""
    run = _RUN
    if keep_previous and not first_micro:  # the step's previous micro-batch; its weights are this one's
        _keep_previous(copy=False)
    tokens = tokens.to(_DEVICE)
    state = GlobalState.capture()
    try:
        with exits_raise():
            forward_backward(run, tokens, loss_scale=loss_scale, device=_DEVICE,
                             phase=lambda phase: report_phase(run.impl.name, f"{where}: {phase}"))
    except TrainError as err:
        return _usage(err)
    except BaseException as err:  # noqa: BLE001 - an implementation that raises or exits is a finding
        return dict(crash=_where(err), state_changes=state.changes_since())
    return dict(loss=run.micro_losses[-1], order=list(run.state.order), state_changes=state.changes_since())


def measure(*, where: str, results: bool, recompute: bool, sampled: bool) -> dict:
    """What the harness reads of the micro-batch just run (no code under test runs here; parity.train
    gives it a time limit of its own): the fingerprints of every GEMM's result (`results`), of each
    output and its checkpoint recompute (`recompute`), and the numerics of a sampled step (`sampled`)."""
    run = _RUN
    report_phase(run.impl.name, f"{where}: the harness's fingerprints and numerics")
    try:
        return _measured(run, results=results, recompute=recompute, sampled=sampled)
    except BaseException as err:  # noqa: BLE001 - tensors the code under test made that cannot be read
        return dict(crash=f"its tensors could not be read: {_where(err)}")


def _measured(run: Run, *, results: bool, recompute: bool, sampled: bool) -> dict:
    reply = {}
    if results:
        reply["results"] = {name: [fingerprint(t) for t in probe.results().values()]
                            for name, probe in run.probes.items()}
    if recompute:
        reply["recompute"] = {name: None if probe.call is None or probe.call.recomputed_output is None else
                              [fingerprint(probe.call.output), fingerprint(probe.call.recomputed_output)]
                              for name, probe in run.probes.items()}
    if sampled:
        start = time.perf_counter()
        reply["numerics"] = {name: gemm_numerics(probe, run.impl.recipe) for name, probe in run.probes.items()}
        reply["numerics_s"] = time.perf_counter() - start
    return reply


def call_tensors(layer: str) -> dict:
    """The current call of `layer` as tensors: what its three GEMMs gave and consumed (parity.train_probes.
    Call's fields, and the weight), and the operands of the call before it (None when none is kept)."""
    probe = _RUN.probes[layer]
    if probe.call is None:
        return dict(call=None, previous=None)
    try:
        call = {field.name: _plain(getattr(probe.call, field.name)) for field in dataclasses.fields(Call)}
        previous = _PREVIOUS.get(layer)
        return dict(call=dict(call, weight=_plain(probe.weight_param)),
                    previous=None if previous is None else {name: _plain(t) for name, t in previous.items()})
    except BaseException as err:  # noqa: BLE001 - tensors the code under test made that cannot be read
        return dict(crash=f"its tensors could not be read: {_where(err)}")


def finish(*, where: str, keep_previous: bool) -> dict:
    """The step's optimizer step. Answers the step's loss (mean over its micro-batches), the gradient
    norm, and the global state changed."""
    run = _RUN
    if keep_previous:  # the step's last call, its weights copied before the optimizer changes them
        _keep_previous(copy=True)
    state = GlobalState.capture()
    report_phase(run.impl.name, f"{where}: optimizer step")
    try:
        with exits_raise():
            finish_step(run)
    except BaseException as err:  # noqa: BLE001 - a hook of the implementation's that raises
        return dict(crash=_where(err), state_changes=state.changes_since())
    return dict(loss=run.loss, grad_norm=run.grad_norm, state_changes=state.changes_since())

"""Turning a case into tensors: distributions (the values) and layouts (the strides).

Values are drawn on the CPU from a generator seeded by the case, so a case id gives the
same numbers on every machine and device (a GPU failure reproduces on a laptop). Each
implementation then gets its own fresh copies in the case's memory layouts.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parity.cases import DTYPES, INPUT_DTYPES, WEIGHT_DTYPES, Case, CaseError, Dist, Layout, SavedCase
from parity.folder_manifest import write_files

NEAR_MAX = 448.0  # e4m3fn max: "near max" data sits at the top of the fp8 range
LAYOUT_PAD = 16  # padded rows: row stride = row length + 16 elements


@dataclass
class StepData:
    """The logical (contiguous) tensors of one call."""

    input: torch.Tensor  # [*lead, K], input dtype
    weight: torch.Tensor  # [N, K], weight dtype: the weight's value during this call
    grad_output: torch.Tensor  # [*lead, N], output dtype (= input dtype)


@dataclass
class CaseData:
    case: Case
    steps: list[StepData]
    bias: torch.Tensor | None  # [N], weight dtype
    host: "CaseData | None" = None  # the same tensors on the CPU (None when these are the CPU's)
    # The exact emulation of every step per recipe name (parity.runner.emulated_steps_of), computed
    # once per case and place however many implementations are compared against it.
    emulated: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.steps[0].input.device

    def on_host(self) -> "CaseData":
        return self if self.host is None else self.host


def sample(dist: Dist, shape: tuple[int, ...], generator: torch.Generator, *, outlier_ratio: int = 100) -> torch.Tensor:
    """float32 values of `dist`, on the CPU."""
    g = generator
    if dist is Dist.NORMAL:
        return torch.randn(shape, generator=g)
    if dist is Dist.UNIFORM:
        return (torch.rand(shape, generator=g) * 2 - 1) * math.sqrt(3.0)
    if dist is Dist.HEAVY:  # Student-t, 3 dof: normal / sqrt(chi2_3 / 3)
        z = torch.randn(shape, generator=g)
        chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0)
        return z / (chi2 / 3).sqrt().clamp(min=1e-3)
    if dist is Dist.OUTLIER:
        x = torch.randn(shape, generator=g)
        channel = int(torch.randint(shape[-1], (1,), generator=g))
        x[..., channel] *= outlier_ratio
        return x
    if dist is Dist.ZEROS:
        return torch.zeros(shape)
    if dist is Dist.NEAR_MAX:
        sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
        x = sign * (0.9 + 0.1 * torch.rand(shape, generator=g)) * NEAR_MAX
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = NEAR_MAX  # amax exactly at the fp8 max
        return x
    if dist is Dist.TINY:
        sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
        return sign * torch.exp2(-30 + 20 * torch.rand(shape, generator=g))
    if dist is Dist.ZERO_ROWS:
        x = torch.randn(shape, generator=g)
        x[..., torch.randperm(shape[-2], generator=g)[: max(1, shape[-2] // 4)], :] = 0
        x[..., torch.randperm(shape[-1], generator=g)[: max(1, shape[-1] // 4)]] = 0
        return x
    if dist is Dist.OUTLIER_ROW:
        x = torch.randn(shape, generator=g)
        x.reshape(-1, shape[-1])[int(torch.randint(math.prod(shape[:-1]), (1,), generator=g))] *= 1e4
        return x
    if dist is Dist.TINY_AMAX:
        return torch.randn(shape, generator=g) * 1e-30
    if dist is Dist.SMALL_AMAX:
        return torch.randn(shape, generator=g) * 2.0 ** -16
    if dist is Dist.LARGE:
        return torch.randn(shape, generator=g) * 1000.0
    if dist is Dist.NAN:
        x = torch.randn(shape, generator=g)
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] = math.nan
        return x
    if dist is Dist.NEGATIVE:
        x = -torch.randn(shape, generator=g).abs()
        flip = torch.rand(shape, generator=g) < 0.05
        return torch.where(flip, -x * 0.5, x)
    raise ValueError(f"unknown distribution {dist!r}")


def make_data(case: Case, device: torch.device | str = "cpu") -> CaseData:
    """The tensors of every call of `case`, on `device` (with their CPU twin in `.host`): drawn from
    the case's distribution and seed, or, for a SavedCase, read from its case file."""
    if isinstance(case, SavedCase):
        steps, bias = _saved_steps(case)
    else:
        steps, bias = _drawn_steps(case)
    host = CaseData(case=case, steps=steps, bias=bias)
    if torch.device(device).type == "cpu":
        return host
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return CaseData(case, [StepData(move(s.input), move(s.weight), move(s.grad_output)) for s in steps],
                    move(host.bias), host=host)


def _drawn_steps(case: Case) -> tuple[list[StepData], torch.Tensor | None]:
    g = torch.Generator().manual_seed(case.seed)
    draw = lambda shape: sample(case.dist, shape, g, outlier_ratio=case.outlier_ratio)  # noqa: E731
    # Outlier channels are an activation phenomenon (LLM hidden states): weights and gradients
    # stay normal. With outliers in both operands of grad_weight, tensorwise FP8 loses all
    # accuracy in the one huge, cancelling product term, which says nothing about the code.
    # The same holds for a single huge token (outlier_row) and for a tiny activation amax.
    activation_only = (Dist.OUTLIER, Dist.OUTLIER_ROW, Dist.TINY_AMAX, Dist.SMALL_AMAX, Dist.LARGE, Dist.NAN)
    draw_param = (lambda shape: sample(Dist.NORMAL, shape, g)) if case.dist in activation_only else draw  # noqa: E731
    in_dtype, w_dtype = case.torch_input_dtype, case.torch_weight_dtype
    weight = draw_param((case.N, case.K))
    bias = torch.randn(case.N, generator=g) * 0.1 if case.bias else None
    steps = []
    for step in range(case.steps):
        if step:  # an in-place update between calls, like an optimizer step
            weight = weight * -0.5 + draw_param((case.N, case.K))
        steps.append(StepData(input=draw(case.input_shape).to(in_dtype), weight=weight.to(w_dtype),
                              grad_output=draw_param(case.output_shape).to(in_dtype)))
    return steps, None if bias is None else bias.to(w_dtype)


# ---- case files ----------------------------------------------------------------------------------
#
# A case file is torch.save of a dict (read back with torch.load(path, weights_only=True)):
#
#   format       CASE_FILE_FORMAT
#   steps        a list of {"input": [*lead, K], "weight": [N, K], "grad_output": [*lead, N]}: the
#                layer's operands of consecutive calls, as the model held them (dtypes and strides
#                kept), the call to judge last; the calls before it give state kept across calls
#                (a weight cache) the chance to go stale, as the optimizer step did in training
#   bias         [N] or None
#   meta         {"layer", "gemm", "step" (the training step of the last call), "steps" (of each
#                call), "impl", "against", "recipe", "model", "tensors" (dtype, shape, stride of
#                each saved tensor, as text)}: where the tensors come from; not read back

CASE_FILE_FORMAT = "fp8-parity case file v1"


def write_case_file(path: str | Path, steps: list[dict[str, torch.Tensor]], *, bias: torch.Tensor | None = None,
                    meta: dict | None = None) -> Path:
    """Save a layer's operands of consecutive calls as a case file (format above); the path written."""
    saved = [{name: step[name].detach().cpu().clone() for name in ("input", "weight", "grad_output")}
             for step in steps]
    described = [{name: dict(dtype=str(t.dtype).replace("torch.", ""), shape=list(t.shape), stride=list(t.stride()))
                  for name, t in step.items()} for step in saved]
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(dict(format=CASE_FILE_FORMAT, steps=saved, bias=None if bias is None else bias.detach().cpu().clone(),
                    meta=dict(meta or {}, tensors=described)), buffer)
    return write_files(path.parent, {path.name: buffer.getvalue()})[0]  # whole, and listed as fp8-parity's


@functools.lru_cache(maxsize=8)
def read_case_file(path: str) -> dict:
    """The case file's dict (format above), validated; CaseError saying what is wrong with it."""
    file = Path(path)
    if not file.is_file():
        raise CaseError(f"case file {path} does not exist (`fp8-parity train` writes one where two runs diverge)")
    try:
        saved = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported the same way
        raise CaseError(f"case file {path} cannot be read by torch.load: {type(err).__name__}: {err}") from None
    if not isinstance(saved, dict) or saved.get("format") != CASE_FILE_FORMAT:
        raise CaseError(f"{path} is not a case file ({CASE_FILE_FORMAT!r} expected in its 'format' entry)")
    steps = saved.get("steps")
    names = ("input", "weight", "grad_output")
    if not steps or not all(isinstance(s, dict) and all(isinstance(s.get(n), torch.Tensor) for n in names)
                            for s in steps):
        raise CaseError(f"case file {path}: 'steps' must be a non-empty list of dicts of tensors {names}")
    first = steps[0]
    for index, step in enumerate(steps):
        shapes = {n: tuple(step[n].shape) for n in names}
        if (step["input"].dim() < 2 or shapes["weight"][1:] != shapes["input"][-1:]
                or shapes["grad_output"] != (*shapes["input"][:-1], shapes["weight"][0])
                or any(step[n].shape != first[n].shape or step[n].dtype != first[n].dtype for n in names)):
            raise CaseError(f"case file {path}: step {index} has shapes {shapes}: expected input [*lead, K], weight "
                            f"[N, K], grad_output [*lead, N], the same in every step")
    return saved


def _layout_of(t: torch.Tensor) -> Layout:
    """The harness's name for how `t` sits in memory (its last two dims): contiguous, or stored transposed;
    any other strides are read as contiguous (the values are what a case file keeps)."""
    if t.is_contiguous():
        return Layout.CONTIGUOUS
    return Layout.TRANSPOSED if t.transpose(-1, -2).is_contiguous() else Layout.CONTIGUOUS


def saved_case(path: str | Path) -> SavedCase:
    """The case of a case file: its dims, dtypes, layouts and number of calls."""
    path = str(Path(path).expanduser().resolve())
    saved = read_case_file(path)
    step = saved["steps"][0]
    names = {dtype: name for name, dtype in DTYPES.items()}
    input_dtype, weight_dtype = names.get(step["input"].dtype), names.get(step["weight"].dtype)
    if input_dtype not in INPUT_DTYPES or weight_dtype not in (*WEIGHT_DTYPES, "fp16"):
        raise CaseError(f"case file {path}: input {step['input'].dtype} and weight {step['weight'].dtype}: a case "
                        f"takes inputs of {INPUT_DTYPES} and weights of {WEIGHT_DTYPES + ('fp16',)}")
    return SavedCase(lead=tuple(step["input"].shape[:-1]), K=step["input"].shape[-1], N=step["weight"].shape[0],
                     input_dtype=input_dtype, weight_dtype=weight_dtype, bias=saved.get("bias") is not None,
                     input_layout=_layout_of(step["input"]), weight_layout=_layout_of(step["weight"]),
                     grad_output_layout=_layout_of(step["grad_output"]), steps=len(saved["steps"]), path=path)


def _fitted(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`t` as [rows, cols]: its leading dims flattened, then cropped or zero-padded."""
    flat = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
    out = torch.zeros(rows, cols, dtype=t.dtype)
    r, c = min(rows, flat.shape[0]), min(cols, flat.shape[1])
    out[:r, :c] = flat[:r, :c]
    return out


def _saved_steps(case: SavedCase) -> tuple[list[StepData], torch.Tensor | None]:
    """The saved calls, fitted to `case` (see SavedCase): the last case.steps of them (a case asking for
    more repeats them in order), cast to the case's dtypes, cropped or zero-padded to its dims."""
    saved = read_case_file(case.path)
    calls = saved["steps"][-case.steps:] if case.steps <= len(saved["steps"]) else [
        saved["steps"][i % len(saved["steps"])] for i in range(case.steps)]
    in_dtype, w_dtype = case.torch_input_dtype, case.torch_weight_dtype
    steps = [StepData(input=_fitted(c["input"], case.M, case.K).reshape(case.input_shape).to(in_dtype),
                      weight=_fitted(c["weight"], case.N, case.K).to(w_dtype),
                      grad_output=_fitted(c["grad_output"], case.M, case.N).reshape(case.output_shape).to(in_dtype))
             for c in calls]
    bias = saved.get("bias")
    if case.bias:
        bias = (_fitted(bias, 1, case.N)[0] if bias is not None else torch.zeros(case.N)).to(w_dtype)
    return steps, bias if case.bias else None


def materialize(values: torch.Tensor, layout: Layout, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh tensor equal to `values` (cast to `dtype`) stored in `layout`.

    Gaps of non-dense layouts hold NaN, so a kernel that reads memory outside the view
    shows up as NaN in its result instead of passing by luck.
    """
    values = values.to(dtype) if dtype is not None and values.dtype != dtype else values
    layout = Layout(layout)
    if layout is Layout.CONTIGUOUS:
        return values.clone(memory_format=torch.contiguous_format)
    if values.dim() < 2:
        raise ValueError(f"layout {layout.value} needs a tensor of at least 2 dims, got shape {tuple(values.shape)}")
    if layout is Layout.TRANSPOSED:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    *outer, cols = values.shape
    if layout is Layout.SLICED:
        buffer = torch.full((*outer, 2 * cols), float("nan"), dtype=values.dtype, device=values.device)
        view = buffer[..., ::2]
    else:  # PADDED
        buffer = torch.full((*outer, cols + LAYOUT_PAD), float("nan"), dtype=values.dtype, device=values.device)
        view = buffer[..., :cols]
    view.copy_(values)
    return view

"""What `fp8-parity train` runs and what it produced: TrainPlan (validated when made), the first
Divergence, and TrainResult; parity.train runs a plan, parity.train_report renders its result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from parity.model import GPTConfig, MarkovSource, ModelError, TokenFile, get_model_config, is_model_factory
from parity.names import DEFAULT_BASELINE, FACTORY_PROTOCOL, LEARNING_RATE  # (the parser shows them without torch)
from parity.recipes import Recipe, get_recipe

if TYPE_CHECKING:  # the report's modules import matplotlib and hypothesis: seconds a run's worker need not pay
    from parity.report_verdict import Verdict

# DeepSeek-V3 (arXiv 2412.19437, section 3.3): FP8 training's relative loss error against BF16
# "consistently remains below 0.25%". A reference line, drawn in the report and used as the floor
# of the allowed gap: below it a gap passes even when the seed-to-seed noise happens to be smaller.
DEEPSEEK_RELATIVE_LOSS_GAP = 0.0025
ROLES = ("candidate", "against", "baseline", "baseline_seed")



class TrainError(ValueError):
    """A training comparison that cannot run as asked; the message says what and how to fix it."""


@dataclass(frozen=True)
class TrainPlan:
    """What `fp8-parity train` runs. `window`: steps at the end whose mean loss is judged (default:
    the last fifth, at least one: long enough to average out batch-to-batch noise, short enough to
    be the end of training). `sample_every`: the steps whose numerics are computed (and the last).
    `model`: a built-in name or `path.py:factory`; `lr`: None for the model's own; `grad_accum`:
    micro-batches a step; `checkpoint`: torch.utils.checkpoint around each block of the built-in
    GPT; `data`: a token or text file instead of the synthetic source."""

    impl: str
    against: str | None = None  # None: the candidate recipe's parity reference
    baseline: str = DEFAULT_BASELINE
    model: str = "tiny"
    steps: int = 50
    device: str = "cpu"
    seed: int = 0
    sample_every: int = 5
    window: int | None = None
    lr: float | None = None
    form: str | None = None
    recipe: str | None = None
    grad_accum: int = 1
    checkpoint: bool = False
    data: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise TrainError(f"steps = {self.steps}: train at least one step (e.g. --steps 50)")
        if self.sample_every < 1:
            raise TrainError(f"sample_every = {self.sample_every} must be at least 1 (1: numerics at every step)")
        if self.window is not None and not 1 <= self.window <= self.steps:
            raise TrainError(f"window = {self.window} must be from 1 to steps = {self.steps}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise TrainError(f"lr = {self.lr} must be a positive finite number (e.g. {LEARNING_RATE})")
        if self.grad_accum < 1:
            raise TrainError(f"grad_accum = {self.grad_accum} must be at least 1 (1: no gradient accumulation)")
        if self.data is not None and not Path(self.data).is_file():
            raise TrainError(f"--data {self.data!r} does not exist (resolved to {Path(self.data).resolve()}): give "
                             f"a .pt or .npy file of token ids or a UTF-8 text file")
        try:
            if self.user_model:
                _check_factory_spec(self.model)  # its module is imported in the runs' workers, never here
            else:
                get_model_config(self.model)
        except ModelError as err:
            raise TrainError(str(err)) from None
        if self.checkpoint and self.user_model:
            raise TrainError(f"--checkpoint wraps the blocks of the built-in GPT; for your own model "
                             f"({self.model}) call torch.utils.checkpoint(..., use_reentrant=False) in its forward "
                             f"instead (the probes handle the recompute either way) and leave out --checkpoint")

    @property
    def user_model(self) -> bool:
        return is_model_factory(self.model)

    @property
    def config(self) -> GPTConfig:
        """The built-in model's config (a user's model has none: see build_models)."""
        return get_model_config(self.model)

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return LEARNING_RATE if self.user_model else self.config.learning_rate

    @property
    def loss_window(self) -> int:
        return self.window or max(1, self.steps // 5)

    def sampled(self, step: int) -> bool:
        return step % self.sample_every == 0 or step == self.steps - 1


def _check_factory_spec(spec: str) -> None:
    """ModelError for a `--model path.py:factory` that cannot name a factory (no attribute, or a file that
    does not exist), found without importing it: your code runs only in the runs' workers."""
    module_spec, _, attr = spec.rpartition(":")
    if not module_spec or not attr:
        raise ModelError(f"--model {spec!r}: write your own model as path/to/file.py:factory (factory: "
                         f"{FACTORY_PROTOCOL})")
    is_path = module_spec.endswith(".py") or "/" in module_spec or "\\" in module_spec
    if is_path and not Path(module_spec).expanduser().is_file():
        raise ModelError(f"--model {spec!r}: model file {module_spec!r} does not exist (resolved to "
                         f"{Path(module_spec).expanduser().resolve()})")


@dataclass(frozen=True)
class RunImpl:
    """What the process that judges knows of a run's implementation: its description, sent by the
    worker that loaded it (parity.train_worker), never the implementation itself."""

    name: str
    form: str
    recipe_name: str
    exact: bool = False
    bit_model: bool = False

    @classmethod
    def from_reply(cls, reply: dict) -> "RunImpl":
        return cls(reply["name"], reply["form"], reply["recipe"], bool(reply["exact"]), bool(reply["bit_model"]))

    @property
    def recipe(self) -> Recipe:
        return get_recipe(self.recipe_name)

    @property
    def reload_args(self) -> tuple[str, str, str, bool]:
        """What loads it again in another process: parity.impls.reload_impl(*reload_args) (a rank does)."""
        return self.name, self.form, self.recipe_name, False

    @property
    def is_reference(self) -> bool:
        """A high-precision nn.Linear (parity.policy.default_policy reads it, as of an Impl)."""
        return not self.recipe.is_fp8


@dataclass
class Divergence:
    """The first (step, micro-batch, layer, GEMM) where the candidate differs from the against run."""

    step: int
    layer: str
    gemm: str
    case_file: Path | None = None
    micro: int = 0
    grad_accum: int = 1

    def __str__(self) -> str:
        micro = f", micro-batch {self.micro} of {self.grad_accum}" if self.grad_accum > 1 else ""
        return f"step {self.step}{micro}, layer {self.layer}, GEMM {self.gemm}"


@dataclass
class TrainResult:
    plan: TrainPlan
    frame: pd.DataFrame  # tidy: one row per step x micro-batch x run x layer x GEMM
    source: MarkovSource | TokenFile | None  # None: training stopped before the data was drawn
    runs: dict[str, str]  # role -> implementation name
    bitwise_required: bool
    divergence: Divergence | None = None
    loss_differs_at: int | None = None  # a step whose loss differs while every GEMM agreed
    crash: str | None = None  # an implementation that raised: where, and its exception (training stops there)
    seconds: float = 0.0
    verdict: Verdict | None = None
    layers: list[str] = field(default_factory=list)  # the converted layers, in the model's order
    timing: pd.DataFrame | None = None  # one row per completed step: seconds, split by phase
    recompute_differs: tuple[int, int, str] | None = None  # (step, micro, layer): the candidate's recompute
    # "R (role) changed global state during step S: forward/backward: what (restored)", the first of each run
    state_changes: list[str] = field(default_factory=list)
    interrupted: str | None = None  # "SIGINT" / "SIGTERM": the report holds the steps that finished
    # the headline of check's comparisons of a case file (parity.train_calls): the first divergence's, or,
    # where the runs never part, the first layer's first call's where check finds something there
    finding: str | None = None
    calls_case_file: Path | None = None  # that first call's case file, kept where check found something

"""A test case is data: shape, dtypes, memory layouts, data distribution, seed, steps.

Every case has a short stable id that names it completely and rebuilds it:

    M2x128K64N32|in:bf16:T|w:fp32:C|go:C|bias|outlier100|seed3|steps2

    M2x128K64N32  leading dims of the input (2, 128) -> M = 256 tokens; K = 64; N = 32
    in:bf16:T     input dtype and layout          w:fp32:C   weight dtype and layout
    go:C          grad_output layout (its dtype is the output's, i.e. the input's)
    bias          the layer has a bias (absent: no bias)
    outlier100    data distribution (here: one channel 100x larger than the rest)
    seed3         seed of the data          steps2    calls, with an in-place weight update between
"""

from __future__ import annotations

import enum
import math
import os
import re
from dataclasses import asdict, dataclass, replace

import torch

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
INPUT_DTYPES = ("bf16", "fp16", "fp32")
WEIGHT_DTYPES = ("bf16", "fp32")
ALIGNMENT = 16  # every FP8 GEMM dimension (M, K, N) must be divisible by 16
# A case's seed seeds torch.Generator (64-bit) and, plus small offsets, the permutations of
# parity.relations; 2**32 - 1 leaves room for both and is more seeds than a search draws (the CLI's
# --seed stops at 2**31 - 1, a sample adds at most 2**16).
MAX_SEED = 2**32 - 1
# Steps exist to show state kept across calls (an amax history, a cached cast, a weight update
# missed): torchao's delayed scaling keeps a history of 16 calls, so 64 calls show what any
# history of that order does; more only multiplies a case's time (steps100000000 ran for hours).
MAX_STEPS = 64


class Layout(str, enum.Enum):
    """How the same logical tensor sits in memory (the last two dims of an N-D tensor)."""

    CONTIGUOUS = "C"  # row-major, dense
    TRANSPOSED = "T"  # stored transposed: a .transpose(-1, -2) view of a contiguous buffer
    SLICED = "S"  # non-dense: every other element of a buffer twice as wide (gaps hold NaN)
    PADDED = "P"  # row-major with padded rows: row stride = row length + 16 (padding holds NaN)


class Dist(str, enum.Enum):
    """Data distributions, applied to input, weight and grad_output alike (outlier: input only)."""

    NORMAL = "normal"  # standard normal
    UNIFORM = "uniform"  # uniform on [-sqrt(3), sqrt(3)] (unit variance)
    HEAVY = "heavy"  # Student-t with 3 degrees of freedom: rare large values
    OUTLIER = "outlier"  # normal input with one channel `ratio` times larger; normal weight and grad_output
    ZEROS = "zeros"  # all zeros: amax = 0 exercises the EPS floor of the scale
    NEAR_MAX = "nearmax"  # |x| in [0.9, 1] x 448 with random signs, one element exactly 448
    TINY = "tiny"  # |x| log-uniform over 2^-30 .. 2^-10: many values land in fp8's subnormals
    NEGATIVE = "negative"  # negative-dominant: -|normal|, 5% positives of half size (amax from a negative)
    ZERO_ROWS = "zero_rows"  # normal, with a quarter of the rows and a quarter of the columns all zero
    OUTLIER_ROW = "outlier_row"  # normal input with one row (token) 10^4 times larger
    TINY_AMAX = "tiny_amax"  # normal input times 1e-30: amax far below the scale's EPS floor of 1e-12
    # normal input times 2^-16: an amax near 5e-5, above the scale's floor of 1e-12 and below the larger
    # floors some code uses (1e-4 in DeepGEMM's casts): a floor that is too high shows only here
    SMALL_AMAX = "small_amax"
    # normal input times 1000: raw magnitudes beyond every fp8 format's max but e5m2's (448, 240):
    # code that clamps (or otherwise bounds) values before it scales them shows here
    LARGE = "large"
    # normal input with one NaN: a microscaled cast keeps it in its block (the block's scale is NaN), as
    # float64 keeps it in its row of the output; a tensor or row scale spreads it over the whole tensor or
    # row, by design. An edge case of MXFP8's checks only (Recipe.nan_stays_in_its_block), never drawn by a
    # search (DRAWN_DISTS)
    NAN = "nan"


# the distributions a search draws and bisect flips a case through: all but nan (see Dist.NAN)
DRAWN_DISTS = tuple(dist for dist in Dist if dist is not Dist.NAN)


TENSORS = ("output", "grad_input", "grad_weight", "grad_bias")


class CaseError(ValueError):
    """A case that cannot be built or parsed; the message says what and how to fix it."""


@dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]  # leading dims of the input; M = prod(lead)
    K: int
    N: int
    input_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    bias: bool = False
    input_layout: Layout = Layout.CONTIGUOUS
    weight_layout: Layout = Layout.CONTIGUOUS
    grad_output_layout: Layout = Layout.CONTIGUOUS
    dist: Dist = Dist.NORMAL
    outlier_ratio: int = 100  # only meaningful for Dist.OUTLIER
    seed: int = 0
    steps: int = 1

    def __post_init__(self):
        object.__setattr__(self, "lead", tuple(int(d) for d in self.lead))
        object.__setattr__(self, "input_layout", Layout(self.input_layout))
        object.__setattr__(self, "weight_layout", Layout(self.weight_layout))
        object.__setattr__(self, "grad_output_layout", Layout(self.grad_output_layout))
        object.__setattr__(self, "dist", Dist(self.dist))
        if self.dist is not Dist.OUTLIER:  # the ratio means nothing else: keep ids one-to-one
            object.__setattr__(self, "outlier_ratio", 100)
        if not self.lead or any(d < 1 for d in self.lead):
            raise CaseError(f"case: leading dims must be positive, got {self.lead}")
        for name, value in (("M", self.M), ("K", self.K), ("N", self.N)):
            if value < 1 or value % ALIGNMENT:
                raise CaseError(
                    f"case: {name} = {value} must be a positive multiple of {ALIGNMENT} "
                    f"(torch._scaled_mm needs every FP8 GEMM dimension divisible by {ALIGNMENT})")
        if self.input_dtype not in INPUT_DTYPES:
            raise CaseError(f"case: input dtype {self.input_dtype!r} not in {INPUT_DTYPES}")
        if self.weight_dtype not in WEIGHT_DTYPES + ("fp16",):
            raise CaseError(f"case: weight dtype {self.weight_dtype!r} not in {WEIGHT_DTYPES + ('fp16',)}")
        if not 1 <= self.steps <= MAX_STEPS:
            raise CaseError(f"case: steps must be from 1 to {MAX_STEPS}, got {self.steps} (steps show state kept "
                            f"across calls; a few dozen calls show it)")
        if not 0 <= self.seed <= MAX_SEED:
            raise CaseError(f"case: seed must be from 0 to {MAX_SEED}, got {self.seed}")
        if self.outlier_ratio < 1:
            raise CaseError(f"case: outlier ratio must be >= 1, got {self.outlier_ratio}")

    # ---- derived ---------------------------------------------------------------------
    @property
    def M(self) -> int:
        return math.prod(self.lead)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.K)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.N)

    @property
    def torch_input_dtype(self) -> torch.dtype:
        return DTYPES[self.input_dtype]

    @property
    def torch_weight_dtype(self) -> torch.dtype:
        return DTYPES[self.weight_dtype]

    @property
    def dist_token(self) -> str:
        return f"outlier{self.outlier_ratio}" if self.dist is Dist.OUTLIER else self.dist.value

    @property
    def tensors(self) -> tuple[str, ...]:
        return TENSORS if self.bias else TENSORS[:3]

    # ---- id <-> case -------------------------------------------------------------------
    @property
    def id(self) -> str:
        parts = [
            f"M{'x'.join(map(str, self.lead))}K{self.K}N{self.N}",
            f"in:{self.input_dtype}:{self.input_layout.value}",
            f"w:{self.weight_dtype}:{self.weight_layout.value}",
            f"go:{self.grad_output_layout.value}",
        ]
        if self.bias:
            parts.append("bias")
        parts += [self.dist_token, f"seed{self.seed}"]
        if self.steps != 1:
            parts.append(f"steps{self.steps}")
        return "|".join(parts)

    def __str__(self) -> str:
        return self.id

    @classmethod
    def from_id(cls, case_id: str) -> "Case":
        """Rebuild a case from its id (inverse of Case.id)."""
        return parse_case_id(case_id)

    def replace(self, **changes) -> "Case":
        return replace(self, **changes)

    def as_record(self) -> dict:
        """Flat columns for a results table."""
        record = asdict(self)
        record.update(
            lead="x".join(map(str, self.lead)), ndim=len(self.lead) + 1, M=self.M,
            input_layout=self.input_layout.value, weight_layout=self.weight_layout.value,
            grad_output_layout=self.grad_output_layout.value, dist=self.dist_token,
        )
        del record["outlier_ratio"]
        return record


@dataclass(frozen=True)
class SavedCase(Case):
    """A case whose tensors come from a case file (`fp8-parity train` writes one for the first GEMM
    where two trainings diverge; parity.data.read_case_file documents it) instead of being drawn
    from a distribution and a seed. Its id is the case's id plus `|file:PATH`, so a rerun command
    names the file; the dims, dtypes and layouts are the saved tensors' (parity.data.saved_case).
    A case derived from it (bisect flips one condition at a time) keeps the file: its tensors are
    the saved ones cast to its dtypes, cropped or zero-padded to its dims; dist and seed mean nothing."""

    path: str = ""

    def __post_init__(self):
        super().__post_init__()
        if not self.path:
            raise CaseError("SavedCase: path is empty; build one with parity.data.saved_case(PATH)")

    @property
    def id(self) -> str:
        return f"{super().id}|file:{self.path}"


_SHAPE = re.compile(r"^M(\d+(?:x\d+)*)K(\d+)N(\d+)$")
_OPERAND = re.compile(r"^(in|w):(\w+):([A-Z])$")
ID_HELP = "expected e.g. 'M256K64N32|in:bf16:C|w:fp32:T|go:C|bias|normal|seed0|steps2'"


def parse_case_id(case_id: str) -> Case:
    parts = [p.strip() for p in case_id.strip().split("|") if p.strip()]
    if not parts:
        raise CaseError(f"case id is empty; {ID_HELP}")
    shape = _SHAPE.match(parts[0])
    if not shape:
        raise CaseError(f"case id {case_id!r}: cannot read the shape {parts[0]!r}; {ID_HELP}")
    fields: dict = dict(lead=tuple(int(d) for d in shape.group(1).split("x")),
                        K=int(shape.group(2)), N=int(shape.group(3)))
    try:
        for part in parts[1:]:
            operand = _OPERAND.match(part)
            if operand:
                who, dtype, layout = operand.groups()
                prefix = "input" if who == "in" else "weight"
                fields[f"{prefix}_dtype"], fields[f"{prefix}_layout"] = dtype, Layout(layout)
            elif part.startswith("go:"):
                fields["grad_output_layout"] = Layout(part[3:])
            elif part == "bias":
                fields["bias"] = True
            elif part.startswith("seed") and part[4:].isdigit():
                fields["seed"] = int(part[4:])
            elif part.startswith("steps") and part[5:].isdigit():
                fields["steps"] = int(part[5:])
            elif part.startswith("file:") and len(part) > 5:
                fields["path"] = part[5:]
            elif part.startswith("outlier") and (part[7:].isdigit() or part == "outlier"):
                fields["dist"], fields["outlier_ratio"] = Dist.OUTLIER, int(part[7:] or 100)
            else:
                fields["dist"] = Dist(part)
    except ValueError as err:
        if isinstance(err, CaseError):
            raise
        raise CaseError(
            f"case id {case_id!r}: cannot read {part!r} ({err}); layouts are "
            f"{[layout.value for layout in Layout]}, distributions {[d.value for d in Dist]}; {ID_HELP}") from None
    return SavedCase(**fields) if "path" in fields else Case(**fields)


def check_fits(case: Case, device: str) -> Case:
    """CaseError when the case's operands alone, in the float64 of the exact references, exceed the
    device's memory: say so before anything is allocated (the run needs several times more)."""
    need = 8 * (case.M * case.K + case.K * case.N + case.M * case.N)
    if device.startswith("cuda") and torch.cuda.is_available():
        have, where = torch.cuda.get_device_properties(torch.device(device)).total_memory, "the GPU's"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's"
    if need > have:
        raise CaseError(f"case {case.id}: its operands alone take {need / 2**30:.3g} GiB in float64, more than "
                        f"{where} {have / 2**30:.3g} GiB: choose smaller M, K, N")
    return case


def edge_cases(*, seed: int = 0, alignment: int = ALIGNMENT, nan_case: bool = False) -> tuple[Case, ...]:
    """Cases every check runs first: the edges where FP8 code most often goes wrong (dims scaled
    to the recipe's alignment: 16, or 128 for block scales; 32 for MXFP8 and NVFP4). With `nan_case`
    (MXFP8's checks: Recipe.nan_stays_in_its_block) a NaN in the input too: its block, and only its
    block, must come out NaN."""
    unit = alignment // ALIGNMENT
    base = Case(lead=(32 * unit,), K=64 * unit, N=48 * unit, seed=seed)
    return (*((base.replace(dist=Dist.NAN),) if nan_case else ()),
        base,
        base.replace(dist=Dist.ZEROS),
        base.replace(dist=Dist.NEAR_MAX),
        base.replace(dist=Dist.OUTLIER),
        base.replace(dist=Dist.NEGATIVE),
        base.replace(dist=Dist.TINY),
        base.replace(dist=Dist.ZERO_ROWS),  # all-zero rows and columns: axis and tile scales of zero
        base.replace(dist=Dist.OUTLIER_ROW),
        base.replace(dist=Dist.TINY_AMAX),
        base.replace(dist=Dist.SMALL_AMAX),
        base.replace(lead=(2, 16 * unit)),  # 3-D input
        # 3-D and non-contiguous together: a .view() that flattens tokens raises where .reshape() copies
        base.replace(lead=(2, 16 * unit), input_layout=Layout.TRANSPOSED, grad_output_layout=Layout.TRANSPOSED),
        base.replace(N=64 * unit),  # K == N: a transposed weight has the right shape here
        base.replace(input_layout=Layout.TRANSPOSED),
        base.replace(weight_layout=Layout.TRANSPOSED, grad_output_layout=Layout.SLICED),
        base.replace(input_dtype="fp32", weight_dtype="fp32", bias=True),
        base.replace(weight_dtype="fp32", bias=True, steps=2),
        # fp16 with a small amax: the scale (about 1e7) is beyond fp16's range, so a scale kept in,
        # or clamped to, the input's dtype shows here and nowhere in bf16 or fp32
        base.replace(dist=Dist.SMALL_AMAX, input_dtype="fp16"),
    )


# The case of a layer's size that `check` runs once its search of small cases found nothing: a bug that shows only
# past a size (a tile or split boundary of K, a second block of rows, an offset that overflows) passed every case
# of at most 256 (issue 29, item 9: wrong only when M > 512, or when K > 256). Every dim a multiple of 128, the
# largest alignment of any recipe; N kept small, since float64 references cost M*K*N (about 4 s of a CPU check).
LAYER_SHAPE = dict(lead=(1024,), K=1024, N=128)


def layer_case(*, seed: int = 0) -> Case:
    """One case of a real layer's size (LAYER_SHAPE), plain otherwise: bf16, contiguous, normal data."""
    return Case(seed=seed, **LAYER_SHAPE)


def simplifications(case: Case, *, alignment: int = ALIGNMENT):
    """One-step simplifications of `case`, as (what changed, simpler case), simplest first,
    keeping every dim a multiple of `alignment`.

    Used to shrink a failing case greedily and to find what a failure depends on.
    """
    def variant(label: str, **changes):
        simpler = case.replace(**changes)
        return None if simpler == case else (label, simpler)

    M, a = case.M, alignment
    candidates = [
        variant("2-D input", lead=(M,)) if len(case.lead) > 1 else None,
        variant(f"M = {a}", lead=(a,)) if len(case.lead) == 1 else None,
        variant(f"K = {a}", K=a), variant(f"N = {a}", N=a),
        variant(f"M = {M // 2}", lead=(M // 2,)) if len(case.lead) == 1 and M % (2 * a) == 0 else None,
        variant(f"K = {case.K // 2}", K=case.K // 2) if case.K % (2 * a) == 0 else None,
        variant(f"N = {case.N // 2}", N=case.N // 2) if case.N % (2 * a) == 0 else None,
        variant("one step", steps=1),
        variant("no bias", bias=False),
        variant("contiguous input", input_layout=Layout.CONTIGUOUS),
        variant("contiguous weight", weight_layout=Layout.CONTIGUOUS),
        variant("contiguous grad_output", grad_output_layout=Layout.CONTIGUOUS),
        variant("bf16 input", input_dtype="bf16"),
        variant("bf16 weight", weight_dtype="bf16"),
        variant("normal data", dist=Dist.NORMAL),
        variant("seed 0", seed=0),
    ]
    return [c for c in candidates if c is not None]


def shrink(case: Case, fails, *, alignment: int = ALIGNMENT) -> Case:
    """Greedy shrinking: take the first simplification that still fails, until none does."""
    progress = True
    while progress:
        progress = False
        for _, simpler in simplifications(case, alignment=alignment):
            if fails(simpler):
                case, progress = simpler, True
                break
    return case

"""Where the Hopper model (parity.hopper) computes a GPU's bits: measured, kept as a table, read at run time.

mmaemu's author validated its Hopper model on an H100 PCIe; the H200 is another machine (more
memory, the same SM count class, a newer cuBLASLt), and a split-K that cuBLASLt chooses for an
unseen shape is not predictable. So exactness is claimed only where it was measured:

    fp8-parity calibrate        on a GPU: every configuration of the grid below, the hardware's call
                                against the model, bit for bit; writes parity/calibration/<gpu>.csv

A configuration is a kind of call (TensorWise, RowWise, BlockWise with 128x128 or 1x128 B scales),
the operand formats, the out dtype, fast accumulation, and M, K, N. The grid holds the GEMMs of the
sweep presets' layers (nanochat d20, Llama 3 8B) at two token counts, forward and backward (the
weight gradient's inner dimension is the token count), small and odd shapes of the sizes `check`
draws, and large-K shapes with small M x N, where cuBLASLt splits K.

`exactness(config, table)` says whether the table vouches for a call: it does when the table holds a
bit-equal configuration of the call's group (kind, formats, out dtype, accumulation) with K at least
the call's, and none of that group that differed with K at most the call's and M x N at least the
call's (the shape of a split-K: a long K over a small output). Elsewhere the accumulation bound
judges, and the reason says why. A GPU without a table is "not calibrated".
"""

from __future__ import annotations

import functools
import itertools
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from parity import hopper
from parity.hopper import CallKind
from parity.recipes import BLOCK

TABLES = Path(__file__).resolve().parent / "calibration"
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


@dataclass(frozen=True)
class Config:
    """One measured kind of call: what decides the hardware's bits, and nothing else."""

    kind: CallKind
    a: str  # e4m3 | e5m2
    b: str
    out: str  # bfloat16 | float16 | float32
    fast_accum: bool
    m: int
    k: int
    n: int
    b_tiles: str = ""  # BlockWise: "128x128" (a weight) or "1x128" (an activation or gradient)

    def __post_init__(self):
        object.__setattr__(self, "kind", CallKind(self.kind))

    @property
    def group(self) -> tuple:
        """What must match for one configuration to speak for another: all but the shape."""
        return (self.kind, self.a, self.b, self.out, self.fast_accum, self.b_tiles)

    @property
    def id(self) -> str:
        kind = {CallKind.TENSORWISE: "tw", CallKind.ROWWISE: "rw", CallKind.BLOCKWISE: "bw"}[self.kind]
        tiles = f"-b{self.b_tiles}" if self.b_tiles else ""
        return (f"{kind}-{self.a}x{self.b}-{self.out}-{'fast' if self.fast_accum else 'exact'}{tiles}-"
                f"{self.m}x{self.k}x{self.n}")


# ---- the grid ---------------------------------------------------------------------------------------

LAYERS = [(1280, 1280), (1280, 5120), (5120, 1280), (4096, 4096), (4096, 1024)]  # (in, out): nanochat d20, Llama 3 8B
TOKENS = (1024, 4096)
SMALL = [(16, 16, 16), (16, 32, 16), (32, 64, 48), (48, 80, 112), (64, 128, 64), (64, 256, 96), (96, 160, 208),
         (128, 256, 128), (112, 336, 176), (256, 512, 256), (16, 1024, 64), (64, 768, 256), (208, 784, 144),
         (32, 4096, 32), (128, 1536, 320)]
LONG_K = [(128, 4096, 128), (256, 8192, 256), (64, 16384, 64), (512, 8192, 512), (256, 2048, 256)]
# the sizes `check` draws (multiples of 16 up to its default --max-dim 256), ten fixed draws
CHECK_LIKE = [(16 * (1 + (37 * i) % 16), 16 * (1 + (11 * i + 5) % 16), 16 * (1 + (23 * i + 9) % 16))
              for i in range(10)]


def layer_gemms(tokens: int, inputs: int, outputs: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of a linear layer's three GEMMs: output, grad_input (inner N), grad_weight (inner M)."""
    return [(tokens, inputs, outputs), (tokens, outputs, inputs), (outputs, tokens, inputs)]


def shapes(alignment: int = 16) -> list[tuple[int, int, int]]:
    found = [gemm for tokens, (i, o) in itertools.product(TOKENS, LAYERS) for gemm in layer_gemms(tokens, i, o)]
    found += SMALL + LONG_K + CHECK_LIKE
    aligned = [shape for shape in found if all(side % alignment == 0 for side in shape)]
    if alignment == BLOCK:  # the block-scaled recipe's dims are multiples of 128: its own small shapes
        aligned += [(128, 128, 128), (128, 384, 256), (384, 640, 128), (256, 1152, 384)]
    return list(dict.fromkeys(aligned))


def grid() -> list[Config]:
    """Every configuration `fp8-parity calibrate` measures, in a fixed order."""
    configs = []
    # TensorWise writes the input's dtype (bf16, fp16, fp32);
    # RowWise and BlockWise calls write bf16 in every recipe (parity.recipes: scaled_out_bf16)
    for (m, k, n), (a, b), out, fast in itertools.product(shapes(), [("e4m3", "e4m3"), ("e5m2", "e4m3")],
                                                          OUT_DTYPES, (True, False)):
        configs.append(Config(CallKind.TENSORWISE, a, b, out, fast, m, k, n))
    for (m, k, n), fast in itertools.product(shapes(), (True, False)):
        configs.append(Config(CallKind.ROWWISE, "e4m3", "e4m3", "bfloat16", fast, m, k, n))
    for (m, k, n), tiles in itertools.product(shapes(BLOCK), ("128x128", "1x128")):
        configs.append(Config(CallKind.BLOCKWISE, "e4m3", "e4m3", "bfloat16", False, m, k, n, tiles))
    return configs


# ---- one measurement ----------------------------------------------------------------------------------


def _operands(config: Config, device: str):
    """Seeded FP8 operands and scales (not powers of two: an epilogue's order of products shows) of a config."""
    generator = torch.Generator().manual_seed(sum(map(ord, config.id)))
    def fp8(rows, cols, fmt):
        values = torch.randn(rows, cols, generator=generator) * FP8_MAX[fmt] / 8
        return values.clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FORMATS[fmt]).to(device)
    def scales(*shape):
        return (torch.rand(*shape, generator=generator) * 0.9 + 0.1).div(FP8_MAX["e4m3"]).to(device)
    a, b_rows = fp8(config.m, config.k, config.a), fp8(config.n, config.k, config.b)
    if config.kind is CallKind.TENSORWISE:
        return a, b_rows, scales(()), scales(())
    if config.kind is CallKind.ROWWISE:
        return a, b_rows, scales(config.m, 1), scales(1, config.n)
    blocks = config.k // BLOCK
    scale_b = scales(-(-config.n // BLOCK), blocks) if config.b_tiles == "128x128" else scales(config.n, blocks)
    return a, b_rows, scales(config.m, blocks), scale_b


def hardware(config: Config, a, b_rows, scale_a, scale_b) -> torch.Tensor:
    """The GPU's own call, laid out as cuBLASLt takes it (A row-major, B column-major, 1x128 scales
    outer-dim-major, 128x128 scales with K/128 padded to a multiple of 4)."""
    out = OUT_DTYPES[config.out]
    if config.kind is not CallKind.BLOCKWISE:
        return torch._scaled_mm(a, b_rows.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out,
                                use_fast_accum=config.fast_accum)
    import torch.nn.functional as F  # only here: the one block-scaled call of the grid
    scale_a = scale_a.t().contiguous().t()
    if config.b_tiles == "1x128":
        scale_b, kind_b = scale_b.t().contiguous().t(), F.ScalingType.BlockWise1x128
    else:
        blocks = scale_b.shape[1]
        padded = scale_b.new_ones(scale_b.shape[0], -(-blocks // 4) * 4)
        padded[:, :blocks] = scale_b
        scale_b, kind_b = padded.t(), F.ScalingType.BlockWise128x128
    return F.scaled_mm(a, b_rows.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b, kind_b, output_dtype=out)


def model(config: Config, a, b_rows, scale_a, scale_b) -> hopper.Modelled:
    out = OUT_DTYPES[config.out]
    if config.kind is CallKind.TENSORWISE:
        return hopper.tensorwise(a, b_rows, scale_a, scale_b, out_dtype=out, fast_accum=config.fast_accum)
    if config.kind is CallKind.ROWWISE:
        return hopper.rowwise(a, b_rows, scale_a, scale_b, out_dtype=out, fast_accum=config.fast_accum)
    return hopper.blockwise(a, b_rows, scale_a, scale_b, out_dtype=out, b_tiles=config.b_tiles,
                            fast_accum=config.fast_accum)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()])


def measure(config: Config, device: str = "cuda") -> dict:
    """One row of the table: how many of the call's elements the model got bit for bit."""
    start = time.perf_counter()
    a, b_rows, scale_a, scale_b = _operands(config, device)
    row = dict(id=config.id, **{key: (value.value if isinstance(value, CallKind) else value)
                                for key, value in asdict(config).items()})
    try:
        got = hardware(config, a, b_rows, scale_a, scale_b)
        modelled = model(config, a, b_rows, scale_a, scale_b)
    except Exception as err:  # noqa: BLE001 - a call the GPU or the model refuses is a row that says so
        return {**row, "splits": None, "split_known": None, "equal_fraction": None, "bitwise": False,
                "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}",
                "seconds": round(time.perf_counter() - start, 2)}
    equal = (_bits(got) == _bits(modelled.value.to(got.device))).float().mean().item()
    return {**row, "splits": modelled.splits, "split_known": modelled.split_known, "equal_fraction": round(equal, 6),
            "bitwise": equal == 1.0, "error": "", "seconds": round(time.perf_counter() - start, 2)}


# ---- the table ----------------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """A GPU's table file name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_path(gpu_name: str) -> Path:
    return TABLES / f"{gpu_slug(gpu_name)}.csv"


def load_table(gpu_name: str):
    """The committed calibration table of this GPU (a DataFrame), or None when it was never calibrated."""
    import pandas as pd  # on first use: impls imports this module, and `fp8-parity --help` need not load pandas
    path = table_path(gpu_name)
    if not path.exists():
        return None
    return pd.read_csv(path, comment="#", dtype={"b_tiles": str}, keep_default_na=False, na_values=[""])


@functools.lru_cache(maxsize=None)
def table_for(gpu_name: str):
    """load_table, read once per GPU name and process."""
    return load_table(gpu_name)


@dataclass(frozen=True)
class Exactness:
    """Whether a call's result may be judged bit for bit against the model, and why (or why not)."""

    exact: bool
    why: str


def exactness(config: Config, table) -> Exactness:
    """What `table` (load_table's) says of a call with this configuration (the rule is the module's docstring)."""
    if table is None:
        return Exactness(False, "this GPU is not calibrated (no table under parity/calibration/)")
    same = table[(table["kind"] == config.kind.value) & (table["a"] == config.a) & (table["b"] == config.b)
                 & (table["out"] == config.out) & (table["fast_accum"] == config.fast_accum)
                 & (table["b_tiles"].fillna("") == config.b_tiles)]
    if not len(same):
        return Exactness(False, f"no calibrated {config.kind.value} call with {config.a} x {config.b} -> "
                                f"{config.out}, fast accumulation {'on' if config.fast_accum else 'off'}")
    area = config.m * config.n
    equal, differed = same[same["bitwise"]], same[~same["bitwise"]]
    split = differed[(differed["k"] <= config.k) & (differed["m"] * differed["n"] >= area)]
    if len(split):
        worst = split.iloc[0]
        return Exactness(False, f"the calibrated {worst['id']} differed ({worst['equal_fraction']:.0%} equal): a "
                                f"longer K over a smaller output may be split in ways the model does not know")
    covering = equal[(equal["k"] >= config.k)]
    if not len(covering):
        return Exactness(False, f"K = {config.k} is beyond the calibrated K (bit-equal at most at "
                                f"K = {int(equal['k'].max()) if len(equal) else 0})")
    return Exactness(True, f"calibrated: {len(equal)} of {len(same)} configurations of this kind bit-equal, "
                           f"K up to {int(covering['k'].max())}")

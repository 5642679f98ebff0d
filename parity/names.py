"""The names `fp8-parity` offers on its command line, and their one-line help: standard library only.

The parser (parity.cli) lists the built-in implementations, recipes, policies, CPU GEMM kernels,
distributed wrappers, presets and defaults in its choices and its --help. They belong to modules
that import torch, pandas or torchao (parity.impls, parity.recipes, parity.policy, ...), and
importing those took 3.4-11 s before a `--help` or a mistyped flag could be answered (issue 28,
item 7). So the names live here, where the parser reads them without importing torch, and the
heavy modules read them from here too: one list, not two that drift apart.

Some names are derived there from objects that need torch (the recipes that are FP8 from each
Recipe's formats, the built-ins from the factories of parity.impls.BUILTINS, the enums Policy and
Form, a bench preset's shapes); those are listed here as well, and property_tests/test_names.py
checks that every list equals what its module builds.
"""

from __future__ import annotations

# ---- recipes (parity.recipes.RECIPES) --------------------------------------------------------------

# the recipes whose GEMMs run in FP8, in the order of parity.recipes.RECIPES
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "mxfp8_floor", "nvfp4")
# the block-scaled recipes of Blackwell's GEMMs (MXFP8, NVFP4)
MX_RECIPES = ("mxfp8", "mxfp8_floor", "nvfp4")
# the recipes a family of built-ins does not implement: no Hopper model computes a microscaled GEMM;
# torchao 0.18's NVFP4 training (prototype.moe_training.nvfp4_training) is Triton-only, with stochastic
# rounding and a Hadamard transform: not the nvfp4 recipe; fp8_impl implements MXFP8, not NVFP4
NOT_IMPLEMENTED_BY = {"hopper": MX_RECIPES, "torchao": ("nvfp4",), "fp8_impl": ("nvfp4",)}


def family_recipes(family: str) -> tuple[str, ...]:
    """The FP8 recipes the built-in family (fp8_impl, torchao, emulated, hopper) implements, in order."""
    return tuple(name for name in FP8_RECIPES if name not in NOT_IMPLEMENTED_BY.get(family, ()))

# the high-precision ones: nn.Linear in a plain dtype, each also a built-in implementation
HIGH_PRECISION_RECIPES = ("bf16", "fp64")

# ---- built-in implementations (parity.impls.BUILTINS) ----------------------------------------------

# the families of built-ins named PACKAGE:RECIPE; any other PACKAGE:ATTR is code outside the harness
BUILTIN_PACKAGES = ("fp8_impl", "torchao", "emulated", "hopper")
# torchao's tensorwise recipe with its weights all-gathered in FP8 under FSDP2
# (Float8LinearConfig(enable_fsdp_float8_all_gather=True): the weight is cast to FP8 before the
# gather, its amax all-reduced first). Only a sharded run (`check --distributed fsdp2`) takes that
# path; on one process it computes what torchao:tensorwise does.
FSDP_FLOAT8_ALL_GATHER = "torchao:tensorwise+fsdp_float8_all_gather"
# every built-in name, in the order of parity.impls.BUILTINS ("fp8_impl" is fp8_impl's tensorwise)
BUILTIN_NAMES = (
    "fp8_impl",
    *(f"fp8_impl:{name}" for name in family_recipes("fp8_impl") if name != "tensorwise"),
    *(f"torchao:{name}" for name in family_recipes("torchao")),
    FSDP_FLOAT8_ALL_GATHER,
    "emulated",
    *(f"emulated:{name}" for name in FP8_RECIPES),
    *(f"hopper:{name}" for name in family_recipes("hopper")),
    *HIGH_PRECISION_RECIPES,
)
# what --help says of the built-ins (the families once, not every recipe of them)
BUILTIN_HELP = {
    "fp8_impl": "this project's minimal Float8Linear (tensorwise; fp8_impl:RECIPE for the others)",
    **{f"torchao:{name}": f"torchao, {name} recipe" for name in family_recipes("torchao")},
    FSDP_FLOAT8_ALL_GATHER: "torchao, tensorwise, its weights all-gathered in FP8 under FSDP2",
    "emulated": "exact float64 emulation of a recipe's FP8 math (emulated:RECIPE; default tensorwise)",
    **{f"hopper:{name}": f"the {name} recipe as an H200 computes it, bit for bit (parity.hopper's model)"
       for name in family_recipes("hopper")},
    "bf16": "nn.Linear in bfloat16",
    "fp64": "nn.Linear in float64",
}
# the forms an implementation can take (the values of parity.impls.Form)
FORMS = ("function", "module", "converter")

# ---- judging (parity.policy.Policy) ----------------------------------------------------------------

POLICIES = ("bitwise", "accumulation", "sqnr", "paired", "exact", "none")

# ---- search budgets (--max-examples) ----------------------------------------------------------------

# generated cases `check` tries after its pinned edge cases
CHECK_SEARCH = 100
# generated cases `bisect` tries after the edge cases when no failing case is given: it localizes a
# failure, and the edge cases show most bugs, so a correct layer's pass takes seconds, not a check's
# search: bisect of fp8_impl on this project's CPU (one thread, 2026-12-07) took 3.6 s of CPU time in
# 38 cases with 20, 13.6 s in 118 with 100. Its PASS prints check's command for the wider search.
BISECT_SEARCH = 20

# ---- how and where it runs -------------------------------------------------------------------------

# how a CPU computes scaled GEMM calls (parity.cpu_gemm): the first is the default
CPU_GEMM_MODES = ("fast", "hopper", "torch")
# the data-parallel wrappers of `check --distributed` (parity.distributed)
DISTRIBUTED_MODES = ("ddp", "fsdp2")

# ---- sweep and bench (parity.sweep.PRESETS, parity.bench.PRESETS) ----------------------------------

SWEEP_DEFAULT_IMPLS = ("fp8_impl", "torchao:tensorwise", "torchao:rowwise", "torchao:rowwise_with_gw_hp", "bf16")
# each sweep preset's name and description, in the order of parity.sweep.PRESETS
SWEEP_PRESET_DESCRIPTIONS = {
    "quick": "small layers of nanochat-d20 and Llama-3-8B shapes, and 120 sampled cases (on a CPU: 60 sampled cases "
             "up to 128, no named shapes)",
    "full": "nanochat d20/d26/d32 and Llama 3 8B/70B layers in four variants, 1000 sampled cases",
    "nanochat": "nanochat d20/d26/d32 layers in four variants",
    "llama": "Llama 3 8B and 70B layers in four variants",
    "outliers": "nanochat d20 and Llama 3 8B/70B layers on normal data, an outlier channel and an outlier token: "
                "which recipe keeps its accuracy (use with --accuracy-only)",
    "cpu-layers": "real layer sizes a CPU runs in minutes: nanochat-d8's three layers (K, N 512 to 2048) at 768 tokens "
                  "in four variants, the edge cases and 20 sampled cases up to 256",
}
BENCH_DEFAULT_IMPLS = ("fp8_impl", "torchao:tensorwise", "torchao:rowwise", "bf16")
# each bench preset's name and description, in the order of parity.bench.PRESETS, and how many layer
# shapes it times (the shapes are built there, from parity.sweep's layer tables)
BENCH_PRESET_DESCRIPTIONS = {
    "nanochat": "nanochat d20/d26/d32 layers, 32768 tokens",
    "llama": "Llama 3 8B and 70B layers, 8192 tokens",
    "small": "GPT-2 small/medium layers and nanochat-sized shapes",
}
BENCH_PRESET_SHAPES = {"nanochat": 9, "llama": 8, "small": 6}

# ---- train (parity.train_plan, parity.model) -------------------------------------------------------

DEFAULT_BASELINE = "bf16"  # what train measures the loss against
# The learning rate of your own model (--model file.py:factory) unless --lr says otherwise; the
# built-in models carry theirs (GPTConfig.learning_rate: 1e-2 for tiny, 3e-3 for d12).
LEARNING_RATE = 1e-2
# what --model path/to/file.py:factory must name
FACTORY_PROTOCOL = ("a callable taking no arguments and returning an nn.Module whose forward maps token ids "
                    "[B, T] to logits [B, T, vocab_size], with int attributes vocab_size and seq_len (and "
                    "optionally batch_size, default 8)")

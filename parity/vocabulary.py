"""The words fp8-parity's findings are made of, as enums: read by code, rendered to text only at the edge.

Each is a `str` enum whose value is the word the JSON, the tables and the docs use ("scale",
"grad_weight"), so a value compares equal to its word and prints as it.
"""

from __future__ import annotations

import enum


# How a worker's death reads: "the implementation exited the process with code 0 during step 0: forward"
# (parity.worker.Died.message). A results table keeps an error as text only: parity.rows tells a death by this.
DIED_PREFIX = "the implementation"


class Word(str, enum.Enum):
    """A str enum that prints as its value (f-strings, str(), CSV cells, JSON)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class BugClass(Word):
    """The bug classes bisect names (DESIGN.md's vocabulary, plus precision and unknown)."""

    TRANSPOSE = "transpose"  # an operand or result logically transposed or reinterpreted with view/reshape
    LAYOUT = "layout"  # the same logical values in other strides give another result
    SCALE = "scale"  # wrong amax region, missing abs, scale instead of inverse, low-precision scale
    FP8_DTYPE = "fp8_dtype"  # another fp8 format for an operand
    SATURATION = "saturation"  # wrong clamp bound, overflow to NaN
    ACCUMULATION = "accumulation"  # differences at accumulation level only (fast accum, out dtype rounding)
    CONTRACT = "contract"  # output or gradient dtype/shape/strides differ from nn.Linear's
    STALE_STATE = "stale_state"  # results depend on earlier calls
    CRASH = "crash"  # the implementation raises
    PRECISION = "precision"  # a GEMM in another precision than its recipe's, or an operand rounded before its cast
    UNKNOWN = "unknown"  # differs, and no hypothesis reproduces it


class Detail(Word):
    """Inside a bug class, what of a microscaled (MXFP8, NVFP4) cast went wrong (parity.mx_mistakes)."""

    SCALE_ROUNDING = "scale_rounding"  # the block scale by another rule (FLOOR/RCEIL/CEIL), a binade off, clamped
    BLOCK_AXIS = "block_axis"  # blocks along the other dim (dim0 where dim1 belongs) or of another length
    SCALE_PADDING = "scale_padding"  # the scale tensor's padding to whole 128x4 tiles
    SWIZZLE = "swizzle"  # the scale tensor's layout (cuBLAS's swizzled 32_4_4 or not)
    NAN_HANDLING = "nan_handling"  # a NaN (or Inf) in a block and what its scale and elements become
    ELEMENT_ROUNDING = "element_rounding"  # the elements' rounding onto the grid (saturation, zeros)


class Operand(Word):
    """What a finding blames: a GEMM operand, the GEMM's result, the call itself."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"
    RESULT = "result"
    CALL = "call"
    UNKNOWN = "unknown"


class Tensor(Word):
    """What a result row or a finding is about: a tensor the layer gives back (the first three are
    its GEMMs' results, grad_bias a sum), or the whole case (a crash)."""

    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"
    GRAD_BIAS = "grad_bias"
    ALL = "all"  # a crash: the case as a whole


class Verdict(Word):
    """What `check` and `bisect` conclude (CheckResult.verdict, Localization.verdict)."""

    PASS = "pass"  # no violation (bisect: nothing to localize)
    FAIL = "fail"
    ERROR = "error"  # nothing could be judged: no case could run, or a reference failed


class Kind(Word):
    """What kind of finding: the metric a policy judges (parity.policy's violations; the JSON's
    `metric`), or a difference the diagnosis finds along a GEMM's data path (parity.diagnose)."""

    BITWISE = "bitwise"
    ACCUMULATION_BOUND = "accumulation_bound"
    EXACT = "exact"  # not bit for bit the Hopper model's result where the calibration vouches for the call
    OPERAND = "operand"  # a recorded GEMM call handed other operands than the recipe's oracle
    SQNR_DB = "sqnr_db"
    PAIRED_SQNR_DB = "paired_sqnr_db"
    NONFINITE = "nonfinite"
    CONTRACT = "contract"  # nn.Linear's contract (dtypes, shapes, strides, side effects)
    SCALED_MM_CONTRACT = "scaled_mm_contract"  # a _scaled_mm call that would fail on an H100
    CRASH = "crash"
    DETERMINISM = "determinism"  # a second run of the same case gave other results
    STAGE = "stage"  # one stage of what a GEMM was handed differs from the oracle's (diagnose)
    BEHAVIOUR = "behaviour"  # a hypothesis reproduces a GEMM's results end to end (diagnose)


class Cause(Word):
    """Why a violation of one kind was raised, where the kind alone does not say (decisions read
    this, never the violation's sentence)."""

    SHAPE_DIFFERS = "shape_differs"  # bitwise: not comparable, the shapes differ
    MISSING = "missing"  # bitwise: not comparable, the candidate returned None (a contract matter, no wrong number)
    DTYPE_ONLY = "dtype_only"  # bitwise: equal values in another dtype (a contract matter)
    VALUES_DIFFER = "values_differ"  # bitwise: elements differ
    FLAG_IGNORED_ON_CPU = "flag_ignored_on_cpu"  # operand: only use_fast_accum differs, which a CPU ignores


class Stage(Word):
    """Where along a GEMM's data path a diagnosis finding is (parity.diagnose, parity.bisect)."""

    IN_PLACE = "in_place"  # an operand the implementation wrote in place
    CALLS = "calls"  # which calls were made (none, or one the kernel rejects outright)
    RECIPE = "recipe"  # every recorded call is another recipe's (the layer implements that one)
    PRECISION = "precision"
    FP8_DTYPE = "fp8_dtype"
    SCALE = "scale"
    BYTES = "bytes"  # the fp8 values
    UNIT_SCALES = "unit_scales"  # a call with scales of one: the scales applied elsewhere
    FAST_ACCUM = "fast_accum"
    OUT_DTYPE = "out_dtype"
    RESULT = "result"  # what the implementation does with the GEMM's result
    CONTRACT = "contract"
    GPU_RULE = "gpu_rule"  # a call an H100 rejects for a rule that names a bug class
    BEHAVIOUR = "behaviour"  # diagnosed end to end (no recorded call)


class Method(Word):
    """How bisect localized a failure (Localization.method)."""

    RECORDED_CALLS = "recorded calls"
    BEHAVIOUR = "behaviour"
    CRASH = "crash"


class Condition(Word):
    """A condition of a case that a failure may need (a bisect trigger), found by flipping it."""

    NON_CONTIGUOUS = "non_contiguous"  # an operand stored non-contiguously
    K_EQUALS_N = "k_equals_n"
    ND_INPUT = "nd_input"  # input with more than one leading dim
    DTYPE = "dtype"  # a tensor's dtype other than bf16
    SECOND_CALL = "second_call"  # a case of two calls (steps)
    EARLIER_CALLS = "earlier_calls"  # state that earlier cases in the same process left
    DISTRIBUTION = "distribution"  # the data distribution
    BIAS = "bias"
    K_NOT_N = "k_not_n"  # a crash's: only while K and N differ
    M_NOT_K = "m_not_k"  # a crash's: only while M and K differ
    GPU = "gpu"  # only on the GPU
    GPU_LINTED = "gpu_linted"  # only on the GPU; on the CPU the contract lint flags the call
    GPU_FAST_ACCUM = "gpu_fast_accum"  # only on the GPU; the CPU ignores use_fast_accum


class Phase(Word):
    """Where the code under test was when it raised or died (parity.runner.execute)."""

    IMPORT = "importing the implementation"  # in its worker, before its first case
    BUILD = "building the module"
    UPDATE = "updating the weight in place"  # an optimizer-like in-place step between calls
    FORWARD = "forward"
    BACKWARD = "backward"

    def at(self, step: int | None) -> str:
        """The phase as the results name it: "building the module", "step 1: forward"."""
        return self.value if step is None else f"step {step}: {self.value}"

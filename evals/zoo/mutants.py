"""The mutant zoo: buggy variants of FP8 linear layers, each a few lines from correct.

`_Tensorwise` below is a correct tensorwise implementation (bitwise equal to torchao); each
mutant switches one `if bug == ...` branch, so the diff between a mutant and correct code
is the lines under its name. `_Recipes` does the same for the rowwise and blockwise recipes,
on fp8_impl's own building blocks. MUTANTS records, for every mutant, what a localizer should
say about it: its recipe, the GEMMs it breaks, the operand to blame, its bug class (the
README's vocabulary) and the condition it needs to show. The harness's own tests use the zoo
to prove that `check` kills every mutant and `bisect` localizes each.

Load one as an implementation: `evals/zoo/mutants.py:<name>` (with `--recipe RECIPE` for
the recipe mutants).
"""

from __future__ import annotations

from dataclasses import dataclass

import weakref

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


@dataclass(frozen=True)
class Mutant:
    name: str
    category: str  # transpose | layout | scale | fp8_dtype | saturation | accumulation | contract | stale_state | crash
    gemms: tuple[str, ...]  # the GEMMs (tensors) it breaks: output, grad_input, grad_weight
    operand: str  # input | weight | grad_output | result
    trigger: str | None  # the one condition it needs, or None when it always shows
    description: str
    gpu_only: bool = False  # shows only where _scaled_mm rejects layouts (a CPU runs them)
    recipe: str = "tensorwise"

    @property
    def spec(self) -> str:
        return f"{__file__}:{self.name}"


MUTANTS = [
    Mutant("weight_reshaped", "transpose", ("output",), "weight", None,
           "forward reinterprets the [N,K] weight as [K,N] with reshape instead of transposing it"),
    Mutant("weight_transposed_if_square", "transpose", ("output",), "weight", "K == N",
           "forward 'fixes' a weight it thinks is stored [K,N] whenever its shape allows: wrong when K == N"),
    Mutant("grad_weight_result_reshaped", "transpose", ("grad_weight",), "result", None,
           "grad_weight computed as input.T @ grad_output ([K,N]) and reshaped to [N,K]"),
    Mutant("input_strides_ignored", "layout", ("output", "grad_weight"), "input", "non-contiguous input",
           "quantizes the input through as_strided with contiguous strides: reads the wrong memory when strided"),
    Mutant("grad_output_strides_ignored", "layout", ("grad_input", "grad_weight"), "grad_output",
           "non-contiguous grad_output", "reads grad_output as if it were contiguous"),
    Mutant("grad_weight_b_row_major", "layout", ("grad_weight",), "input", "on the GPU",
           "passes the input to the grad_weight GEMM row-major: cuBLASLt on SM90 rejects it; CPUs run it",
           gpu_only=True),
    Mutant("amax_without_abs", "scale", ("output", "grad_weight"), "input", None,
           "input amax = max(x) instead of max(|x|): wrong whenever the largest magnitude is negative "
           "(most cases: no single condition triggers it)"),
    Mutant("scale_not_inverted", "scale", ("grad_input", "grad_weight"), "grad_output", None,
           "hands _scaled_mm the grad_output scale instead of its inverse"),
    Mutant("weight_scale_bf16", "scale", ("output", "grad_input"), "weight", None,
           "rounds the weight scale to bfloat16 before quantizing"),
    Mutant("grad_output_e4m3", "fp8_dtype", ("grad_input", "grad_weight"), "grad_output", None,
           "quantizes grad_output to e4m3 instead of e5m2"),
    Mutant("weight_e5m2", "fp8_dtype", ("output", "grad_input"), "weight", None,
           "quantizes the weight to e5m2 instead of e4m3"),
    Mutant("input_scaled_to_e5m2_max", "saturation", ("output", "grad_weight"), "input", None,
           "scales the input to e5m2's max (57344) but casts to e4m3 without a clamp: everything saturates "
           "(or is NaN where casts do not saturate)"),
    Mutant("grad_input_fast_accum", "accumulation", ("grad_input",), "result", None,
           "uses fast accumulation in the grad_input GEMM (CPUs ignore the flag; the recorded call shows it)"),
    Mutant("grad_weight_fp32_out", "accumulation", ("grad_weight",), "result", "fp32 weight",
           "writes grad_weight in float32 directly instead of grad_output's dtype: differs only by rounding"),
    Mutant("output_float32", "contract", ("output",), "result", None,
           "returns the output in float32 for any input dtype"),
    Mutant("output_column_major", "contract", ("output",), "result", None,
           "returns the output in column-major strides (right values, wrong layout)"),
    Mutant("cached_weight", "stale_state", ("output", "grad_input"), "weight", "from the second call",
           "caches the quantized weight by parameter identity: an in-place update is missed"),
    Mutant("crash_on_fp32_input", "crash", ("output",), "input", "fp32 input",
           "raises for float32 input (a dtype the recipe takes)"),
    # ---- recipe mutants (rowwise, blockwise) ----
    Mutant("rowwise_amax_whole_tensor", "scale", ("output", "grad_weight"), "input", None,
           "rowwise: the input's row scales all come from the whole tensor's amax (the wrong region)",
           recipe="rowwise"),
    Mutant("rowwise_stale_axis_after_transpose", "scale", ("grad_input",), "weight", "K == N",
           "rowwise: grad_input reuses the forward's fp8 weight, whose scales run along K, when its transposed "
           "shape fits (K == N): the axis metadata is stale after .t() (pytorch/ao #4444)", recipe="rowwise"),
    Mutant("rowwise_zero_rows_nan", "scale", ("output", "grad_weight"), "input", "zero",
           "rowwise: no EPS floor under the input's amax: an all-zero row gets an infinite scale and NaN "
           "(pytorch/ao #3356)", recipe="rowwise"),
    Mutant("rowwise_pow2_missing", "scale", ("output", "grad_weight"), "input", None,
           "rowwise: the input's scales are not rounded down to a power of two", recipe="rowwise"),
    Mutant("blockwise_padding_consumed", "scale", ("output", "grad_input"), "weight", None,
           "blockwise: the 128x128 weight scales are padded to 4 K-blocks with the padding first, so the GEMM "
           "consumes padding bytes as scales (TransformerEngine #3070)", recipe="blockwise"),
    Mutant("blockwise_scales_reshaped", "transpose", ("output", "grad_input"), "weight", None,
           "blockwise: the [N/128, K/128] grid of weight scales is reshaped, not transposed, to [K/128, N/128] "
           "(pytorch/ao #4229's orientation): wrong once both dims span two blocks", recipe="blockwise"),
]
BY_NAME = {m.name: m for m in MUTANTS}


def _to_float8(x: torch.Tensor, fp8: torch.dtype, *, absolute: bool = True, scale_dtype=None,
               target_max: float | None = None, clamp: bool = True):
    amax = torch.max(torch.abs(x)) if absolute else torch.max(x)
    scale = ((target_max or FP8_MAX[fp8]) / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    if scale_dtype is not None:
        scale = scale.to(scale_dtype).to(torch.float32)
    scaled = x.float() * scale
    if clamp:
        scaled = scaled.clamp(-FP8_MAX[fp8], FP8_MAX[fp8])
    return scaled.to(fp8), scale.reciprocal()


def _row_major(t):
    return t if t.stride(1) == 1 and t.stride(0) >= t.size(1) else t.contiguous()


def _col_major(t):
    return t if t.stride(0) == 1 and t.stride(1) >= t.size(0) else t.t().contiguous().t()


_weight_cache: dict[int, tuple] = {}  # id(weight) -> (weakref to it, fp8 weight, inverse scale)


class _Tensorwise(torch.autograd.Function):
    """Correct tensorwise FP8 matmul (input @ weight.T), except where `bug` says otherwise."""

    @staticmethod
    def forward(ctx, input, weight, bug):
        if bug == "crash_on_fp32_input" and input.dtype == torch.float32:
            raise NotImplementedError("float32 input is not supported")
        M, K = input.shape
        N = weight.shape[0]
        if bug == "input_strides_ignored":
            input = torch.as_strided(input, (M, K), (K, 1))
        x, x_inv = _to_float8(input, E4M3, absolute=bug != "amax_without_abs",
                              target_max=57344.0 if bug == "input_scaled_to_e5m2_max" else None,
                              clamp=bug != "input_scaled_to_e5m2_max")
        cached = _weight_cache.get(id(weight)) if bug == "cached_weight" else None
        if cached is not None and cached[0]() is weight:  # the same parameter: reuse, even if updated in place
            w, w_inv = cached[1:]
        else:
            w, w_inv = _to_float8(weight, E5M2 if bug == "weight_e5m2" else E4M3,
                                  scale_dtype=torch.bfloat16 if bug == "weight_scale_bf16" else None)
            if bug == "cached_weight":
                _weight_cache[id(weight)] = (weakref.ref(weight), w, w_inv)
        if bug == "weight_reshaped":
            b = _col_major(w.reshape(K, N))
        elif bug == "weight_transposed_if_square" and w.shape[0] == w.shape[1]:
            b = _col_major(w)  # "stored as [K,N] already"
        else:
            b = _col_major(w.t())
        output = torch._scaled_mm(_row_major(x), b, scale_a=x_inv, scale_b=w_inv, out_dtype=input.dtype,
                                  use_fast_accum=True)
        if bug == "output_float32":
            output = output.float()
        if bug == "output_column_major":
            output = output.t().contiguous().t()
        ctx.save_for_backward(x, w, x_inv, w_inv)
        ctx.bug, ctx.weight_dtype = bug, weight.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, w, x_inv, w_inv = ctx.saved_tensors
        bug = ctx.bug
        if bug == "grad_output_strides_ignored":
            grad_output = torch.as_strided(grad_output, grad_output.shape, (grad_output.shape[1], 1))
        g, g_inv = _to_float8(grad_output, E4M3 if bug == "grad_output_e4m3" else E5M2)
        g_scale = g_inv.reciprocal() if bug == "scale_not_inverted" else g_inv
        grad_input = torch._scaled_mm(_row_major(g), _col_major(w), scale_a=g_scale, scale_b=w_inv,
                                      out_dtype=grad_output.dtype, use_fast_accum=bug == "grad_input_fast_accum")
        out_dtype = torch.float32 if bug == "grad_weight_fp32_out" else grad_output.dtype
        if bug == "grad_weight_result_reshaped":
            grad_weight = torch._scaled_mm(_row_major(x.t()), _col_major(g), scale_a=x_inv, scale_b=g_scale,
                                           out_dtype=out_dtype).reshape(w.shape)
        else:
            b = _row_major(x) if bug == "grad_weight_b_row_major" else _col_major(x)
            grad_weight = torch._scaled_mm(_row_major(g.t()), b, scale_a=g_scale, scale_b=x_inv, out_dtype=out_dtype)
        return grad_input, grad_weight.to(ctx.weight_dtype), None


class _Recipes(torch.autograd.Function):
    """fp8_impl's rowwise and blockwise GEMMs (correct: bitwise equal to fp8_impl), except where `bug` says."""

    @staticmethod
    def forward(ctx, input, weight, recipe, bug):
        from fp8_impl import Float8LinearConfig
        config = Float8LinearConfig.from_recipe_name(recipe)
        ctx.save_for_backward(input, weight)
        ctx.config, ctx.bug, ctx.weight_dtype = config, bug, weight.dtype
        ctx.weight_cast = _recipe_cast(weight, config.output.b, config, bug, "weight")  # kept for the stale bug
        return _recipe_gemm(input, weight, config.output, config, input.dtype, bug, ("input", "weight"))

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        config, bug = ctx.config, ctx.bug
        stale = ctx.weight_cast if bug == "rowwise_stale_axis_after_transpose" and weight.shape[0] == \
            weight.shape[1] else None  # "the transposed fp8 weight has the right shape: reuse it"
        grad_input = _recipe_gemm(grad_output, weight.t(), config.grad_input, config, grad_output.dtype, bug,
                                  ("grad_output", "weight"), cached_b=stale and (stale[0].t(), stale[1]))
        grad_weight = _recipe_gemm(grad_output.t(), input.t(), config.grad_weight, config, grad_output.dtype, bug,
                                   ("grad_output", "input"))
        return grad_input, grad_weight.to(ctx.weight_dtype), None, None


def _recipe_cast(x, cast, config, bug, operand):
    from fp8_impl.config import Scaling
    from fp8_impl.matmul import quantize
    pow2 = config.round_scales_to_power_of_2 and not (bug == "rowwise_pow2_missing" and operand == "input")
    if operand == "input" and bug == "rowwise_amax_whole_tensor" and cast.scaling is Scaling.AXISWISE:
        scale = (FP8_MAX[E4M3] / torch.clamp(x.abs().max().double(), min=1e-12)).float()
        scale = torch.exp2(torch.floor(torch.log2(scale))).expand(x.shape[0], 1)
        return (x.float() * scale).clamp(-448, 448).to(E4M3), scale.reciprocal()
    if operand == "input" and bug == "rowwise_zero_rows_nan" and cast.scaling is Scaling.AXISWISE:
        scale = torch.exp2(torch.floor(torch.log2((448.0 / x.abs().amax(1, keepdim=True).double()).float())))
        return (x.float() * scale).clamp(-448, 448).to(E4M3), scale.reciprocal()
    x_fp8, inverse = quantize(x, cast, pow2=pow2)
    if cast.scaling is Scaling.BLOCK_1X128:
        inverse = inverse.t().contiguous().t()
    return x_fp8, inverse


def _recipe_gemm(a_hp, b_hp_t, gemm, config, out_dtype, bug, operands, cached_b=None):
    from fp8_impl.config import Scaling
    from fp8_impl.matmul import _gemm
    if gemm.a.scaling is Scaling.DISABLED:
        return a_hp @ b_hp_t.t()
    a, scale_a = _recipe_cast(a_hp, gemm.a, config, bug, operands[0])
    bt, scale_bt = cached_b or _recipe_cast(b_hp_t, gemm.b, config, bug, operands[1])
    scale_b = scale_bt if gemm.b.scaling is Scaling.BLOCK_1X128 else scale_bt.t()
    if gemm.b.scaling is Scaling.BLOCK_128X128 and bug == "blockwise_scales_reshaped":
        scale_b = scale_bt.reshape(scale_b.shape)
    if gemm.b.scaling is Scaling.BLOCK_128X128 and bug == "blockwise_padding_consumed":
        blocks = scale_b.shape[0]
        padded = torch.cat([scale_b.new_ones(-blocks % 4, scale_b.shape[1]), scale_b])  # padding first
        scale_b = padded[:blocks] if a.device.type != "cuda" else padded.t().contiguous().t()
    return _gemm(_row_major(a), scale_a, _col_major(bt.t()), scale_b, gemm, out_dtype)


def correct(input_2d, weight):
    """The zoo's control: no bug. Bitwise equal to torchao tensorwise."""
    return _Tensorwise.apply(input_2d, weight, None)


def _make(name: str):
    recipe = BY_NAME[name].recipe

    def mutant(input_2d, weight):
        if recipe != "tensorwise":
            return _Recipes.apply(input_2d, weight, recipe, name)
        return _Tensorwise.apply(input_2d, weight, name)
    mutant.__name__ = name
    mutant.__doc__ = BY_NAME[name].description
    return mutant


for _m in MUTANTS:
    globals()[_m.name] = _make(_m.name)


def correct_rowwise(input_2d, weight):
    """The recipe mutants' control for rowwise (run with --recipe rowwise): no bug."""
    return _Recipes.apply(input_2d, weight, "rowwise", None)


def correct_blockwise(input_2d, weight):
    """The recipe mutants' control for blockwise (run with --recipe blockwise): no bug."""
    return _Recipes.apply(input_2d, weight, "blockwise", None)


class CachedWeightLinear(nn.Linear):
    """The stale_state mutant in module form (a from_float Float8Linear-style class)."""

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "CachedWeightLinear":
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, input):
        out = _Tensorwise.apply(input.reshape(-1, input.shape[-1]), self.weight, "cached_weight")
        out = out.reshape(*input.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias.to(out.dtype)

"""The MX zoo: MXFP8 and NVFP4 linear layers written from /work/wt/MX-SPEC.md, correct and with public bugs planted.

`_Mx` is a correct implementation of the contract, independent of parity.mx (its own casts, its own
swizzle), calling torch.nn.functional.scaled_mm as SM100 takes it; on a CPU the harness serves those
calls (parity.cpu_gemm). Each mutant switches one `if bug == ...` branch. MX_MUTANTS records what a
localizer should say: the recipe, the GEMMs it breaks, the operand, the bug class and the public report
it plants. The first six are the public bugs of issue 30; the NVFP4 ones make the planted-bug set of the
NVFP4 operand comparison.

Load one as an implementation: `evals/zoo/mx_mutants.py:<name>` with `--recipe mxfp8` (or the entry's recipe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3, E8M0, FP4 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2
SWIZZLE = F.SwizzleType.SWIZZLE_32_4_4
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# a Triton kernel's tiles, scaled to the dims a CPU check runs (up to 256): torchao's dim1 cast tiles 512
# columns (#3362) and 128 rows (#4627) on a B200; the grouped GEMM pads each group to 128 tokens (TE #3484)
COL_TILE, ROW_TILE, GROUP_PAD = 64, 128, 128


@dataclass(frozen=True)
class MxMutant:
    name: str
    recipe: str
    category: str
    gemms: tuple[str, ...]
    operand: str
    source: str  # the public report it plants, or "invented"
    description: str

    @property
    def spec(self) -> str:
        return f"{__file__}:{self.name}"


MX_MUTANTS = [
    MxMutant("mx_dim1_floor", "mxfp8", "scale", ("grad_input", "grad_weight"), "weight", "pytorch/ao PR #3686",
             "the dim1 casts (weight for grad_input; grad_output and input for grad_weight) round their E8M0 scales "
             "by FLOOR where the recipe asks RCEIL"),
    MxMutant("mx_dim1_tile_transposed", "mxfp8", "transpose", ("grad_weight",), "input", "pytorch/ao #3362",
             "the dim1 cast of the input (for grad_weight) with a multi-tile column loop stores its fp8 elements "
             "transposed within each 32x32 sub-tile (a transposed store's index swap); its scales are right"),
    MxMutant("mx_dim1_scale_overwrite", "mxfp8", "layout", ("grad_weight",), "grad_output", "pytorch/ao PR #4627",
             "the dim1 cast of grad_output stores the scales of a partial row tile (M not a multiple of the tile) "
             "as a whole tile: the padding's scales overwrite the first scales of the next column"),
    MxMutant("mx_dim0_nan_skipped", "mxfp8", "scale", ("output",), "input", "pytorch/ao PR #4201",
             "the dim0 casts take amax with a max that skips NaN: a block holding a NaN keeps a finite scale"),
    MxMutant("mx_padded_tokens", "mxfp8", "layout", ("output",), "input", "TransformerEngine #3484",
             "tokens padded to a group of 128 as a grouped GEMM of one group does: the input's dim0 scales are "
             "read at the padded group's offset (misindexed). The report's second half, grad_weight summed over the "
             "padding, is not planted: it changes the GEMM's shape (see docs/concepts/mx.md)"),
    MxMutant("nvfp4_sr_zeros", "nvfp4", "scale", ("grad_input", "grad_weight"), "grad_output",
             "TransformerEngine PR #3281", "the casts of grad_output take a stochastic-rounding path that returns "
             "zero elements (its scales are right)"),
    # ---- NVFP4's planted set (invented) ----
    MxMutant("nvfp4_no_global_scale", "nvfp4", "scale", ("output", "grad_weight"), "input", "invented",
             "the input's casts leave out the per-tensor scale (global 1.0): e4m3 block scales alone"),
    MxMutant("nvfp4_block_scale_clamped", "nvfp4", "scale", ("output", "grad_input"), "weight", "invented",
             "the weight's block scales clamped at e4m3's smallest normal 2^-6 (torchao 0.18's nvfp4_quantize)"),
    MxMutant("nvfp4_nibbles_swapped", "nvfp4", "layout", ("output", "grad_weight"), "input", "invented",
             "the input's e2m1 pairs packed with element 2j in the high nibble (the contract: the low one)"),
    MxMutant("nvfp4_unswizzled_scales", "nvfp4", "layout", ("output",), "input", "invented",
             "the input's block scales handed over row-major while the call declares SWIZZLE_32_4_4"),
    # ---- MXFP8's invented mistakes that no single hypothesis of parity.mx_mistakes reproduces ----
    MxMutant("mx_floor_saturation_wraps", "mxfp8_floor", "saturation", ("output", "grad_input"), "weight",
             "invented", "a software e4m3 encoder of the weight's casts without saturation: FLOOR-scaled values "
             "past 464 wrap into the sign bit (-448 for 512) instead of saturating at 448"),
    MxMutant("mx_grad_input_scales_swapped", "mxfp8", "scale", ("grad_input",), "grad_output", "invented",
             "the grad_input GEMM handed B's scales as A's and A's as B's (their padded sizes agree while both "
             "operands fit one 128x4 tile)"),
    MxMutant("mx_input_round_half_away", "mxfp8", "scale", ("output",), "input", "invented",
             "a software e4m3 encoder of the input's dim0 cast that rounds ties away from zero (the contract: to "
             "even); its scales are right"),
    MxMutant("mx_input_blocks_of_64", "mxfp8", "scale", ("output",), "input", "invented",
             "the input's dim0 cast in blocks of 64: its scale tensor has the size of 32-blocks' only where the "
             "padding to 4 scale columns hides it (K = 64, 128), and the call raises elsewhere"),
]
BY_NAME = {m.name: m for m in MX_MUTANTS}


# ---- the contract's casts, written independently of parity.mx -----------------------------------------

def _e8m0(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """The unbiased E8M0 exponent of each block (float32; NaN for a block with a NaN or an Inf)."""
    ratio = amax / 448.0 if rule == "rceil" else amax  # float32 / float: a float32 quotient
    mantissa, exponent = torch.frexp(ratio)
    if rule == "rceil":  # the smallest e with 2^e >= amax / 448
        e = torch.where(mantissa == 0.5, exponent - 1, exponent).float()
    else:  # floor(log2 amax) - 8
        e = (exponent - 1).float() - 8
    e = torch.where(ratio > 0, e, torch.full_like(e, -127.0)).clamp(-127, 127)
    return torch.where(amax.isfinite(), e, torch.full_like(e, float("nan")))


def _mxfp8(x: torch.Tensor, rule: str, bug: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, inner] -> (e4m3 [rows, inner], E8M0 scales [rows, inner / 32])."""
    rows, inner = x.shape
    size = 64 if bug == "blocks_of_64" else 32
    blocks = x.float().reshape(rows, inner // size, size)
    magnitude = blocks.abs()
    amax = torch.nan_to_num(magnitude, nan=0.0).amax(-1) if bug == "nan_skipped" else magnitude.amax(-1)
    e = _e8m0(amax, rule)
    scaled = blocks * torch.exp2(-e)[..., None]  # exact: a power of two (NaN for a NaN block)
    saturated = scaled.clamp(-448.0, 448.0)
    if bug == "wraps":  # past 464 (448 and half a step) the exponent overflows into the sign bit
        saturated = torch.where(scaled.abs() > 464.0, -saturated, saturated)
    if bug == "half_away":  # ties away from zero: the step of e4m3 at each magnitude (3 mantissa bits, 2^-9 below)
        _, exponent = torch.frexp(saturated)
        step = torch.exp2((torch.clamp(exponent - 1, min=-6) - 3).float())
        saturated = torch.copysign(torch.floor(saturated.abs() / step + 0.5) * step, saturated).clamp(-448.0, 448.0)
    elements = saturated.to(E4M3).reshape(rows, inner).contiguous()  # row-major, as A or B.T
    biased = torch.where(e.isnan(), torch.full_like(e, 255.0), e + 127).to(torch.uint8)
    return elements, biased.view(E8M0)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest e2m1 value, ties to even, saturating at 6: the grid steps by 0.5 below 2, by 1
    up to 4, by 2 above (torch.round rounds half to even)."""
    magnitude = x.abs().clamp(max=6.0)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, x)


def _codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign in bit 3) of values on the grid."""
    codes = (values.abs()[..., None] == E2M1).float().argmax(-1).to(torch.uint8)
    return codes | (torch.signbit(values).to(torch.uint8) << 3)


def _nvfp4(x: torch.Tensor, bug: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, inner] -> (fp4 packed [rows, inner / 2], e4m3 block scales [rows, inner / 16], float32 global)."""
    rows, inner = x.shape
    blocks = x.float().reshape(rows, inner // 16, 16)
    amax_t = blocks.abs().max()
    global_ = torch.tensor(1.0) if bug == "no_global" or amax_t == 0 else amax_t / (448.0 * 6.0)
    block_scales = (blocks.abs().amax(-1) / 6.0 / global_).clamp(max=448.0).to(E4M3)
    if bug == "clamped":
        block_scales = block_scales.float().clamp(min=2.0 ** -6).to(E4M3)
    decode = block_scales.float() * global_
    quotient = torch.where(decode[..., None] == 0, torch.zeros_like(blocks), blocks / decode[..., None])
    values = torch.zeros_like(quotient) if bug == "zeros" else _round_e2m1(quotient)
    codes = _codes(values).reshape(rows, inner)
    low, high = (codes[:, 1::2], codes[:, 0::2]) if bug == "nibbles_swapped" else (codes[:, 0::2], codes[:, 1::2])
    packed = (low | (high << 4)).view(FP4)
    return packed, block_scales, global_.float().reshape(())


def _swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's blocked layout: [rows, cols] padded to 128x4 tiles, each tile's (r, c) at (r%32)*16+(r//32)*4+c."""
    rows, cols = scales.shape
    rows_p, cols_p = -(-rows // 128) * 128, -(-cols // 4) * 4
    raw = scales.view(torch.uint8)
    padded = raw.new_zeros(rows_p, cols_p)
    padded[:rows, :cols] = raw
    tiles = padded.reshape(rows_p // 128, 4, 32, cols_p // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(scales.dtype)


# ---- the GEMMs -------------------------------------------------------------------------------------------

def _mxfp8_call(a, sa, bt, sb, out_dtype):
    """F.scaled_mm as SM100 takes it: A [rows, K] row-major, B = B.T's transpose (column-major), swizzled scales."""
    return F.scaled_mm(a, bt.t(), _swizzle(sa), F.ScalingType.BlockWise1x32, _swizzle(sb),
                       F.ScalingType.BlockWise1x32, swizzle_a=SWIZZLE, swizzle_b=SWIZZLE, output_dtype=out_dtype)


def _mxfp8_gemm(a_hp, bt_hp, out_dtype, rules, bugs=(None, None)):
    """a @ b from A [rows, inner] and B.T [cols, inner], each cast along the inner dim by its rule."""
    a, sa = _mxfp8(a_hp, rules[0], bugs[0])
    bt, sb = _mxfp8(bt_hp, rules[1], bugs[1])
    return _mxfp8_call(a, sa, bt, sb, out_dtype)


def _nvfp4_gemm(a_hp, bt_hp, out_dtype, bugs=(None, None)):
    a, sa, ga = _nvfp4(a_hp, bugs[0])
    bt, sb, gb = _nvfp4(bt_hp, bugs[1])
    kinds = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzles = [SWIZZLE, F.SwizzleType.NO_SWIZZLE]
    scale_a = _swizzle(sa)
    if bugs[0] == "unswizzled":  # row-major scales padded to the swizzled size, declared swizzled
        scale_a = torch.cat([sa.reshape(-1), sa.new_zeros(scale_a.numel() - sa.numel())])
    return F.scaled_mm(a, bt.t(), [scale_a, ga], kinds, [_swizzle(sb), gb], kinds, swizzle_a=swizzles,
                       swizzle_b=swizzles, output_dtype=out_dtype)


def _tile_transposed(x_fp8: torch.Tensor) -> torch.Tensor:
    """[rows, inner] fp8 with every 32x32 sub-tile transposed, where the rows span more than one column tile."""
    rows, inner = x_fp8.shape
    if rows <= COL_TILE:
        return x_fp8
    raw = x_fp8.view(torch.uint8).reshape(rows // 32, 32, inner // 32, 32)
    return raw.transpose(1, 3).reshape(rows, inner).contiguous().view(E4M3)


def _overwritten(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """A dim1 scale grid [cols, rows / 32] stored tile by tile (ROW_TILE rows): a partial last tile written
    whole, its padding scales (amax 0: byte 0) spilling into the next column's first scales."""
    spill = (-rows % ROW_TILE) // 32
    if not spill:
        return scales
    raw = scales.view(torch.uint8).clone()
    raw[1:, :spill] = 0
    return raw.view(E8M0)


def _padding(t: torch.Tensor) -> torch.Tensor:
    """t's rows padded to a whole group of GROUP_PAD with garbage (its rows again, shifted by one)."""
    pad = -t.shape[0] % GROUP_PAD
    return torch.cat([t, t[(torch.arange(pad) + 1) % t.shape[0]]])


class _Mx(torch.autograd.Function):
    """MX-SPEC.md's linear layer (input @ weight.T), except where `bug` says otherwise."""

    @staticmethod
    def forward(ctx, input, weight, recipe, bug):
        ctx.save_for_backward(input, weight)
        ctx.recipe, ctx.bug, ctx.weight_dtype = recipe, bug, weight.dtype
        if recipe == "nvfp4":
            bugs = ({"nvfp4_no_global_scale": "no_global", "nvfp4_unswizzled_scales": "unswizzled",
                     "nvfp4_nibbles_swapped": "nibbles_swapped"}.get(bug),
                    "clamped" if bug == "nvfp4_block_scale_clamped" else None)
            return _nvfp4_gemm(input, weight, input.dtype, bugs)
        rule = "floor" if recipe == "mxfp8_floor" else "rceil"
        if bug == "mx_padded_tokens" and input.shape[0] % GROUP_PAD:
            # one group padded to GROUP_PAD tokens; its scale grid read from the padded group's offset: token m
            # gets the scale of padded token m + pad
            pad = -input.shape[0] % GROUP_PAD
            a, sa = _mxfp8(_padding(input), rule)
            bt, sb = _mxfp8(weight, rule)
            return _mxfp8_call(a[: input.shape[0]], sa[pad:], bt, sb, input.dtype)
        dim0 = "nan_skipped" if bug == "mx_dim0_nan_skipped" else None
        weight_bug = "wraps" if bug == "mx_floor_saturation_wraps" else dim0
        input_bug = {"mx_input_blocks_of_64": "blocks_of_64", "mx_input_round_half_away": "half_away"}.get(bug, dim0)
        return _mxfp8_gemm(input, weight, input.dtype, (rule, rule), (input_bug, weight_bug))

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        recipe, bug = ctx.recipe, ctx.bug
        if recipe == "nvfp4":
            go = "zeros" if bug == "nvfp4_sr_zeros" else None
            grad_input = _nvfp4_gemm(grad_output, weight.t(), grad_output.dtype,
                                     (go, "clamped" if bug == "nvfp4_block_scale_clamped" else None))
            grad_weight = _nvfp4_gemm(grad_output.t(), input.t(), ctx.weight_dtype,
                                      (go, {"nvfp4_no_global_scale": "no_global",
                                            "nvfp4_nibbles_swapped": "nibbles_swapped"}.get(bug)))
            return grad_input, grad_weight, None, None
        rule = "floor" if recipe == "mxfp8_floor" else "rceil"
        dim1 = "floor" if bug == "mx_dim1_floor" else rule  # the casts along the other axis
        dim0 = "nan_skipped" if bug == "mx_dim0_nan_skipped" else None
        if bug == "mx_grad_input_scales_swapped":
            (a, sa), (bt, sb) = _mxfp8(grad_output, rule), _mxfp8(weight.t(), dim1)
            grad_input = _mxfp8_call(a, sb, bt, sa, grad_output.dtype)
        else:
            grad_input = _mxfp8_gemm(grad_output, weight.t(), grad_output.dtype, (rule, dim1),
                                     (dim0, "wraps" if bug == "mx_floor_saturation_wraps" else None))
        return grad_input, _grad_weight(grad_output, input, ctx.weight_dtype, dim1, bug), None, None


def _grad_weight(grad_output, input, weight_dtype, dim1_rule, bug):
    """grad_output.T @ input, both cast along M (their dim1 casts)."""
    a, sa = _mxfp8(grad_output.t(), dim1_rule)
    bt, sb = _mxfp8(input.t(), dim1_rule)
    if bug == "mx_dim1_tile_transposed":
        bt = _tile_transposed(bt)
    if bug == "mx_dim1_scale_overwrite":
        sa = _overwritten(sa, grad_output.shape[0])
    return _mxfp8_call(a, sa, bt, sb, weight_dtype)


def _make(name: str | None, recipe: str):
    def matmul(input_2d, weight):
        return _Mx.apply(input_2d, weight, recipe, name)
    matmul.__name__ = name or f"correct_{recipe}"
    matmul.__doc__ = BY_NAME[name].description if name else f"The MX zoo's control for {recipe}: no bug."
    return matmul


correct_mxfp8 = _make(None, "mxfp8")
correct_mxfp8_floor = _make(None, "mxfp8_floor")
correct_nvfp4 = _make(None, "nvfp4")
for _m in MX_MUTANTS:
    globals()[_m.name] = _make(_m.name, _m.recipe)

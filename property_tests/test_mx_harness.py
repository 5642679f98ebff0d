"""The harness around the MX recipes: the CPU kernel that serves F.scaled_mm's MXFP8/NVFP4 calls, the recorder,
SM100's rules run on a CPU, and the operand comparison (bytes and scales against the oracle's, with the
microscaled hypotheses of parity.mx_mistakes naming what differs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity import cpu_gemm, mx, oracles
from parity.call_diagnosis import call_findings
from parity.cases import Case, Dist
from parity.contract import MX_EMULATED, GpuRule, ScaledMMRecorder, sm90_problems
from parity.data import make_data
from parity.impls import load_impl
from parity.recipes import RECIPES
from parity.runner import execute
from parity.vocabulary import BugClass, Detail

# the zoo's implementations are code under test: each execution runs in a worker (conftest.py)
pytestmark = pytest.mark.usefixtures("code_under_test_in_a_worker")

ZOO = "evals/zoo/mx_mutants.py"
SWIZZLE, NO_SWIZZLE = F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE
MX32, NV16, TENSOR = F.ScalingType.BlockWise1x32, F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise


def mxfp8_operands(M=64, K=96, N=160, seed=0):
    """(a, b, scale_a, scale_b, exact result) of an MXFP8 output GEMM, cast by the oracle."""
    torch.manual_seed(seed)
    cast = RECIPES["mxfp8"].gemm("output").a
    qa, qb = (oracles.quantize(torch.randn(rows, K), cast) for rows in (M, N))
    scales = [mx.swizzled(mx.e8m0_bytes_of(q.inv_scale).view(torch.float8_e8m0fnu)) for q in (qa, qb)]
    return qa.values.to(torch.float8_e4m3fn), qb.values.to(torch.float8_e4m3fn), *scales, oracles.gemm(qa, qb)


def test_the_cpu_kernel_serves_mxfp8_calls_that_torch_refuses():
    a, b, sa, sb, exact = mxfp8_operands()
    call = lambda scale_a=sa: F.scaled_mm(a, b.t(), scale_a, MX32, sb, MX32, swizzle_a=SWIZZLE,  # noqa: E731
                                          swizzle_b=SWIZZLE, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CPU does not support swizzle"):
        call()
    with cpu_gemm.FastScaledMM():
        assert torch.equal(call(), exact.to(torch.bfloat16))
        with pytest.raises(ValueError, match="served on the CPU.*512 entries.*got 256"):
            call(sa[:256])  # scales not padded to whole 128x4 tiles: SM100 refuses them too


def test_the_cpu_kernel_serves_two_level_nvfp4_calls():
    torch.manual_seed(1)
    cast = RECIPES["nvfp4"].gemm("output").a
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    qa, qb = oracles.quantize(x, cast), oracles.quantize(w, cast)
    globals_ = [mx.nvfp4_global_scale(t.abs().amax()) for t in (x, w)]
    blocks = [mx.swizzled((q.inv_scale / g.double()).to(torch.float8_e4m3fn)) for q, g in zip((qa, qb), globals_)]
    with cpu_gemm.FastScaledMM():
        out = F.scaled_mm(mx.pack_e2m1(qa.values), mx.pack_e2m1(qb.values).t(), [blocks[0], globals_[0]],
                          [NV16, TENSOR], [blocks[1], globals_[1]], [NV16, TENSOR], swizzle_a=[SWIZZLE, NO_SWIZZLE],
                          swizzle_b=[SWIZZLE, NO_SWIZZLE], output_dtype=torch.float32)
    assert torch.equal(out, oracles.gemm(qa, qb).to(torch.float32))


def recorded(a, b, sa, sb, **kwargs):
    recorder = ScaledMMRecorder(a.shape[0], a.shape[1], b.shape[1], keep_data=True)
    with cpu_gemm.FastScaledMM(), recorder:  # the recorder on top: it sees the call, the kernel computes it
        F.scaled_mm(a, b, sa, MX32, sb, MX32, output_dtype=torch.bfloat16, **kwargs)
    return recorder.calls[0]


def test_sm100_rules_on_a_cpu():
    """torch's _scaled_mm_v2 rules for MXFP8 on SM100 (ScaledBlas.cpp), reported as SM100's, on a CPU."""
    a, b, sa, sb, _ = mxfp8_operands()
    good = recorded(a, b.t(), sa, sb, swizzle_a=SWIZZLE, swizzle_b=SWIZZLE)
    assert good.swizzle == ("SWIZZLE_32_4_4", "SWIZZLE_32_4_4") and sm90_problems(good) == []
    grids = mx.unswizzled(sa, 64, 3), mx.unswizzled(sb, 160, 3)  # [rows, K / 32], as torchao's to_mx gives them
    unswizzled = recorded(a, b.t(), *grids)  # no swizzle named: the CPU reads the grids as they are
    assert {p.rule for p in sm90_problems(unswizzled)} == {GpuRule.A_NOT_SWIZZLED, GpuRule.B_NOT_SWIZZLED,
                                                           GpuRule.A_MX_SCALE_SIZE, GpuRule.B_MX_SCALE_SIZE}
    assert all(p.message.startswith("would fail on SM100 (B200): ") for p in sm90_problems(unswizzled))
    row_major_b = recorded(a, b.t().contiguous(), sa, sb, swizzle_a=SWIZZLE, swizzle_b=SWIZZLE)
    assert [p.rule for p in sm90_problems(row_major_b)] == [GpuRule.B_NOT_COLUMN_MAJOR]
    float_scales = recorded(a, b.t(), sa.view(torch.uint8).float(), sb, swizzle_a=SWIZZLE, swizzle_b=SWIZZLE)
    assert GpuRule.MX_SCALE_DTYPE in {p.rule for p in sm90_problems(float_scales)}


def run(impl_name: str, recipe: str, case: Case):
    """(execution, findings of its recorded calls against the oracle) of one case on the CPU."""
    impl = load_impl(impl_name, recipe=recipe)
    data = make_data(case)
    execution = execute(impl, data, record=True, keep_data=True)
    assert execution.error is None, execution.error
    return execution, call_findings(execution.calls, data.steps, RECIPES[recipe], case)


CASE = Case(lead=(96,), K=128, N=64)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_floor", "nvfp4"])
def test_a_correct_implementation_hands_every_gemm_the_oracles_bytes_and_scales(recipe):
    execution, findings = run(f"{ZOO}:correct_{recipe}", recipe, CASE)
    assert len(execution.calls) == 3 and findings == []


@pytest.mark.parametrize("impl, recipe", [(f"{ZOO}:correct_mxfp8", "mxfp8"), ("torchao:mxfp8_floor", "mxfp8_floor")])
def test_nan_blocks_compare_by_their_scale_alone(impl, recipe):
    """A NaN in the input: its block's scale is 0xFF and every element decodes to NaN, whatever its byte
    (torchao's FLOOR cast keeps the block's finite elements, as 0: not a finding)."""
    execution, findings = run(impl, recipe, CASE.replace(dist=Dist.NAN))
    assert findings == [] and execution.steps[0]["output"].isnan().any()


@pytest.mark.parametrize("mutant, gemm, operand, bug_class, detail", [
    ("mx_dim1_floor", "grad_input", "weight", BugClass.SCALE, Detail.SCALE_ROUNDING),
    ("mx_dim1_tile_transposed", "grad_weight", "input", BugClass.TRANSPOSE, None),
    # no single mistake reproduces it: the scales it reads are the oracle's, misplaced (call_diagnosis)
    ("mx_dim1_scale_overwrite", "grad_weight", "grad_output", BugClass.LAYOUT, None),
    ("nvfp4_sr_zeros", "grad_input", "grad_output", BugClass.SCALE, Detail.ELEMENT_ROUNDING),
    ("nvfp4_no_global_scale", "output", "input", BugClass.SCALE, Detail.SCALE_ROUNDING),
    ("nvfp4_unswizzled_scales", "output", "input", BugClass.LAYOUT, Detail.SWIZZLE),
    ("nvfp4_nibbles_swapped", "output", "input", BugClass.LAYOUT, None),
])
def test_operand_findings_name_the_gemm_operand_and_mistake(mutant, gemm, operand, bug_class, detail):
    from evals.zoo.mx_mutants import BY_NAME
    _, findings = run(f"{ZOO}:{mutant}", BY_NAME[mutant].recipe, CASE)
    first = findings[0]
    assert (first.gemm, first.operand, first.category) == (gemm, operand, bug_class), str(first)
    assert (first.hypothesis.detail if first.hypothesis else None) == detail
    if first.hypothesis is None:
        assert first.stage == "scale" and "the right scales stored at the wrong places" in first.message


def test_the_nan_skipping_cast_is_named_on_nan_data_only():
    _, normal = run(f"{ZOO}:mx_dim0_nan_skipped", "mxfp8", CASE)
    _, nan = run(f"{ZOO}:mx_dim0_nan_skipped", "mxfp8", CASE.replace(dist=Dist.NAN))
    assert normal == [] and nan[0].hypothesis.detail is Detail.NAN_HANDLING
    assert (nan[0].gemm, nan[0].operand) == ("output", "input")


def test_torchaos_emulated_mx_layer_is_recorded_and_hands_the_oracles_operands():
    """torchao 0.18's MXFP8Linear (EMULATED) makes no scaled_mm call: its MXTensor GEMMs are recorded from
    the aten.mm of two MXTensors, and on normal data its fp8 bytes and e8m0 scales are the oracle's."""
    execution, findings = run("torchao:mxfp8", "mxfp8", CASE)
    assert [call.op for call in execution.calls] == [MX_EMULATED] * 3 and findings == []
    assert all(sm90_problems(call) == [] for call in execution.calls)


# ---- fp8_impl's mxfp8 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fp8_impls_mxfp8_cast_is_the_oracles_bit_for_bit(rule, dtype):
    """fp8_impl casts on its own (it imports nothing of parity): its bytes and E8M0 scales are the oracle's,
    edge blocks included (a NaN, an Inf, zeros, subnormals, amax at a power of two)."""
    from fp8_impl.matmul import to_mxfp8
    torch.manual_seed(2)
    x = (torch.randn(8, 256) * torch.exp2(torch.randint(-20, 20, (8, 1)).float())).to(dtype)
    x[0, 3], x[1, 40], x[2, 64:96], x[3, 96:128] = float("nan"), float("inf"), 0.0, 2.0 ** -20
    x[4, :32] = torch.linspace(-1, 1, 32).to(dtype) * 448 * 2.0 ** -6  # amax 448 * 2^-6 exactly
    ours_values, ours_scales = to_mxfp8(x, rule)
    q = oracles.quantize(x, RECIPES["mxfp8"].gemm("output").a, mx_rule=rule)
    assert torch.equal(ours_scales.view(torch.uint8), mx.e8m0_bytes_of(q.inv_scale))
    finite = ~q.inv_scale.isnan().repeat_interleave(32, 1)
    assert torch.equal(ours_values.to(torch.float64)[finite], q.values[finite])


def test_fp8_impls_mxfp8_runs_alone_on_a_cpu_and_through_the_harness_kernel():
    """Alone on a CPU, torch refuses the block-scaled call and fp8_impl runs the emulated GEMM; under the
    harness's CPU kernel its F.scaled_mm calls are served, recorded and hand every GEMM the oracle's operands."""
    from fp8_impl import Float8Linear, Float8LinearConfig
    torch.manual_seed(3)
    linear = torch.nn.Linear(64, 96, bias=False, dtype=torch.bfloat16)
    layer = Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name("mxfp8"))
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    exact = oracles.emulate_linear(x, linear.weight.detach(), torch.zeros(32, 96, dtype=torch.bfloat16),
                                   RECIPES["mxfp8"])
    alone = layer(x)
    with cpu_gemm.FastScaledMM():
        served = layer(x)
    assert torch.equal(served, exact.output.to(torch.bfloat16))  # the exact GEMM rounded once
    torch.testing.assert_close(alone, served, rtol=2 ** -7, atol=0)  # fp32 accumulation, then bf16
    execution, findings = run("fp8_impl:mxfp8", "mxfp8", CASE)
    assert len(execution.calls) == 3 and findings == []


@pytest.mark.fp8_gpu
def test_fp8_impls_mxfp8_on_the_gpu_is_within_the_bound_of_the_exact_emulation():
    """On a GPU before SM100 (the H200) fp8_impl's MXFP8 GEMMs are the emulated ones; on SM100 cuBLAS's. Either
    way every element lies within the accumulation bound of the exact result."""
    from fp8_impl import Float8Linear, Float8LinearConfig
    torch.manual_seed(4)
    M, K, N = 256, 512, 384
    linear = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda")
    layer = Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name("mxfp8"))
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    grad_output = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    output = layer(x)
    output.backward(grad_output)
    exact = oracles.emulate_linear(x.detach().cpu(), linear.weight.detach().cpu(), grad_output.cpu(),
                                   RECIPES["mxfp8"])
    for name, got in (("output", output), ("grad_input", x.grad), ("grad_weight", linear.weight.grad)):
        gamma = oracles.accumulation_gamma(exact.inner_dim[name], device_type="cuda", fast_accum=False)
        ratio, beyond, _ = oracles.accumulation_excess(
            got.cpu(), getattr(exact, name).to(torch.bfloat16), magnitude=exact.magnitude[name], gamma=gamma,
            gemm_value=getattr(exact, name), rounding_chain=[torch.bfloat16])
        assert ratio <= 1, f"{name}: {beyond} elements beyond the bound ({ratio:.3g}x)"


def test_torch_scaled_mm_with_e8m0_scales_is_served_and_recorded_as_mxfp8():
    """torchao's SM100 path calls torch._scaled_mm (v1) with e8m0 scales, swizzled: served and read so too."""
    a, b, sa, sb, exact = mxfp8_operands()
    recorder = ScaledMMRecorder(64, 96, 160, keep_data=True)
    with cpu_gemm.FastScaledMM(), recorder:
        out = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16)
    assert torch.equal(out, exact.to(torch.bfloat16))
    call = recorder.calls[0]
    assert call.scaling == ("BlockWise1x32", "BlockWise1x32") and sm90_problems(call) == []



def test_calls_exactly_another_mx_recipes_are_told_so_where_only_the_scale_rule_differs():
    """Held-out set 16's s16_b02 (after its first run): where an operand's difference was explained by no single
    mistake and every call was exactly the mxfp8 (RCEIL) recipe's, the recipe an mxfp8_floor layer implements was
    looked up by what the two recipes' GEMMs differ in, and they differ in none (only in the scale rule): check
    ended in an internal error (StopIteration). It names the recipe, class scale."""
    from parity.call_diagnosis import recipe_finding, stage_finding
    case = Case(lead=(64,), K=128, N=64)
    data = make_data(case)
    execution = execute(load_impl(f"{ZOO}:correct_mxfp8"), data, record=True, keep_data=True)
    unexplained = stage_finding(0, "output", "input", "bytes", "no single mistake reproduces them")
    found = recipe_finding([unexplained], execution.calls, data.steps, RECIPES["mxfp8_floor"], case)
    assert found is not None and found.category is BugClass.SCALE
    assert "every recorded call is exactly the mxfp8 recipe's" in found.message, found.message


@pytest.mark.parametrize("described", [
    "its elements clamped at 240 (e4m3fnuz's max) instead of 448",
    "its raw values clamped to +-448 before the cast",
    "its raw values clamped to +-448 before they are scaled",
    "its grid of scales reinterpreted with view as the other axis's grid shape",
    "its grid of scales transposed and reshaped back to its own shape",  # set 19's s19_b11, after its first run
])
def test_the_mx_saturation_and_grid_view_mistakes_apply_and_change_the_operand(described):
    """Held-out set 16's clamp at 240 (s16_b19), clamp of the raw values (s16_b20) and a dim1 grid viewed in the
    weight's shape (s16_b38) were 'unknown' or 'scale': each is a hypothesis now, which changes a FLOOR-cast operand
    of large values [K = 64, N = 128] (a grid the view reshapes) from the recipe's own cast."""
    from parity.mistakes import quantize_mistaken
    from parity.mx_mistakes import mx_hypotheses
    from parity.recipes import RECIPES
    recipe = RECIPES["mxfp8_floor"]
    cast = recipe.gemm("grad_input").b
    source = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 1000
    hypothesis = next(h for h in mx_hypotheses(cast, recipe, 64, 128) if h.description.startswith(described))
    correct, mistaken = quantize_mistaken(source, cast, recipe), quantize_mistaken(source, cast, recipe, hypothesis)
    assert mistaken is not None
    assert not (torch.equal(mistaken.values, correct.values) and torch.equal(mistaken.inv_scale, correct.inv_scale))


def test_nvfp4_elements_divided_by_the_unrounded_block_scale_is_a_hypothesis_that_applies():
    """Held-out set 17's s17_b03 (elements divided by amax / 6 before its e4m3 rounding, the GEMM handed the rounded
    scale) was 'unknown': it is a scale hypothesis now, and it changes the elements of a Gaussian operand."""
    from parity.mistakes import quantize_mistaken
    from parity.mx_mistakes import mx_hypotheses
    from parity.recipes import RECIPES
    recipe = RECIPES["nvfp4"]
    cast = recipe.gemm("output").a
    source = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    hypothesis = next(h for h in mx_hypotheses(cast, recipe, 32, 64)
                      if h.description.startswith("its elements divided by the block scale before its e4m3 rounding"))
    correct, mistaken = quantize_mistaken(source, cast, recipe), quantize_mistaken(source, cast, recipe, hypothesis)
    assert torch.equal(mistaken.inv_scale, correct.inv_scale) and not torch.equal(mistaken.values, correct.values)
    assert hypothesis.category == "scale"


@pytest.mark.parametrize(("recipe_name", "described", "bug_class"), [
    ("nvfp4", "its e4m3 block scales saturated at 240", "saturation"),
    ("nvfp4", "its e2m1 elements rounded toward zero", "scale"),
    ("mxfp8", "its e4m3 elements rounded toward zero", "scale"),
])
def test_the_clamp_bound_and_truncation_mistakes_apply(recipe_name, described, bug_class):
    """Held-out set 18's s18_b29 (NVFP4 block scales clamped at 240) and s18_b38 (e2m1 rounding by floor) were
    'scale' and 'unknown' on its first run: each is a hypothesis now, of the class the MX sets' convention gives
    (a clamp bound: saturation; the elements' encoding: scale), which changes an operand with a large block."""
    from parity.mistakes import quantize_mistaken
    from parity.mx_mistakes import mx_hypotheses
    from parity.recipes import RECIPES
    recipe = RECIPES[recipe_name]
    cast = recipe.gemm("output").a
    source = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    source[0, :16] *= 1e4  # one block near the tensor's amax, the rest far below it
    hypothesis = next(h for h in mx_hypotheses(cast, recipe, 32, 64) if h.description.startswith(described))
    correct, mistaken = quantize_mistaken(source, cast, recipe), quantize_mistaken(source, cast, recipe, hypothesis)
    assert mistaken is not None and hypothesis.category == bug_class
    assert not (torch.equal(mistaken.values, correct.values) and torch.equal(mistaken.inv_scale, correct.inv_scale))

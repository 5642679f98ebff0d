"""parity.diagnose and bisect's classification: the stage that differs names the class, rounding is
never structural, a crash does not hide the numbers, and no recorded FP8 GEMM is a finding.

The implementations here are small user-style layers written in the test, beside the zoo."""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap

import pytest
import torch

from parity import cpu_gemm, mistakes, oracles, result_mistakes
from parity.bisect import localize
from parity.localization import is_gpu_lint as _is_gpu_lint
from parity.cases import Case
from parity.check import CheckPlan, run_check
from parity.data import make_data
from parity.diagnose import _closeness, explain_operand, explain_result
from parity.findings import labels
from parity.impls import load_impl
from parity.mistakes import OperandStage, operand_hypotheses, quantize_mistaken
from parity.operand_sources import OperandSources
from parity.recipes import RECIPES, Cast, Scaling
from parity.vocabulary import BugClass

USER_CODE = textwrap.dedent('''
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from fp8_impl import Float8LinearConfig, float8_matmul


    def bf16_linear(input_2d, weight):
        """Claims FP8 but multiplies in bf16: no _scaled_mm call at all."""
        return input_2d @ weight.t().to(input_2d.dtype)


    class _OneUlp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out):
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad


    class _NudgeWeightGrad(torch.autograd.Function):
        """Passes the weight through; its gradient's first element moves one ulp."""

        @staticmethod
        def forward(ctx, weight):
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            grad.view(-1)[0] = torch.nextafter(grad.view(-1)[0], torch.tensor(float("inf"), dtype=grad.dtype))
            return grad


    class _ReshapedWeightGrad(torch.autograd.Function):
        """Passes the weight through; its gradient comes back reshaped to [K, N] where a transpose belongs,
        then transposed (a function that takes the weight as weight.t() and reshapes its gradient back)."""

        @staticmethod
        def forward(ctx, weight):
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx, grad):
            return grad.reshape(grad.shape[1], grad.shape[0]).t()


    def grad_weight_reshaped(input_2d, weight):
        return float8_matmul(input_2d, _ReshapedWeightGrad.apply(weight))


    class _FallbackThenBackwardRaises(torch.autograd.Function):
        """Blockwise; the forward tries the device's block-scaled kernel first and falls back when there is
        none (a CPU rejects the call: blockwise code does this), then runs fp8_impl's GEMM; the backward
        raises."""

        @staticmethod
        def forward(ctx, input_2d, weight):
            import torch.nn.functional as F
            from fp8_impl.matmul import _cast_for_gemm, _col_major, _gemm, _row_major
            config = Float8LinearConfig.from_recipe_name("blockwise")
            pow2 = config.round_scales_to_power_of_2
            (x, scale_x), (w, scale_w) = (_cast_for_gemm(input_2d, config.output.a, pow2),
                                          _cast_for_gemm(weight, config.output.b, pow2))
            a, b, scale_b = _row_major(x), _col_major(w.t()), scale_w.t()
            padded = scale_b.new_ones(scale_b.shape[1], -(-scale_b.shape[0] // 4) * 4).t()  # K/128 padded to 4
            padded[: scale_b.shape[0]] = scale_b
            try:
                F.scaled_mm(a, b, scale_x, F.ScalingType.BlockWise1x128, padded, F.ScalingType.BlockWise128x128,
                            output_dtype=torch.bfloat16)
            except (RuntimeError, ValueError, NotImplementedError):
                pass
            return _gemm(a, scale_x, b, scale_b, config.output, input_2d.dtype)

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("this backward is not written yet")


    def fallback_then_backward_raises(input_2d, weight):
        return _FallbackThenBackwardRaises.apply(input_2d, weight)


    def one_ulp_off(input_2d, weight):
        """fp8_impl with one grad_weight element a single ulp away: an honest rounding difference."""
        return float8_matmul(input_2d, _NudgeWeightGrad.apply(weight))


    def rowwise_output_without_fast_accum(input_2d, weight):
        """fp8_impl's rowwise recipe with fast accumulation off in the output GEMM: torchao's form of such a
        GEMM (unit scales in the call, the row scales multiplied in afterwards)."""
        import dataclasses
        from fp8_impl import Float8LinearConfig
        config = Float8LinearConfig.from_recipe_name("rowwise")
        config = dataclasses.replace(config, output=dataclasses.replace(config.output, fast_accum=False))
        return float8_matmul(input_2d, weight, config=config)


    class BiasDropped(torch.nn.Linear):
        """fp8_impl's tensorwise GEMMs; from_float builds the layer without the bias (and never copies it)."""

        @classmethod
        def from_float(cls, linear):
            module = cls(linear.in_features, linear.out_features, bias=False, device=linear.weight.device,
                         dtype=linear.weight.dtype)
            module.weight = linear.weight
            return module

        def forward(self, input):
            return float8_matmul(input.reshape(-1, input.shape[-1]), self.weight).reshape(
                *input.shape[:-1], self.out_features)


    class BiasGradientDropped(torch.nn.Linear):
        """fp8_impl's tensorwise GEMMs and the bias added, outside the autograd graph: the bias gets no gradient."""

        @classmethod
        def from_float(cls, linear):
            module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
            module.weight, module.bias = linear.weight, linear.bias
            return module

        def forward(self, input):
            output = float8_matmul(input.reshape(-1, input.shape[-1]), self.weight)
            if self.bias is not None:
                output = output + self.bias.detach()
            return output.reshape(*input.shape[:-1], self.out_features)


    class _UnitScaleCallsFast(TorchDispatchMode):
        """Every _scaled_mm call with unit scales asks for fast accumulation."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.ops.aten._scaled_mm.default and args[2].numel() == 1 and float(args[2]) == 1.0:
                args = (*args[:7], True) if len(args) > 7 else args
                kwargs = kwargs if len(args) > 7 else {**kwargs, "use_fast_accum": True}
            return func(*args, **kwargs)


    from fp8_impl.matmul import _Float8Matmul


    class _RowwiseGradGemmsFast(_Float8Matmul):
        """fp8_impl's GEMMs; in the backward its unit-scale calls (torchao's form of a rowwise GEMM without
        fast accumulation) ask for it."""

        @staticmethod
        def backward(ctx, grad_output):
            with _UnitScaleCallsFast():
                return _Float8Matmul.backward(ctx, grad_output)


    def rowwise_grad_gemms_fast(input_2d, weight):
        return _RowwiseGradGemmsFast.apply(input_2d, weight, Float8LinearConfig.from_recipe_name("rowwise"))


    def operands_rounded_to_bf16(input_2d, weight):
        """fp8_impl with both operands rounded to bf16 first: wrong for an fp32 input or an fp32 weight alike."""
        return float8_matmul(input_2d.to(torch.bfloat16).to(input_2d.dtype), weight.to(torch.bfloat16).to(weight.dtype))


    def input_rounded_to_bf16(input_2d, weight):
        """fp8_impl with the input rounded to bf16 first: wrong for an fp32 or an fp16 input."""
        return float8_matmul(input_2d.to(torch.bfloat16).to(input_2d.dtype), weight)


    def output_doubled(input_2d, weight):
        """The right GEMM, its result then multiplied by 2."""
        return float8_matmul(input_2d, weight) * 2


    def output_times_1_05(input_2d, weight):
        """The right GEMM, its result then multiplied by 1.05."""
        return float8_matmul(input_2d, weight) * 1.05


    def output_through_bf16(input_2d, weight):
        """The right GEMMs; the output rounded through bf16 on its way back to the input's dtype."""
        output = float8_matmul(input_2d, weight)
        return output.to(torch.bfloat16).to(output.dtype)


    class _InputScaledInBf16OnGpu(torch.autograd.Function):
        """Tensorwise; the output GEMM's input multiplied by its scale converted to bf16 (what `x * scale`
        does on a GPU with a 0-dim float32 scale on the device), the product rounded to bf16 before the
        e4m3 cast; the GEMM is handed the float32 scale's inverse. The backward is fp8_impl's."""

        @staticmethod
        def forward(ctx, input_2d, weight):
            from fp8_impl.matmul import to_float8
            ctx.save_for_backward(input_2d, weight)
            scale = (448.0 / input_2d.abs().max().to(torch.float64).clamp(min=1e-12)).to(torch.float32)
            x = (input_2d * scale.to(input_2d.dtype)).clamp(-448, 448).to(torch.float8_e4m3fn)
            w, sw = to_float8(weight, torch.float8_e4m3fn)
            return torch._scaled_mm(x, w.t(), scale_a=scale.reciprocal(), scale_b=sw, out_dtype=input_2d.dtype,
                                    use_fast_accum=True)

        @staticmethod
        def backward(ctx, grad):
            input_2d, weight = ctx.saved_tensors
            with torch.enable_grad():
                leaves = input_2d.detach().requires_grad_(), weight.detach().requires_grad_()
                return torch.autograd.grad(float8_matmul(*leaves), leaves, grad)


    def input_scaled_in_bf16_on_gpu(input_2d, weight):
        return _InputScaledInBf16OnGpu.apply(input_2d, weight)


    class _WeightScaledBy(torch.autograd.Function):
        """Tensorwise output GEMM with the weight cast by a given scale; the backward is fp8_impl's."""

        @staticmethod
        def forward(ctx, input_2d, weight, weight_scale):
            from fp8_impl.matmul import to_float8
            ctx.save_for_backward(input_2d, weight)
            x, sx = to_float8(input_2d, torch.float8_e4m3fn)
            w = (weight.float() * weight_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=weight_scale.reciprocal(),
                                    out_dtype=input_2d.dtype, use_fast_accum=True)

        @staticmethod
        def backward(ctx, grad):
            input_2d, weight = ctx.saved_tensors
            with torch.enable_grad():
                leaves = input_2d.detach().requires_grad_(), weight.detach().requires_grad_()
                return (*torch.autograd.grad(float8_matmul(*leaves), leaves, grad), None)


    class DelayedWeightScaling(torch.nn.Linear):
        """Delayed scaling of the weight: each call casts it by the scale of the call before (1 on the
        first call), as an amax history of length one does."""

        @classmethod
        def from_float(cls, linear):
            module = cls(linear.in_features, linear.out_features, bias=False, device=linear.weight.device,
                         dtype=linear.weight.dtype)
            module.weight = linear.weight
            module.kept_scale = torch.ones((), device=linear.weight.device)
            return module

        def forward(self, input):
            scale, self.kept_scale = self.kept_scale, (448.0 / self.weight.detach().abs().max().double()).float()
            return _WeightScaledBy.apply(input.reshape(-1, input.shape[-1]), self.weight, scale).reshape(
                *input.shape[:-1], self.out_features)


    class _WrongThenCrash(torch.autograd.Function):
        """The weight cast to e5m2 in the forward; the backward then raises."""

        @staticmethod
        def forward(ctx, input_2d, weight):
            from fp8_impl.matmul import to_float8
            x, sx = to_float8(input_2d, torch.float8_e4m3fn)
            w, sw = to_float8(weight, torch.float8_e5m2)
            return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw, out_dtype=input_2d.dtype, use_fast_accum=True)

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


    def wrong_then_crash(input_2d, weight):
        return _WrongThenCrash.apply(input_2d, weight)


    class _SwappedOutputGemm(torch.autograd.Function):
        """The output GEMM as its transpose, weight_fp8 @ input_fp8.T (exact operands), the result
        transposed back; the backward in bf16."""

        @staticmethod
        def forward(ctx, input_2d, weight, contiguous):
            from fp8_impl.matmul import to_float8
            ctx.save_for_backward(input_2d, weight)
            x, sx = to_float8(input_2d, torch.float8_e4m3fn)
            w, sw = to_float8(weight, torch.float8_e4m3fn)
            out = torch._scaled_mm(w, x.t(), scale_a=sw, scale_b=sx, out_dtype=input_2d.dtype,
                                   use_fast_accum=True).t()
            return out.contiguous() if contiguous else out

        @staticmethod
        def backward(ctx, grad):
            input_2d, weight = ctx.saved_tensors
            return grad @ weight.to(grad.dtype), (grad.t() @ input_2d.to(grad.dtype)).to(weight.dtype), None


    def swapped_output_view(input_2d, weight):
        return _SwappedOutputGemm.apply(input_2d, weight, False)


    def swapped_output_contiguous(input_2d, weight):
        return _SwappedOutputGemm.apply(input_2d, weight, True)


    def _rowwise_fake_quant(x, first_row_scale=False):
        """Rowwise e4m3 quantize-dequantize (power-of-2 scales along the last dim) in plain torch: no
        _scaled_mm call; the gradient passes straight through."""
        amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
        amax = amax[:1].expand_as(amax) if first_row_scale else amax
        scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
        fake = (x.detach().float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale
        return x.float() + (fake - x.detach().float())


    def rowwise_weight_kept_hp(input_2d, weight):
        """Rowwise by fake quantization, the weight never cast."""
        return (_rowwise_fake_quant(input_2d) @ weight.float().t()).to(input_2d.dtype)


    class _GradWeightInBf16(torch.autograd.Function):
        """rowwise_with_gw_hp through fp8_impl, but the high-precision grad_weight GEMM always in bf16."""

        @staticmethod
        def forward(ctx, input_2d, weight):
            from fp8_impl import Float8LinearConfig, float8_matmul
            ctx.save_for_backward(input_2d, weight)
            with torch.enable_grad():
                ctx.detached = input_2d.detach().requires_grad_(), weight.detach().requires_grad_()
                ctx.out = float8_matmul(*ctx.detached,
                                        config=Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"))
            return ctx.out.detach()

        @staticmethod
        def backward(ctx, grad):
            grad_input, = torch.autograd.grad(ctx.out, ctx.detached[0], grad)
            input_2d, weight = ctx.saved_tensors
            grad_weight = (grad.to(torch.bfloat16).t() @ input_2d.to(torch.bfloat16)).to(weight.dtype)
            return grad_input, grad_weight


    def gw_hp_grad_weight_in_bf16(input_2d, weight):
        return _GradWeightInBf16.apply(input_2d, weight)


    class _NoWeightGrad(_GradWeightInBf16):
        @staticmethod
        def backward(ctx, grad):
            return _GradWeightInBf16.backward(ctx, grad)[0], None


    def no_weight_grad(input_2d, weight):
        """Returns no gradient for the weight."""
        return _NoWeightGrad.apply(input_2d, weight)


    class _WeightReadTransposed(torch.autograd.Function):
        """Tensorwise; grad_input's GEMM takes the weight the other way round ([K, N] where it needs
        [N, K]): it raises unless K == N, and is wrong there."""

        @staticmethod
        def forward(ctx, input_2d, weight):
            from fp8_impl.matmul import to_float8
            ctx.save_for_backward(input_2d, weight)
            x, sx = to_float8(input_2d, torch.float8_e4m3fn)
            w, sw = to_float8(weight, torch.float8_e4m3fn)
            return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw, out_dtype=input_2d.dtype, use_fast_accum=True)

        @staticmethod
        def backward(ctx, grad):
            from fp8_impl.matmul import to_float8
            input_2d, weight = ctx.saved_tensors
            g, sg = to_float8(grad, torch.float8_e5m2)
            w, sw = to_float8(weight, torch.float8_e4m3fn)
            x, sx = to_float8(input_2d, torch.float8_e4m3fn)
            grad_input = torch._scaled_mm(g, w.t(), scale_a=sg, scale_b=sw, out_dtype=grad.dtype)
            grad_weight = torch._scaled_mm(g.t().contiguous(), x.t().contiguous().t(), scale_a=sg, scale_b=sx,
                                           out_dtype=grad.dtype)
            return grad_input, grad_weight.to(weight.dtype)


    def weight_read_transposed(input_2d, weight):
        return _WeightReadTransposed.apply(input_2d, weight)


    class _GradWeightColumnMajorA(torch.autograd.Function):
        """Tensorwise; grad_weight's GEMM is handed grad_output's fp8 transpose as a view: a column-major
        A, which a CPU multiplies and SM90's cuBLASLt rejects."""

        @staticmethod
        def forward(ctx, input_2d, weight):
            from fp8_impl.matmul import to_float8
            ctx.save_for_backward(input_2d, weight)
            x, sx = to_float8(input_2d, torch.float8_e4m3fn)
            w, sw = to_float8(weight, torch.float8_e4m3fn)
            return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw, out_dtype=input_2d.dtype, use_fast_accum=True)

        @staticmethod
        def backward(ctx, grad):
            from fp8_impl.matmul import to_float8
            input_2d, weight = ctx.saved_tensors
            g, sg = to_float8(grad.contiguous(), torch.float8_e5m2)
            w, sw = to_float8(weight, torch.float8_e4m3fn)
            x, sx = to_float8(input_2d, torch.float8_e4m3fn)
            grad_input = torch._scaled_mm(g, w.t().contiguous().t(), scale_a=sg, scale_b=sw, out_dtype=grad.dtype)
            grad_weight = torch._scaled_mm(g.t(), x.t().contiguous().t(), scale_a=sg, scale_b=sx, out_dtype=grad.dtype)
            return grad_input, grad_weight.to(weight.dtype)


    def grad_weight_column_major_a(input_2d, weight):
        return _GradWeightColumnMajorA.apply(input_2d, weight)


    def _block_fake_quant(x, rows, cols, fp8=torch.float8_e4m3fn, float32_scale=False):
        """Quantize-dequantize [R, C] in rows x cols blocks, e4m3 scales (448 / amax, exact, or with float32_scale
        as `448.0 / amax` on a float32 tensor); straight-through gradient."""
        R, C = x.shape
        v = x.detach().double().reshape(R // rows, rows, C // cols, cols)
        amax = v.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
        scale = (448.0 / amax.float() if float32_scale else (448.0 / amax).float()).double()
        fake = ((v * scale).float().clamp(-448, 448).to(fp8).double() / scale).reshape(R, C).float()
        return x.float() + (fake - x.detach().float())


    def blockwise_weight_e5m2(input_2d, weight):
        """Blockwise by fake quantization, the weight's 128x128 blocks cast to e5m2 with e4m3 scales."""
        out = _block_fake_quant(input_2d, 1, 128) @ _block_fake_quant(weight, 128, 128, torch.float8_e5m2).t()
        return out.to(input_2d.dtype)


    class _BlockwiseFloat32Scales(torch.autograd.Function):
        """All three GEMMs blockwise by fake quantization, every scale `448.0 / amax` on a float32 tensor;
        with `gw_blocks`, grad_weight's grad_output in 128x128 blocks instead of 1x128 tiles along M."""

        @staticmethod
        def forward(ctx, input_2d, weight, gw_blocks):
            ctx.save_for_backward(input_2d, weight)
            ctx.gw_blocks = gw_blocks
            quant = _block_fake_quant
            return (quant(input_2d, 1, 128, float32_scale=True) @
                    quant(weight, 128, 128, float32_scale=True).t()).to(input_2d.dtype)

        @staticmethod
        def backward(ctx, grad):
            input_2d, weight = ctx.saved_tensors
            quant, rows = _block_fake_quant, 128 if ctx.gw_blocks else 1
            grad_input = quant(grad, 1, 128, float32_scale=True) @ quant(weight, 128, 128, float32_scale=True)
            grad_weight = quant(grad.t(), rows, 128, float32_scale=True) @ \
                quant(input_2d.t(), 1, 128, float32_scale=True).t()
            return grad_input.to(grad.dtype), grad_weight.to(weight.dtype), None


    def blockwise_float32_scales(input_2d, weight):
        """Blockwise by fake quantization, each scale `448.0 / amax` on a float32 tensor."""
        return _BlockwiseFloat32Scales.apply(input_2d, weight, False)


    def blockwise_float32_scales_gw_blocks(input_2d, weight):
        """Every scale through a float32 reciprocal, and grad_weight's grad_output scaled per 128x128 block."""
        return _BlockwiseFloat32Scales.apply(input_2d, weight, True)


    def rowwise_first_row_scale(input_2d, weight):
        """Rowwise by fake quantization, every input row scaled by the first row's amax."""
        out = _rowwise_fake_quant(input_2d, first_row_scale=True) @ _rowwise_fake_quant(weight).t()
        return out.to(input_2d.dtype)
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "user_fp8.py"
    path.write_text(USER_CODE)
    return path


def bisect(user_file, name: str, **kw):
    return localize(CheckPlan.make(load_impl(f"{user_file}:{name}")), max_examples=30, **kw)


def test_no_recorded_fp8_gemm_is_a_finding_of_its_own(user_file):
    result = bisect(user_file, "bf16_linear")
    assert result.category == "precision", (result.category, result.evidence)
    assert any("no _scaled_mm call was recorded" in line for line in result.evidence)


@pytest.mark.parametrize("name, category, operand", [("rowwise_weight_kept_hp", "precision", "weight"),
                                                      ("rowwise_first_row_scale", "scale", "input")])
def test_an_implementation_without_scaled_mm_is_diagnosed_by_behaviour(user_file, name, category, operand):
    """No recorded call to compare: the hypotheses are emulated end to end (an operand never cast to
    fp8; a scale broadcast from the first row) and the nearest names the output GEMM's class."""
    result = localize(CheckPlan.make(load_impl(f"{user_file}:{name}", recipe="rowwise")), max_examples=30)
    assert (result.method, result.first, result.category, result.operand) == \
        ("behaviour", "output", category, operand), result.evidence


def test_a_gemm_inside_a_loose_bound_yet_near_a_mistake_is_named_first(user_file, monkeypatch):
    """On a GPU the accumulation bound is the tensor cores' (14-bit partial sums), loose at small K: a
    weight cast to e5m2 can stay inside it in the output GEMM and exceed it first in grad_input. The
    output GEMM, far nearer the mistake than the correct emulation, is named first (the H200's bound,
    applied on the CPU in this process)."""
    accumulation_gamma = oracles.accumulation_gamma
    monkeypatch.setattr(oracles, "accumulation_gamma", lambda inner_dim, *, device_type, fast_accum:
                        accumulation_gamma(inner_dim, device_type="cuda", fast_accum=fast_accum))
    result = localize(CheckPlan.make(load_impl(f"{user_file}:blockwise_weight_e5m2", recipe="blockwise")),
                      max_examples=30, isolate=False)
    assert (result.first, result.category, result.operand) == ("output", "fp8_dtype", "weight"), result.evidence
    assert any("within the accumulation bound here" in line for line in result.evidence), result.evidence


def test_a_dropped_bias_inside_a_loose_bound_is_the_output_gemms(user_file, monkeypatch):
    """A bias never copied: on a GPU the output can stay inside the tensor cores' loose bound, and then
    only grad_bias (None) breaks nn.Linear's contract; the bias is the output GEMM's (held-out set 15's
    h15_b36 came back with no GEMM on the H200). The H200's bound, applied on the CPU in this process."""
    monkeypatch.setattr(oracles, "accumulation_gamma", lambda inner_dim, *, device_type, fast_accum: 1.0)
    result = localize(CheckPlan.make(load_impl(f"{user_file}:BiasDropped")), max_examples=30, isolate=False)
    assert (result.first, result.category, result.operand) == ("output", "contract", "result"), result.evidence
    assert any("only with a bias" in trigger for trigger in result.trigger), result.trigger


def test_only_a_dropped_bias_gradient_blames_no_gemm(user_file):
    """The output, with its bias, and the three GEMMs are right; only grad_bias is None: no GEMM is to blame
    (held-out set 16's s16_b29 was put in the output GEMM, whose result was right)."""
    result = bisect(user_file, "BiasGradientDropped")
    assert (result.first, result.gemm, result.category) == (None, [], "contract"), result.evidence
    assert any("grad_bias is None" in line for line in result.evidence), result.evidence
    from parity.bisect import render
    assert "GEMM         : none (the three GEMMs' results are right; grad_bias is not)" in render(result)


def test_a_result_reshaped_where_a_transpose_belongs_is_named(user_file):
    """grad_weight [N, K] reshaped to [K, N] instead of transposed, then transposed back: a transpose of the
    result, after its GEMM (held-out set 15's h15_b01 was `unknown`: only the other order was tried)."""
    result = bisect(user_file, "grad_weight_reshaped")
    assert (result.first, result.category, result.operand) == ("grad_weight", "transpose", "result"), \
        result.evidence


def test_a_rejected_call_caught_by_the_code_is_not_the_crash(user_file):
    """A call the kernel rejects and the code catches (a fallback) did not end the case: the backward's
    crash is a backward GEMM's (held-out set 15's h15_b48 was put in the output GEMM on the CPU, where its
    blockwise calls are rejected and caught)."""
    result = localize(CheckPlan.make(load_impl(f"{user_file}:fallback_then_backward_raises", recipe="blockwise")),
                      max_examples=30)
    assert (result.first, result.category) == ("grad_input", "crash"), result.evidence


def test_a_missing_gradient_is_a_contract_finding_not_a_harness_error(user_file):
    result = localize(CheckPlan.make(load_impl(f"{user_file}:no_weight_grad", recipe="rowwise_with_gw_hp")),
                      max_examples=30)
    assert (result.first, result.category) == ("grad_weight", "contract"), result.evidence
    assert not any("could not finish" in line for line in result.evidence), result.evidence


def test_a_crash_unless_two_dims_are_equal_is_diagnosed_where_it_runs(user_file):
    """Raises when K != N and computes wrong numbers when K == N: the numbers name the class, the crash
    is reported beside them with its own trigger."""
    result = bisect(user_file, "weight_read_transposed", case=Case(lead=(32,), K=16, N=48))  # raises here
    assert (result.first, result.category, result.operand) == ("grad_input", "transpose", "weight"), \
        (result.category, result.evidence)
    assert result.crash and "only when K != N" in labels(result.crash.triggers), result.crash


def test_a_call_the_gpu_rejects_for_its_layout_is_layout_not_crash(user_file, monkeypatch):
    """On an H200, cuBLASLt rejects a column-major A: the implementation raises in grad_weight. The rule the
    rejected call breaks names the class (layout, grad_output's transpose handed as a view), and the crash is
    reported beside it; here the CPU kernel rejects such calls as SM90's does (in the worker too)."""
    monkeypatch.setenv(cpu_gemm.REJECT_ENV, "sm90-layout")
    result = bisect(user_file, "grad_weight_column_major_a")
    assert (result.first, result.category, result.operand) == ("grad_weight", "layout", "grad_output"), \
        (result.category, result.evidence)
    assert result.crash and "CUBLAS_STATUS_NOT_SUPPORTED" in result.crash.message, result.crash


@pytest.mark.parametrize("name", ["rowwise_output_without_fast_accum", "rowwise_grad_gemms_fast"])
def test_fast_accumulation_flag_in_torchaos_unit_scale_form_is_all_a_cpu_can_show(user_file, name):
    """Without fast accumulation a rowwise GEMM runs torchao's way (unit scales, row scales after): where the
    recipe wants fast accumulation the flag is then the only difference, and so it is where a GEMM the recipe
    runs that way asks for it; either is marked as one only a GPU's numbers show (bisect on the H200 names
    "only on the GPU" from it; held-out set 15's h15_b32 had the unit scales reported beside the flag)."""
    result = run_check(CheckPlan.make(load_impl(f"{user_file}:{name}", recipe="rowwise")), max_examples=10)
    assert result.verdict == "fail" and result.violations
    assert all(_is_gpu_lint(v) for v in result.violations), [v.full_message for v in result.violations]


def test_a_failure_either_dtype_triggers_names_both(user_file):
    """Wrong with an fp32 input and with an fp32 weight: whichever the minimal case has, the other is named too."""
    result = bisect(user_file, "operands_rounded_to_bf16")
    assert result.category == "precision", result.evidence
    for dtype_trigger in ("with fp32 input", "with fp32 weight"):
        assert any(dtype_trigger in trigger for trigger in result.trigger), result.trigger


def test_a_failure_two_input_dtypes_trigger_names_both(user_file):
    """Wrong with an fp32 and with an fp16 input (not with an fp32 weight): whichever the minimal case has,
    the other is named too (held-out set 14's first run named only fp32 for such a bug)."""
    result = bisect(user_file, "input_rounded_to_bf16")
    assert result.category == "precision", result.evidence
    for dtype_trigger in ("with fp32 input", "with fp16 input"):
        assert any(dtype_trigger in trigger for trigger in result.trigger), result.trigger
    assert not any("weight" in trigger for trigger in result.trigger), result.trigger


def test_an_operand_scaled_in_bf16_the_gpu_way_is_named(user_file):
    """`x * scale` with a 0-dim float32 scale: on the CPU the scale is read in float32, on a GPU the kernel
    converts it to bf16 first (held-out set 14's h14_b48 was `unknown` on the H200 for want of that form)."""
    result = bisect(user_file, "input_scaled_in_bf16_on_gpu")
    assert (result.first, result.category, result.operand) == ("output", "precision", "input"), result.evidence
    assert any("converted to bfloat16 first" in line for line in result.evidence), result.evidence


def test_a_scale_kept_from_the_call_before_is_named_stale(user_file):
    """Delayed scaling: the first call's weight scale is an initial 1, every later call's the call
    before's. The first call's scale matches no single mistake; a second call shows where it comes
    from (held-out set 14's h14_b37 was named `scale` for want of that)."""
    result = bisect(user_file, "DelayedWeightScaling")
    assert (result.first, result.category, result.operand) == ("output", "stale_state", "weight"), result.evidence
    assert any("the previous call's amax" in line for line in result.evidence), result.evidence


def test_a_scale_one_ulp_off_through_a_float32_reciprocal_is_named(user_file):
    """`448.0 / amax` on a float32 tensor is 448 * (1 / amax), two roundings: one ulp off torchao's
    float64-then-float32 scale in about a quarter of the groups, enough to round some fp8 values the
    other way. Bisect names exactly that."""
    result = localize(CheckPlan.make(load_impl(f"{user_file}:blockwise_float32_scales", recipe="blockwise")),
                      max_examples=30)
    assert (result.first, result.category) == ("output", "scale"), result.evidence
    assert any("fp8_max * (1 / amax)" in line for line in result.evidence), result.evidence


def test_a_mistake_beside_float32_reciprocal_scales_is_named(user_file):
    """Scales one ulp off through a float32 reciprocal differ in every GEMM; a mistake in grad_weight beside
    them is found by checking again against a recipe that rounds its scales that way."""
    result = localize(CheckPlan.make(load_impl(f"{user_file}:blockwise_float32_scales_gw_blocks",
                                               recipe="blockwise")), max_examples=30)
    assert (result.first, result.category, result.operand) == ("grad_weight", "scale", "grad_output"), \
        (result.first, result.category, result.evidence)
    assert "fp8_max * (1 / amax)" in result.evidence[0], result.evidence


def test_a_high_precision_gemm_run_in_bf16_is_precision(user_file):
    """rowwise_with_gw_hp keeps grad_weight in the input's precision: in bf16 for fp32 training, its operands
    and result rounded to bf16, it is a GEMM in another precision, not an accumulation difference."""
    result = localize(CheckPlan.make(load_impl(f"{user_file}:gw_hp_grad_weight_in_bf16",
                                               recipe="rowwise_with_gw_hp")), max_examples=30)
    assert (result.first, result.category) == ("grad_weight", "precision"), result.evidence
    assert any("fp32 input" in trigger for trigger in result.trigger), result.trigger


def test_an_intermediate_overflow_is_saturation_not_a_misapplied_scale():
    """A result whose finite elements are right and whose Inf sit where the exact result is finite: no
    rescaling hypothesis may explain it by its finite part alone (the Inf must match too)."""
    case = Case(lead=(32,), K=16, N=16, input_dtype="fp16")
    exact = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = exact.to(torch.float16)
    got[::3, ::2] = float("inf")
    explained = explain_result(got, exact, case, "grad_input", RECIPES["rowwise"],
                               scales=(torch.full((32, 1), 2.0 ** -6, dtype=torch.float64),
                                       torch.full((1, 16), 2.0 ** -7, dtype=torch.float64)))
    assert explained.category == "saturation", explained.description


def test_one_ulp_is_a_rounding_level_difference_never_a_structural_bug(user_file):
    """One element of grad_weight one ulp off (within the bound; not bitwise torchao's): the CPU's kernel computed
    its call, so the result stage looks for a mistake that reproduces its bits; none does, and the evidence
    says how near the nearest came (every element but the one) instead of naming one."""
    result = bisect(user_file, "one_ulp_off")
    assert (result.category, result.gemm) == ("accumulation", ["grad_weight"]), (result.category, result.evidence)
    elements = result.diagnosed_case.N * result.diagnosed_case.K
    assert any(line.startswith("exact: grad_weight GEMM (step 0)") and f"no mistake of the result stage reproduces "
               f"its {elements} elements bit for bit (the nearest: {elements - 1})" in line
               for line in result.evidence), result.evidence
    assert result.to_json()["exact"] is None  # no mistake named the class: nothing was reproduced


def test_a_result_rescaled_after_its_gemm(user_file):
    result = bisect(user_file, "output_doubled")
    assert (result.category, result.operand, result.first) == ("scale", "result", "output"), result.evidence
    assert any("multiplied by 2" in line for line in result.evidence)


def test_a_mistake_that_reproduces_every_bit_wins_over_one_that_only_comes_near(user_file):
    """fp32 input with a bias, K = 1024: the output rounded through bf16 before the bias is added. Against the
    float64 result both that rounding and "the bias added twice" come within MATCH_DB (53 and 48 dB on this
    case: the bias is small beside sums of 1024 products), and the space tries the bias first: bisect said
    `contract`. The CPU's fast kernel computed the call; through it the rounding reproduces every element of
    the output bit for bit and the bias twice does not, so the rounding is named, and the JSON says so."""
    result = bisect(user_file, "output_through_bf16", case=Case(lead=(32,), K=1024, N=16, input_dtype="fp32",
                                                                  bias=True))
    assert (result.first, result.category, result.operand) == ("output", "accumulation", "result"), result.evidence
    assert any("stage result" in line and "rounded through bfloat16" in line for line in result.evidence)
    assert any(line.startswith("exact: output GEMM (step 0)") and "reproduces all 512 elements bit for bit" in line
               for line in result.evidence), result.evidence
    assert result.to_json()["exact"] == dict(bit_for_bit=True, equal=512, elements=512, nearest=512,
                                             kernel="cpu_fast")
    entry = next(e for e in result.to_json()["diagnosis"] if e["stage"] == "result")
    assert entry["exact"]["bit_for_bit"] and entry["category"] == "accumulation"


def test_where_no_mistake_reproduces_every_bit_the_one_named_by_closeness_says_how_many_it_does(
        user_file, code_under_test_in_a_worker):
    """The output multiplied by 1.05: the rescaling the space estimates (a least-squares ratio, not 1.05 itself)
    comes within MATCH_DB of the result and is named, as before; through the kernel it reproduces only some of
    the elements bit for bit, and the reading says how many, never that it is exact."""
    from parity.diagnose import gemm_inverse_scales, read_result
    from parity.exact_reproduction import Kernel, call_out_dtype, gemm_bits
    from parity.runner import emulated_steps_of, execute
    case = Case(lead=(32,), K=48, N=16)
    data, recipe = make_data(case), RECIPES["tensorwise"]
    execution = execute(load_impl(f"{user_file}:output_times_1_05"), data, record=True, keep_data=True)
    emulated = emulated_steps_of(data, recipe)[0]
    bits = gemm_bits(recipe, "output", emulated.operands["output"], call_out_dtype(execution.calls, 0, "output"),
                     torch.device("cpu"))
    assert bits is not None and bits.kernel is Kernel.CPU_FAST
    reading = read_result(execution.steps[0]["output"], emulated.output, case, "output", recipe, bits=bits,
                          scales=gemm_inverse_scales(data.steps[0], "output", recipe))
    named = reading.explanation
    assert named.description.startswith("the result multiplied by 1.05"), named
    assert not named.reproduced.whole and 0 < named.reproduced.equal < 512 == named.reproduced.elements
    assert named.reproduced.nearest >= named.reproduced.equal
    # within the bound (only bitwise different) closeness names nothing: only the bits may
    assert read_result(execution.steps[0]["output"], emulated.output, case, "output", recipe, bits=bits,
                       beyond_bound=False).explanation is None


@pytest.mark.parametrize("recipe_name", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("mode", ["fast", "hopper"])
def test_no_kernel_bits_are_claimed_for_a_microscaled_gemm(recipe_name, mode, monkeypatch):
    """No model of SM100's MX GEMMs exists here: exactness never claims one. Before, an MXFP8 call went to the
    Hopper blockwise model (1x128 blocks), and bisect of a converter that dropped the bias ended 'the diagnosis
    could not finish: HopperModelError: a BlockWise call needs K a multiple of 128' (held-out set 16, s16_b25)."""
    from parity.exact_reproduction import gemm_bits
    from parity.runner import emulated_steps_of
    monkeypatch.setenv(cpu_gemm.ENV, mode)
    recipe = RECIPES[recipe_name]
    data = make_data(Case(lead=(64,), K=96, N=32))
    operands = emulated_steps_of(data, recipe)[0].operands["output"]
    assert gemm_bits(recipe, "output", operands, torch.bfloat16, torch.device("cpu")) is None


def test_the_exact_evidence_says_all_n_elements_or_how_near_the_nearest_came():
    from types import SimpleNamespace

    from parity.call_diagnosis import stage_finding
    from parity.evidence import exact_lines
    from parity.exact_reproduction import BitMatch, Kernel
    whole = stage_finding(0, "output", "result", "result", "the bias dropped", "contract",
                          reproduced=BitMatch(96, 96, 96, Kernel.HOPPER_MODEL))
    near = stage_finding(1, "grad_input", "result", "result", "the result multiplied by 3", "scale",
                         reproduced=BitMatch(40, 96, 90, Kernel.CPU_FAST))
    lines = exact_lines(SimpleNamespace(findings=[whole, near], unreproduced=[]))
    assert lines[0] == ("exact: output GEMM (step 0), its call through the Hopper model, calibrated bit for bit for "
                        "this call on this GPU: the mistake named reproduces all 96 elements bit for bit")
    assert "grad_input GEMM (step 1)" in lines[1] and "reproduces its 96 elements bit for bit (the nearest: 90)" \
        in lines[1] and "reproduces 40 of 96" in lines[1] and "all 96" not in lines[1]


def test_a_crash_does_not_hide_the_numbers_before_it(user_file):
    """The forward already handed its GEMM an e5m2 weight; the backward then raises: the class is
    the forward's, and the crash is reported beside it."""
    result = bisect(user_file, "wrong_then_crash")
    assert (result.category, result.first, result.operand) == ("fp8_dtype", "output", "weight"), result.evidence
    assert result.crash is not None and "mat1 and mat2 shapes" in result.crash.message


def test_a_gemm_computed_as_its_transpose_is_not_an_operand_bug(user_file):
    """A and B swapped (B^T A^T, exact operands) is a legitimate formulation: returned as a
    transposed view, the output's strides are the finding (contract); made contiguous, the output
    GEMM has nothing wrong and the first finding is a later GEMM's."""
    result = bisect(user_file, "swapped_output_view")
    assert (result.category, result.first, result.operand) == ("contract", "output", "result"), result.evidence
    result = bisect(user_file, "swapped_output_contiguous")
    assert result.first != "output", result.evidence


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_every_hypothesis_of_the_space_is_recognised_from_its_own_operand(recipe, generator):
    """Quantize an operand with each mistake of the space, hand it to explain_operand: it names that
    mistake (or an equivalent one of the same class), never another class, unless that other
    mistake gives exactly the same operand on this data. Mistakes that end in another fp8 format
    (e5m2, ROCm's fnuz formats, values converted after the cast) are left to the call's dtype."""
    spec = RECIPES[recipe].gemm("output")
    size = 128 if recipe == "blockwise" else 16
    case = Case(lead=(2 * size,), K=2 * size, N=3 * size, steps=2)
    data = make_data(case)
    sources = OperandSources(data.steps[1], data.steps[0])
    for role, cast in (("a", spec.a), ("b", spec.b)):
        rows, inner = sources.view("output", role, "same").shape
        for hypothesis in operand_hypotheses(cast, RECIPES[recipe], rows, inner):
            source = sources.view("output", role, hypothesis.source)
            if source is None or hypothesis.keeps_high_precision:  # not fp8: a recorded call's dtype says it
                continue
            q = quantize_mistaken(source, cast, RECIPES[recipe], hypothesis)
            correct = quantize_mistaken(sources.view("output", role, "same"), cast, RECIPES[recipe])
            if q is None or (torch.equal(q.values, correct.values) and torch.equal(q.inv_scale, correct.inv_scale)):
                continue  # this data does not tell the mistake apart
            if q.fp8_dtype != cast.dtype:  # ends in another fp8 format: a recorded call's dtype says it
                continue
            scales = q.inv_scale.repeat_interleave(rows // q.inv_scale.shape[0], 0).repeat_interleave(
                inner // q.inv_scale.shape[1], 1)
            found = explain_operand(q.values, scales, cast, RECIPES[recipe], sources, "output", role)
            assert found is not None, hypothesis.description
            if found[1] != hypothesis.category:  # only where another mistake gives exactly this operand here
                named = next(h for h in operand_hypotheses(cast, RECIPES[recipe], rows, inner)
                             if h.description == found[2])
                twin = quantize_mistaken(sources.view("output", role, named.source), cast, RECIPES[recipe], named)
                assert twin is not None and torch.equal(twin.values.nan_to_num(), q.values.nan_to_num()) \
                    and torch.equal(twin.inv_scale, q.inv_scale), (hypothesis.description, found)


def test_the_mistake_without_an_amax_floor_gives_infinite_scales():
    cast = Cast(Scaling.TENSORWISE, "e4m3")
    no_floor = next(h for h in operand_hypotheses(cast, RECIPES["tensorwise"], 2, 16)
                    if h.description.startswith("no floor under amax"))
    q = quantize_mistaken(torch.zeros(2, 16), cast, RECIPES["tensorwise"], no_floor)
    assert torch.isnan(q.values).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "reciprocal"])
def test_the_hypothesis_space_is_data(recipe):
    """Every hypothesis is a record: a description, a BugClass and the stage it changes, with that stage's
    transform (or only its source moved); descriptions are unique per operand, every family's part is tried
    in ORDER exactly once, and the reciprocal-scales rounding is a record another module can recognise."""
    spec = RECIPES["tensorwise"] if recipe == "reciprocal" else RECIPES[recipe]
    if recipe == "reciprocal":
        spec = dataclasses.replace(spec, name="reciprocal", reciprocal_scales=True)
    for fp8, (rows, inner) in itertools.product(("e4m3", "e5m2"), ((32, 16), (48, 48), (128, 256), (256, 128))):
        cast = Cast(spec.gemm("output").a.scaling, fp8)
        families = mistakes.hypothesis_families(cast, spec, rows, inner)
        assert sorted(map(repr, families)) == sorted(map(repr, mistakes.ORDER)) and len(set(mistakes.ORDER)) == len(
            mistakes.ORDER)
        space = operand_hypotheses(cast, spec, rows, inner)
        for hypotheses in (space, mistakes.high_precision_hypotheses()):
            for h in hypotheses:
                assert isinstance(h, mistakes.Hypothesis) and h.description and isinstance(h.bug_class, BugClass)
                assert isinstance(h.stage, OperandStage) and all(isinstance(stage, OperandStage) for stage in h.changes)
                assert h.transform is not None or h.source != "same" or h.amax_source != "same", h.description
            assert len({h.description for h in hypotheses}) == len(hypotheses)
        reciprocal = [h for h in space if h is mistakes.RECIPROCAL_SCALES_HYPOTHESIS]
        assert len(reciprocal) == (recipe != "reciprocal") and all(
            h.description == mistakes.RECIPROCAL_SCALES for h in reciprocal)
    # every stage of the cast a hypothesis can change is a stage of the recipe's cast
    assert {stage.value for stage in mistakes.CAST_STAGES} <= {f.name for f in dataclasses.fields(oracles.CastStages)}


def test_the_result_mistakes_are_data():
    """The result stage's mistakes are records too (description, BugClass, what they blame, a transform),
    tried in order: misapplied scales, a rescaling, transpositions, the bias, a second rounding."""
    case = Case(lead=(16,), K=16, N=16, bias=True, input_dtype="fp16")
    exact = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    scales = (torch.full((16, 1), 2.0 ** -6, dtype=torch.float64), torch.full((1, 16), 2.0 ** -7, dtype=torch.float64))
    found = result_mistakes.result_mistakes((exact * 2).to(torch.float16), exact, case, "output", RECIPES["rowwise"],
                                     has_bias=True, scales=scales)
    # (rowwise writes bf16 and then fp16: of the dtypes a result could be rounded through, only float32 is left)
    assert [m.bug_class for m in found] == [BugClass.SCALE] * 7 + [BugClass.TRANSPOSE] * 2 + [BugClass.CONTRACT] * 2 \
        + [BugClass.ACCUMULATION]
    assert {m.operand for m in found[:6]} == {"input", "weight", "result"} and len({m.description for m in found}) == 12
    assert found[6].description == "the result multiplied by 2 (= 2^1) after its GEMM"
    assert all(callable(m.transform) and m.bit_exact == (m.bug_class is BugClass.ACCUMULATION) for m in found)


def test_closeness_needs_the_same_nan_and_inf():
    """A hypothesis explains NaN only if it makes NaN at the same places (an amax without its
    floor on an all-zero tile), never by an SQNR computed around them."""
    zeros, nan = torch.zeros(4), torch.full((4,), math.nan)
    assert _closeness(nan, zeros) == -math.inf
    assert _closeness(zeros, nan) == -math.inf
    assert _closeness(nan, nan) == math.inf
    got = torch.tensor([1.0, math.nan, 3.0, math.inf])
    assert _closeness(got, torch.tensor([1.0, math.nan, 3.0, math.inf])) == math.inf
    assert _closeness(got, torch.tensor([1.0, math.nan, 3.0, -math.inf])) == -math.inf
    assert 30 < _closeness(got, torch.tensor([1.01, math.nan, 3.0, math.inf])) < 60

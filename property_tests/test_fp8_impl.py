"""fp8_impl against torchao's Float8Linear (tensorwise, rowwise, rowwise_with_gw_hp; eager): bitwise
equal, forward and backward; blockwise against torchao's blockwise training on the GPU.

Plain pytest, no engine: these tests stand on their own so the engine's tests can trust fp8_impl.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp8_impl
from fp8_impl import Float8Linear, Float8LinearConfig, convert_to_float8_training, float8_matmul
from parity.impls import quiet_imports

with quiet_imports():
    from torchao.float8 import Float8LinearConfig as TorchaoConfig
    from torchao.float8 import convert_to_float8_training as torchao_convert

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# (leading dims, K, N): 2-D and 3-D inputs, non-square, K == N, and one wider shape.
SHAPES = [((32,), 64, 48), ((2, 16), 32, 80), ((4, 8, 16), 48, 48), ((128,), 256, 112)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.fp8_gpu)]
TORCHAO_RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]  # torchao.float8's


def _shape_id(shape) -> str:
    lead, K, N = shape
    return f"M{'x'.join(map(str, lead))}K{K}N{N}"


def run_layer(layer: nn.Module, linear: nn.Linear, x: torch.Tensor, grad_output: torch.Tensor):
    """(output, grad_input, grad_weight, grad_bias) of one forward + backward."""
    x = x.detach().clone().requires_grad_()
    output = layer(x)
    output.backward(grad_output)
    return output.detach(), x.grad, linear.weight.grad, None if linear.bias is None else linear.bias.grad


def assert_bitwise(ours, theirs, names=("output", "grad_input", "grad_weight", "grad_bias")):
    for name, a, b in zip(names, ours, theirs):
        if a is None and b is None:
            continue
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != torchao's {b.dtype}"
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != torchao's {tuple(b.shape)}"
        assert torch.equal(a, b), (
            f"{name}: not bitwise equal to torchao: {(a != b).sum().item()} of {a.numel()} elements differ, "
            f"max abs diff {(a.double() - b.double()).abs().max().item():.3g}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("input_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_bitwise_equal_to_torchao(shape, input_dtype, weight_dtype, bias, recipe, device, generator):
    lead, K, N = shape
    torch.manual_seed(generator.initial_seed())
    base = nn.Linear(K, N, bias=bias, dtype=DTYPES[weight_dtype], device=device)
    x = torch.randn(*lead, K, generator=generator).to(DTYPES[input_dtype]).to(device)
    grad_output = torch.randn(*lead, N, generator=generator).to(DTYPES[input_dtype]).to(device)

    ours_linear, theirs_linear = copy.deepcopy(base), copy.deepcopy(base)
    ours = run_layer(convert_to_float8_training(nn.Sequential(ours_linear),
                                                config=Float8LinearConfig.from_recipe_name(recipe)),
                     ours_linear, x, grad_output)
    theirs = run_layer(torchao_convert(nn.Sequential(theirs_linear), config=TorchaoConfig.from_recipe_name(recipe)),
                       theirs_linear, x, grad_output)
    assert_bitwise(ours, theirs)
    # nn.Linear's contract: dtypes of output and gradients.
    assert ours[0].dtype == DTYPES[input_dtype] and ours[1].dtype == DTYPES[input_dtype]
    assert ours[2].dtype == DTYPES[weight_dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_bitwise_equal_for_non_contiguous_input(layout, recipe, device, generator):
    """The same logical input in other strides gives the same bits as torchao (and as contiguous)."""
    torch.manual_seed(0)
    base = nn.Linear(64, 32, dtype=torch.bfloat16, device=device)
    x = torch.randn(48, 64, generator=generator).to(torch.bfloat16).to(device)
    grad_output = torch.randn(48, 32, generator=generator).to(torch.bfloat16).to(device)
    strided = x.t().contiguous().t() if layout == "transposed" else torch.repeat_interleave(x, 2, dim=1)[:, ::2]
    assert torch.equal(strided, x) and not strided.is_contiguous()
    ours = lambda m: convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))  # noqa: E731
    results = []
    for convert, data in ((ours, x), (ours, strided),
                          (lambda m: torchao_convert(m, config=TorchaoConfig.from_recipe_name(recipe)), strided)):
        linear = copy.deepcopy(base)
        results.append(run_layer(convert(nn.Sequential(linear)), linear, data, grad_output))
    assert_bitwise(results[1], results[2])
    assert_bitwise(results[1], results[0])


@pytest.mark.fp8_gpu
@pytest.mark.parametrize("shape", [(256, 512, 1024), (4096, 1024, 2048), (1024, 384, 256)], ids=str)
def test_blockwise_bitwise_equal_to_torchao_on_the_gpu(shape, generator):
    """The same block scales, the same torch.nn.functional.scaled_mm: the same bits as torchao's
    Float8BlockwiseLinear (use_triton=False: its GEMMs are the scaled_mm ones)."""
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    M, K, N = shape
    base = nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, K, generator=generator).to(torch.bfloat16).cuda()
    grad_output = torch.randn(M, N, generator=generator).to(torch.bfloat16).cuda()
    ours_linear, theirs_linear = copy.deepcopy(base), copy.deepcopy(base)
    config = Float8LinearConfig.from_recipe_name("blockwise")
    ours = run_layer(Float8Linear.from_float(ours_linear, config=config), ours_linear, x, grad_output)
    theirs = run_layer(Float8BlockwiseLinear.from_float(theirs_linear), theirs_linear, x, grad_output)
    assert_bitwise(ours, theirs, names=("output", "grad_input", "grad_weight"))


def test_blockwise_on_the_cpu_is_an_emulation_within_fp32_accumulation(generator):
    """No CPU kernel has block scales: fp8_impl multiplies the same fp8 operands and block scales by
    exact 128-long partial products summed in fp32 (within fp32 accumulation of the exact result)."""
    from parity import oracles
    from parity.recipes import RECIPES
    M, K, N = 256, 384, 128
    linear = nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
    x = torch.randn(M, K, generator=generator).to(torch.bfloat16)
    grad_output = torch.randn(M, N, generator=generator).to(torch.bfloat16)
    ours = run_layer(Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name("blockwise")), linear,
                     x, grad_output)
    exact = oracles.emulate_linear(x, linear.weight.detach(), grad_output, RECIPES["blockwise"])
    for name, got in zip(("output", "grad_input", "grad_weight"), ours):
        gamma = oracles.accumulation_gamma(exact.inner_dim[name], device_type="cpu", fast_accum=False)
        class Case:  # the dtypes the rounding chain needs
            torch_input_dtype = torch_weight_dtype = torch.bfloat16
            bias = False
        ratio, beyond, _ = oracles.accumulation_excess(
            got, oracles.rounded_like_result(getattr(exact, name), Case, name, RECIPES["blockwise"]),
            magnitude=exact.magnitude[name], gamma=gamma, gemm_value=getattr(exact, name),
            rounding_chain=oracles.rounding_chain(Case, name, RECIPES["blockwise"]))
        assert ratio <= 1, f"{name}: {beyond} elements beyond the fp32 accumulation bound ({ratio:.3g}x)"


def test_float8_matmul_is_a_drop_in_for_matmul(generator):
    x = torch.randn(32, 64, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    out = float8_matmul(x, w)
    out.sum().backward()
    exact = x.detach().double() @ w.detach().double().t()
    sqnr = 20 * torch.log10(exact.norm() / (out.double() - exact).norm())
    assert out.shape == (32, 48) and out.dtype == torch.bfloat16
    assert sqnr > 25.5, f"output SQNR {sqnr:.1f} dB; e4m3 x e4m3 tensorwise gives about 28.5 dB"
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_saves_fp8_tensors_for_backward():
    """Activation memory: tensorwise keeps the FP8 tensors for backward, not the bf16 input and weight
    (the other recipes re-quantize along another axis per GEMM, so they keep the high-precision ones)."""
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        float8_matmul(x, w)
    big = [t for t in saved if t.numel() > 1]
    assert big and all(t.dtype in (fp8_impl.E4M3, fp8_impl.E5M2) for t in big), [t.dtype for t in big]


def test_from_float_shares_parameters():
    linear = nn.Linear(32, 16)
    converted = Float8Linear.from_float(linear)
    assert converted.weight is linear.weight and converted.bias is linear.bias
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 16)))
    params_before = [id(p) for p in model.parameters()]
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "0")
    assert type(model[0]) is nn.Linear and isinstance(model[2][0], Float8Linear)
    assert [id(p) for p in model.parameters()] == params_before


def test_root_linear_is_returned_converted():
    converted = convert_to_float8_training(nn.Linear(16, 16))
    assert isinstance(converted, Float8Linear)


def test_config_recipes():
    assert Float8LinearConfig.from_recipe_name("tensorwise") == Float8LinearConfig()
    with pytest.raises(ValueError, match=r"knows the recipes \['tensorwise', 'rowwise', 'rowwise_with_gw_hp', "
                                         r"'blockwise', 'mxfp8', 'mxfp8_floor'\], got 'rowwize'"):
        Float8LinearConfig.from_recipe_name("rowwize")
    with pytest.raises(TypeError, match="fast_accum must be a bool"):
        fp8_impl.GemmConfig(fp8_impl.CastConfig(), fp8_impl.CastConfig(), fast_accum="yes")
    with pytest.raises(ValueError, match="both operands of a GEMM run in fp8, or both in high precision"):
        fp8_impl.GemmConfig(fp8_impl.CastConfig(), fp8_impl.CastConfig(fp8_impl.Scaling.DISABLED, None))
    assert Float8LinearConfig().short_str() == ("tensorwise[out=tensorwise:e4m3 x tensorwise:e4m3 (fast), "
                                                "gi=tensorwise:e5m2 x tensorwise:e4m3, gw=tensorwise:e5m2 x "
                                                "tensorwise:e4m3]")
    blockwise = Float8LinearConfig.from_recipe_name("blockwise")
    assert blockwise.alignment == 128 and Float8LinearConfig.from_recipe_name("rowwise").alignment == 16
    assert Float8LinearConfig.from_recipe_name("rowwise").round_scales_to_power_of_2
    mxfp8, floor = (Float8LinearConfig.from_recipe_name(name) for name in ("mxfp8", "mxfp8_floor"))
    assert mxfp8.alignment == floor.alignment == 32 and (mxfp8.mx_rule, floor.mx_rule) == ("rceil", "floor")


def test_blockwise_needs_multiples_of_128():
    """gpt-oss's 2880 is a multiple of 16 (tensorwise and rowwise take it) but not of 128."""
    config = Float8LinearConfig.from_recipe_name("blockwise")
    with pytest.raises(ValueError, match=r"in_features \(K\) = 2880 is not divisible by 128, which the blockwise "
                                         r"recipe requires"):
        Float8Linear(2880, 256, config=config)
    with pytest.raises(ValueError, match=r"M = 64 is not divisible by 128.*block scales tile every GEMM dimension"):
        Float8Linear(256, 256, config=config)(torch.randn(64, 256))
    for recipe in TORCHAO_RECIPES:
        Float8Linear(2880, 256, config=Float8LinearConfig.from_recipe_name(recipe))(torch.randn(16, 2880))


def test_fp8_formats():
    assert fp8_impl.FP8_MAX[torch.float8_e4m3fn] == 448.0 and fp8_impl.FP8_MAX[torch.float8_e5m2] == 57344.0
    assert fp8_impl.FP8_MAX[torch.float8_e4m3fnuz] == 240.0 and fp8_impl.FP8_MAX[torch.float8_e5m2fnuz] == 57344.0
    if not torch.version.hip:
        assert (fp8_impl.E4M3, fp8_impl.E5M2) == (torch.float8_e4m3fn, torch.float8_e5m2)


def test_zeros_give_zeros_and_saturation_never_nan():
    linear = Float8Linear(32, 16, dtype=torch.bfloat16)
    zeros = torch.zeros(16, 32, dtype=torch.bfloat16, requires_grad=True)
    out = linear(zeros)
    out.backward(torch.zeros_like(out))
    assert torch.equal(out, linear.bias.expand_as(out).to(out.dtype)) and not zeros.grad.isnan().any()
    huge = torch.full((16, 32), 1e30, dtype=torch.float32)
    assert torch.isfinite(Float8Linear(32, 16)(huge)).all()


# ---- clear errors, raised before any kernel runs -----------------------------------------------

@pytest.mark.parametrize(("lead", "K", "N", "match"), [
    ((20,), 32, 16, r"M = 20 is not divisible by 16 \(M = tokens \(the product of the input's leading dims \(20,\)\)"),
    ((2, 7), 32, 16, r"M = 14 is not divisible by 16 .*leading dims \(2, 7\).*pad the batch or sequence"),
])
def test_tokens_not_divisible_by_16(lead, K, N, match):
    with pytest.raises(ValueError, match=match):
        Float8Linear(K, N)(torch.randn(*lead, K))


@pytest.mark.parametrize(("K", "N", "which"), [(20, 16, r"in_features \(K\) = 20"),
                                               (32, 40, r"out_features \(N\) = 40")])
def test_features_not_divisible_by_16(K, N, which):
    with pytest.raises(ValueError, match=f"{which} is not divisible by 16.*module_filter_fn"):
        convert_to_float8_training(nn.Sequential(nn.Linear(K, N)))
    with pytest.raises(ValueError, match=f"{which} is not divisible by 16"):
        Float8Linear(K, N)


def test_convert_names_the_layer():
    with pytest.raises(ValueError, match="layer 'head': in_features"):
        convert_to_float8_training(nn.ModuleDict({"body": nn.Linear(16, 16), "head": nn.Linear(24, 16)}))


@pytest.mark.parametrize(("x", "error", "match"), [
    (torch.randn(32), ValueError, r"at least 2 dims \[\*, K\].*got shape \(32,\)"),
    (torch.ones(16, 32, dtype=torch.int64), TypeError, "needs a floating-point input tensor, got torch.int64"),
    (torch.randn(16, 32, dtype=torch.float64), TypeError,
     "dtype torch.float64 is not supported.*bfloat16, float16 or float32"),
])
def test_bad_input(x, error, match):
    with pytest.raises(error, match=match):
        Float8Linear(32, 16)(x)


def test_float8_matmul_errors():
    with pytest.raises(ValueError, match=r"needs a 2-D input \[M, K\], got shape \(2, 16, 32\)"):
        float8_matmul(torch.randn(2, 16, 32), torch.randn(16, 32))
    with pytest.raises(ValueError, match="input has K=32 features but weight expects 48"):
        float8_matmul(torch.randn(16, 32), torch.randn(16, 48))
    with pytest.raises(ValueError, match="N = 24 is not divisible by 16"):
        float8_matmul(torch.randn(16, 32), torch.randn(24, 32))


def test_module_is_small():
    """fp8_impl is meant to be read: at most 400 lines of code for all four recipes, besides
    docstrings and comments."""
    import ast
    import inspect
    total = 0
    for module in (fp8_impl.config, fp8_impl.matmul, fp8_impl.linear):
        source = inspect.getsource(module)
        docstrings = sum(len(ast.get_docstring(node, clean=False).splitlines())
                         for node in ast.walk(ast.parse(source))
                         if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node))
        code = [line for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]
        total += len(code) - docstrings
    assert total <= 400, f"fp8_impl has {total} lines of code; the budget is 400"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("special", [None, "nan", "inf", "-inf", "huge", "zeros", "subnormal"])
def test_quantization_bits_equal_torchao(special, fp8, device, generator):
    """to_float8 (two passes, no clamp) gives torchao's fp8 bits and scale, special values included."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    x = torch.randn(32, 48, generator=generator).to(torch.bfloat16)
    if special == "zeros":
        x.zero_()
    elif special == "subnormal":
        x = x * 1e-39
    elif special is not None:
        x[3, 5] = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "huge": 3e38}[special]
    x = x.to(device)
    ours, inverse_scale = fp8_impl.to_float8(x, fp8)
    scale = tensor_to_scale(x, fp8)
    theirs = to_fp8_saturated(x.to(torch.float32) * scale, fp8)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert torch.equal(inverse_scale.view(torch.int32), scale.reciprocal().view(torch.int32))

"""The contracts: _scaled_mm calls are recorded (through torchao's subclass too) and judged by SM90's rules;
the nn.Linear contract the engine expects is what nn.Linear really does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8_impl import Float8Linear
from parity.cases import Case, Layout
from parity.contract import (ScaledMMCall, ScaledMMRecorder, contract_violations, expected_contract,
                             sm90_violations)
from parity.data import make_data, materialize
from parity.impls import load_here, load_impl


def record(impl_name: str, case: Case) -> list:
    impl = load_here(impl_name)
    data = make_data(case)
    linear = nn.Linear(case.K, case.N, bias=case.bias, dtype=case.torch_weight_dtype)
    module, _, _ = impl.build(linear)
    recorder = ScaledMMRecorder(case.M, case.K, case.N)
    x = data.steps[0].input.clone().requires_grad_()
    with recorder:
        out = module(x)
        recorder.phase = "backward"
        out.backward(data.steps[0].grad_output)
    return recorder.calls


@pytest.mark.parametrize("impl", ["fp8_impl", "torchao:tensorwise"])
def test_recorder_sees_the_three_gemms(impl):
    calls = record(impl, Case(lead=(32,), K=64, N=48))
    assert sorted(c.gemms for c in calls) == [("grad_input",), ("grad_weight",), ("output",)]
    by_gemm = {c.label: c for c in calls}
    assert by_gemm["output"].use_fast_accum and not by_gemm["grad_input"].use_fast_accum
    assert (by_gemm["output"].a_dtype, by_gemm["output"].b_dtype) == ("float8_e4m3fn", "float8_e4m3fn")
    assert by_gemm["grad_weight"].a_dtype == "float8_e5m2"
    assert all(sm90_violations(c) == [] for c in calls), [sm90_violations(c) for c in calls]


@pytest.mark.parametrize("layout", ["T", "S", "P"])
def test_fp8_impl_keeps_the_gpu_contract_for_any_layout(layout):
    case = Case(lead=(32,), K=64, N=48, input_layout=layout, weight_layout=layout, grad_output_layout=layout)
    impl = load_impl("fp8_impl")
    data = make_data(case)
    linear = nn.Linear(case.K, case.N, bias=False)
    linear.weight = nn.Parameter(materialize(data.steps[0].weight, case.weight_layout))
    module, _, _ = impl.build(linear)
    recorder = ScaledMMRecorder(case.M, case.K, case.N)
    x = materialize(data.steps[0].input, case.input_layout).requires_grad_()
    with recorder:
        module(x).backward(materialize(data.steps[0].grad_output, case.grad_output_layout))
    assert len(recorder.calls) == 3 and all(sm90_violations(c) == [] for c in recorder.calls)


def test_sm90_rules_name_the_problem():
    a = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    b_row_major = torch.zeros(64, 48, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    recorder = ScaledMMRecorder(32, 64, 48)
    with recorder:
        torch._scaled_mm(a, b_row_major, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(a.to(torch.float8_e5m2), b_row_major.to(torch.float8_e5m2).t().contiguous().t(),
                         scale_a=one, scale_b=one)
        torch._scaled_mm(a.t().contiguous().t(), b_row_major.t().contiguous().t(), scale_a=one, scale_b=one,
                         out_dtype=torch.bfloat16)
    row_b, both_e5m2, col_a = (sm90_violations(c) for c in recorder.calls)
    assert any("B [64x48] has strides (48, 1)" in p and "column-major" in p for p in row_b)
    assert any("both operands are float8_e5m2" in p for p in both_e5m2)
    assert any("no out_dtype" in p for p in both_e5m2)
    assert any("A [32x64] has strides (1, 32)" in p and "row-major" in p for p in col_a)


def test_sm90_rules_check_divisibility_and_scales():
    a = torch.zeros(32, 40, dtype=torch.float8_e4m3fn)  # K = 40 (the CPU accepts it)
    b = torch.zeros(48, 40, dtype=torch.float8_e4m3fn).t()
    recorder = ScaledMMRecorder(32, 40, 48)
    with recorder:
        torch._scaled_mm(a, b, scale_a=torch.ones(()), scale_b=torch.ones((), dtype=torch.float64).float(),
                         out_dtype=torch.bfloat16)
    problems = sm90_violations(recorder.calls[0])
    assert any("K (A.size(1)) = 40 is not divisible by 16" in p for p in problems)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("lead", [(32,), (2, 16)])
@pytest.mark.parametrize("dtypes", [("bf16", "bf16"), ("fp32", "fp32")])
def test_expected_contract_is_nn_linear(layout, lead, dtypes):
    """The engine's idea of nn.Linear's dtypes, shapes and strides is nn.Linear's own."""
    case = Case(lead=lead, K=32, N=16, input_dtype=dtypes[0], weight_dtype=dtypes[1], bias=True,
                input_layout=layout, weight_layout=layout)
    data = make_data(case)
    linear = nn.Linear(case.K, case.N, dtype=case.torch_weight_dtype)
    linear.weight = nn.Parameter(materialize(data.steps[0].weight, layout))
    x = materialize(data.steps[0].input, layout).requires_grad_()
    out = linear(x)
    out.backward(torch.ones_like(out))
    actual = dict(output=out, grad_input=x.grad, grad_weight=linear.weight.grad, grad_bias=linear.bias.grad)
    for name, expected in expected_contract(case).items():
        assert contract_violations(actual[name], expected, name) == []


def test_contract_violations_describe_the_difference():
    case = Case(lead=(16,), K=32, N=16)
    expected = expected_contract(case)["output"]
    wrong = torch.zeros(16, 16, dtype=torch.float32)
    assert contract_violations(wrong, expected, "output") == ["output dtype is float32, nn.Linear gives bfloat16"]
    column_major = torch.zeros(16, 16, dtype=torch.bfloat16).t()
    assert "strides are (1, 16), nn.Linear gives (16, 1)" in contract_violations(column_major, expected, "output")[0]


def test_float8_linear_contract_on_nd_input():
    layer = Float8Linear(32, 16, dtype=torch.bfloat16)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    out.backward(torch.ones_like(out))
    assert out.shape == (2, 8, 16) and out.is_contiguous() and x.grad.shape == x.shape


def _call(scaling, scale_a, scale_b, *, M=256, K=384, N=256, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn",
          fast=False) -> ScaledMMCall:
    """A recorded call as the recorder writes it: scale_a/scale_b are (shape, strides)."""
    return ScaledMMCall("forward", ("output",), (M, K), (K, 1), a_dtype, 0, (K, N), (1, K), b_dtype, 0,
                        (scale_a[0], "float32"), (scale_b[0], "float32"), None, "bfloat16", fast,
                        op="scaled_mm_v2", scaling=scaling, scale_strides=(scale_a[1], scale_b[1]))


BLOCKS, TILES = ("BlockWise1x128", "BlockWise128x128"), ("BlockWise1x128", "BlockWise1x128")
# (what the call does, the call, a phrase of the rule it breaks (None: none)): each rule seen on the H200
# by .ci/probe_scaled_mm.py
RECIPE_RULES = [
    ("rowwise, correct", _call(("RowWise", "RowWise"), ((256, 1), (1, 1)), ((1, 256), (256, 1))), None),
    ("rowwise, scale_b shaped [N, 1]", _call(("RowWise", "RowWise"), ((256, 1), (1, 1)), ((256, 1), (1, 1))),
     "rowwise scales must be [256, 1] and [1, 256]"),
    ("rowwise, scale_a every other element", _call(("RowWise", "RowWise"), ((256, 1), (2, 1)), ((1, 256), (256, 1))),
     "rowwise scales must be contiguous"),
    ("blockwise, correct", _call(BLOCKS, ((256, 3), (1, 256)), ((4, 2), (1, 4))), None),
    ("blockwise, A scales row-major", _call(BLOCKS, ((256, 3), (3, 1)), ((4, 2), (1, 4))),
     "1x128 scales of A must be stored M-major"),
    ("blockwise, B scales not padded", _call(BLOCKS, ((256, 3), (1, 256)), ((3, 2), (1, 3))),
     "must be [4, 2] (K/128 padded to a multiple of 4)"),
    ("blockwise, B scales N-major", _call(BLOCKS, ((256, 3), (1, 256)), ((4, 2), (2, 1))),
     "128x128 scales of B must be stored K-major"),
    ("blockwise, fast accumulation", _call(BLOCKS, ((256, 3), (1, 256)), ((4, 2), (1, 4)), fast=True),
     "fast accumulation is not supported with 128x128"),
    ("blockwise, e5m2 A", _call(BLOCKS, ((256, 3), (1, 256)), ((4, 2), (1, 4)), a_dtype="float8_e5m2"),
     "block scaling takes e4m3 operands only"),
    ("1x128 x 1x128, correct", _call(TILES, ((256, 3), (1, 256)), ((256, 3), (1, 256))), None),
    ("1x128 x 1x128, B scales row-major", _call(TILES, ((256, 3), (1, 256)), ((256, 3), (3, 1))),
     "1x128 scales of B must be stored N-major"),
    ("block scales through _scaled_mm", _call(("?", "?"), ((256, 3), (1, 256)), ((4, 2), (1, 4))),
     "are none of tensorwise"),
]


@pytest.mark.parametrize(("what", "call", "rule"), RECIPE_RULES, ids=[r[0] for r in RECIPE_RULES])
def test_scale_rules_of_each_recipe(what, call, rule):
    problems = sm90_violations(call)
    if rule is None:
        assert problems == [], problems
    else:
        assert any(rule in p for p in problems), problems


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_fp8_impl_rowwise_calls_keep_the_gpu_contract(recipe):
    """The rowwise recipes' recorded calls on the CPU meet the H100's rules (fast accumulation: rowwise
    scales; without: torchao's unit scales, the scales applied after the GEMM)."""
    calls = record(f"fp8_impl:{recipe}", Case(lead=(32,), K=64, N=48))
    assert len(calls) == (3 if recipe == "rowwise" else 2)  # rowwise_with_gw_hp: grad_weight in bf16
    assert all(sm90_violations(c) == [] for c in calls), [sm90_violations(c) for c in calls]
    by_gemm = {c.label: c for c in calls}
    assert by_gemm["output"].scaling == ("RowWise", "RowWise") and by_gemm["output"].use_fast_accum
    assert by_gemm["grad_input"].scaling == ("TensorWise", "TensorWise")  # unit scales


def test_no_module_names_a_recipe_outside_the_recipe_definitions():
    """Recipes are data (parity/recipes.py; fp8_impl/config.py for fp8_impl): every other module asks a
    Recipe its properties. No string constant outside docstrings names a recipe there."""
    import ast
    from pathlib import Path

    from parity.recipes import FP8_RECIPES
    root = Path(__file__).resolve().parent.parent
    # parity/names.py: the recipes' names for the parser, torch-free (test_names checks them against recipes.py)
    allowed = {root / "parity" / "recipes.py", root / "fp8_impl" / "config.py", root / "parity" / "names.py"}
    found = []
    for path in sorted([*(root / "parity").glob("*.py"), *(root / "fp8_impl").glob("*.py")]):
        if path in allowed:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        found += [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in FP8_RECIPES and id(node) not in docstrings]
    assert not found, found


def test_a_call_the_kernel_rejects_raises_and_is_recorded_as_rejected():
    """The harness's fast CPU kernel rejects what torch's rejects (row scales whose last stride is not 1:
    a transposed view), so an implementation crashes under test as it would without the harness; the
    recorder marks that call, so bisect names its GEMM as the crash's."""
    from parity import cpu_gemm
    M, K, N = 32, 48, 16
    a = torch.randn(M, K).to(torch.float8_e4m3fn)
    b = torch.randn(N, K).to(torch.float8_e4m3fn).t()
    scale_a, scale_b = torch.rand(1, M).t(), torch.rand(1, N)  # [M, 1] with strides (1, M)
    recorder = ScaledMMRecorder(M, K, N)
    with pytest.raises((RuntimeError, ValueError), match="stride"), cpu_gemm.FastScaledMM(), recorder:
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    assert [call.raised for call in recorder.calls] == [True]
    recorder = ScaledMMRecorder(M, K, N)
    with cpu_gemm.FastScaledMM(), recorder:  # the same call with contiguous row scales runs
        torch._scaled_mm(a, b, scale_a=scale_a.flatten().clone().reshape(M, 1), scale_b=scale_b,
                         out_dtype=torch.bfloat16)
    assert [call.raised for call in recorder.calls] == [False]


def test_the_stride_of_a_dimension_of_size_one_is_not_compared():
    """A false alarm on correct code (issue 29): a [1, 16, 16] grad_input with strides (16, 1, 16) where
    nn.Linear gave (256, 1, 16) is the same layout; a real difference in a longer dimension still shows."""
    import torch

    from parity.contract import Breach, TensorContract, contract_problems
    want = TensorContract(torch.bfloat16, (1, 16, 16), (256, 1, 16))
    assert contract_problems(TensorContract(torch.bfloat16, (1, 16, 16), (16, 1, 16)), want, "grad_input") == []
    moved = contract_problems(TensorContract(torch.bfloat16, (1, 16, 16), (256, 16, 1)), want, "grad_input")
    assert [problem.breach for problem in moved] == [Breach.STRIDES]

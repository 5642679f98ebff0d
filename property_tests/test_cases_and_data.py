"""Cases are data: ids round-trip, parse errors are clear, layouts and distributions are what they say."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from parity.cases import Case, CaseError, Dist, Layout, edge_cases, parse_case_id, shrink, simplifications
from parity.data import make_data, materialize
from parity.strategies import cases


@given(case=cases())
def test_case_id_round_trips(case):
    assert Case.from_id(case.id) == case
    assert Case.from_id(case.id).id == case.id


def test_case_id_format():
    case = Case(lead=(2, 128), K=64, N=32, input_dtype="bf16", weight_dtype="fp32", bias=True,
                input_layout="T", grad_output_layout="S", dist=Dist.OUTLIER, outlier_ratio=100, seed=3, steps=2)
    assert case.id == "M2x128K64N32|in:bf16:T|w:fp32:C|go:S|bias|outlier100|seed3|steps2"
    assert case.M == 256 and case.input_shape == (2, 128, 64) and case.output_shape == (2, 128, 32)


@pytest.mark.parametrize(("case_id", "match"), [
    ("", "case id is empty"),
    ("M20K16N16", r"M = 20 must be a positive multiple of 16"),
    ("X16K16N16", "cannot read the shape 'X16K16N16'"),
    ("M16K16N16|in:bf16:Q", "cannot read 'in:bf16:Q'.*layouts are"),
    ("M16K16N16|gaussian", "cannot read 'gaussian'.*distributions"),
    ("M16K16N16|in:int8:C", "input dtype 'int8' not in"),
    # issue 29: a 20-digit seed was an internal error deep in torch.Generator (exit 3), and 10**8 steps ran for
    # hours past a SIGTERM
    ("M16K16N16|seed99999999999999999999", r"seed must be from 0 to 4294967295, got 99999999999999999999"),
    ("M16K16N16|steps100000000", r"steps must be from 1 to 64, got 100000000"),
])
def test_case_id_errors(case_id, match):
    with pytest.raises(CaseError, match=match):
        parse_case_id(case_id)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("shape", [(16, 32), (2, 16, 32)])
def test_materialize_keeps_values_in_the_layout(layout, shape, generator):
    values = torch.randn(shape, generator=generator).to(torch.bfloat16)
    tensor = materialize(values, layout)
    assert torch.equal(tensor, values)
    assert tensor.data_ptr() != values.data_ptr()  # a fresh copy: implementations cannot share state
    expected_contiguous = layout is Layout.CONTIGUOUS
    assert tensor.is_contiguous() == expected_contiguous
    if layout is Layout.TRANSPOSED:
        assert tensor.stride()[-2:] == (1, shape[-2])
    if layout in (Layout.SLICED, Layout.PADDED):  # the gaps hold NaN, to expose reads outside the view
        storage = torch.tensor([], dtype=tensor.dtype).set_(tensor.untyped_storage())
        assert storage.isnan().sum() == storage.numel() - values.numel()


def test_distributions_have_their_defining_property():
    def data(dist, **kw):
        return make_data(Case(lead=(64,), K=64, N=32, dist=dist, **kw)).steps[0]
    assert all(not t.any() for t in vars(data(Dist.ZEROS)).values())
    nearmax = data(Dist.NEAR_MAX).input.float()
    assert nearmax.abs().max() == 448 and nearmax.abs().min() >= 0.9 * 448 * 0.99
    negative = data(Dist.NEGATIVE).input.float()
    assert negative.min().abs() > negative.max() and (negative < 0).float().mean() > 0.9
    outlier = data(Dist.OUTLIER, outlier_ratio=100)
    channel_amax = outlier.input.float().abs().amax(0)
    assert channel_amax.max() > 20 * channel_amax.median()  # one channel far above the rest
    assert outlier.weight.float().abs().max() < 10  # outliers are in activations only
    tiny = data(Dist.TINY).input.float().abs()
    assert tiny.max() <= 2.0 ** -10 and tiny.min() >= 2.0 ** -31


def test_data_is_reproducible_and_device_independent():
    case = Case(lead=(32,), K=48, N=16, dist=Dist.HEAVY, seed=7, steps=2)
    a, b = make_data(case), make_data(case)
    for step_a, step_b in zip(a.steps, b.steps):
        assert all(torch.equal(x, y) for x, y in zip(vars(step_a).values(), vars(step_b).values()))
    assert not torch.equal(a.steps[0].weight, a.steps[1].weight)  # the in-place update changes the weight


def test_edge_cases_cover_the_pinned_edges():
    ids = [c.id for c in edge_cases()]
    assert any("zeros" in i for i in ids) and any("nearmax" in i for i in ids) and any("outlier" in i for i in ids)
    assert any(c.K == c.N for c in edge_cases()) and any(len(c.lead) > 1 for c in edge_cases())
    assert any(c.input_layout is Layout.TRANSPOSED for c in edge_cases())
    assert any(c.steps > 1 for c in edge_cases())


def test_shrink_takes_simplifications_while_the_failure_persists():
    start = Case(lead=(2, 64), K=128, N=96, input_layout="T", dist=Dist.HEAVY, seed=5, steps=2)
    # A "bug" that needs a transposed input and K >= 64: shrinking keeps exactly those.
    minimal = shrink(start, lambda c: c.input_layout is Layout.TRANSPOSED and c.K >= 64)
    assert minimal == Case(lead=(16,), K=64, N=16, input_layout="T")
    assert all(simpler != start for _, simpler in simplifications(start))


@pytest.mark.parametrize("scaling", ["TensorWise", "RowWise"])
def test_the_cpus_fast_kernel_serves_scaled_mm_and_scaled_mm_v2_alike(scaling):
    """An implementation written with torch.nn.functional.scaled_mm (aten._scaled_mm_v2) runs the same CPU
    kernel as one written with torch._scaled_mm: torch's own CPU kernel rounds the scaling in another order
    (410 of 512 fp32 elements differ from the fast kernel's on this case), which made a correct F.scaled_mm
    layer differ from torchao."""
    import torch.nn.functional as F

    from parity.cpu_gemm import FastScaledMM
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(16, 64, generator=generator) * 20).to(torch.float8_e4m3fn)
    b = (torch.randn(32, 64, generator=generator) * 20).to(torch.float8_e4m3fn)
    if scaling == "TensorWise":
        scale_a, scale_b = torch.rand((), generator=generator) + 0.01, torch.rand((), generator=generator) + 0.01
    else:
        scale_a, scale_b = torch.rand(16, 1, generator=generator) + 0.01, torch.rand(1, 32, generator=generator) + 0.01
    kind = getattr(F.ScalingType, scaling)
    with FastScaledMM():
        v1 = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        v2 = F.scaled_mm(a, b.t(), scale_a, kind, scale_b, kind, output_dtype=torch.float32)
    assert torch.equal(v1, v2)

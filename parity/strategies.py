"""Hypothesis strategies for FP8 linear-layer cases, importable for your own suites.

Each strategy is small and keyword-only; `cases()` composes them within a CaseBounds (each of
its fields also a keyword of `cases()`). Choices are listed
simplest first (contiguous before transposed, bf16 before fp32, normal before outliers,
one step before two), so hypothesis shrinks a failure towards the simplest case that
still fails.

    from hypothesis import given
    from parity.strategies import cases

    @given(case=cases(max_dim=128, layouts_allowed=("C", "T")))
    def test_my_fp8_linear(case): ...
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

from hypothesis import strategies as st

from parity.cases import ALIGNMENT, DRAWN_DISTS, INPUT_DTYPES, WEIGHT_DTYPES, Case, Dist, Layout

OUTLIER_RATIOS = (100, 10, 1000)


def dims(*, max_dim: int = 256, alignment: int = ALIGNMENT) -> st.SearchStrategy[int]:
    """A GEMM dimension: a multiple of `alignment` (16; recipes.BLOCK for block scales) up to max_dim
    (shrinks towards the smallest)."""
    return st.integers(1, max(1, max_dim // alignment)).map(lambda n: alignment * n)


def leads(*, max_tokens: int = 256, max_batch_dims: int = 2,
          alignment: int = ALIGNMENT) -> st.SearchStrategy[tuple[int, ...]]:
    """Leading dims of the input: (M,) or N-D (batch..., seq) with M = product a multiple of
    `alignment` (the sequence dim is)."""
    flat = dims(max_dim=max_tokens, alignment=alignment).map(lambda m: (m,))
    if max_batch_dims < 1:
        return flat

    def batched(seq: int) -> st.SearchStrategy[tuple[int, ...]]:
        room = max(1, max_tokens // seq)
        batch = st.lists(st.integers(1, min(4, room)), min_size=1, max_size=max_batch_dims)
        return batch.filter(lambda b: _prod(b) * seq <= max_tokens).map(lambda b: (*b, seq))

    nd = dims(max_dim=max(alignment, max_tokens // 2), alignment=alignment).flatmap(batched)
    return st.one_of(flat, nd)


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def layouts(*, allowed: Sequence[str | Layout] = tuple(Layout)) -> st.SearchStrategy[Layout]:
    return st.sampled_from([Layout(a) for a in allowed])


def distributions(*, allowed: Sequence[str | Dist] = DRAWN_DISTS) -> st.SearchStrategy[Dist]:
    return st.sampled_from([Dist(d) for d in allowed])


@dataclass(frozen=True)
class CaseBounds:
    """What `cases()` may draw. max_dim: largest K and N; max_tokens: largest M (the product of the
    input's leading dims), in at most max_batch_dims batch dims before the sequence dim; the dtypes,
    layouts (of input, weight and grad_output) and distributions allowed; up to max_steps calls of
    one layer; bias True / False, or None for either; `square=True` forces K == N (where a
    transposed weight has the right shape); `alignment` is the recipe's (parity.recipes.Recipe.
    alignment: recipes.BLOCK for block scales), of which every dim is a multiple."""

    max_dim: int = 256
    max_tokens: int = 256
    max_batch_dims: int = 2
    input_dtypes: Sequence[str] = INPUT_DTYPES
    weight_dtypes: Sequence[str] = WEIGHT_DTYPES
    layouts_allowed: Sequence[str | Layout] = tuple(Layout)
    dists: Sequence[str | Dist] = DRAWN_DISTS
    max_steps: int = 2
    bias: bool | None = None
    square: bool = False
    alignment: int = ALIGNMENT


def cases(bounds: CaseBounds | None = None, **overrides) -> st.SearchStrategy[Case]:
    """Whole cases within `bounds` (default CaseBounds()), with any of its fields overridden by
    keyword: cases(max_dim=128, layouts_allowed=("C",)), cases(alignment=recipe.alignment)."""
    bounds = bounds or CaseBounds()
    unknown = sorted(set(overrides) - {f.name for f in fields(CaseBounds)})
    if unknown:
        raise TypeError(f"cases() got unknown bounds {unknown}: the bounds are the fields of CaseBounds "
                        f"({', '.join(f.name for f in fields(CaseBounds))})")
    bounds = replace(bounds, **overrides)
    K, N = (dims(max_dim=bounds.max_dim, alignment=bounds.alignment) for _ in range(2))

    def build(k_and_n):
        k, n = k_and_n
        return st.builds(
            Case,
            lead=leads(max_tokens=bounds.max_tokens, max_batch_dims=bounds.max_batch_dims, alignment=bounds.alignment),
            K=st.just(k), N=st.just(n),
            input_dtype=st.sampled_from(list(bounds.input_dtypes)),
            weight_dtype=st.sampled_from(list(bounds.weight_dtypes)),
            bias=st.booleans() if bounds.bias is None else st.just(bounds.bias),
            input_layout=layouts(allowed=bounds.layouts_allowed),
            weight_layout=layouts(allowed=bounds.layouts_allowed),
            grad_output_layout=layouts(allowed=bounds.layouts_allowed),
            dist=distributions(allowed=bounds.dists),
            outlier_ratio=st.sampled_from(OUTLIER_RATIOS),
            seed=st.integers(0, 2**16),
            steps=st.integers(1, max(1, bounds.max_steps)),
        )

    pairs = K.map(lambda k: (k, k)) if bounds.square else st.tuples(K, N)
    return pairs.flatmap(build)

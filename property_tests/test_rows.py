"""parity.rows and parity.findings: the result row's schema, reading tables back, and typed findings."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.cases import Case
from parity.contract import RULES, GpuRule, ScaledMMCall, sm90_problems
from parity.findings import Trigger
from parity.impls import load_impl
from parity.metrics import METRICS
from parity.policy import evaluate
from parity.report import ResultsError, read_results, verdict
from parity.rows import COLUMNS, KEY_COLUMNS, RecordedError, Row, frame, rows_from_frame
from parity.runner import all_pairs, run_case, run_cases
from parity.vocabulary import BugClass, Condition, Kind, Operand, Phase
from parity.worker import Died

REPORTS = Path(__file__).resolve().parents[1] / "reports"
# The columns of a results table (results.csv.gz) as parity.runner wrote them before rows were typed,
# in the order of a row that was compared: the schema every committed table and `diff` rely on.
SCHEMA = ["case_id", "lead", "K", "N", "input_dtype", "weight_dtype", "bias", "input_layout", "weight_layout",
          "grad_output_layout", "dist", "seed", "steps", "ndim", "M", "impl", "reference", "recipe",
          "reference_recipe", "policy", "device", "tensor", "step", "bitwise", "n_diff", "sqnr_db", "rel_l2",
          "max_abs_err", "max_abs_index", "worst_candidate", "worst_reference", "max_rel_err", "n_mismatch", "rtol",
          "atol", "ulp_max", "ulp_p99", "cosine", "nan", "inf", "ref_nan", "ref_inf", "unexpected_inf", "numel",
          "n_eff", "n_diff_where_reference_zero", "error", "reference_error", "contract", "skipped", "scaled_mm",
          "operands", "operand_stages", "bound_ratio", "n_beyond_bound", "bound_index", "dtype"]


@pytest.fixture(scope="module")
def table():
    cases = [Case(lead=(16,), K=16, N=16, bias=True), Case(lead=(16,), K=48, N=16)]
    return run_cases(cases, all_pairs([load_impl("fp8_impl"), load_impl("fp8_impl:blockwise")],
                                      [load_impl("torchao:tensorwise"), load_impl("fp64")]))


def test_the_results_table_keeps_its_columns(table):
    assert list(table.columns) == SCHEMA
    assert set(METRICS) <= set(COLUMNS) and set(KEY_COLUMNS) <= set(COLUMNS)
    swept = frame([row.but(shape="sampled") for row in rows_from_frame(table)])
    assert list(swept.columns) == [*SCHEMA, "shape"]  # a sweep's table adds its label, as before


def test_rows_read_back_from_a_table_give_the_same_table_and_verdict(table):
    rows = rows_from_frame(table)
    assert all(isinstance(row, Row) for row in rows) and rows[0].key == tuple(table.iloc[0][list(KEY_COLUMNS)])
    again = frame(rows)
    assert again.fillna("-").astype(str).equals(table.fillna("-").astype(str))
    assert [v.full_message for v in evaluate(rows)] == [v.full_message for v in evaluate(table)]


def test_a_committed_reference_table_still_reads():
    # written before recipes were data: refused as before, with the fix, not misread
    with pytest.raises(ResultsError, match="older fp8-parity .*missing columns recipe, policy, skipped, operands"):
        read_results(REPORTS / "reference-h200-quick")
    # one of today's schema (without the columns added since: operand_stages, n_diff_where_reference_zero)
    nanochat = read_results(REPORTS / "reference-cpu-recipes-nanochat")
    rows = rows_from_frame(nanochat)
    assert len(rows) == len(nanochat) == 1110
    found = evaluate(rows)  # its bf16 rows return bf16 where nn.Linear of fp32 data returns fp32
    assert len(found) == 52 and {v.kind for v in found} == {Kind.CONTRACT} and {v.impl for v in found} == {"bf16"}
    assert found[0].message == "output: output dtype is bfloat16, nn.Linear gives float32"
    judged = verdict(nanochat, candidate="fp8_impl")
    assert judged.ok and judged.headline == ("PASS: fp8_impl (tensorwise) is above the SQNR floor against fp64 in "
                                             "222/222 comparisons (67 cases). Covered: M <= 256, K <= 8192, "
                                             "N <= 8192, input bf16/fp32, weight bf16/fp32, layouts C/S/T, 2-D/3-D "
                                             "input, with and without bias, up to 2 calls, 9 of 13 data "
                                             "distributions")


def test_errors_are_typed_in_memory_and_text_in_the_table(code_under_test_in_a_worker):
    case = Case(lead=(16,), K=16, N=16)
    rows = run_case(case.replace(input_dtype="fp32"), all_pairs(
        [load_impl("evals.zoo.mutants:crash_on_fp32_input")], [load_impl("fp64")]))
    error = rows[0].error
    assert (error.phase, error.step) == (Phase.FORWARD, 0) and str(error).startswith(f"step 0: forward: {error.type}: ")
    crash = evaluate(rows)[0]
    assert crash.kind is Kind.CRASH and crash.error is error and crash.message == f"the implementation raised: {error}"
    (back,) = {row.error for row in rows_from_frame(frame(rows))}
    assert isinstance(back, RecordedError) and not back.died and back.crash_message == crash.message
    died = Died("exited the process with code 0", "x", "step 0: forward", "")
    assert RecordedError(str(died)).died and RecordedError(str(died)).crash_message == died.message


def test_triggers_render_word_for_word():
    assert str(Trigger(Condition.NON_CONTIGUOUS, Operand.WEIGHT, layout="transposed")) == \
        "only with non-contiguous weight (transposed)"
    assert str(Trigger(Condition.DTYPE, Operand.INPUT, dtype="fp32")) == "only with fp32 input"
    assert str(Trigger(Condition.DTYPE, Operand.INPUT, dtype="fp16", alternative=True)) == "or with fp16 input"
    assert str(Trigger(Condition.DISTRIBUTION, dist="zeros", alternative=True)) == "or with zeros data"
    assert str(Trigger(Condition.SECOND_CALL, Operand.WEIGHT)) == "only from the second call"
    assert str(Trigger(Condition.K_EQUALS_N, Operand.WEIGHT)) == "only when K == N"
    assert all(str(Trigger(condition)) for condition in Condition if condition not in (
        Condition.NON_CONTIGUOUS, Condition.DTYPE, Condition.DISTRIBUTION))


def _call(**changes) -> ScaledMMCall:
    fields = dict(phase="forward", gemms=("output",), a_shape=(32, 32), a_stride=(32, 1), a_dtype="float8_e4m3fn",
                  a_align=0, b_shape=(32, 32), b_stride=(1, 32), b_dtype="float8_e4m3fn", b_align=0,
                  scale_a=((), "float32"), scale_b=((), "float32"), bias_dtype=None, out_dtype="bfloat16",
                  use_fast_accum=False, scaling=("TensorWise", "TensorWise"), scale_strides=((), ()))
    return ScaledMMCall(**{**fields, **changes})


@pytest.mark.parametrize("changes, rule, role, category", [
    (dict(a_stride=(1, 32)), GpuRule.A_NOT_ROW_MAJOR, "a", BugClass.LAYOUT),
    (dict(b_stride=(32, 1)), GpuRule.B_NOT_COLUMN_MAJOR, "b", BugClass.LAYOUT),
    (dict(a_dtype="float8_e5m2", b_dtype="float8_e5m2"), GpuRule.BOTH_E5M2, "call", BugClass.FP8_DTYPE),
    (dict(scale_a=((), "float16")), GpuRule.SCALES_NOT_FLOAT32, "call", BugClass.SCALE),
    (dict(out_dtype=None), GpuRule.NO_OUT_DTYPE, "call", BugClass.CONTRACT),
    (dict(a_shape=(32, 24), a_stride=(24, 1), b_shape=(24, 32), b_stride=(1, 24)), GpuRule.NOT_DIVISIBLE_BY_16,
     "call", BugClass.CRASH),
])
def test_each_gpu_rule_says_what_it_is_about(changes, rule, role, category):
    """Which rule, which operand and which bug class come from the rule itself, not from its sentence."""
    problem = next(p for p in sm90_problems(_call(**changes)) if p.rule is rule)
    assert (problem.role, problem.category) == (role, category)
    assert problem.message.startswith("no out_dtype" if rule is GpuRule.NO_OUT_DTYPE else "would fail on H100: ")
    assert set(RULES) == set(GpuRule)


def test_an_enormous_exception_message_is_kept_as_one_bounded_line():
    """Issue 29: a 50 MiB message was echoed whole (52 MB on stdout, twice that in --json)."""
    from parity.exits import MESSAGE_CHARS
    from parity.rows import Raised
    raised = Raised(Phase.FORWARD, 0, "RuntimeError", "x" * (50 * 2**20))
    assert len(str(raised)) < 2 * MESSAGE_CHARS and "52428800 characters in all" in raised.message

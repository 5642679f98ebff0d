"""parity.report: the files of a report, the verdict, reading results back, and diffs."""

from __future__ import annotations

import gzip
import math
import re
import xml.etree.ElementTree as ElementTree

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.image import imread

from parity.cases import Case
from parity.impls import load_impl
from parity import folder_manifest
from parity import report_diff, report_plots
from parity.bench import COLUMNS as BENCH_COLUMNS
from parity.report import (ADDED_LATER, KEY, ResultsError, diff_results, read_results, render_diff, summary_tables,
                           verdict, write_report)
from parity.policy import sqnr_floor
from parity.runner import all_pairs, run_cases

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PARITY = "torchao:tensorwise"


@pytest.fixture(scope="module")
def results() -> pd.DataFrame:
    """fp8_impl and bf16 against fp64 and torchao's tensorwise recipe on two tiny cases, one of
    them all zeros (SQNR = inf against fp64) with a bias and a transposed input."""
    cases = [Case(lead=(16,), K=16, N=16),
             Case(lead=(2, 8), K=32, N=16, bias=True, input_layout="T", dist="zeros")]
    return run_cases(cases, all_pairs([load_impl("fp8_impl"), load_impl("bf16")],
                                      [load_impl("fp64"), load_impl(PARITY)]))


@pytest.fixture(scope="module")
def report(results, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return out, write_report(results, out, title="tiny report")


def parity_rows(frame: pd.DataFrame) -> pd.Series:
    return (frame["impl"] == "fp8_impl") & (frame["reference"] == PARITY)


def test_every_file_is_written_and_not_empty(report):
    out, paths = report
    assert {p.name for p in paths} == {"results.csv.gz", "env.json", "summary.md", "index.html", "summary.png",
                                       "sqnr_vs_k.png", "parity_heatmap.png"}
    assert all(p.parent == out and p.stat().st_size > 0 for p in paths)


def test_plots_are_valid_pngs(report):
    out, _ = report
    for name in ("summary.png", "sqnr_vs_k.png", "parity_heatmap.png"):
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE)
        height, width, _ = imread(out / name).shape
        assert height > 100 and width > 100


def test_summary_md_opens_with_the_title_then_the_verdict_then_the_figure(report, results):
    """The summary first (the verdict, the figure, the worst judged values, what to run next), then the
    environment: the top answers before any table."""
    out, _ = report
    lines = [line for line in (out / "summary.md").read_text().splitlines() if line]
    assert lines[0] == "# tiny report"
    assert lines[1] == f"**{verdict(results).headline}**" and lines[1].startswith("**PASS: fp8_impl")
    assert lines[2] == "![summary](summary.png)"
    assert lines[4] == "Worst judged values of fp8_impl:" and lines[5].startswith("- **SQNR against fp64** (within")
    assert "rerun: `fp8-parity check --impl fp8_impl --against fp64 --device cpu --case '" in lines[5]
    nxt = next(i for i, line in enumerate(lines) if line.startswith("**What to run next:** `fp8-parity check"))
    assert "torch " in lines[nxt + 1] and lines[nxt + 2].startswith("- SQNR vs fp64")  # the environment, the evidence
    assert "![sqnr_vs_k](sqnr_vs_k.png)" in lines


def test_index_html_is_well_formed_and_standalone(report):
    out, _ = report
    page = (out / "index.html").read_text()
    root = ElementTree.fromstring(page.removeprefix("<!DOCTYPE html>\n"))  # raises if not well-formed
    assert root.find("head/style") is not None and len(root.findall(".//table")) == 6  # with the worst values
    assert {img.get("src") for img in root.iter("img")} == {"summary.png", "sqnr_vs_k.png", "parity_heatmap.png"}
    summary = root.find(".//section[@id='summary']")
    assert summary.find("p[@class='headline pass']") is not None and summary.find("figure/img") is not None
    assert all(div.get("class") == "scroll" for div in root.iter("div")) and len(root.findall(".//div")) == 6
    assert "<script" not in page and "http" not in page


def test_inf_sqnr_is_kept_and_shown_as_inf(results, report):
    tables = summary_tables(results)
    assert (tables["by_dist"]["zeros"] == math.inf).all()  # all-zero data: exact against fp64
    assert not tables["overall"].filter(like="SQNR").isna().any().any()
    out, _ = report
    assert re.search(r"\|\s+inf \|", (out / "summary.md").read_text())


@pytest.mark.parametrize("where", ["directory", "file"])
def test_read_results_round_trips(report, results, where):
    out, _ = report
    frame = read_results(out if where == "directory" else out / "results.csv.gz")
    before, after = summary_tables(results), summary_tables(frame)
    assert before.keys() == after.keys()
    for name in before:
        pd.testing.assert_frame_equal(before[name], after[name])
    assert verdict(frame) == verdict(results)
    assert frame.attrs["env"] == results.attrs["env"]
    assert frame["bitwise"].dtype == bool and frame["case_id"].tolist() == results["case_id"].tolist()
    assert diff_results(results, frame).empty


def test_an_empty_section_is_left_out_never_printed_as_no_rows(results, tmp_path):
    write_report(results, tmp_path, plots=False, extra_tables={"by named shape": pd.DataFrame()})
    for page in ("summary.md", "index.html"):
        text = (tmp_path / page).read_text()
        assert "by named shape" not in text and "(no rows)" not in text


def test_grad_bias_s_fixed_expected_sqnr_is_explained_where_it_is_shown(report, results):
    from parity.recipes import GRAD_BIAS_SQNR_DB, GRAD_BIAS_WHY
    assert summary_tables(results)["overall"].loc[("fp8_impl", "grad_bias"), "expected SQNR (dB)"] == GRAD_BIAS_SQNR_DB
    out, _ = report
    for page in ("summary.md", "index.html"):
        text = (out / page).read_text()
        assert f"grad_bias's expected {GRAD_BIAS_SQNR_DB:.1f} dB: {GRAD_BIAS_WHY}" in text.replace("&#x27;", "'")
        assert "high-precision sum in every recipe (parity.recipes.GRAD_BIAS_SQNR_DB)" in text  # the figure's caption
    assert f"expected {GRAD_BIAS_SQNR_DB:.1f} (fixed: a high-precision sum)" in verdict(results).details[0]


def test_extra_tables_and_plots_go_through_the_same_writer(results, tmp_path):
    bench = pd.DataFrame({"shape": ["16x16x16"], "ms": [0.125]})
    paths = write_report(results, tmp_path, plots=False, extra_tables={"Benchmark": bench},
                         extra_plots={"bench.png": lambda fig: fig.subplots().plot([1, 2], [3, 4])})
    assert [p.name for p in paths if p.suffix == ".png"] == ["bench.png"]
    assert "## Benchmark" in (tmp_path / "summary.md").read_text()
    assert '<img src="bench.png"' in (tmp_path / "index.html").read_text()


def test_verdict_passes_when_every_comparison_is_bitwise_equal(results):
    judged = verdict(results)
    assert judged.ok and judged.headline.startswith("PASS: fp8_impl (tensorwise) is ")
    assert f"bitwise equal to {PARITY} in 7/7 comparisons (2 cases)" in judged.headline
    assert "above the SQNR floor against fp64 in 7/7" in judged.headline
    assert judged.details[0].startswith("SQNR vs fp64, median (p05): output")


@pytest.mark.parametrize(("column", "value", "phrase"), [
    ("bitwise", False, "differs from an implementation of its recipe in 1 comparison"),
    ("error", "step 0: forward: RuntimeError: boom", "crashed in 1 case"),
    ("contract", "output dtype is float32, nn.Linear gives bfloat16", "breaks nn.Linear's contract in 1 comparison"),
    ("scaled_mm", "would fail on H100: output GEMM: mat2 is not column-major",
     "makes _scaled_mm calls that would fail on an H100 in 1"),
    ("operands", "output GEMM (step 0): B (weight) fp8 values differ",
     "other fp8 operands or scales than its recipe's"),
    ("reference_error", "step 0: forward: RuntimeError: boom", "could not be compared"),
])
def test_verdict_fails_on_one_bad_row(results, column, value, phrase):
    frame = results.copy()
    bad = frame.index[parity_rows(frame)][1]
    frame[column] = frame[column].astype(object)
    frame.loc[bad, column] = value
    judged = verdict(frame)
    assert not judged.ok and judged.headline.startswith("FAIL: fp8_impl (tensorwise) ")
    assert phrase in judged.headline and frame.loc[bad, "case_id"] in judged.headline
    assert any(frame.loc[bad, "case_id"] in line for line in judged.details)
    assert judged.short == judged.brief and phrase in judged.brief and "(first: " not in judged.brief  # the report's


def test_verdict_without_the_comparison_says_so(results):
    judged = verdict(results, candidate="torchao:rowwise")
    assert not judged.ok and judged.headline.startswith("NO VERDICT")


def test_diff_finds_planted_moves_and_ignores_noise(results):
    b = results.copy()
    finite = b.index[(b["reference"] == "fp64") & b["sqnr_db"].map(math.isfinite)]
    moved, noise = finite[0], finite[1]
    flipped = b.index[parity_rows(b) & b["bitwise"]][0]
    dropped, raising = b.index[b["reference"] == "fp64"][-1], finite[2]
    b.loc[moved, "sqnr_db"] += 1.0
    b.loc[noise, "sqnr_db"] += 0.01
    b.loc[flipped, "bitwise"] = False
    b["error"] = b["error"].astype(object)
    b.loc[raising, "error"] = "step 0: forward: RuntimeError: boom"
    diff = diff_results(results, b.drop(index=dropped))
    key = lambda i: tuple(results.loc[i, KEY])  # noqa: E731
    found = {tuple(row[KEY]): row["change"] for _, row in diff.iterrows()}
    assert found == {key(moved): "SQNR rose", key(flipped): "lost bitwise parity", key(dropped): "only in A",
                     key(raising): "started raising"}
    assert diff.loc[diff["change"] == "SQNR rose", "delta"].item() == pytest.approx(1.0)
    counts, identical, summary = render_diff(diff).splitlines()[:3]
    assert counts.startswith(f"{len(results) - 1} rows in both, 1 only in A, 0 only in B")
    # the moved and the raising rows differ (the SQNR nudge within noise too: identical means to the last bit)
    same = len(results) - 1 - 4
    assert identical.startswith(f"{same} of the {len(results) - 1} rows in both ({same / (len(results) - 1):.1%}) "
                                f"have identical metrics")
    assert summary.startswith("3 rows moved beyond noise") and "1 lost bitwise parity" in summary
    assert "only in A" not in summary  # a row without a counterpart did not move


def test_identical_results_do_not_differ(results):
    diff = diff_results(results, results.copy())
    lines = render_diff(diff).splitlines()
    assert diff.empty and lines[2] == "No row moved beyond noise."
    assert lines[1].startswith(f"{len(results)} of the {len(results)} rows in both (100.0%) have identical metrics")


@pytest.mark.parametrize("call", [summary_tables, verdict, lambda f: write_report(f, "/nonexistent/never"),
                                  lambda f: diff_results(f, f)])
def test_an_empty_frame_is_a_clear_value_error(results, call):
    with pytest.raises(ValueError, match="results table is empty"):
        call(results.iloc[:0])
    with pytest.raises(ValueError, match="results table is empty"):
        call(pd.DataFrame())


def test_a_frame_of_another_kind_is_a_clear_value_error():
    with pytest.raises(ValueError, match="lacks the columns"):
        summary_tables(pd.DataFrame({"case_id": ["x"]}))


@given(st.lists(st.sampled_from([math.inf, 0.5, 12.0, 24.6, 28.5, 30.25]) | st.floats(-10, 200), min_size=1,
                max_size=30))
def test_sqnr_statistics_are_measured_values_in_order(results, values):
    template = results[results["reference"] == "fp64"].iloc[[0]]
    frame = pd.concat([template] * len(values), ignore_index=True).assign(
        case_id=[f"case{i}" for i in range(len(values))], sqnr_db=values)
    row = summary_tables(frame)["overall"].iloc[0]
    median, p05, low = row["SQNR median (dB)"], row["SQNR p05 (dB)"], row["SQNR min (dB)"]
    assert {median, p05, low} <= set(values)  # order statistics: never an interpolated inf - inf = NaN
    assert low <= p05 <= median and low == min(values)


def _results_file(report, results, tmp_path, kind: str):
    """A results.csv.gz of `kind` in tmp_path (one of the tables read_results must refuse)."""
    out, _ = report
    path = tmp_path / "results.csv.gz"
    table = (out / "results.csv.gz").read_bytes()
    if kind == "truncated":
        path.write_bytes(table[:len(table) // 2])
    elif kind == "corrupt":
        path.write_bytes(table[:40] + bytes(b ^ 0xFF for b in table[40:80]) + table[80:])
    elif kind == "not gzip":
        path.write_text(",".join(KEY) + "\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "header only":
        path.write_bytes(gzip.compress(results.iloc[:0].to_csv(index=False).encode()))
    elif kind == "foreign":
        pd.DataFrame({"name": ["a", "b"], "score": [1.0, 2.0]}).to_csv(path, index=False)
    elif kind == "bench":
        row = dict.fromkeys(BENCH_COLUMNS, 1.0) | {"preset": "small", "shape": "16x16x16", "impl": "fp8_impl",
                                                   "recipe": "tensorwise", "error": None}
        pd.DataFrame([row], columns=BENCH_COLUMNS).to_csv(path, index=False)
    elif kind == "old schema":
        results.drop(columns=ADDED_LATER).to_csv(path, index=False)
    return path


@pytest.mark.parametrize(("kind", "says"), [
    ("truncated", r"is truncated or corrupt \(Compressed file ended before the end-of-stream marker was reached\): "
                  r"re-run the sweep$"),
    ("corrupt", r"is truncated or corrupt \(.+\): re-run the sweep$"),
    ("not gzip", r"is truncated or corrupt \(Not a gzipped file"),
    ("empty", r"holds no results \(the file is empty\)"),
    ("header only", r"holds no results \(a header without rows\)"),
    ("foreign", r"is not an fp8-parity results table: it lacks columns case_id, impl, reference, tensor, step, "),
    ("bench", r"is a benchmark report, not a parity sweep: it has timings \(median_ms, gpu_ms, tflops\) "
              r"and no sqnr_db"),
    ("old schema", r"was written by an older fp8-parity \(missing columns recipe, policy, skipped, operands\): "
                   r"re-run the sweep$"),
])
@pytest.mark.parametrize("given", ["file", "directory"])
def test_read_results_refuses_what_is_not_a_sweep_table(report, results, tmp_path, kind, says, given):
    path = _results_file(report, results, tmp_path, kind)
    with pytest.raises(ResultsError, match=says) as caught:
        read_results(path if given == "file" else tmp_path)
    assert str(caught.value).startswith(f"{path} ")
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)


def test_read_results_of_a_missing_file_stays_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_results(tmp_path / "nothing.csv.gz")
    with pytest.raises(FileNotFoundError):
        read_results(tmp_path)  # a directory without results.csv.gz


def _snapshot(directory):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_write_report_without_the_table_leaves_it_and_rewrites_the_summary(results, tmp_path):
    write_report(results, tmp_path, plots=False)
    before = _snapshot(tmp_path)
    paths = write_report(read_results(tmp_path), tmp_path, title="re-rendered", plots=False, write_table=False)
    after = _snapshot(tmp_path)
    assert {p.name for p in paths} == {"summary.md", "index.html"}
    for name in ("results.csv.gz", "env.json"):
        assert after[name] == before[name]  # bytes and mtime: never rewritten
    assert after["summary.md"][0].startswith(b"# re-rendered\n") and after["summary.md"] != before["summary.md"]
    assert not [name for name in after if name.startswith(".")]  # no temp file left


def test_a_report_that_fails_while_rendering_touches_no_file(results, tmp_path):
    write_report(results, tmp_path, plots=False)
    before = _snapshot(tmp_path)

    def broken(fig):
        raise RuntimeError("a plot that fails")

    with pytest.raises(RuntimeError, match="a plot that fails"):
        write_report(results.iloc[:-1], tmp_path, title="changed", plots=False, extra_plots={"x.png": broken})
    assert _snapshot(tmp_path) == before


def test_a_report_cut_short_never_leaves_the_old_summary_beside_a_new_table(results, tmp_path, monkeypatch):
    write_report(results, tmp_path, plots=False)
    old_table = (tmp_path / "results.csv.gz").read_bytes()

    write = folder_manifest.atomic_write_bytes

    def cut(path, data):
        if path.name == "summary.md":
            raise KeyboardInterrupt
        return write(path, data)

    monkeypatch.setattr(folder_manifest, "atomic_write_bytes", cut)  # killed after the table, before the summary
    with pytest.raises(KeyboardInterrupt):
        write_report(results.iloc[:-1], tmp_path, plots=False)
    assert (tmp_path / "results.csv.gz").read_bytes() != old_table
    assert len(read_results(tmp_path)) == len(results) - 1  # the new table, whole
    assert not (tmp_path / "summary.md").exists() and not (tmp_path / "index.html").exists()
    folder_manifest.check_folder(tmp_path)  # still a folder fp8-parity wrote: a rerun may write it again


def test_nonfinite_counts_separate_findings_from_overflow_of_the_data(results):
    """NaN that fp64 does not have, and Inf far from the output dtype's max, are findings; Inf
    where fp16 itself overflows is the data's. The report counts them apart: findings in the
    accuracy table, the overflow in the expected outliers (the accuracy table once had both)."""
    frame = results.copy()
    row = (frame["impl"] == "fp8_impl") & (frame["reference"] == "fp64") & (frame["tensor"] == "output")
    first = frame.index[row][0]
    frame.loc[first, ["nan", "ref_nan", "inf", "unexpected_inf"]] = [3, 0, 5, 1]
    tables = summary_tables(frame)
    overall = tables["overall"].loc[("fp8_impl", "output")]
    assert overall["NaN/Inf where fp64 is finite"] == 3 + 1 and "NaN/Inf from overflow" not in overall
    outlier = tables["outliers"].set_index(["data", "impl"]).loc[("overflow", "fp8_impl")]
    assert outlier["NaN/Inf from overflow"] == 4 and outlier["tensors"] == "output"


# ---- where the worst values are, expected SQNR, crashes, plots, diffs of other runs, the ETA ----------------

def _fp64_row(frame: pd.DataFrame, impl: str = "fp8_impl", tensor: str = "output") -> int:
    rows = frame.index[(frame["impl"] == impl) & (frame["reference"] == "fp64") & (frame["tensor"] == tensor)]
    return rows[0]


@pytest.mark.parametrize(("dist", "input_dtype", "why"), [
    ("tiny_amax", "bf16", "amax 1e-30 is below the scale's EPS floor"),
    ("outlier_row", "bf16", "one token 10^4x larger"),
    ("nearmax", "fp16", "fp16 output of nearmax data"),
])
def test_an_expected_outlier_is_in_its_own_section_never_in_the_main_tables(results, tmp_path, dist, input_dtype,
                                                                            why):
    """0.4 dB on data the sqnr policy exempts is what that data gives: the accuracy and worst tables,
    which once showed it as "SQNR min", leave it out, and the outliers section has it with its reason."""
    frame = results.copy()
    low = _fp64_row(frame)
    frame.loc[low, ["sqnr_db", "dist", "input_dtype"]] = [0.4, dist, input_dtype]
    tables = summary_tables(frame)
    case_id = frame.loc[low, "case_id"]
    assert verdict(frame).ok  # not judged, so no finding
    assert tables["overall"].loc[("fp8_impl", "output"), "SQNR min (dB)"] > 20
    assert tables["overall"].loc[("fp8_impl", "output"), "outlier cases"] == 1
    worst = tables["worst"].set_index(["impl", "tensor", "worst"])
    assert worst.loc[("fp8_impl", "output", "SQNR (dB)"), "value"] > 20
    assert not (tables["by_dist"] == 0.4).any().any()
    outlier = tables["outliers"].set_index(["data", "impl"]).loc[(dist, "fp8_impl")]
    assert outlier["SQNR min (dB)"] == 0.4 and outlier["cases"] == 1 and outlier["tensors"] == "output"
    assert outlier["rerun"] == f"fp8-parity check --impl fp8_impl --against fp64 --device cpu --case '{case_id}'"
    write_report(frame, tmp_path, plots=False)
    summary = (tmp_path / "summary.md").read_text()
    section = summary.split("## Expected outliers: measured, not judged by SQNR", 1)[1].split("\n## ", 1)[0]
    assert f"{dist}: " in section and why in section and f"--case '{case_id}'" in section
    assert "| 0.40 |" not in summary.split("## Expected outliers")[0]  # nowhere above it


def test_every_worst_judged_value_names_its_case_data_why_and_rerun(results, tmp_path):
    frame = results.copy()
    low = _fp64_row(frame)
    frame.loc[low, "sqnr_db"] = 0.4
    worst = summary_tables(frame)["worst"].set_index(["impl", "tensor", "worst"])
    row = worst.loc[("fp8_impl", "output", "SQNR (dB)")]
    case_id = frame.loc[low, "case_id"]
    assert row["value"] == 0.4 and row["case"] == case_id and row["dist"] == "normal" and row["against"] == "fp64"
    assert row["limit"] == pytest.approx(sqnr_floor("tensorwise", "output", "normal", "bf16", frame.loc[low, "n_eff"]))
    assert row["why"].startswith("a finding: output (step 0): SQNR 0.4 dB against fp64 is below the tensorwise floor")
    assert row["rerun"] == f"fp8-parity check --impl fp8_impl --against fp64 --device cpu --case '{case_id}'"
    assert set(worst.index.get_level_values("worst")) == {"SQNR (dB)"}  # no emulation here; rel err is not judged
    write_report(frame, tmp_path, plots=False)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Where the worst judged values are" in summary and f"--case '{case_id}'" in summary
    assert "- **SQNR against fp64** (finding): output 0.4 dB, " in summary  # the summary names it first


@pytest.fixture(scope="module")
def emulated_results() -> pd.DataFrame:
    """fp8_impl against fp64 and its recipe's exact emulation on one tiny case."""
    return run_cases([Case(lead=(16,), K=32, N=16)],
                     all_pairs([load_impl("fp8_impl")], [load_impl("fp64"), load_impl("emulated:tensorwise")]))


def test_a_worst_value_within_its_policy_says_so(emulated_results):
    worst = summary_tables(emulated_results)["worst"].set_index(["impl", "tensor", "worst"])
    assert worst.loc[("fp8_impl", "grad_input", "SQNR (dB)"), "why"].startswith("SQNR ")
    assert "above its floor of" in worst.loc[("fp8_impl", "grad_input", "SQNR (dB)"), "why"]
    shares = worst.xs("share of the accumulation bound", level="worst")  # what the policy judges, not ULPs
    assert len(shares) == 3 and (shares["against"] == "emulated:tensorwise").all() and (shares["limit"] == 1).all()
    for _, share in shares.iterrows():
        assert share["why"] == "equal to its exact emulation" if share["value"] == 0 else re.fullmatch(
            r"at [0-9.e-]+ of the accumulation bound \(\d+ ULP\)", share["why"])
    frame = emulated_results.copy()
    frame.loc[frame["reference"] == "emulated:tensorwise", "n_diff_where_reference_zero"] = 3
    why = summary_tables(frame)["worst"].set_index(["impl", "tensor", "worst"]).loc[
        ("fp8_impl", "output", "share of the accumulation bound")]
    assert why["why"].startswith("3 elements differ where the reference is 0 (not in ULPs); ")


def test_the_median_sqnr_stands_beside_the_recipe_s_expected_sqnr_and_floor(results):
    from parity.policy import sqnr_floor
    from parity.recipes import get_recipe
    overall = summary_tables(results)["overall"]
    columns = list(overall.columns)
    assert columns[columns.index("SQNR median (dB)") + 1:][:2] == ["expected SQNR (dB)", "SQNR floor (dB)"]
    for (_, tensor), row in overall.iterrows():
        recipe = get_recipe(row["recipe"])
        assert row["expected SQNR (dB)"] == recipe.expected_sqnr_db(tensor)
        assert row["SQNR floor (dB)"] == sqnr_floor(recipe, tensor, "normal")
    output = overall.loc[("fp8_impl", "output")]
    assert output["SQNR floor (dB)"] < output["expected SQNR (dB)"] < output["SQNR median (dB)"] + 3
    said = (f"output {output['SQNR median (dB)']:.1f} ({output['SQNR p05 (dB)']:.1f}) dB, expected "
            f"{output['expected SQNR (dB)']:.1f} (floor {output['SQNR floor (dB)']:.1f})")
    assert said in verdict(results).details[0]


def test_every_implementation_that_crashed_has_its_message_and_cases(results, tmp_path):
    frame = results.copy()
    frame["error"] = frame["error"].astype(object)
    first_case = frame["case_id"].iloc[0]
    frame.loc[(frame["impl"] == "fp8_impl") & (frame["case_id"] == first_case), "error"] = (
        "step 0: forward: RuntimeError: boom\nTraceback (most recent call last): ...")
    frame.loc[frame["impl"] == "bf16", "error"] = "step 0: backward: ValueError: bad strides"
    crashes = summary_tables(frame)["crashes"].reset_index()
    assert crashes[["implementation", "raised as", "exception", "cases"]].values.tolist() == [
        ["bf16", "implementation", "step 0: backward: ValueError: bad strides", 2],
        ["fp8_impl", "implementation", "step 0: forward: RuntimeError: boom", 1]]
    assert crashes["example case"].tolist() == [first_case, first_case]
    assert all(command.startswith(f"fp8-parity check --impl {impl} ")
               for impl, command in zip(crashes["implementation"], crashes["rerun"]))
    write_report(frame, tmp_path, plots=False)
    summary = (tmp_path / "summary.md").read_text()
    assert "| step 0: backward: ValueError: bad strides" in summary
    assert "| step 0: forward: RuntimeError: boom  " in summary  # the first line alone
    assert "crashes" not in summary_tables(results)  # nothing raised: no empty section


def test_identical_implementations_stay_distinguishable_in_the_sqnr_plot(results):
    from matplotlib.figure import Figure
    twin = results[results["impl"] == "fp8_impl"].assign(impl="torchao:tensorwise")
    fig = Figure()
    report_plots._plot_sqnr_vs_k(fig, pd.concat([results, twin], ignore_index=True))
    labels = [text.get_text() for text in fig.legends[0].texts]
    assert "fp8_impl" in labels and "torchao:tensorwise (identical to fp8_impl)" in labels
    assert not any("identical" in label for label in labels if label.startswith(("fp8_impl", "bf16")))
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    mine, theirs = lines["fp8_impl"], lines["torchao:tensorwise (identical to fp8_impl)"]
    assert mine.get_linestyle() != theirs.get_linestyle() and mine.get_marker() != theirs.get_marker()
    assert mine.get_linewidth() > theirs.get_linewidth()  # the later one on top, thinner: both visible


def test_heatmap_cells_show_how_many_cases_they_hold(results):
    from matplotlib.figure import Figure
    fig = Figure()
    report_plots._plot_parity_heatmap(fig, results, "fp8_impl")
    cells = [text.get_text() for text in fig.axes[0].texts]
    assert cells and all(re.fullmatch(r"\d+(\.\d)?% n=\d+", cell) for cell in cells), cells
    assert sum(int(cell.split("n=")[1]) for cell in cells) == results["case_id"].nunique()


def test_relative_error_and_ulps_stay_finite_where_the_reference_is_zero():
    import torch

    from parity.metrics import compare, describe_mismatch
    reference = torch.tensor([0.0, 1.0, -2.0, 4.0])
    candidate = torch.tensor([1e-3, 1.0, -2.0, 4.0])
    m = compare(candidate, reference)
    assert m["max_rel_err"] == pytest.approx(1e-3 / 4)  # relative to the largest |reference|
    assert m["ulp_max"] == 0 and m["n_diff_where_reference_zero"] == 1  # counted apart, not 1e44 ULPs
    assert math.isfinite(m["max_rel_err"]) and m["max_abs_err"] == pytest.approx(1e-3)
    nonzero = compare(torch.tensor([0.0, 1.0 + 2 ** -22]), torch.tensor([0.0, 1.0]))
    assert nonzero["ulp_max"] == 2 and nonzero["n_diff_where_reference_zero"] == 0
    assert compare(torch.ones(3), torch.zeros(3))["max_rel_err"] == math.inf  # nothing to be relative to
    text = describe_mismatch(dict(m, tensor="output", reference="fp64", step=0, dtype="float32"))
    assert "relative to the largest |reference|" in text and "1 elements differ where it is 0" in text


def _moves(results: pd.DataFrame, deltas: list[float]) -> pd.DataFrame:
    b = results.copy()
    finite = b.index[(b["reference"] == "fp64") & b["sqnr_db"].map(math.isfinite)]
    for index, delta in zip(finite, deltas):
        b.loc[index, "sqnr_db"] += delta
    return b


def _table_lines(text: str) -> list[str]:
    """The body rows of render_diff's table (after the blank line: a header and a rule first)."""
    return [line for line in text.split("\n\n", 1)[1].splitlines()[2:] if not line.startswith("... and")]


def test_diff_lists_a_bounded_number_of_moves_largest_first(results, monkeypatch):
    monkeypatch.setattr(report_diff, "DIFF_ROWS_SHOWN", 1)
    b = _moves(results, [-1.0, -5.0, -3.0, -2.0, -4.0, -0.5]).iloc[3:]  # the first three moves go: only in A
    text = render_diff(diff_results(results, b))
    lines = text.splitlines()
    assert lines[0] == f"{len(results) - 3} rows in both, 3 only in A, 0 only in B; SQNR tolerance 0.1 dB"
    assert lines[2] == "3 rows moved beyond noise: 3 SQNR fell"  # a row only in A is no move
    shown = _table_lines(text)
    assert len(shown) == 1 and shown[0].split()[-1] == "-4.00"  # the largest move first
    assert text.rstrip().endswith("... and 2 more moves (--csv FILE writes every one)")
    assert "only in A" not in text.split("\n\n", 1)[1]


def test_diff_of_runs_of_other_cases_says_so_first(results):
    a, b = results.copy(), results.copy()
    a.attrs["env"] = {**results.attrs["env"], "cases": "60 sampled cases"}
    b.attrs["env"] = {**results.attrs["env"], "cases": "1000 sampled cases"}
    assert render_diff(diff_results(a, b)).startswith("A and B ran different cases (A: 60 sampled cases; B: 1000")
    assert render_diff(diff_results(results, results.iloc[:4])).startswith("4 rows in both")  # a part: no warning
    others = results.assign(case_id=results["case_id"] + "-other")  # the same shapes under other ids
    text = render_diff(diff_results(results, pd.concat([results.iloc[:2], others], ignore_index=True)))
    assert text.startswith(f"A and B share only 2 of the smaller run's {len(results)} rows: they ran mostly")


def test_the_eta_weighs_cases_by_their_work():
    from parity.progress import Progress
    fixed, per_unit = 1.0, 1e-6  # seconds per case, and per multiply-add
    progress = Progress(True, "cases")
    works = [1e6, 1e6, 1e6, 1e4, 1e4, 1e4] + [1e4] * 10  # three large cases, then small ones
    planned, done, elapsed = sum(works), 0.0, 0.0
    for count, work in enumerate(works[:6], start=1):
        done, elapsed = done + work, elapsed + fixed + per_unit * work
        progress(count, len(works), elapsed, work=(done, planned))
    assert "~10 s left" in progress.status  # ten cases of 1.01 s; by count alone: ~15 s
    alike = Progress(True, "cases")
    alike(1, 4, 2.0, work=(5.0, 20.0))
    alike(2, 4, 4.0, work=(10.0, 20.0))
    assert "~4 s left" in alike.status  # cases of one size: the same as counting them


def test_the_sweep_feeds_its_progress_the_work_of_each_case():
    from parity.runner import Comparison
    from parity.policy import Policy
    from parity.sweep import case_work, run_sweep
    cases = [("sampled", Case(lead=(16,), K=16, N=16)), ("sampled", Case(lead=(32,), K=32, N=16, steps=2))]
    calls = []
    run_sweep(cases, [Comparison(load_impl("bf16"), load_impl("fp64"), Policy.SQNR)], device="cpu", isolate=False,
              progress=lambda done, total, elapsed, work: calls.append((done, total, work)))
    planned = case_work(cases[0][1]) + case_work(cases[1][1])
    assert calls == [(1, 2, (16 ** 3, planned)), (2, 2, (planned, planned))]
    assert case_work(cases[1][1]) == 32 * 32 * 16 * 2


# ---- a table's seal: its row count and checksum (issue 29, item 8) -------------------------------------------

def test_a_written_table_carries_its_seal_and_stays_a_plain_gzip_csv(report, results):
    out, _ = report
    frame = read_results(out)
    assert frame.attrs["seal"].rows == len(results)
    assert len(pd.read_csv(out / "results.csv.gz")) == len(results)  # any gzip reader reads it, seal ignored
    assert gzip.decompress((out / "results.csv.gz").read_bytes()).startswith(b"case_id,")


def test_a_table_cut_and_compressed_again_carries_no_seal_and_report_refuses_it(report, tmp_path, capsys):
    """Half a FAIL table, gzipped again, read PASS (issue 29): `report` refuses a table without a seal unless
    --unverified, which heads the verdict UNVERIFIED and exits 4 where it would pass."""
    from parity.cli import main
    out, _ = report
    lines = gzip.decompress((out / "results.csv.gz").read_bytes()).splitlines(keepends=True)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "results.csv.gz").write_bytes(gzip.compress(b"".join(lines[:len(lines) // 2])))
    assert read_results(tmp_path / "half").attrs["seal"] is None
    assert main(["report", str(tmp_path / "half")]) == 2
    assert "carries no seal (its row count and checksum): fp8-parity cannot tell whether it is complete" in \
        capsys.readouterr().err
    code = main(["report", str(tmp_path / "half"), "--unverified", "--candidate", "bf16", "--out",
                 str(tmp_path / "rendered")])  # not beside it: fp8-parity did not write that folder
    printed = capsys.readouterr().out
    assert code == 4 and printed.startswith("UNVERIFIED: ") and "Among its rows: PASS: bf16" in printed, printed
    assert "UNVERIFIED: " in (tmp_path / "rendered" / "summary.md").read_text()
    assert read_results(tmp_path / "rendered").attrs["seal"] is None  # its copy does not vouch for it either


def test_report_of_a_report_folder_writes_into_it_and_nowhere_else(report, tmp_path):
    """`report DIR/rep` wrote summary.md and index.html into DIR, over the user's own (issue 29, item 11)."""
    import shutil
    from parity.cli import main
    out, _ = report
    shutil.copytree(out, tmp_path / "rep")
    (tmp_path / "summary.md").write_text("mine\n")
    assert main(["report", str(tmp_path / "rep"), "--candidate", "bf16"]) in (0, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep", "summary.md"]
    assert (tmp_path / "summary.md").read_text() == "mine\n"


def test_a_passing_verdict_states_what_its_cases_covered(results):
    """Issue 29, item 9: a pass says the largest M, K, N, the dtypes and layouts that ran (here two tiny cases)."""
    judged = verdict(results)
    assert judged.ok and judged.headline.endswith(
        ". Covered: M <= 16, K <= 32, N <= 16, input bf16, weight bf16, layouts C/T, 2-D/3-D input, with and without "
        "bias, up to 1 call, 2 of 13 data distributions"), judged.headline

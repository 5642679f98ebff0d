"""The HTML report as a reader sees it: index.html opened in headless Chromium (Debian's /usr/bin/chromium,
driven by playwright) in a 1280x800 window, for a PASS report and a FAIL one.

What a reader needs first must be on the first screen: the summary (the verdict, the figure of every
implementation, the worst judged values with their rerun commands, what to run next) lies within the
first 800 px. Nothing widens the page: the document is no wider than the window, with every folded
section opened, and every table either fits or sits in its own box that scrolls sideways. The verdict
is visible, every table has rows, no section says "(no rows)", every image has loaded, a screenshot of
the page is not blank, and a PASS report's accuracy table holds no value the verdict did not judge
(tiny_amax's 0 dB is in the expected outliers, with its reason).

Without Chromium or playwright these tests skip and say what is missing; with FP8_PARITY_REQUIRE_BROWSER=1
(CI sets it in .ci/run) they fail instead, so CI can never skip them silently.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from matplotlib.image import imread

from parity.cases import Case
from parity.impls import load_impl
from parity.report import verdict, write_report
from parity.runner import executing_in, run_cases
from parity.sweep import sweep_comparisons
from parity.worker import Worker

CHROMIUM = Path("/usr/bin/chromium")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REQUIRED = os.environ.get("FP8_PARITY_REQUIRE_BROWSER") == "1"
WINDOW = {"width": 1280, "height": 800}
CANDIDATES = {"PASS": "fp8_impl", "FAIL": "evals/zoo/mutants.py:scale_not_inverted"}  # the planted bug fails 5 ways


def missing_browser_parts() -> list[str]:
    """What the browser tests need and this machine lacks, each with the command that installs it."""
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("the Python package playwright (pip install -e '.[test]')")
    if not CHROMIUM.is_file():
        missing.append(f"Debian's Chromium at {CHROMIUM} (apt-get update && apt-get install -y chromium)")
    return missing


@pytest.fixture(scope="module")
def browser():
    missing = "; ".join(missing_browser_parts())
    if missing and REQUIRED:
        pytest.fail(f"FP8_PARITY_REQUIRE_BROWSER=1 (CI sets it), but the browser tests cannot run: missing {missing}",
                    pytrace=False)
    if missing:
        pytest.skip(f"missing {missing} (with FP8_PARITY_REQUIRE_BROWSER=1 this is a failure)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM))  # headless by default
        yield chromium
        chromium.close()


@pytest.fixture(scope="module", params=list(CANDIDATES))
def report(request, tmp_path_factory):
    """A sweep's report in small: the candidate and bf16 against fp64, the recipe's reference and its exact
    emulation (the sweep's comparisons) on a plain case and a tiny_amax one with a bias (an expected
    outlier, and grad_bias), with long case ids and rerun commands; the candidate passes or fails."""
    candidate = CANDIDATES[request.param]
    cases = [Case(lead=(2, 16), K=32, N=48, input_layout="T", weight_dtype="fp32"),
             Case(lead=(16,), K=32, N=16, bias=True, dist="tiny_amax")]
    runner = Worker("cpu")  # the failing candidate is code under test: it runs in a worker, as a sweep runs it
    try:
        with executing_in(runner, 600.0):
            results = run_cases(cases, sweep_comparisons([load_impl(candidate), load_impl("bf16")], "cpu"))
    finally:
        runner.close()
    out = tmp_path_factory.mktemp(request.param.lower())
    judged = verdict(results, candidate=candidate)
    assert judged.headline.startswith(request.param)
    write_report(results, out, title=f"browser report: {request.param}", candidate=candidate)
    return out, judged


@pytest.fixture(scope="module")
def page(browser, report):
    out, _ = report
    opened = browser.new_page(viewport=WINDOW)
    opened.goto((out / "index.html").as_uri(), wait_until="load")  # "load": after every image
    yield opened
    opened.close()


def test_the_verdict_headline_is_visible_text(page, report):
    _, judged = report
    headline = page.locator("#summary p.headline")
    assert headline.is_visible()
    assert headline.inner_text() == judged.short and "(first: " not in judged.short  # its examples are below


def test_the_summary_fits_the_first_screen(page, report):
    """The verdict, the figure, the worst judged values with their rerun commands and what to run next,
    all within the first 800 px of a 1280 px window."""
    _, judged = report
    summary = page.locator("#summary")
    bottom = page.evaluate("() => document.querySelector('#summary').getBoundingClientRect().bottom + scrollY")
    assert bottom <= WINDOW["height"], f"the summary ends at {bottom} px"
    assert summary.locator("figure img").evaluate("i => i.complete && i.naturalWidth > 0")
    extremes = summary.locator("ul.extremes li")
    assert extremes.count() and "rerun: fp8-parity check --impl " in extremes.first.inner_text()
    assert extremes.first.get_attribute("class") == ("within" if judged.ok else "finding")  # a FAIL's findings first
    assert extremes.first.inner_text().startswith("SQNR against fp64:")  # nearest its floor, or furthest below
    assert summary.locator("p.next", has_text="What to run next:").locator("code").inner_text().startswith(
        "fp8-parity bisect --impl " if not judged.ok else "fp8-parity check --impl fp8_impl ")


def test_nothing_widens_the_page_and_every_table_fits_or_scrolls_in_its_own_box(page):
    page.evaluate("() => document.querySelectorAll('details').forEach(d => d.open = true)")  # every folded section
    width = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1] == WINDOW["width"], f"the page is {width[0]} px wide in a {width[1]} px window"
    tables = page.locator("table").evaluate_all("""tables => tables.map(t => {
        const box = t.parentElement, r = t.getBoundingClientRect(), b = box.getBoundingClientRect();
        return {columns: t.tHead.rows[0].cells.length, fits: r.right <= window.innerWidth,
                scrolls: getComputedStyle(box).overflowX === 'auto' && b.right <= window.innerWidth}; })""")
    assert tables and all(t["fits"] or t["scrolls"] for t in tables), [t for t in tables if not t["fits"]]
    assert any(not t["fits"] for t in tables)  # the worst values' rerun commands are wider than the window


def test_every_table_has_a_body_row_and_no_section_says_no_rows(page):
    rows_per_table = page.locator("table").evaluate_all("tables => tables.map(t => t.tBodies[0]?.rows.length ?? 0)")
    assert rows_per_table, "the report has no table"
    assert all(rows > 0 for rows in rows_per_table), f"body rows per table: {rows_per_table}"
    assert "(no rows)" not in page.locator("body").inner_text()


def test_expected_outliers_are_apart_and_a_pass_s_main_table_holds_only_judged_values(page, report):
    _, judged = report
    outliers = _table_after(page, "Expected outliers")
    assert {row["data"] for row in outliers} == {"tiny_amax"}
    if judged.ok:  # a FAIL's main table holds its findings
        main = _table_after(page, "Accuracy against fp64")
        lows = [row["SQNR min (dB)"] for row in main if row["SQNR min (dB)"]]  # blank: nothing of it was judged
        assert lows and all(float(low) > 10 for low in lows), lows  # tiny_amax's 0.00 is no result of the verdict's
        assert [row["SQNR min (dB)"] for row in outliers if row["impl"] == "fp8_impl"] == ["0.00"]
    note = page.locator("h2", has_text="Expected outliers").locator("xpath=following-sibling::p[1]").inner_text()
    assert "tiny_amax: amax 1e-30 is below the scale's EPS floor" in note
    assert "grad_bias's expected 40.0 dB: grad_bias is a high-precision sum" in page.locator(
        "h2", has_text="Accuracy against fp64").locator("xpath=following-sibling::p[1]").inner_text()


def _table_after(page, heading: str) -> list[dict]:
    """The rows (column -> text) of the table under the section heading that starts with `heading`."""
    table = page.locator("h2", has_text=heading).locator("xpath=following-sibling::div[1]//table")
    return table.evaluate("""t => { const names = [...t.tHead.rows[0].cells].map(c => c.innerText);
        return [...t.tBodies[0].rows].map(r => Object.fromEntries([...r.cells].map((c, i) => [names[i], c.innerText])));
    }""")


def test_every_image_has_loaded(page, report):
    out, _ = report
    images = page.locator("img").evaluate_all(
        "images => images.map(i => ({src: i.getAttribute('src'), complete: i.complete, width: i.naturalWidth}))")
    assert sorted(image["src"] for image in images) == sorted(p.name for p in out.glob("*.png"))
    broken = [image for image in images if not (image["complete"] and image["width"] > 0)]
    assert not broken, f"images that did not load: {broken}"


def test_a_screenshot_of_the_page_is_a_png_that_is_not_blank(page, tmp_path):
    shot = tmp_path / "index.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes().startswith(PNG_SIGNATURE)
    pixels = imread(shot)  # [height, width, channels]
    assert (pixels != pixels[0, 0]).any(), "the screenshot is one flat colour: nothing was rendered"


def test_what_is_missing_is_named_with_its_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(f"{__name__}.CHROMIUM", tmp_path / "no-chromium-here")
    assert any("apt-get install -y chromium" in part for part in missing_browser_parts())

"""The HTML report as a reader sees it: index.html opened in headless Chromium (Debian's /usr/bin/chromium,
driven by playwright). The verdict is visible, every table has rows, every image has loaded, and a
screenshot of the page is not blank.

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
from parity.runner import all_pairs, run_cases

CHROMIUM = Path("/usr/bin/chromium")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REQUIRED = os.environ.get("FP8_PARITY_REQUIRE_BROWSER") == "1"


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


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A report of the smallest sweep with a verdict, tables and both plots: fp8_impl on one tiny case,
    against fp64 (the SQNR plot) and torchao's tensorwise recipe (the parity heatmap)."""
    results = run_cases([Case(lead=(16,), K=16, N=16)],
                        all_pairs([load_impl("fp8_impl")], [load_impl("fp64"), load_impl("torchao:tensorwise")]))
    out = tmp_path_factory.mktemp("report")
    write_report(results, out, title="browser report")
    return out, verdict(results)


@pytest.fixture(scope="module")
def page(browser, report):
    out, _ = report
    opened = browser.new_page()
    opened.goto((out / "index.html").as_uri(), wait_until="load")  # "load": after every image
    yield opened
    opened.close()


def test_the_verdict_headline_is_visible_text(page, report):
    _, judged = report
    headline = page.locator("p.headline")
    assert headline.is_visible()
    assert headline.inner_text() == judged.headline and judged.headline.startswith("PASS: fp8_impl")


def test_every_table_has_a_body_row(page):
    rows_per_table = page.locator("table").evaluate_all("tables => tables.map(t => t.tBodies[0]?.rows.length ?? 0)")
    assert rows_per_table, "the report has no table"
    assert all(rows > 0 for rows in rows_per_table), f"body rows per table: {rows_per_table}"


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

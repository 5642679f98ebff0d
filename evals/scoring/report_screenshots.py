"""The README's screenshots of a report: the first screen of a PASS and of a FAIL sweep report.

    python -m evals.scoring.report_screenshots [--out docs/images] [--samples 8]

Runs two small sweeps on the CPU (the quick preset's edge cases and `--samples` sampled cases): the
default implementations, whose candidate fp8_impl passes, and the zoo's planted bug
scale_not_inverted beside fp8_impl, which fails. Each report's index.html is opened in headless
Chromium (Debian's /usr/bin/chromium, driven by playwright, as property_tests/test_browser.py does)
in a 1280x800 window, and the window is saved as report-pass.png and report-fail.png: what a reader
sees before scrolling. Prints each page's size at that width.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
WINDOW = {"width": 1280, "height": 800}
ROOT = Path(__file__).resolve().parents[2]  # the sweeps run here, so the planted bug's path reads as in the README
PLANTED = "evals/zoo/mutants.py:scale_not_inverted"
SWEEPS = {  # screenshot -> the implementations of its sweep (the first is the candidate)
    "report-pass.png": [],  # the default implementations
    "report-fail.png": [PLANTED, "fp8_impl"],
}


def sweep(out: Path, impls: list[str], samples: int) -> None:
    """`fp8-parity sweep` on the CPU into `out`; exit 1 (a FAIL) is what the planted bug should give."""
    command = [sys.executable, "-m", "parity", "sweep", "--device", "cpu", "--samples", str(samples), "--quiet",
               "--out", str(out), *(part for impl in impls for part in ("--impl", impl))]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
    print(done.stdout.splitlines()[0][:160])


def screenshot(page_file: Path, shot: Path) -> tuple[int, int]:
    """Save the first screen of `page_file` as `shot`; (width, height) of the whole page."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport=WINDOW)
        page.goto(page_file.as_uri(), wait_until="load")
        size = page.evaluate("() => [document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        page.screenshot(path=str(shot))
        browser.close()
    return size[0], size[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for name, impls in SWEEPS.items():
            report = Path(work) / Path(name).stem
            sweep(report, impls, args.samples)
            width, height = screenshot(report / "index.html", args.out / name)
            print(f"{args.out / name}: the page is {width} x {height} px at {WINDOW['width']} px wide")


if __name__ == "__main__":
    main()

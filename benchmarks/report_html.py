"""report.html in a real browser: what it embeds, how fast it opens, and a screenshot.

    python -m calibrate task=compare hydra.run.dir=/tmp/html-compare
    python -m benchmarks.report_html /tmp/html-compare [/tmp/html-compare-ours ...] \\
        --screenshot artifacts/benchmarks/report_html.png --trajectory 2 --scheme naive2 --at 0.6 \\
        --out artifacts/benchmarks/report_html.md

Prints (and with --out writes) a table of the page's size and of its embedded frame sheets per
stream, in bytes per raw 8-bit RGB byte. With --screenshot it opens the page in headless
Chromium, waits until the players have decoded their frames, seeks by clicking the PSNR curve
at `--at` of the rollout, checks that the frame index, the players and the curve cursors agree,
and saves a screenshot of the page's top (verdict, blind-spot table, players, curves).

Browser: Chromium and its WebDriver (Debian: ``apt-get install -y chromium chromium-driver``)
driven by selenium (``pip install -e ".[browser]"``); paths from ``CALIBRATE_CHROMIUM`` and
``CALIBRATE_CHROMEDRIVER`` or the PATH. The helpers below are also what the browser test uses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import command_line
from calibrate.evaluate.html import page_data, page_sheet, read_page
from calibrate.io import write_bytes_atomic, write_text_atomic

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars")
STATE_JS = """
const q = (s) => document.querySelector(s);
const frame = (x) => (x === undefined || x === "") ? null : Number(x);
return {
  ready: document.body.dataset.ready === "1",
  index: frame(q("#frame-index").dataset.frame),
  seek: Number(q("#seek").value),
  players: Object.fromEntries([...document.querySelectorAll("#players canvas")].map((c) => [c.id.slice(2), frame(c.dataset.frame)])),
  players_hidden: q("#players").hidden,
  cursors: [...document.querySelectorAll("svg.curve .cursor")].map((l) => frame(l.dataset.frame)),
  playing: q("#play").dataset.playing === "1",
  note: q("#frames-note").hidden ? null : q("#frames-note").textContent,
  trajectory: Number(q("#traj").value),
  scheme: q("#scheme").value,
};
"""


def browser_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver), or None when either is missing."""
    chromium = os.environ.get("CALIBRATE_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = os.environ.get("CALIBRATE_CHROMEDRIVER") or shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@contextmanager
def browser(width: int = 1280, height: int = 1500):
    """A headless Chromium (selenium WebDriver) with a fresh profile, closed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = browser_paths()
    if paths is None:
        raise RuntimeError("Chromium or chromedriver not found (Debian: apt-get install -y chromium chromium-driver)")
    with tempfile.TemporaryDirectory(prefix="calibrate-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = paths[0]
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        options.add_argument(f"--window-size={width},{height}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
        try:
            yield driver
        finally:
            driver.quit()


def open_report(driver, path: str | os.PathLike, timeout: float = 60.0) -> float:
    """Load a report.html and wait until its players have their frames; returns the seconds it took."""
    t0 = time.time()
    driver.get(Path(path).resolve().as_uri())
    wait_ready(driver, timeout)
    return time.time() - t0


def wait_ready(driver, timeout: float = 60.0) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")


def page_state(driver) -> dict:
    """What the page shows: frame index, each player's frame, the cursors, selection, note."""
    return driver.execute_script(STATE_JS)


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def click_curve(driver, curve_id: str, frame: int) -> None:
    """A real mouse click on the curve `curve_id` at frame `frame` (its line's point there)."""
    from selenium.webdriver.common.action_chains import ActionChains

    svg = driver.find_element("id", curve_id)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", svg)
    dx, dy = driver.execute_script("""
        const svg = arguments[0], line = svg.querySelector(".main");
        const first = svg.id === "curve-flicker" ? 1 : 0;  // the flicker series starts at frame 1
        const p = line.points.getItem(arguments[1] - first).matrixTransform(svg.getScreenCTM());
        const r = svg.getBoundingClientRect();
        return [p.x - (r.left + r.width / 2), 0];""", svg, frame)
    ActionChains(driver).move_to_element_with_offset(svg, round(dx), round(dy)).click().perform()


def canvas_rgb(driver, panel: str):
    """The pixels a player shows now, ``[H, W, 3]`` uint8 (torch)."""
    import torch

    w, h, data = driver.execute_script("""
        const c = document.getElementById("p-" + arguments[0]);
        return [c.width, c.height, Array.from(c.getContext("2d").getImageData(0, 0, c.width, c.height).data)];""", panel)
    return torch.tensor(data, dtype=torch.uint8).reshape(h, w, 4)[..., :3]


def select(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", element_id)).select_by_value(value)


# ---- the benchmark ------------------------------------------------------------------------------
def sizes(page_path: Path) -> list[dict]:
    """Bytes the page embeds per stream, against raw 8-bit RGB of the same frames."""
    page = read_page(page_path)
    data = page_data(page)
    frames = data["frames"]
    if frames is None:
        return []
    per_frame = frames["height"] * frames["width"] * 3
    totals: dict[str, list[int]] = {}

    def add(stream, sheets, n):
        if sheets:
            t = totals.setdefault(stream, [0, 0, 0, 0])
            t[0] += sum(len(page_sheet(page, span)) for span in sheets)
            t[1] += n * per_frame
            t[2] += n
            t[3] += sum(end - start for start, end in sheets)

    for traj, entry in zip(data["trajectories"], frames["trajectories"]):
        n = traj["num_frames"]
        add("reference", entry["reference"], n)
        add("ground truth", entry["ground_truth"], n)
        for scheme, sheets in entry["quantized"].items():
            add(f"quantized: {scheme}", sheets, n)
    return [{"stream": s, "frames": t[2], "bytes": t[0], "raw_bytes": t[1], "ratio": t[0] / t[1], "in_page": t[3]}
            for s, t in totals.items()]


def screenshot(page_path: Path, out: Path, at: float, trajectory: int | None = None, scheme: str | None = None) -> dict:
    """Open the page, pick a trajectory and scheme (default: the page's), seek by clicking the
    PSNR curve, check that the page agrees on the frame, save a screenshot."""
    with browser(height=1760) as driver:
        seconds = open_report(driver, page_path)
        for element, value in (("traj", trajectory), ("scheme", scheme)):
            if value is not None:
                select(driver, element, str(value))
                wait_ready(driver)
        state = page_state(driver)
        n = page_data(read_page(page_path))["trajectories"][state["trajectory"]]["num_frames"]
        click_curve(driver, "curve-psnr", round(at * (n - 1)))
        state = page_state(driver)
        shown = [state["index"], state["seek"], *state["cursors"], *(v for v in state["players"].values() if v is not None)]
        if len(set(shown)) != 1:
            raise RuntimeError(f"the page does not agree on the frame it shows: {state}")
        driver.execute_script("window.scrollTo(0, 0);")
        png = driver.get_screenshot_as_png()
        errors = console_errors(driver)
    write_bytes_atomic(out, png)
    return {"load_seconds": seconds, "frame": state["index"], "scheme": state["scheme"],
            "trajectory": state["trajectory"], "console_errors": errors}


def size_table(page: Path) -> list[str]:
    data = page_data(read_page(page))
    trajs = data["trajectories"]
    total = page.stat().st_size
    lines = [f"`{page}`: {len(data['schemes'])} schemes x {len(trajs)} trajectories x up to "
             f"{max(t['num_frames'] for t in trajs)} frames: **{total / 1e6:.2f} MB** ({total:,} bytes)", "",
             "| stream | frames | sheet bytes | raw RGB bytes | sheet / raw |", "|---|---|---|---|---|"]
    rows = sizes(page)
    for r in rows:
        lines.append(f"| {r['stream']} | {r['frames']} | {r['bytes']:,} | {r['raw_bytes']:,} | {r['ratio']:.3f} |")
    embedded, raw, in_page = (sum(r[key] for r in rows) for key in ("bytes", "raw_bytes", "in_page"))
    lines.append(f"| all | | {embedded:,} | {raw:,} | {embedded / max(1, raw):.3f} |")
    lines.append(f"| all, as the page holds them (escaped bytes: x{in_page / max(1, embedded):.4f}) | | {in_page:,} | {raw:,} "
                 f"| {in_page / max(1, raw):.3f} |")
    return lines + [""]


BUDGET_BYTES = 20_000_000


def run_command(run_dir: Path) -> str:
    """The command line a finished run recorded (`.hydra/overrides.yaml`, written once it succeeded)."""
    from omegaconf import OmegaConf

    overrides = run_dir / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return f"(not recorded: {overrides} is missing)"
    return " ".join(["python -m calibrate", *OmegaConf.load(overrides)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", help="run directories holding report.html (the screenshot is of the first)")
    p.add_argument("--screenshot", help="write a PNG screenshot here (needs Chromium + selenium)")
    p.add_argument("--at", type=float, default=0.75, help="seek to this fraction of the rollout before the screenshot")
    p.add_argument("--trajectory", type=int, help="show this trajectory (index in the page's picker; default: the page's)")
    p.add_argument("--scheme", help="show this scheme (default: the page's)")
    p.add_argument("--out", help="write the tables as markdown here")
    args = p.parse_args(argv)
    pages = [Path(d) / "report.html" for d in args.run_dirs]
    for page in pages:
        if not page.is_file():
            print(f"error: {page} not found (run task=evaluate, compare or check first)", file=sys.stderr)
            return 2
    lines = [line for page in pages for line in size_table(page)]
    if args.screenshot:
        shot = screenshot(pages[0], Path(args.screenshot), args.at, args.trajectory, args.scheme)
        lines += [f"Opened `{pages[0]}` in headless Chromium: players ready after {shot['load_seconds']:.1f} s; "
                  f"clicked the PSNR curve at frame {shot['frame']} of trajectory {shot['trajectory']}, scheme "
                  f"{shot['scheme']}: frame index, seek bar, cursors and players agree; console errors: "
                  f"{len(shot['console_errors'])}; screenshot `{args.screenshot}`."]
    print("\n".join(lines))
    if args.out:
        command = command_line("report_html", argv)
        head = ["# report.html: size and a real-browser check", "", f"Command: `{command}`  ",
                f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}", "",
                f"Budget: <= {BUDGET_BYTES / 1e6:.0f} MB for the default compare with `ours` (7 trajectories x 256 "
                f"frames of 32x32 RGB). The runs, as each recorded its command line:", "",
                *[f"- `{run_command(page.parent)}`: {page.stat().st_size / 1e6:.2f} MB, "
                  f"{'within' if page.stat().st_size <= BUDGET_BYTES else '**over**'} the budget" for page in pages],
                ""]
        write_text_atomic(args.out, "\n".join(head + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

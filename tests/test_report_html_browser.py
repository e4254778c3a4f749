"""report.html in a real browser (headless Chromium driven by selenium): it plays, a mouse click on
a curve seeks the players, and the frame index, the seek bar, the curve cursors and every player
show the same frame, with exactly that frame's pixels of the evaluation's rollouts.

Slow (a real TinyWorld evaluation, then a browser). To run it:

    apt-get install -y chromium chromium-driver      # Debian; or set CALIBRATE_CHROMIUM / CALIBRATE_CHROMEDRIVER
    pip install -e ".[browser]"                      # selenium
    python -m pytest -m slow tests/test_report_html_browser.py
"""

import shutil
import time

import pytest
import torch

from calibrate import load_model
from benchmarks.report_html import (browser, browser_paths, canvas_rgb, click_curve, console_errors, open_report,
                                              page_state, select, wait_ready)
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.html import page_data, read_page, write_report_html
from calibrate.evaluate.run import evaluate
from calibrate.evaluate.sheets import FrameSheets, sheet_path, to_uint8
from calibrate.adapters import as_world
from calibrate.schemes import build_baseline
from calibrate.world.trajectories import make_trajectories

pytest.importorskip("selenium", reason='needs selenium: pip install -e ".[browser]"')
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(browser_paths() is None, reason="needs chromium + chromedriver (apt-get install -y chromium chromium-driver)")]
CPU = torch.device("cpu")
PANELS = ("reference", "quantized", "error", "ground_truth")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Three schemes on 2 x 140-frame (two sheets) and 1 x 24-frame held-out trajectories: the page, a copy with
    a damaged sheet, one without frames, and the frames the players must show."""
    out = tmp_path_factory.mktemp("report")
    model = load_model("tinyworld")
    info = as_world(model).info
    recipes = {n: build_baseline(n, info) for n in ("fp16", "naive2", "kivi4")}
    trajs = make_trajectories(["static", "stress"], "evaluation", 2, 140) + make_trajectories(["orbit"], "evaluation", 1, 24)
    sheets = FrameSheets(out / "frames")
    runs = evaluate(as_world(model), recipes, trajs, 16, 1, CPU, attention=False, keep_frames=True, on_rollout=sheets)
    rep = report_mod.build(runs, [], {}, 30.0)
    pages = {"full": write_report_html(out / "report.html", rep, runs, sheets, "pytest browser"),
             "none": write_report_html(out / "none" / "report.html", rep, runs, None, "pytest browser")}
    shutil.copytree(out / "frames", out / "damaged")
    bad = sheet_path(out / "damaged", "quantized/naive2", 0, 0)
    bad.write_bytes(bad.read_bytes()[:-50])
    pages["damaged"] = write_report_html(out / "damaged" / "report.html", rep, runs, FrameSheets(out / "damaged"), "pytest")
    frames = {key: [to_uint8(x) for batch in runs["fp16"].frames for x in batch[key]] for key in ("reference", "ground_truth")}
    for name, run in runs.items():
        frames[name] = [to_uint8(x) for batch in run.frames for x in batch["quantized"]]
    return pages, frames, page_data(read_page(pages["full"]))


def assert_players_agree(driver, frames: dict, gain: int = 4) -> dict:
    """Every view shows the same frame, and each player shows exactly that frame's pixels."""
    s = page_state(driver)
    t, i = s["index"], s["trajectory"]
    assert s["ready"] and s["seek"] == t and s["cursors"] == [t, t], s
    assert s["players"] == {p: t for p in PANELS}, s
    ref, quant = frames["reference"][i][t], frames[s["scheme"]][i][t]
    assert torch.equal(canvas_rgb(driver, "reference"), ref)
    assert torch.equal(canvas_rgb(driver, "quantized"), quant)
    assert torch.equal(canvas_rgb(driver, "ground_truth"), frames["ground_truth"][i][t])
    error = ((quant.int() - ref.int()).abs() * gain).clamp(max=255).to(torch.uint8)
    assert torch.equal(canvas_rgb(driver, "error"), error)
    return s


def frames_played(driver, speed: str, seconds: float) -> int:
    select(driver, "speed", speed)
    start = page_state(driver)["index"]
    driver.find_element("id", "play").click()
    time.sleep(seconds)
    driver.find_element("id", "play").click()
    s = page_state(driver)
    assert not s["playing"]
    n = int(driver.find_element("id", "seek").get_attribute("max")) + 1
    return (s["index"] - start) % n


def test_plays_seeks_by_clicking_the_curve_and_the_players_agree(report, tmp_path):
    pages, frames, data = report
    with browser() as d:
        open_report(d, pages["full"])
        s = assert_players_agree(d, frames)
        assert (s["index"], s["scheme"], s["trajectory"]) == (0, data["default_scheme"], data["default_trajectory"])

        assert frames_played(d, "1", 1.0) > 0  # it plays, and stops on pause
        assert_players_agree(d, frames)

        click_curve(d, "curve-psnr", 30)  # a real mouse click on the PSNR curve at frame 30
        assert assert_players_agree(d, frames)["index"] == 30
        click_curve(d, "curve-psnr", 135)  # in the second sheet
        assert assert_players_agree(d, frames)["index"] == 135
        click_curve(d, "curve-flicker", 7)
        assert assert_players_agree(d, frames)["index"] == 7
        d.find_element("id", "next").click()
        d.find_element("id", "next").click()
        d.find_element("id", "prev").click()
        assert assert_players_agree(d, frames)["index"] == 8

        for scheme in ("fp16", "kivi4", "naive2"):
            select(d, "scheme", scheme)
            wait_ready(d)
            assert assert_players_agree(d, frames)["scheme"] == scheme
        select(d, "gain", "16")
        assert_players_agree(d, frames, gain=16)
        select(d, "gain", "4")

        select(d, "traj", "2")  # 24 frames: the shown frame stays inside it
        wait_ready(d)
        assert assert_players_agree(d, frames)["trajectory"] == 2
        d.find_element("id", "last").click()
        assert assert_players_agree(d, frames)["index"] == 23
        d.find_element("id", "first").click()
        select(d, "traj", "1")
        wait_ready(d)

        fast, slow = frames_played(d, "4", 1.0), frames_played(d, "0.25", 1.0)
        assert fast > 4 * max(slow, 1), (fast, slow)  # 32 vs 2 frames per second
        assert_players_agree(d, frames)
        d.save_screenshot(str(tmp_path / "report.png"))
        assert console_errors(d) == []


def test_damaged_and_frameless_pages_still_work(report):
    pages, frames, data = report
    with browser() as d:
        open_report(d, pages["damaged"])
        s = page_state(d)
        assert "quantized/naive2/0.0.webp" in s["note"] and s["note"].count("\n") == 0
        select(d, "traj", "0")
        select(d, "scheme", "naive2")
        wait_ready(d)
        s = page_state(d)
        assert s["players"]["reference"] == s["index"] and s["players"]["quantized"] is None and s["players"]["error"] is None
        select(d, "scheme", "kivi4")
        wait_ready(d)
        assert_players_agree(d, frames)
        assert console_errors(d) == []

        open_report(d, pages["none"])
        s = page_state(d)
        assert s["players_hidden"] and "eval.strips=false" in s["note"]
        click_curve(d, "curve-psnr", 20)  # the numbers and the curves work without frames
        s = page_state(d)
        assert s["index"] == 20 and s["cursors"] == [20, 20] and set(s["players"].values()) == {None}
        assert console_errors(d) == []

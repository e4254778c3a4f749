"""report.html without a browser: the frames it embeds are exactly the rollouts, the page is
self-contained and escaped, and missing or damaged frames cost one line on the page, not the page.

A tiny random TinyWorld keeps this fast (its frames are noise-like, which is the hard case for
the encoder and as good as any for exactness). The real-browser test is test_report_html_browser.py.
"""

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from calibrate.config import Config, TrajectoriesConfig
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.html import (TRAP_SENTENCE, embed, fit_summary, page_data, page_sheet, read_page, unembed,
                                     write_report_html)
from calibrate.evaluate.run import evaluate
from calibrate.evaluate.sheets import (MAX_HEIGHT, SHEET_FRAMES, FrameSheets, decode_sheet, difference, encode_sheet,
                                       read_stream, sheet_frames, sheet_path, to_uint8, undo_difference)
from calibrate.recipe import load_recipe, save_recipe
from calibrate.adapters import as_world
from calibrate.schemes import build_baseline
from calibrate.world.model import TinyWorld, TinyWorldConfig
from calibrate.world.trajectories import make_trajectories
from calibrate.world.weights import save_weights

CPU = torch.device("cpu")
TINY = TinyWorldConfig(dim=64, num_layers=1, num_heads=1, rope_xy_pairs=4, rope_bearing_pairs=8)
ROOT = Path(__file__).resolve().parent.parent


# ---- sheets: layout and exactness -------------------------------------------------------------
def test_sheet_interleaves_rows_by_time_and_round_trips_exactly():
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (5, 3, 7, 3), dtype=torch.uint8, generator=g)  # [F, H, W, 3]
    data = encode_sheet(frames)
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    from io import BytesIO

    from PIL import Image

    with Image.open(BytesIO(data)) as im:
        rows = torch.frombuffer(bytearray(im.convert("RGB").tobytes()), dtype=torch.uint8).reshape(3 * 5, 7, 3)
    for t in range(5):
        for y in range(3):
            assert torch.equal(rows[y * 5 + t], frames[t, y])  # image row y*F + t = row y of frame t
    assert torch.equal(decode_sheet(data, 5), frames)


def test_difference_is_exact_for_every_pair_of_values():
    q, r = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    q, r = q.to(torch.uint8)[..., None], r.to(torch.uint8)[..., None]
    d = difference(q, r)
    assert torch.equal(undo_difference(d, r), q)
    assert torch.all(difference(r, r) == 128)  # equal frames: a flat sheet


def test_embedded_bytes_round_trip_and_are_safe_in_a_script_block():
    g = torch.Generator().manual_seed(0)
    noise = bytes(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g).tolist())
    for data in (bytes(range(256)) * 3 + b"</script>\r\n=3=", b"=" * 5, b"", noise):
        stored = embed(data)
        assert unembed(stored) == data
        assert not set(stored) & {0x00, 0x0D, 0x3C}  # NUL, CR, '<': what the HTML parser would change
        assert len(stored) == len(data) + sum(data.count(b) for b in (0, 0x0D, 0x3C, 0x3D))  # one byte per escape
    assert len(embed(noise)) < 1.02 * len(noise)  # near-uniform bytes: ~4/256 escaped


def test_sheet_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match="sheet holds"):
        encode_sheet(torch.zeros(SHEET_FRAMES + 1, 2, 2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="sheet holds"):
        encode_sheet(torch.zeros(1, 2, 2, 3))  # float
    with pytest.raises(ValueError, match="RGB"):
        to_uint8(torch.zeros(2, 4, 2, 2))


def test_frames_too_tall_leave_a_note_and_no_files(tmp_path):
    sheets = FrameSheets(tmp_path / "frames")
    tall = torch.zeros(1, 2, 3, MAX_HEIGHT + 1, 4)
    sheets("a", 0, tall, tall, None)
    assert "pixels tall" in sheets.note and not (tmp_path / "frames").exists()


# ---- a real (tiny) evaluation -------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TinyWorld(TINY).eval()
    torch.nn.init.normal_(m.patch_out.weight, std=0.02)
    return m


@pytest.fixture(scope="module")
def evaluated(model, tmp_path_factory):
    """fp16 + naive2 on 3 trajectories (lengths 130 and 20: two batches, 2 and 1 sheets), frames kept."""
    info = as_world(model).info
    recipes = {"fp16": build_baseline("fp16", info), "naive2": build_baseline("naive2", info)}
    trajs = make_trajectories(["static", "stress"], "evaluation", 2, 130) + make_trajectories(["orbit"], "evaluation", 1, 20)
    sheets = FrameSheets(tmp_path_factory.mktemp("frames"))
    runs = evaluate(as_world(model), recipes, trajs, 16, 1, CPU, batch_size=8, attention=False, keep_frames=True, on_rollout=sheets)
    rep = report_mod.build(runs, [], {}, 30.0)
    return rep, runs, sheets


def kept(runs, name: str, key: str) -> list[torch.Tensor]:
    """Per trajectory (SchemeRun.trajs order), the kept frames as the page should show them."""
    return [to_uint8(x) for batch in runs[name].frames for x in batch[key]]


def page_frames(page: str, trajectory: dict, stream: list[list[int]]) -> torch.Tensor:
    n = trajectory["num_frames"]
    return torch.cat([decode_sheet(page_sheet(page, span), sheet_frames(n, k)) for k, span in enumerate(stream)])


def test_page_embeds_every_rollout_exactly(evaluated, tmp_path):
    rep, runs, sheets = evaluated
    page = read_page(write_report_html(tmp_path / "report.html", rep, runs, sheets, "pytest"))
    data = page_data(page)
    assert data["frames_note"] is None and data["schemes"] == ["fp16", "naive2"]
    assert [t["num_frames"] for t in data["trajectories"]] == [130, 130, 20]
    frames = data["frames"]
    ref, truth = kept(runs, "fp16", "reference"), kept(runs, "fp16", "ground_truth")
    for i, (traj, entry) in enumerate(zip(data["trajectories"], frames["trajectories"])):
        assert len(entry["reference"]) == (2 if traj["num_frames"] == 130 else 1)
        r = page_frames(page, traj, entry["reference"])
        assert torch.equal(r, ref[i])
        assert torch.equal(page_frames(page, traj, entry["ground_truth"]), truth[i])
        for name in runs:
            q = undo_difference(page_frames(page, traj, entry["quantized"][name]), r)
            assert torch.equal(q, kept(runs, name, "quantized")[i]), (name, i)
        for name, run in runs.items():  # the curves are the evaluation's float series, per trajectory
            assert data["series"][name]["psnr_ref"][i] == pytest.approx(run.trajs[i].series["psnr_ref"].tolist(), abs=1e-3)
            assert len(data["series"][name]["flicker"][i]) == traj["num_frames"] - 1
    assert (frames["height"], frames["width"]) == tuple(ref[0].shape[1:3])
    assert data["default_scheme"] in runs and 0 <= data["default_trajectory"] < 3


def test_page_is_self_contained_with_the_numbers_at_the_top(evaluated, tmp_path):
    rep, runs, sheets = evaluated
    page = read_page(write_report_html(tmp_path / "report.html", rep, runs, sheets, "python -m calibrate task=compare"))
    raw = (tmp_path / "report.html").read_bytes()
    assert b'<meta charset="windows-1252">' in raw[:1024]  # where a browser looks for it
    block = raw.index(b'<script id="report-sheets"')
    assert (raw[:block] + raw[raw.index(b"</script>", block):]).isascii()  # only the block holds bytes past ASCII
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page), "the page must not load anything"
    assert "<link" not in page and not re.search(r"<script[^>]+src=", page)
    assert "image-rendering: pixelated" in page
    verdict, table, viewer = page.index('id="verdict"'), page.index("Blind spot"), page.index('id="viewer"')
    assert verdict < table < viewer  # the verdict and the blind-spot table come first
    assert TRAP_SENTENCE in page
    for name in runs:
        assert f"<td>{name}</td>" in page
    assert "Memory and how each recipe was made" in page and "per-token symmetric 2-bit" in page
    assert page.index("Does the reference move?") < page.index("PSNR_ref where the reference moves")  # with a truth


def test_names_are_escaped(evaluated, tmp_path):
    rep, runs, _ = evaluated
    evil = "<i>x</i></script>"
    rep2 = copy.deepcopy(rep)
    rep2["schemes"] = {evil if n == "naive2" else n: s for n, s in rep["schemes"].items()}
    runs2 = {evil if n == "naive2" else n: r for n, r in runs.items()}
    page = read_page(write_report_html(tmp_path / "report.html", rep2, runs2, None, "a </script> command"))
    assert evil not in page and "&lt;i&gt;x&lt;/i&gt;" in page
    assert page.count("</script>") == 3  # the sheets block's, the data block's and the player's own
    assert evil in page_data(page)["schemes"]


def test_without_frames_the_page_keeps_the_numbers_and_says_why(evaluated, tmp_path):
    rep, runs, _ = evaluated
    page = read_page(write_report_html(tmp_path / "report.html", rep, runs, None, "pytest"))
    data = page_data(page)
    assert data["frames"] is None and "eval.strips=false" in data["frames_note"]
    assert "<td>naive2</td>" in page and len(data["series"]["naive2"]["psnr_ref"]) == 3


def test_a_missing_or_damaged_sheet_is_one_line_and_only_its_players_go(evaluated, tmp_path):
    rep, runs, sheets = evaluated
    frames = tmp_path / "frames"
    shutil.copytree(sheets.directory, frames)
    damaged = sheet_path(frames, "quantized/naive2", 1, 1)
    damaged.write_bytes(damaged.read_bytes()[:40])
    sheet_path(frames, "reference", 2, 0).unlink()
    page = read_page(write_report_html(tmp_path / "report.html", rep, runs, FrameSheets(frames), "pytest"))
    data = page_data(page)
    note = data["frames_note"]
    assert "\n" not in note and "(and 1 more)" in note
    assert note.startswith(f"some players are off: frame sheet {damaged}: not a readable WebP image")
    t = data["frames"]["trajectories"]
    assert t[2]["reference"] is None  # its quantized streams are differences to it: none shown
    assert "naive2" not in t[1]["quantized"] and "fp16" in t[1]["quantized"]
    assert t[0]["quantized"].keys() == {"fp16", "naive2"}
    with pytest.raises(ValueError, match="not a readable WebP"):
        read_stream(frames, "quantized/naive2", 1, 130)
    with pytest.raises(ValueError, match="2.0.webp: missing"):
        read_stream(frames, "reference", 2, 20)

    for sub in ("reference", "ground_truth", "quantized"):  # nothing readable at all: numbers only
        shutil.rmtree(frames / sub)
    data = page_data(read_page(write_report_html(tmp_path / "report.html", rep, runs, FrameSheets(frames), "pytest")))
    assert data["frames"] is None and data["frames_note"].startswith("no frame sheet could be read")


def test_a_model_without_ground_truth_has_no_ground_truth_player(evaluated, tmp_path):
    rep, runs, _ = evaluated
    sheets = FrameSheets(tmp_path / "frames")
    for name, run in runs.items():
        first = 0
        for batch in run.frames:
            sheets(name, first, batch["reference"], batch["quantized"], None)
            first += batch["reference"].shape[0]
    data = page_data(read_page(write_report_html(tmp_path / "report.html", rep, runs, sheets, "pytest")))
    assert data["frames_note"] is None
    assert all(t["ground_truth"] is None and t["reference"] for t in data["frames"]["trajectories"])


def test_fit_summary_of_the_shipped_recipe():
    recipe = load_recipe(ROOT / "recipes" / "tinyworld-ours-2bit.safetensors")
    line = fit_summary(recipe.metadata, recipe.scheme.notes)
    assert "budget 2.5 bits/elem" in line and "closed loop" not in line  # off by default: nothing was chosen
    record = {"closed_loop": {"chosen": "inter_x2", "scores": {"fitted": {"psnr_ref": 48.914}, "inter_x2": {"psnr_ref": 49.8}}}}
    assert fit_summary({"fit": json.dumps(record)}, "").endswith(
        "closed loop chose 'inter_x2' (fitted 48.91 dB, inter_x2 49.80 dB)")
    assert fit_summary({}, "notes of a preset") == "notes of a preset"
    assert fit_summary({"fit": "{oops"}, "") == "fit record unreadable"


# ---- the runs write it --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_weights(model, path)
    return str(path)


def small_config(task: str, weights: str) -> Config:
    cfg = Config(task=task)
    cfg.model.weights = weights
    cfg.trajectories = TrajectoriesConfig(name="quick", families=["orbit", "static"], num_trajectories=2, num_frames=8)
    cfg.eval.attention = False
    return cfg


@pytest.mark.parametrize("strips", [True, False])
def test_compare_writes_report_html(weights, tmp_path, strips):
    from calibrate.pipeline import run_compare

    cfg = small_config("compare", weights)
    cfg.schemes = ["fp16", "naive2"]
    cfg.eval.strips = strips
    run_compare(cfg, tmp_path)
    data = page_data(read_page(tmp_path / "report.html"))
    assert (data["frames"] is not None) == strips
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_check_writes_report_html_with_the_gate(model, weights, tmp_path):
    from calibrate.pipeline import run_check

    recipe = tmp_path / "naive2.safetensors"
    save_recipe(build_baseline("naive2", as_world(model).info), recipe)
    cfg = small_config("check", weights)
    cfg.recipe = str(recipe)
    cfg.check.min_psnr_db, cfg.check.max_flicker = 0.0, 1.0
    result = run_check(cfg, tmp_path / "run")
    page = read_page(tmp_path / "run" / "report.html")
    assert result["passed"] and "Gate: the recipe passes" in page and "<td>psnr_ref_all</td>" in page
    assert page_data(page)["frames"]["trajectories"][0]["quantized"].keys() == {"recipe"}

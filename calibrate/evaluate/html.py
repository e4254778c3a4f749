"""report.html: one self-contained page that shows what a run measured and lets people watch it.

Flicker and drift are seen before they are read. The page puts, in one file that opens from
disk with no network and no server:

* the verdict of the short-clip trap test and the blind-spot table (report.py) at the top;
* players: fp reference | quantized | error x gain | ground truth of any trajectory and scheme,
  on one shared timeline (play/pause, frame stepping, speed, a seek bar, keys);
* per-frame PSNR-vs-fp and flicker curves of that trajectory with a cursor at the shown frame;
  clicking a curve seeks the players;
* each recipe's measured memory and a summary of how it was fitted; the per-window tables.

Frames are the run's frame sheets (sheets.py: lossless WebP, rows interleaved by time,
quantized rollouts as differences to the reference) embedded as bytes in one block of the
page, which is windows-1252 so that a byte is a character (:func:`embed`); the page decodes
the selected trajectory's sheets on a canvas, undoes the differences and computes the error
panel itself, so nothing upscaled or derived is stored (panels are upscaled by CSS with
``image-rendering: pixelated``). Tables are plain HTML written here, readable without
JavaScript; the player and the curves are hand-written canvas/SVG in
``report_template.html`` (no plotting library: two line plots and a cursor do not earn one).

Size budget: <= 20 MB for the default compare with `ours`, 9 schemes x 7 trajectories x 256
frames of 32x32 TinyWorld frames; measured in artifacts/benchmarks/report_html.md (~0.28 sheet
bytes per raw RGB byte, ~2% more as the page holds them). Each further scheme adds about
2 MB; the page decodes only the selected trajectory, so it opens in ~2 s.

A run without frames (``eval.strips=false``) still gets the page, with the numbers and the
curves and one line saying why there are no players; a missing or damaged sheet file turns
off the players it feeds and is named in one line on the page (and in the log).
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
from importlib import resources
from pathlib import Path

from calibrate.evaluate import metrics as M
from calibrate.evaluate import motion
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.run import SchemeRun
from calibrate.evaluate.sheets import (GROUND_TRUTH, REFERENCE, SHEET_FRAMES, FrameSheets, SheetError, quantized_stream,
                                       read_stream)
from calibrate.io import write_bytes_atomic

log = logging.getLogger(__name__)

TEMPLATE = "report_template.html"
SHEETS_BLOCK = "report-sheets"  # the id of the page's sheets block
GAIN = 4  # default amplification of the error panel (as in the GIF strips)
TRAP_SENTENCE = (
    f"A scheme is flagged as a short-clip trap when it looks lossless on a short clip (at least "
    f"{report_mod.TRAP_SHORT_DB:.0f} dB PSNR against the full-precision rollout on frames 0-{report_mod.SHORT}) "
    f"but its worst window from frame 64 on falls below {report_mod.TRAP_LONG_DB:.0f} dB: a short-clip, "
    f"per-frame benchmark would pass it while long rollouts visibly drift."
)


def write_report_html(path: str | os.PathLike, rep: dict, runs: dict[str, SchemeRun], sheets: FrameSheets | None,
                      command: str, check: dict | None = None) -> Path:
    """Write report.html (atomically) for a report `rep` (report.build) of `runs`.

    `sheets` wrote the frames during the evaluation (`evaluate(..., on_rollout=sheets)`); None
    when the run kept none. `check`, for task=check, is the gate's result (criteria table).
    """
    trajs = _trajectories(runs)
    block = b""
    if sheets is None:
        frames, note = None, "this run kept no frames (eval.strips=false), so there are no players; the numbers are complete"
    elif sheets.note:
        frames, note = None, f"no players: {sheets.note}"
    else:
        frames, note, block = _frames(sheets.directory, runs, trajs)
    if note:  # a problem worth a warning, unless the run chose to keep no frames
        (log.info if sheets is None else log.warning)("report.html: %s", note)
    rows = report_mod.blind_spot_rows(rep)
    data = {
        "schemes": list(runs),
        "trap": {r["scheme"]: r["trap"] for r in rows},
        "bits": {r["scheme"]: r["bits"] for r in rows},
        "trajectories": trajs,
        "series": {name: {"psnr_ref": [[round(M.json_safe(x), 3) for x in t.series["psnr_ref"]] for t in run.trajs],
                          "flicker": [[float(f"{M.json_safe(x, False):.4g}") for x in t.series["flicker"]] for t in run.trajs]}
                   for name, run in runs.items()},
        "default_scheme": _default_scheme(rows),
        "short_frames": report_mod.SHORT,
        "threshold_db": _threshold(rep),
        "gain": GAIN,
        "frames": frames,
        "frames_note": note,
    }
    data["default_trajectory"] = _worst_trajectory(data["series"][data["default_scheme"]]["psnr_ref"])
    slots = {
        "title": html.escape("task=check report" if check is not None else "Evaluation report"),
        "header": _header(command, trajs),
        "verdict": _verdict(rows),
        "check": _check_table(check) if check is not None else "",
        "blind_spot": _blind_spot_table(rows),
        "memory": _memory_table(rep, runs),
        "windows": _windows_tables(rep),
        "data": json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c"),
    }
    template = resources.files("calibrate.evaluate").joinpath(TEMPLATE).read_text(encoding="utf-8")
    # one pass per side of the sheets block (filled text is not rescanned); the page is windows-1252:
    # text outside ASCII as character references (the JSON and the scripts are ASCII), the block as bytes
    head, tail = (re.sub(r"\{\{(\w+)\}\}", lambda m: slots[m.group(1)], part).encode("ascii", "xmlcharrefreplace")
                  for part in template.split("{{sheets}}"))
    out = write_bytes_atomic(path, head + block + tail)
    log.info("report.html: %.1f MB", out.stat().st_size / 1e6)
    return out


# ---- data -----------------------------------------------------------------------------------
def _trajectories(runs: dict[str, SchemeRun]) -> list[dict]:
    """Trajectories in `SchemeRun.trajs` order (the order the sheets are indexed by)."""
    run = next(iter(runs.values()))
    return [{"family": t.family, "seed": t.seed, "num_frames": len(t.series["psnr_ref"])} for t in run.trajs]


def _frames(frames_dir: Path, runs: dict[str, SchemeRun], trajs: list[dict]) -> tuple[dict | None, str | None, bytes]:
    """The sheets of every trajectory and stream as [start, end) spans of the sheets block, one line
    on what is missing, and the block's bytes (every sheet through :func:`embed`)."""
    size, problems, out, block = None, [], [], bytearray()
    for i, traj in enumerate(trajs):
        n = traj["num_frames"]
        entry = {"reference": None, "ground_truth": None, "quantized": {}}
        streams = [(REFERENCE, None), (GROUND_TRUTH, None)] + [(quantized_stream(s), s) for s in runs]
        for stream, scheme in streams:
            if stream == GROUND_TRUTH and not (Path(frames_dir) / GROUND_TRUTH).is_dir():
                continue  # a model without a renderer has no ground truth
            try:
                sheets, size = read_stream(frames_dir, stream, i, n, size)
            except SheetError as e:
                problems.append(str(e))
                if stream == REFERENCE:
                    break  # the quantized streams are differences to it: nothing to show for this trajectory
                continue
            encoded = []
            for sheet in sheets:
                start = len(block)
                block += embed(sheet)
                encoded.append([start, len(block)])
            if scheme is None:
                entry[stream] = encoded
            else:
                entry["quantized"][scheme] = encoded
        out.append(entry)
    if size is None:
        return None, "no frame sheet could be read, so there are no players: " + (problems[0] if problems else "none written"), b""
    note = None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        note = f"some players are off: frame sheet {problems[0]}{more}"
    return {"height": size[0], "width": size[1], "sheet_frames": SHEET_FRAMES, "trajectories": out}, note, bytes(block)


# The page is windows-1252 (one character per byte), so a sheet's bytes stand in it as they are,
# in one <script type="application/octet-stream"> block, except four: NUL (the parser replaces
# it), CR (the parser turns it into LF), '<' (it could close the block) and the escape '=' itself,
# each written as '=' and a digit. WebP bytes are near uniform, so that costs ~2% where the
# Base85 text this replaced cost 25%. The page's JavaScript maps characters back to bytes with
# the browser's own windows-1252 decoder (TextDecoder).
ESCAPE = b"="
ESCAPED = b"\x00\r<="  # escaped as '=0', '=1', '=2', '=3'


def embed(data: bytes) -> bytes:
    """Bytes as they stand in the page's sheets block (see above)."""
    data = data.replace(ESCAPE, b"=3")  # the escape first: the others write it
    for digit, byte in enumerate(ESCAPED[:3]):
        data = data.replace(bytes([byte]), ESCAPE + str(digit).encode())
    return data


def unembed(data: bytes) -> bytes:
    """Inverse of :func:`embed`."""
    return re.sub(rb"=([0-3])", lambda m: ESCAPED[int(m.group(1)): int(m.group(1)) + 1], data)


def read_page(path: str | os.PathLike) -> str:
    """report.html as text, one character per byte (Latin-1, so a sheet's span indexes it): what
    :func:`page_data` and :func:`page_sheet` read."""
    return Path(path).read_bytes().decode("latin-1")


def _default_scheme(rows: list[dict]) -> str:
    """The first short-clip trap, else the scheme with the worst late PSNR: the one worth watching."""
    traps = [r["scheme"] for r in rows if r["trap"]]
    return traps[0] if traps else min(rows, key=lambda r: r["long_psnr_ref"])["scheme"]


def _worst_trajectory(psnr_per_traj: list[list[float]]) -> int:
    means = [sum(s) / len(s) for s in psnr_per_traj]
    return means.index(min(means))


def _threshold(rep: dict) -> float | None:
    s = next(iter(rep["schemes"].values()))
    return s["metrics"]["drift"]["first_below"].get("threshold_db")


# ---- static HTML --------------------------------------------------------------------------------
def _fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1e29:
        return "inf"
    return f"{x:.{digits}f}"


def _table(head: list[str], rows: list[list[str]], row_classes: list[str] | None = None, cls: str = "") -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = []
    for i, row in enumerate(rows):
        c = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{c}>" + "".join(f"<td>{v}</td>" for v in row) + "</tr>")
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _header(command: str, trajs: list[dict]) -> str:
    families = ", ".join(sorted({t["family"] for t in trajs}))
    longest = max(t["num_frames"] for t in trajs)
    return (f"<p>Command: <code>{html.escape(command)}</code></p>"
            f"<p>{len(trajs)} held-out trajectories ({html.escape(families)}), up to {longest} frames each.</p>")


def _verdict(rows: list[dict]) -> str:
    traps = [html.escape(r["scheme"]) for r in rows if r["trap"]]
    if traps:
        head = (f'<p class="verdict-line">Short-clip trap: <strong>{", ".join(traps)}</strong> '
                f'{"looks" if len(traps) == 1 else "look"} lossless on the first {report_mod.SHORT} frames '
                f'but {"falls" if len(traps) == 1 else "fall"} below {report_mod.TRAP_LONG_DB:.0f} dB later.</p>')
    else:
        head = '<p class="verdict-line">Short-clip trap: no scheme is flagged.</p>'
    return f'<section id="verdict" class="{"trap" if traps else "clean"}">{head}<p>{html.escape(TRAP_SENTENCE)}</p></section>'


def _blind_spot_table(rows: list[dict]) -> str:
    head = ["scheme", "bits/elem", "x fp16", "short: PSNR_ref 0-16", "short: SSIM 0-16", "short: PSNR_gt 0-16",
            "long: PSNR_ref (worst late window)", "tail: p95 PSNR_ref", "tail: worst window", "flicker",
            "drift (err/frame)", "revisit (fp)", "PSNR_gt all", "short-clip trap?"]
    body = [[html.escape(r["scheme"]), f"{r['bits']:.2f}", f"{r['ratio']:.3f}", _fmt(r["short_psnr_ref"]),
             _fmt(r["short_ssim_ref"], 3), _fmt(r["short_psnr_gt"]), _fmt(r["long_psnr_ref"]), _fmt(r["p95_psnr_ref"]),
             _fmt(r["worst_window"]), f"{r['flicker']:.5f}", f"{r['drift_slope']:.2e}",
             f"{_fmt(r['revisit'])} ({_fmt(r['revisit_fp'])})", _fmt(r["psnr_gt"]), "YES" if r["trap"] else "no"]
            for r in rows]
    return _table(head, body, ["trap" if r["trap"] else "" for r in rows], "numbers")


def _check_table(check: dict) -> str:
    rows = [[html.escape(c["name"]), f"{c['measured']:.4f}", f"{c['comparison']} {c['threshold']:.4f}",
             "pass" if c["passed"] else "FAIL"] for c in check["criteria"]]
    verdict = "passes" if check["passed"] else "FAILS"
    return (f'<section id="check"><h2>Gate: the recipe {verdict}</h2>'
            + _table(["criterion", "measured", "threshold", "result"], rows,
                     ["" if c["passed"] else "trap" for c in check["criteria"]], "numbers") + "</section>")


def fit_summary(metadata: dict[str, str], notes: str) -> str:
    """One line on how a recipe was made: its fit record if it has one, else the scheme's notes."""
    try:
        fit = json.loads(metadata.get("fit") or "{}")
    except json.JSONDecodeError:
        return "fit record unreadable"
    if not fit:
        return notes or "-"
    parts = []
    if "budget_bits" in fit:
        parts.append(f"budget {fit['budget_bits']:g} bits/elem, used {fit.get('bits_per_element', float('nan')):.2f}")
    rotations: dict[str, int] = {}
    for layer in fit.get("layers", []):
        for tensor in ("k", "v"):
            r = layer.get(tensor, {}).get("rotation")
            if r:
                rotations[r] = rotations.get(r, 0) + 1
    if rotations:
        parts.append("rotations " + ", ".join(f"{k} x{v}" for k, v in sorted(rotations.items())))
    parts.append(f"{len(fit.get('upgrades', []))} mixed-precision upgrades")
    if fit.get("compensators"):
        parts.append(f"{len(fit['compensators'])} low-rank compensators")
    heads = sum(a > 0 for lc in fit.get("logit_correction", []) for a in lc.get("alpha", []))
    if heads:
        parts.append(f"logit correction on {heads} heads")
    loop = fit.get("closed_loop", {})
    if loop.get("chosen"):
        scores = ", ".join(f"{n} {s['psnr_ref']:.2f} dB" for n, s in loop.get("scores", {}).items())
        parts.append(f"closed loop chose '{loop['chosen']}' ({scores})")
    return "; ".join(parts)


def _memory_table(rep: dict, runs: dict[str, SchemeRun]) -> str:
    head = ["scheme", "recipe", "bits/elem (measured)", "x fp16", "cache bytes (steady state)", "fp16 bytes",
            "predicted bytes/frame", "how it was made"]
    rows = []
    for name, s in rep["schemes"].items():
        recipe = runs[name].recipe
        mem = s["memory"]
        try:
            per_frame = json.loads(recipe.metadata.get("memory") or "{}").get("bytes_per_frame_steady")
        except json.JSONDecodeError:
            per_frame = None
        where = (f"<code>{html.escape(Path(s['recipe']['path']).name)}</code> <small>{s['recipe']['sha256'][:12]}</small>"
                 if s["recipe"]["path"] and s["recipe"]["sha256"] else "built-in preset")
        rows.append([html.escape(name), where, f"{mem['bits_per_element']:.3f}", f"{mem['ratio_to_fp16']:.3f}",
                     f"{mem['bytes']:,}", f"{mem['fp16_bytes']:,}", "-" if per_frame is None else f"{per_frame:,.0f}",
                     html.escape(fit_summary(recipe.metadata, recipe.scheme.notes))])
    return _table(head, rows, cls="numbers memory")


def _windows_tables(rep: dict) -> str:
    out = []
    for key, title, digits, note in (("psnr_ref", "PSNR vs the fp rollout per window (dB): mean (p95)", 2, ""),
                                     ("flicker", "Flicker per window: mean (p95)", 5, ""),
                                     ("motion", "Motion kept per window: mean (most damped 5%)", 2,
                                      motion.MOTION_KEPT_SENTENCE)):
        names = list(rep["schemes"])
        windows = M.sorted_windows(rep["schemes"][names[0]]["metrics"][key]["windows"])
        rows = []
        for n in names:
            w = rep["schemes"][n]["metrics"][key]["windows"]
            rows.append([html.escape(n)] + [f"{_fmt(w[x]['mean'], digits)} ({_fmt(w[x]['p95'], digits)})" if x in w else "-"
                                            for x in windows])
        out.append(f"<h3>{title}</h3>" + (f"<p>{html.escape(note)}</p>" if note else "")
                   + _table(["scheme"] + windows, rows, cls="numbers"))
    return "".join(out) + _twin_table(rep) + _motion_table(rep)


def _twin_table(rep: dict) -> str:
    """report.twin_table (the noise twin), when the run measured one."""
    head, rows = report_mod.twin_table(rep)
    if not rows:
        return ""
    return ("<h3>Coherent error: each scheme against its noise twin</h3>"
            f"<p>{html.escape(report_mod.TWIN_SENTENCE)}</p>"
            + _table(head, [[html.escape(c) for c in r] for r in rows], cls="numbers"))


def _motion_table(rep: dict) -> str:
    """motion.motion_table (does the fp rollout move?), when the model has a ground truth."""
    head, rows = motion.motion_table(rep)
    if not rows:
        return ""
    cells = [[f"<strong>{html.escape(t)}</strong>" if frozen else html.escape(t) for t, frozen in row] for row in rows]
    note = motion.frozen_note(rep)
    regime_head, regime_rows = motion.regime_table(rep)
    return (f"<h3>{html.escape(motion.MOTION_TITLE)}</h3><p>{html.escape(motion.MOTION_SENTENCE)}</p>"
            + _table(head, cells, cls="numbers")
            + (f"<p>{html.escape(note)}</p>" if note else "")
            + (f"<h4>{html.escape(motion.REGIME_TITLE)} (moving / frozen / still)</h4>"
               f"<p>{html.escape(motion.REGIME_SENTENCE)}</p>"
               + _table(regime_head, [[html.escape(c) for c in r] for r in regime_rows], cls="numbers")
               if regime_rows else ""))


def page_data(page: str) -> dict:
    """The JSON data a report.html embeds (what its player and curves run on): for tests and tools."""
    start = page.index('<script id="report-data" type="application/json">')
    start = page.index(">", start) + 1
    return json.loads(page[start:page.index("</script>", start)])


def page_sheet(page: str, span: list[int]) -> bytes:
    """The bytes of one embedded sheet of a page read by :func:`read_page`, `span` as its data gives it."""
    start = page.index(f'<script id="{SHEETS_BLOCK}" type="application/octet-stream">')
    start = page.index(">", start) + 1
    return unembed(page[start + span[0]: start + span[1]].encode("latin-1"))

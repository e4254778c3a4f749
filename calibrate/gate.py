"""The CI gate (`task=check`): what a recipe must measure, judged, and written for CI.

A recipe records what it measured on the check set when it was made (`metrics.check` in its
metadata, `summary_metrics` of evaluate/report.py). The gate replays the same set with the
recipe (pipeline.run_check) and judges each criterion: the recorded PSNR (overall and per time
window) minus `check.tolerance_db`, the recorded flicker times 1 + `check.flicker_tolerance`,
or the absolute floors `check.min_psnr_db` / `check.max_flicker` when given. The verdict is
written as `check.json` and as a JUnit `check.xml` that CI systems display per criterion;
`check.json` last, so a run that failed to write its outputs leaves no new verdict.
"""

from __future__ import annotations

from dataclasses import replace
from xml.sax.saxutils import quoteattr

from calibrate.config import CheckConfig, Config, TrajectoriesConfig, check_set


def check_trajectories(cfg: Config, recorded: dict | None = None) -> Config:
    """`cfg` with the CI gate's trajectory set (`config.check_set`: conf/trajectories/check.yaml,
    count and length from `check.*` or the set a recipe `recorded` its check metrics on)."""
    return replace(cfg, trajectories=check_set(cfg, recorded))


def check_comparable(cfg: Config, recorded_check: dict | None) -> None:
    """A recipe's recorded metrics are thresholds for the set they were measured on only: replaying
    another set (`trajectories=...`, `check.num_*`) against them is refused, unless both thresholds
    are given (`check.min_psnr_db`, `check.max_flicker`). `cfg.trajectories` is the set to replay;
    `recorded_check` is the recipe's check metrics (their `trajectories` say the counts they were measured on)."""
    if not recorded_check or (cfg.check.min_psnr_db is not None and cfg.check.max_flicker is not None):
        return
    asked = replace(cfg.check, num_trajectories=None, num_frames=None)
    measured_on = check_trajectories(replace(cfg, check=asked), recorded_check.get("trajectories")).trajectories

    def identity(t: TrajectoriesConfig) -> tuple:
        return t.file or t.name, t.split, tuple(t.families), t.seed, t.num_trajectories, t.num_frames

    if identity(cfg.trajectories) != identity(measured_on):
        m, t = measured_on, cfg.trajectories
        raise ValueError(f"check: the recipe's thresholds were measured on {m.file or m.name} ({m.num_trajectories} x "
                         f"{m.num_frames} frames); this run would replay {t.file or t.name} ({t.num_trajectories} x "
                         f"{t.num_frames} frames) against them: drop the trajectories / check.num_* overrides, or "
                         f"give check.min_psnr_db and check.max_flicker")


def check_criteria(measured: dict, recorded: dict | None, c: CheckConfig) -> list[dict]:
    """Each criterion: name, measured value, threshold, comparison, passed."""
    criteria = []

    def add(name, value, threshold, higher_is_better):
        passed = value >= threshold if higher_is_better else value <= threshold
        criteria.append({"name": name, "measured": value, "threshold": threshold,
                         "comparison": ">=" if higher_is_better else "<=", "passed": bool(passed)})

    if c.min_psnr_db is not None:
        add("psnr_ref_all", measured["psnr_ref_all"], c.min_psnr_db, True)
    elif recorded:
        add("psnr_ref_all", measured["psnr_ref_all"], recorded["psnr_ref_all"] - c.tolerance_db, True)
        for w, v in recorded.get("psnr_ref_windows", {}).items():
            if w in measured["psnr_ref_windows"]:
                add(f"psnr_ref[{w}]", measured["psnr_ref_windows"][w], v - c.tolerance_db, True)
    if c.max_flicker is not None:
        add("flicker", measured["flicker"], c.max_flicker, False)
    elif recorded:
        add("flicker", measured["flicker"], recorded["flicker"] * (1 + c.flicker_tolerance), False)
    if not criteria:
        raise ValueError("check: the recipe records no metrics to compare against; set check.min_psnr_db and check.max_flicker")
    return criteria


def verdict(recipe_path: str, measured: dict, criteria: list[dict]) -> dict:
    """The gate's result (check.json): passed, the criteria, what was measured, a one-line summary."""
    passed = all(c["passed"] for c in criteria)
    failed = [c["name"] for c in criteria if not c["passed"]]
    return {"recipe": recipe_path, "passed": passed, "criteria": criteria, "measured": measured,
            "summary": "all criteria pass" if passed else f"{len(failed)} criteria regressed: {', '.join(failed)}"}


def _number(x: float) -> str:
    """4 decimals, or 4 significant digits for a small value (a tiny model's flicker: 3.2e-06)."""
    return f"{x:.4f}" if x == 0 or abs(x) >= 0.01 else f"{x:.3e}"


def markdown_table(criteria: list[dict]) -> str:
    lines = ["| criterion | measured | threshold | result |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {_number(c['measured'])} | {c['comparison']} {_number(c['threshold'])} | "
              f"{'pass' if c['passed'] else 'FAIL'} |" for c in criteria]
    return "\n".join(lines)


def junit_xml(criteria: list[dict], recipe_path: str) -> str:
    """One JUnit test case per criterion, a failure message naming the value and its threshold."""
    failures = sum(not c["passed"] for c in criteria)
    lines = ['<?xml version="1.0" encoding="utf-8"?>',
             f'<testsuite name="calibrate.check" tests="{len(criteria)}" failures="{failures}" errors="0">']
    for c in criteria:
        lines.append(f'  <testcase classname={quoteattr(recipe_path)} name={quoteattr(c["name"])}>')
        if not c["passed"]:
            msg = f'{c["name"]} = {c["measured"]:.6g}, needs {c["comparison"]} {c["threshold"]:.6g}'
            lines.append(f'    <failure message={quoteattr(msg)}/>')
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"

"""The compensation benchmark's verdict: a mechanism earns a default only with better long-window
PSNR and flicker at most 1% worse than `off` at the same budget; declined mechanisms are named."""

from benchmarks.compensation import variants, verdicts


def _row(psnr_long, flicker, comp=0, keyframes="none", alpha=()):
    return {"psnr_long": psnr_long, "flicker": flicker, "static_bytes": 1000 + 100 * comp, "cpu_ms_per_frame": 10.0,
            "compensators": comp, "keyframes": keyframes, "logit_alpha": [list(alpha)]}


def test_verdicts():
    rows = {"off": _row(27.0, 0.0100),
            "comp_r8": _row(27.5, 0.0102, comp=4),  # better PSNR, flicker +2%: does not earn
            "logit": _row(27.1, 0.01005, alpha=(0.5, 0.0)),  # better PSNR, flicker +0.5%: earns
            "keyframes": _row(27.0, 0.0100),  # declined by the fitter: same as off
            "all": _row(26.9, 0.0090, comp=4, alpha=(0.25,))}  # flicker better but PSNR worse
    got = {v["mechanism"]: v for v in verdicts(rows, [2.5], variants(8))}
    assert {n: v["earns"] for n, v in got.items()} == {"comp_r8": False, "logit": True, "keyframes": False, "all": False}
    assert "keyframes" in got["keyframes"]["note"] and "keyframes" in got["all"]["note"]
    assert got["logit"]["note"] == "" and got["comp_r8"]["static_bytes_delta"] == 400

"""Benchmark: the Jensen-bias correction against the project's key-noise logit correction, on the same cache.

    python -m benchmarks.jensen [--out artifacts/benchmarks] [--frames 128] [--trajectories 7]
    python -m benchmarks.jensen --quick --out /tmp/bench      # a couple of minutes: sanity run

Two plain 2-bit caches (asymmetric min/max, no float16 frames), each run with the same codes
and three kinds of logit offsets:

- caches: `channel` = jensen2's (K per-channel over each frame's tokens, V per-token groups of
  64: 3.25 bits/element) and `token` = kivi2_lowmem's (K and V per-token groups of 64: 2.5);
- `plain`: no correction;
- `jensen`: the Jensen-bias correction (quant/jensen.py): each key's own stored steps,
  sum_d q_d^2 Delta_d^2 / (24 D), strength 1 by its expectation argument;
- `logit_a<alpha>`: the project's correction (quant/logit_noise.py) with the per-channel key
  error variance sigma^2 measured as the fitter measures it (fit/logit_correction.py: whole
  calibration frames fake-quantized with the cache's spec) and a strength alpha for every head
  (the fitter picks alpha per head on its objective; the sweep shows the whole curve).

Evaluated on held-out trajectories (all families): PSNR vs the fp rollout per window, flicker,
and the teacher-forced attention KL(fp || quant) averaged over layers (the correction's direct
target), with bits per element measured from the runtime's tensors (the same for every row of
a cache: neither correction stores per-frame bytes). Writes `jensen.md` and `jensen.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import command_line
from calibrate import calibration, pipeline
from calibrate.codec import fake_quant_heads
from calibrate.config import Config, TrajectoriesConfig
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.run import evaluate
from calibrate.fit.logit_correction import ALPHAS, key_error_variance
from calibrate.io import write_text_atomic
from calibrate.recipe import Recipe, Scheme, TensorSpec
from calibrate.schemes import build_baseline
from calibrate.trace import LayerTraces

CACHES = {"channel": "jensen2", "token": "kivi2_lowmem"}


def base_recipe(cache: str, info) -> Recipe:
    """The cache's recipe with no correction (jensen off)."""
    r = build_baseline(CACHES[cache], info)
    layers = [replace(l, k=replace(l.k, jensen=False)) for l in r.scheme.layers]
    return Recipe(info, Scheme(f"{cache}/plain", layers, r.scheme.policy, r.scheme.notes), dict(r.tensors))


def with_jensen(base: Recipe, name: str) -> Recipe:
    layers = [replace(l, k=replace(l.k, jensen=True)) for l in base.scheme.layers]
    return Recipe(base.model, Scheme(name, layers, base.scheme.policy, base.scheme.notes), dict(base.tensors))


def key_variances(base: Recipe, keys: list[torch.Tensor]) -> list[torch.Tensor]:
    """sigma^2 [H, D] per layer: the key error of the cache's spec on whole calibration frames."""
    out = []
    for i, k in enumerate(keys):
        spec: TensorSpec = base.spec(i, "k")
        k_hat = fake_quant_heads(k, spec, base.layer_tensors(i, "k"), [spec.bits_of(h) for h in range(k.shape[1])])
        out.append(key_error_variance(k, k_hat, base.layer_tensors(i, "k").get("rotation")))
    return out


def with_logit_bias(base: Recipe, variances: list[torch.Tensor], alpha: float, name: str) -> Recipe:
    tensors = dict(base.tensors)
    for i, var in enumerate(variances):
        tensors[f"layers.{i}.k.logit_bias"] = alpha * var
    return Recipe(base.model, Scheme(name, base.scheme.layers, base.scheme.policy, base.scheme.notes), tensors)


def row(name: str, rep: dict) -> dict:
    s = rep["schemes"][name]
    m = s["metrics"]
    kl = m["attention"]["kl"]
    return {"psnr": {w: v["mean"] for w, v in m["psnr_ref"]["windows"].items()}, "psnr_all": m["psnr_ref"]["all"]["mean"],
            "flicker": m["flicker"]["all"]["mean"], "attn_kl": sum(kl) / len(kl),
            "bits": s["memory"]["bits_per_element"], "bytes_equal_predicted": s["memory"]["bytes"] == s["memory"]["predicted_bytes"]}


def markdown(rows: dict[str, dict], command: str, setup: str, elapsed: float) -> str:
    windows = list(next(iter(rows.values()))["psnr"])
    lines = ["# The Jensen-bias correction vs the key-noise logit correction, on the same cache", "",
             f"Command: `{command}`  ",
             f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {elapsed / 60:.1f} min on {platform.machine()} "
             f"(torch {torch.__version__}, {torch.get_num_threads()} thread(s)).  ", setup, "",
             "`jensen` = each key's own stored steps, strength 1; `logit_a<alpha>` = the project's correction with "
             "the key-error variance measured on calibration frames, strength alpha for every head (benchmarks/jensen.py).",
             "", "| cache / correction | bits | " + " | ".join(f"PSNR {w}" for w in windows)
             + " | PSNR all | flicker | attn KL |", "|---" * (len(windows) + 5) + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['bits']:.3f} | " + " | ".join(f"{r['psnr'][w]:.2f}" for w in windows)
                     + f" | {r['psnr_all']:.2f} | {r['flicker']:.5f} | {r['attn_kl']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--frames", type=int, default=128)
    p.add_argument("--trajectories", type=int, default=7)
    p.add_argument("--calib-frames", type=int, default=64)
    p.add_argument("--calib-trajectories", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="3 trajectories x 48 frames, calibration 2 x 32")
    args = p.parse_args(argv)
    if args.quick:
        args.frames, args.trajectories, args.calib_frames, args.calib_trajectories = 48, 3, 32, 2
    torch.manual_seed(0)
    start = time.time()
    cfg = Config(task="compare", device="cpu")
    cfg.trajectories = TrajectoriesConfig(num_trajectories=args.calib_trajectories, num_frames=args.calib_frames, split="calibration")
    cfg.fit = replace(cfg.fit, trace_frames=args.calib_frames, trace_trajectories=args.calib_trajectories, sample_tokens=256)
    device = torch.device("cpu")
    model = pipeline.load_world(cfg, device)
    info = model.info
    window, sink = cfg.model.cache.window, cfg.model.cache.sink_frames
    traces = LayerTraces(calibration.calibration_recording(cfg, model, device).traces[0], window, sink)
    keys = [t.k for t in traces]
    recipes: dict[str, Recipe] = {}
    for cache in CACHES:
        base = base_recipe(cache, info)
        recipes[f"{cache}/plain"] = base
        recipes[f"{cache}/jensen"] = with_jensen(base, f"{cache}/jensen")
        variances = key_variances(base, keys)
        for alpha in ALPHAS[1:]:
            recipes[f"{cache}/logit_a{alpha}"] = with_logit_bias(base, variances, alpha, f"{cache}/logit_a{alpha}")
    eval_cfg = replace(cfg, trajectories=TrajectoriesConfig(num_trajectories=args.trajectories, num_frames=args.frames,
                                                            split="evaluation"))
    trajs = pipeline.trajectory_set(eval_cfg)
    runs = evaluate(model, recipes, trajs, window, sink, device, cfg.trajectories.batch_size, attention=True)
    rep = report_mod.build(runs, [], {}, cfg.eval.psnr_threshold_db)
    rows = {name: row(name, rep) for name in recipes}
    setup = (f"Calibration (sigma^2): {args.calib_trajectories} x {args.calib_frames} frames; held-out evaluation: "
             f"{args.trajectories} trajectories (all families) x {args.frames} frames; window {window} + {sink} sink.")
    command = command_line("jensen", argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "jensen.md", markdown(rows, command, setup, time.time() - start))
    write_text_atomic(out / "jensen.json", json.dumps({"setup": setup, "rows": rows}, indent=2, sort_keys=True) + "\n")
    print(markdown(rows, command, setup, time.time() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

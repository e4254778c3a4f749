"""Study: would vector codes beat the scalar code at the same bits? (issue 28, item 6)

    python -m benchmarks.vector_study [--models tinyworld,wanworld] [--frames 48] [--out artifacts/benchmarks]

The predictive code quantizes each PCA component on its own (a scalar code). A vector code
(CQ / CommVQ-style: a codebook over several coupled components) can win where components stay
dependent after the transform, and by its space-filling and shape gains. This measures the most
it could win before any format change, on the components the shipped recipe codes: full-precision
rollouts (held-out evaluation seeds; pan, orbit, dolly, static), each head's pre-rotary K and V
in the recipe's own basis u = (x - mean) @ R, and per component the two signals the code sees:
the token itself (intra) and its change from the previous frame (inter). For every pair of
components the recipe gives the same width b <= 3 (adjacent in its order: PCA's, by variance;
wider components, where a scalar code is close to its best, are left out), on codes fitted on the
first trajectory of each family and measured on the second:

- ``uniform``: b-bit mid-rise levels with the best step per component (what the recipe's code is);
- ``lloyd``: the best b-bit scalar code per component (1-D k-means: Lloyd-Max);
- ``vq2``: a 2^(2b)-word codebook per pair (2-D k-means), the same bits.

Gains are ratios of the squared error summed over all paired components (dB, on the test
trajectories). A codebook costs 2^(2b) x 2 floats per pair and head in the recipe, nothing per token.
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime, timezone

import torch

from benchmarks.kv_stats import CPU, SINK, WINDOW, FrameRecorder, load_world, run_study
from calibrate.pipeline import ours_recipe
from calibrate.predictive_roles import head_params
from calibrate.recipe import load_recipe
from calibrate.world.trajectories import make_trajectories

FAMILIES = ("pan", "orbit", "dolly", "static")
START = 16
MAX_SAMPLES = 4_000  # per component or pair and split (drawn evenly)
MAX_BITS = 3  # widths studied: a 2-D codebook of 2^(2b) words (64 at 3 bits)


def kmeans(x_ND: torch.Tensor, k: int, iters: int = 25) -> torch.Tensor:
    """k centroids [k, D] of x by Lloyd's iterations from k-means++ (seeded: deterministic). Not
    quant/qvg.kmeans, Quant VideoGen's k-means as published (uniform start, float32): a bound on
    what a codebook could win wants the better start."""
    gen = torch.Generator().manual_seed(0)
    cent = x_ND[torch.randint(len(x_ND), (1,), generator=gen)]
    for _ in range(1, k):
        d = torch.cdist(x_ND, cent).min(1).values.pow(2)
        cent = torch.cat([cent, x_ND[torch.multinomial(d + 1e-12, 1, generator=gen)]])
    for _ in range(iters):
        idx = torch.cdist(x_ND, cent).argmin(1)
        sums = torch.zeros_like(cent).index_add_(0, idx, x_ND)
        counts = torch.bincount(idx, minlength=k).unsqueeze(1)
        cent = torch.where(counts > 0, sums / counts.clamp_min(1), cent)
    return cent


def codebook_error(train: torch.Tensor, test: torch.Tensor, k: int) -> float:
    """Squared error on `test` [N, D] of the k-word codebook fitted on `train`."""
    cent = kmeans(train, k)
    return float(torch.cdist(test, cent).min(1).values.pow(2).sum())


def uniform_error(train: torch.Tensor, test: torch.Tensor, bits: int) -> float:
    """Squared error on `test` [N] of b-bit mid-rise levels step * (2c - n), c = 0..n, with the step
    that is best on `train` (a grid of 100 steps, then 100 more around the best)."""
    n = (1 << bits) - 1
    err = lambda x, steps: (x - steps[:, None] * (2 * torch.clamp(torch.round((x / steps[:, None] + n) / 2), 0, n) - n)).pow(2).sum(1)
    std = float(train.std()) or 1.0
    steps = torch.linspace(0.02, 3.0, 100, dtype=train.dtype) * std
    best = int(err(train, steps).argmin())
    fine = torch.linspace(float(steps[max(best - 1, 0)]), float(steps[min(best + 1, 99)]), 100, dtype=train.dtype)
    step = fine[err(train, fine).argmin()]
    return float(err(test, step[None])[0])


def thin(x: torch.Tensor) -> torch.Tensor:
    return x if len(x) <= MAX_SAMPLES else x[torch.linspace(0, len(x) - 1, MAX_SAMPLES).long()]


def signals(frames: list[torch.Tensor], p) -> dict[str, torch.Tensor]:
    """intra: u of every token [N, D]; inter: u_t - u_{t-1} of the same slot [N, D] (frames START on)."""
    x = torch.stack(frames, 1).double()  # [B, F, T, D] of one head
    u = (x - p.mean_D.double()) @ p.rotation_DD.double()
    return {"intra": u[:, START:].reshape(-1, u.shape[-1]), "inter": (u[:, START:] - u[:, START - 1:-1]).reshape(-1, u.shape[-1])}


def measure(name: str, frames: int) -> dict:
    world = load_world(name)
    recipe = load_recipe(ours_recipe(world.info), world.info)
    recs = []
    for split in range(2):
        rec = FrameRecorder(world.info.num_layers, WINDOW, SINK)
        trajs = [make_trajectories([f], "evaluation", 2, frames)[split] for f in FAMILIES]
        world.rollout(trajs, rec, CPU, keep_frames=False)
        recs.append(rec)
    err = {(sig, kv, code): 0.0 for sig in ("intra", "inter") for kv in "KV" for code in ("uniform", "lloyd", "vq2")}
    pairs = {kv: 0 for kv in "KV"}
    for layer in range(world.info.num_layers):
        for kv in "kv":
            tensors = recipe.layer_tensors(layer, kv)
            if "channel_bits" not in tensors:
                continue
            for h in range(world.info.num_kv_heads):
                p = head_params(tensors, h)
                sig = [signals([f[:, h] for f in rec.frames[(layer, kv)]], p) for rec in recs]
                bits = p.bits_D.tolist()
                for b in sorted({b for b in bits if 0 < b <= MAX_BITS}):
                    comps = [d for d, bd in enumerate(bits) if bd == b]
                    for i in range(0, len(comps) - 1, 2):
                        pair = comps[i : i + 2]
                        pairs[kv.upper()] += 1
                        for s in ("intra", "inter"):
                            tr, te = thin(sig[0][s][:, pair]), thin(sig[1][s][:, pair])
                            err[(s, kv.upper(), "uniform")] += sum(uniform_error(tr[:, j], te[:, j], b) for j in range(2))
                            err[(s, kv.upper(), "lloyd")] += sum(codebook_error(tr[:, j : j + 1], te[:, j : j + 1], 1 << b)
                                                                  for j in range(2))
                            err[(s, kv.upper(), "vq2")] += codebook_error(tr, te, 1 << (2 * b))
    db = lambda a, c: 10 * math.log10(a / c) if c > 0 else float("nan")
    rows = [{"signal": s, "kv": kv, "pairs": pairs[kv],
             "lloyd_over_uniform_db": db(err[(s, kv, "uniform")], err[(s, kv, "lloyd")]),
             "vq2_over_lloyd_db": db(err[(s, kv, "lloyd")], err[(s, kv, "vq2")]),
             "vq2_over_uniform_db": db(err[(s, kv, "uniform")], err[(s, kv, "vq2")])}
            for s in ("intra", "inter") for kv in "KV"]
    return {"model": name, "recipe": ours_recipe(world.info).name, "rows": rows}


def markdown(results: list[dict], command: str, minutes: float, frames: int) -> str:
    lines = ["# Vector codes: the most a 2-D codebook could win over the scalar code", "",
             f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; command: `{command}`",
             f"- {minutes:.1f} min, {torch.get_num_threads()} torch thread(s), the CPU shared with other jobs",
             f"- held-out evaluation seeds, {', '.join(FAMILIES)}; fitted on one trajectory per family, measured on "
             f"another, {frames} frames each, frames {START} on; the method is in the module docstring of "
             "`benchmarks/vector_study.py`", "",
             "Squared-error ratios in dB over every pair of same-width coded components (widths 1-3 bits; positive: the second code "
             "stores less error at the same bits).", ""]
    for res in results:
        lines += [f"## {res['model']} (`recipes/{res['recipe']}`)", "",
                  "| signal | K/V | pairs | Lloyd-Max over uniform | 2-D codebook over Lloyd-Max | 2-D codebook over uniform |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in res["rows"]:
            lines.append(f"| {r['signal']} | {r['kv']} | {r['pairs']} | {r['lloyd_over_uniform_db']:+.2f} "
                         f"| {r['vq2_over_lloyd_db']:+.2f} | {r['vq2_over_uniform_db']:+.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tinyworld,wanworld")
    p.add_argument("--frames", type=int, default=48)
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    return run_study("vector_study", argv, args.models, args.frames, START, args.out,
                     lambda name: measure(name, args.frames),
                     lambda results, command, minutes: markdown(results, command, minutes, args.frames))


if __name__ == "__main__":
    sys.exit(main())

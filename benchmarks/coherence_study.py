"""Study: where the shipped recipe's coherent error comes from, and three encoder changes tried.

    python -m benchmarks.coherence_study [--frames 256] [--out artifacts/benchmarks]

Writes `coherence_study.md` + `.json`. Two parts, on held-out TinyWorld rollouts (evaluation
seeds, one trajectory per family):

1. **Where the stored error lies** (static, pan, orbit; teacher-forced on the fp rollout's K/V):
   per layer, K and V, the stored SQNR of the shipped recipe's predictive code, the share of the
   error in uncoded (0-bit) components, and how much of each part is the same in every frame
   (the energy of its per-token mean over frames 16 on, over its energy: 100% = it never changes).
2. **Encoder changes** rolled out next to their noise twins (evaluate/twin.py) on static, pan,
   orbit and dolly, through `FakePredictiveCache`: a float cache that reconstructs each frame as
   the predictive code does (quant/predictive.py: intra/inter modes, closed loop, mid-rise
   levels, anchor range; anchoring is lossless, so nothing needs packing). With nearest rounding
   and fixed steps it is the shipped recipe (through the runtime the same rollouts score within
   0.1 dB per family: the runtime's float arithmetic differs in the last bits).
   - `stochastic`: codes rounded up with probability equal to the fraction (non-subtractive
     dither, seeded): decorrelates the rounding from the content;
   - `adaptive E`: each (token, component) inter step scaled by 2^e, e in [-E, 1], from the last
     code (backward adaptation as in ADPCM/CVSD, nothing sent): b >= 2: the outermost code grows
     the step, the innermost shrinks it; b = 1: the same sign as the last code grows it, else
     shrinks it; an intra token resets e = 0. The finer grid it needs costs about E bits per
     coded component in every anchor, plus e's own state there, which this study does not count.

Nothing here changes the package; it measures before the format would change.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from calibrate import pipeline
from calibrate.adapters import as_world
from calibrate.cache import KVCache
from calibrate.config import Config
from calibrate.evaluate import metrics as M
from calibrate.evaluate.twin import TWIN_SEED, NoiseTwinCache
from calibrate.io import write_text_atomic
from calibrate.predictive_roles import head_params
from calibrate.quant import predictive as P
from calibrate.recipe import load_recipe
from calibrate.replay import rollout_batch
from calibrate.shadow import ShadowCache
from calibrate.world.trajectories import make_trajectories

RECIPE = "recipes/tinyworld-ours-2bit.safetensors"
VARIANTS = {"shipped": ("nearest", 0), "stochastic": ("stochastic", 0), "adaptive 1": ("nearest", 1),
            "adaptive 2": ("nearest", 2), "adaptive 3": ("nearest", 3)}


class HeadCoder:
    """One head's predictive code with its chain state; `adapt` = E > 0 scales the inter steps."""

    def __init__(self, p: P.PredictiveParams, rounding: str, adapt: int, generator: torch.Generator):
        self.p, self.rounding, self.E, self.gen = p, rounding, adapt, generator
        f = 2**adapt  # a grid 2^E finer: e = 0 is the fitted step
        self.unit, self.intra, self.limit, self.n = p.unit_D / f, p.intra_step_D * f, p.limit_D * f, p.levels_D
        self.v = self.e = self.sign = None

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounding == "stochastic":
            return torch.floor(x + torch.rand(x.shape, generator=self.gen))
        return torch.round(x)

    def code(self, x_BTD: torch.Tensor) -> torch.Tensor:
        p, n = self.p, self.n
        tau = ((x_BTD.float() - p.mean_D) @ p.rotation_DD) / self.unit
        c_i = torch.clamp(self._round((tau / self.intra + n) / 2), torch.zeros_like(n), n).long()
        v_i = self.intra * (2 * c_i - n)
        if self.v is None:
            self.v, self.e, self.sign = v_i, torch.zeros_like(v_i), torch.zeros_like(v_i)
            return self._values()
        s = p.inter_step_D * 2 ** (self.e + self.E)
        lo = (-torch.div(self.v + self.limit - n * s, 2 * s, rounding_mode="floor")).clamp_min(0)
        hi = torch.minimum(torch.div(n * s + self.limit - self.v, 2 * s, rounding_mode="floor"), n.expand_as(self.v))
        c = self._round(((tau - self.v.float()) / s.float() + n) / 2)
        c = torch.minimum(torch.maximum(c, lo.float()), hi.float()).long()
        v_p = self.v + s * (2 * c - n)
        w = self.unit**2
        inter = (((tau - v_p.float()) ** 2 * w).sum(-1) <= ((tau - v_i.float()) ** 2 * w).sum(-1)).unsqueeze(-1)
        q = 2 * c - n
        if self.E:
            one_bit = n == 1
            grow = torch.where(one_bit, q.sign() == self.sign, (c == 0) | (c == n))
            shrink = torch.where(one_bit, q.sign() != self.sign, q.abs() == 1) & ~grow
            self.e = torch.where(inter, (self.e + grow.long() - shrink.long()).clamp(-self.E, 1), 0)
        self.sign = torch.where(inter, q.sign(), 0)
        self.v = torch.where(inter, v_p, v_i)
        return self._values()

    def _values(self) -> torch.Tensor:
        return (self.unit * self.v.float()) @ self.p.rotation_DD.T + self.p.mean_D


class FakePredictiveCache(KVCache):
    """The fp cache holding each frame as a predictive recipe reconstructs it (keys coded pre-rotary)."""

    def __init__(self, recipe, window: int, sink_frames: int, rounding: str = "nearest", adapt: int = 0, seed: int = 0):
        super().__init__(recipe.model.num_layers, window, sink_frames)
        gen = torch.Generator().manual_seed(seed)
        self.coders = [{kv: [HeadCoder(head_params(recipe.layer_tensors(layer, kv), h), rounding, adapt, gen)
                             for h in range(recipe.model.num_kv_heads)] for kv in "kv"}
                       for layer in range(self.num_layers)]

    def append(self, layer, k_BHTD, v_BHTD, key_rope) -> int:
        k = torch.stack([c.code(k_BHTD[:, h]) for h, c in enumerate(self.coders[layer]["k"])], 1)
        v = torch.stack([c.code(v_BHTD[:, h]) for h, c in enumerate(self.coders[layer]["v"])], 1)
        return super().append(layer, k, v, key_rope)


class _Recorder(KVCache):
    def __init__(self, *args):
        super().__init__(*args)
        self.kv: dict[tuple[int, str], list[torch.Tensor]] = {}

    def observe(self, seen) -> None:
        self.kv.setdefault((seen.layer, "k"), []).append(seen.k_BHTD)
        self.kv.setdefault((seen.layer, "v"), []).append(seen.v_BHTD)


def where_the_error_lies(world, recipe, families: list[str], frames: int, device) -> list[dict]:
    rows = []
    for family in families:
        rec = _Recorder(world.info.num_layers, 16, 1)
        rollout_batch(world, make_trajectories([family], "evaluation", 1, frames), rec, device, keep_frames=False)
        for (layer, kv), xs in sorted(rec.kv.items()):
            x = torch.stack(xs, 2)[0]  # [H, F, T, D]
            tensors = recipe.layer_tensors(layer, kv)
            sig = err = 0.0
            parts = {True: [0.0, 0.0], False: [0.0, 0.0]}  # uncoded? -> [error energy, static energy] (frames 16+)
            for h in range(x.shape[0]):
                p = head_params(tensors, h)
                xh = x[h : h + 1]
                e = (P.fake_quant_sequence(xh, p) - xh) @ p.rotation_DD  # error in the code's basis
                sig, err = sig + float(xh.double().pow(2).sum()), err + float(e.double().pow(2).sum())
                late = e[:, 16:].double()
                for uncoded in (True, False):
                    sel = late[..., (p.bits_D == 0) == uncoded]
                    parts[uncoded][0] += float(sel.pow(2).sum())
                    parts[uncoded][1] += float(sel.mean(1).pow(2).sum()) * sel.shape[1]
            total = parts[True][0] + parts[False][0]
            rows.append({"family": family, "layer": layer, "kv": kv, "sqnr_db": 10 * torch.log10(torch.tensor(sig / err)).item(),
                         "uncoded_share": parts[True][0] / total,
                         "uncoded_static": parts[True][1] / max(parts[True][0], 1e-30),
                         "coded_static": parts[False][1] / max(parts[False][0], 1e-30)})
    return rows


def roll_variant(world, recipe, trajs, rounding: str, adapt: int, device) -> dict:
    """PSNR vs fp per window and family of one variant and its noise twin, and its stored SQNR."""
    L = world.info.num_layers
    make = lambda: FakePredictiveCache(recipe, 16, 1, rounding, adapt)
    fp = ShadowCache(L, 16, 1, {"x": make()}, attention=False)
    ref, truth = rollout_batch(world, trajs, fp, device)
    quant, _ = rollout_batch(world, trajs, make(), device, truth=truth)
    stored = fp.stored["x"]
    twin, _ = rollout_batch(world, trajs, NoiseTwinCache(L, 16, 1, stored.noise_std(), TWIN_SEED), device, truth=truth)
    sqnr = stored.sqnr_db().mean(1)  # [B, 2]: mean over layers
    out = {}
    for b, t in enumerate(trajs):
        out[t.family] = {"sqnr_k": float(sqnr[b, 0]), "sqnr_v": float(sqnr[b, 1]),
                         "scheme": M.window_means(M.psnr(quant[b], ref[b])), "twin": M.window_means(M.psnr(twin[b], ref[b])),
                         "flicker": float(M.flicker_series(quant[b], ref[b]).mean())}
    return out


def markdown(decomp: list[dict], variants: dict, command: str, minutes: float, frames: int) -> str:
    lines = ["# Coherent error of the shipped recipe: where it lies, and three encoder changes tried", "",
             f"Command: `{command}`, {minutes:.1f} min on this 2-core CPU (torch threads {torch.get_num_threads()}, "
             "the other core busy). Held-out TinyWorld rollouts (evaluation seeds, one per family), "
             f"{frames} frames, window 16 + 1 sink, `{RECIPE}`. The method is in the module docstring of "
             "`benchmarks/coherence_study.py`.", "",
             "## 1. Where the stored error lies (teacher-forced)", "",
             "| family | layer | K/V | stored SQNR dB | share of the error in uncoded components | of it, the same in every frame "
             "| coded components' error, the same in every frame |", "|---|---|---|---|---|---|---|"]
    for r in decomp:
        lines.append(f"| {r['family']} | {r['layer']} | {r['kv'].upper()} | {r['sqnr_db']:.1f} | {100 * r['uncoded_share']:.0f}% "
                     f"| {100 * r['uncoded_static']:.0f}% | {100 * r['coded_static']:.0f}% |")
    fams = list(next(iter(variants.values())))
    windows = list(next(iter(variants.values()))[fams[0]]["scheme"])
    late = windows[-1]
    lines += ["", "## 2. Encoder changes against their noise twins", "",
              f"PSNR vs the fp rollout, frames {late}: variant / its noise twin (gap); SQNR = stored K / V, mean over layers.",
              "", "| variant | " + " | ".join(fams) + " | mean | flicker |", "|---|" + "---|" * (len(fams) + 2)]
    for name, res in variants.items():
        cells = [f"{res[f]['scheme'][late]:.1f} / {res[f]['twin'][late]:.1f} ({res[f]['scheme'][late] - res[f]['twin'][late]:+.1f}); "
                 f"SQNR {res[f]['sqnr_k']:.1f} / {res[f]['sqnr_v']:.1f}" for f in fams]
        mean = sum(res[f]["scheme"][late] for f in fams) / len(fams)
        flick = sum(res[f]["flicker"] for f in fams) / len(fams)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean:.2f} | {flick:.5f} |")
    lines += ["", "Every window, mean over the families:", "", "| variant | " + " | ".join(windows) + " |",
              "|---|" + "---|" * len(windows)]
    for name, res in variants.items():
        lines.append(f"| {name} | " + " | ".join(f"{sum(res[f]['scheme'][w] for f in fams) / len(fams):.2f}" for w in windows) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--out", default="artifacts/benchmarks")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    t0 = time.time()
    cfg, device = Config(), torch.device("cpu")
    world = as_world(pipeline.load_world(cfg, device))
    recipe = load_recipe(RECIPE, world.info)
    decomp = where_the_error_lies(world, recipe, ["static", "pan", "orbit"], min(args.frames, 128), device)
    trajs = make_trajectories(["static", "pan", "orbit", "dolly"], "evaluation", 4, args.frames)
    variants = {name: roll_variant(world, recipe, trajs, *VARIANTS[name], device) for name in args.variants.split(",")}
    command = "python -m benchmarks.coherence_study " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(decomp, variants, command, (time.time() - t0) / 60, args.frames)
    out = Path(args.out)
    write_text_atomic(out / "coherence_study.md", md)
    write_text_atomic(out / "coherence_study.json", json.dumps({"decomposition": decomp, "variants": variants}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Study: which property of a recipe's stored error makes it cost more than its noise twin.

    python -m benchmarks.error_twins [--model tinyworld] [--frames 256] [--out artifacts/benchmarks]

Writes `error_twins.md` + `.json` (`error_twins_<model>` for another model than TinyWorld). The
shipped recipe's rollout sits far below its noise twin (independent Gaussian error of the same
power, evaluate/twin.py) on both models, and a twin with the error's own covariance does no worse
than the isotropic one (`coherence_study.md`): its directions per head are not what hurts. Each
variant here keeps the recipe's actual error (coded as `coherence_study.FakePredictiveCache`
reconstructs every frame, keys before the rotary) and destroys one property of it, per frame,
head and K/V:

- `random direction`: each token's error keeps its norm and points a uniformly random way, so
  which tokens carry large errors is kept and how each error lines up with its token is lost;
- `tokens shuffled`: the frame's error vectors move to other tokens (a random permutation), so the
  set of errors is kept and which token carries which is lost;
- `random sign`: each token's error is multiplied by +1 or -1, drawn per frame, so its size and axis
  are kept and its sign from frame to frame is lost (an error that repeats in a still scene
  becomes one that averages out);
- `first frame exact`: an oracle, not a property: frame 0 (the sink that every step attends to)
  stored without error, every later frame as shipped; bits not counted;
- `first frame b bits`: frame 0 stored by a per-token uniform code instead (2^b levels between the
  token's min and max over the head dimension, the format's `uniform` kind with per-token groups),
  every later frame as shipped. With a window of W frames plus the sink, that adds about
  (b + 0.5 - recipe bits) / (W + 1) bits per element held (0.5: a float16 scale and offset per
  token and head of 64).

Every variant but the last stores exactly the shipped error's power per frame (so the same twin). Whichever
variant closes the gap names the property that costs: the error's alignment with its token
(direction), its placement on tokens (shuffle), or its persistence over frames (sign). Held-out
rollouts: evaluation seeds 0-3, static, pan, orbit, dolly (`coherence_study.md`'s).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import command_line, report_name, shipped_setup, window_note, write_report
from benchmarks.coherence_study import FakePredictiveCache, roll_variant
from calibrate.cache import KVCache
from calibrate.world.trajectories import make_trajectories

FAMILIES = ["static", "pan", "orbit", "dolly"]
VARIANTS = ("shipped", "random direction", "tokens shuffled", "random sign", "first frame exact",
            "first frame 8 bits", "first frame 4 bits")
SEED = 4242


def reshaped_error(e_BHTD: torch.Tensor, variant: str, gen: torch.Generator) -> torch.Tensor:
    """The error with one property destroyed (module docstring); the same energy per token or frame."""
    if variant == "shipped":
        return e_BHTD
    if variant == "random direction":
        z = torch.randn(e_BHTD.shape, generator=gen, dtype=e_BHTD.dtype)
        return z * (e_BHTD.norm(dim=-1, keepdim=True) / z.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    if variant == "tokens shuffled":
        B, H, T, _ = e_BHTD.shape
        perm = torch.argsort(torch.rand(B, H, T, generator=gen), dim=-1)
        return torch.gather(e_BHTD, 2, perm.unsqueeze(-1).expand_as(e_BHTD))
    if variant.startswith("first frame"):
        return e_BHTD  # ErrorVariantCache replaces frame 0's
    if variant == "random sign":
        sign = torch.randint(0, 2, (*e_BHTD.shape[:-1], 1), generator=gen).to(e_BHTD.dtype) * 2 - 1
        return e_BHTD * sign
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def per_token_uniform(x_BHTD: torch.Tensor, bits: int) -> torch.Tensor:
    """Each token on 2^bits uniform levels from its min to its max over the last axis."""
    lo, hi = x_BHTD.amin(-1, keepdim=True), x_BHTD.amax(-1, keepdim=True)
    step = ((hi - lo) / (2**bits - 1)).clamp_min(1e-12)
    return torch.round((x_BHTD - lo) / step) * step + lo


class ErrorVariantCache(FakePredictiveCache):
    """`FakePredictiveCache` whose stored error is `reshaped_error` of the recipe's own."""

    def __init__(self, recipe, window: int, sink_frames: int, variant: str, seed: int = SEED):
        super().__init__(recipe, window, sink_frames)
        self.variant, self.gen = variant, torch.Generator().manual_seed(seed)
        self.energy = None  # [B, L, 2 (K, V), 2 (signal, error)] float64: what this cache's own rollout stored
        self.first = None  # the same for frame 0 alone

    def append(self, layer, k_BHTD, v_BHTD, key_rope) -> int:
        coded = [torch.stack([c.code(x[:, h]) for h, c in enumerate(self.coders[layer][kv])], 1)
                 for kv, x in (("k", k_BHTD), ("v", v_BHTD))]
        errors = [reshaped_error(x_hat - x, self.variant, self.gen) for x_hat, x in zip(coded, (k_BHTD, v_BHTD))]
        if self.variant.startswith("first frame") and self._num_appended[layer] == 0:
            bits = None if self.variant == "first frame exact" else int(self.variant.split()[2])
            errors = [torch.zeros_like(x) if bits is None else per_token_uniform(x, bits) - x for x in (k_BHTD, v_BHTD)]
        if self.energy is None:
            self.energy = torch.zeros(k_BHTD.shape[0], self.num_layers, 2, 2, dtype=torch.float64)
            self.first = torch.zeros_like(self.energy)
        for acc in (self.energy, self.first) if self._num_appended[layer] == 0 else (self.energy,):
            for i, (x, e) in enumerate(zip((k_BHTD, v_BHTD), errors)):
                acc[:, layer, i, 0] += x.double().pow(2).sum((1, 2, 3))
                acc[:, layer, i, 1] += e.double().pow(2).sum((1, 2, 3))
        return KVCache.append(self, layer, k_BHTD + errors[0], v_BHTD + errors[1], key_rope)

    def sqnr_db(self, first: bool = False) -> torch.Tensor:
        """[B, 2]: stored K / V SQNR in this cache's own rollout (of frame 0 alone with `first`), dB,
        mean over layers."""
        e = self.first if first else self.energy
        return (10 * torch.log10(e[..., 0] / e[..., 1].clamp_min(1e-300))).mean(1)


def markdown(results: dict, command: str, minutes: float, frames: int, recipe: str) -> str:
    fams = list(next(iter(results.values())))
    late = list(next(iter(results.values()))[fams[0]]["scheme"])[-1]
    lines = ["# Which property of the stored error costs: direction, placement or persistence", "",
             f"Command: `{command}`, {minutes:.1f} min on this 2-core CPU (torch threads {torch.get_num_threads()}). "
             f"`{recipe}`, {frames} frames; the variants are in the module docstring of `benchmarks/error_twins.py`.", "",
             f"PSNR vs the fp rollout, frames {late}{window_note(late, frames)}: variant / the noise twin (gap); SQNR = stored K / V dB, mean "
             "over layers, teacher-forced (on the fp rollout's K/V, which the twin is drawn for; equal in every row by "
             "construction), then in the variant's own rollout (`own`: each frame counted once, when it is stored; the "
             "teacher-forced one counts a frame once per step that attends to it).", "",
             "| variant | " + " | ".join(fams) + " | mean | mean gap | flicker |", "|---|" + "---|" * (len(fams) + 3)]
    for name, res in results.items():
        cells = [f"{res[f]['scheme'][late]:.1f} / {res[f]['twin'][late]:.1f} ({res[f]['scheme'][late] - res[f]['twin'][late]:+.1f}); "
                 f"SQNR {res[f]['sqnr_k']:.1f} / {res[f]['sqnr_v']:.1f}, own {res[f]['own_sqnr_k']:.1f} / "
                 f"{res[f]['own_sqnr_v']:.1f}" for f in fams]
        mean = sum(res[f]["scheme"][late] for f in fams) / len(fams)
        gap = sum(res[f]["scheme"][late] - res[f]["twin"][late] for f in fams) / len(fams)
        flick = sum(res[f]["flicker"] for f in fams) / len(fams)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean:.2f} | {gap:+.1f} | {flick:.5f} |")
    shipped = results.get("shipped")
    if shipped:
        lines += ["", "The shipped recipe's stored SQNR (own rollout, K / V dB, mean over layers): frame 0 alone "
                  "against every frame.", "", "| family | frame 0 | every frame |", "|---|---|---|"]
        lines += [f"| {f} | {r['frame0_sqnr_k']:.1f} / {r['frame0_sqnr_v']:.1f} | {r['own_sqnr_k']:.1f} / "
                  f"{r['own_sqnr_v']:.1f} |" for f, r in shipped.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tinyworld", help="a conf/model preset with a shipped recipe (tinyworld, wanworld)")
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--out", default="artifacts/benchmarks")
    args = p.parse_args(argv)
    if args.frames < 2:
        print(f"error_twins: --frames must be at least 2, got {args.frames}", file=sys.stderr)
        return 2
    t0 = time.time()
    device = torch.device("cpu")
    try:
        cfg, world, path, recipe = shipped_setup(args.model, device=device)
    except ValueError as err:
        print(f"error_twins: {err}", file=sys.stderr)
        return 2
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    trajs = make_trajectories(FAMILIES, "evaluation", len(FAMILIES), args.frames)
    results = {}
    for name in VARIANTS:
        made = []  # roll_variant makes two: the fp rollout's shadow, then the variant's own rollout
        make = lambda n=name: made.append(ErrorVariantCache(recipe, window, sinks, n)) or made[-1]
        results[name] = roll_variant(world, recipe, trajs, "nearest", 0, 1.0, window, sinks, device, make=make)
        for t, own, first in zip(trajs, made[-1].sqnr_db().tolist(), made[-1].sqnr_db(first=True).tolist()):
            results[name][t.family]["own_sqnr_k"], results[name][t.family]["own_sqnr_v"] = own
            results[name][t.family]["frame0_sqnr_k"], results[name][t.family]["frame0_sqnr_v"] = first
    md = markdown(results, command_line("error_twins", argv), (time.time() - t0) / 60, args.frames, f"recipes/{path.name}")
    name = report_name("error_twins", args.model)
    write_report(args.out, name, md, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

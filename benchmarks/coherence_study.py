"""Study: where the shipped recipe's coherent error comes from, and the encoder changes tried.

    python -m benchmarks.coherence_study [--frames 256] [--out artifacts/benchmarks]
    python -m benchmarks.coherence_study --model wanworld --frames 96 --variants shipped,subtractive

Writes `coherence_study.md` + `.json` (`coherence_study_<model>` for another model than
TinyWorld) for the model's shipped recipe (`recipes/<model>-ours-2bit`). Two parts, on held-out
rollouts (evaluation seeds, one trajectory per family):

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
   - `subtractive`: subtractive dither that keeps the integer states: a seeded offset d in
     [-1/2, 1/2) per frame, token and coded component shifts this frame's levels by 2 s d (s the
     mode's step; levels are 2 s apart), the encoder picks the code nearest to the target on the
     shifted levels, the decoder adds 2 s d to the value, and the chain carries the integer state:
     the error is uniform and independent of the content and of the last frame's;
   - `adaptive E`: each (token, component) inter step scaled by 2^e, e in [-E, 1], from the last
     code (backward adaptation as in ADPCM/CVSD, nothing sent): b >= 2: the outermost code grows
     the step, the innermost shrinks it; b = 1: the same sign as the last code grows it, else
     shrinks it; an intra token resets e = 0. The finer grid it needs costs about E bits per
     coded component in every anchor, plus e's own state there, which this study does not count;
   - `unit x1.5`, `unit x2`: every head's `unit` times 1.5 or 2 (every level and step coarser by
     that factor, the anchors' reach wider, the same bits; nothing refitted): are the fitted steps
     where the rollout wants them (issue 28 item 4)?
   - `reach x2`: the same levels and steps, one more anchor bit per coded component, so a state
     may go twice as far from the mean before the encoder clamps it (+1 bit in anchor frames only);
   - `intra x2`: intra levels twice as far apart, inter steps as fitted (this study lets intra
     states beyond the anchors' range stand; a recipe would need wider anchors);
   - `compand`: non-uniform inter levels on 2- and 3-bit components, s g(q) with g(q) = sign(q)
     (q^2 + 1) / 2 for q = 2c - n (1, 5, 13, 25 steps: as fine near no change, a wider reach;
     Lloyd-Max's shape for a peaky change, `vector_study.md`), the nearest within the anchor range;
     the fitted steps, nothing refitted.

Nothing here changes the package; it measures before the format would change.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from benchmarks import command_line, report_name, shipped_setup, write_report
from benchmarks.kv_stats import FrameRecorder
from calibrate.cache import KVCache
from calibrate.evaluate import metrics as M
from calibrate.evaluate.twin import TWIN_SEED, NoiseTwinCache
from calibrate.predictive_roles import head_params
from calibrate.quant import predictive as P
from calibrate.replay import rollout_batch
from calibrate.shadow import ShadowCache
from calibrate.world.trajectories import make_trajectories

VARIANTS = {"shipped": ("nearest", 0, 1.0), "stochastic": ("stochastic", 0, 1.0), "subtractive": ("subtractive", 0, 1.0),
            "adaptive 1": ("nearest", 1, 1.0), "adaptive 2": ("nearest", 2, 1.0), "adaptive 3": ("nearest", 3, 1.0),
            "unit x1.5": ("nearest", 0, 1.5), "unit x2": ("nearest", 0, 2.0),
            "reach x2": ("nearest", 0, "reach"), "intra x2": ("nearest", 0, "intra"),
            "compand": ("nearest", 0, "compand")}  # (rounding, E, unit scale or what)


class HeadCoder:
    """One head's predictive code with its chain state; `adapt` = E > 0 scales the inter steps."""

    def __init__(self, p: P.PredictiveParams, rounding: str, adapt: int, generator: torch.Generator, compand: bool = False):
        self.p, self.rounding, self.E, self.gen, self.compand = p, rounding, adapt, generator, compand
        f = 2**adapt  # a grid 2^E finer: e = 0 is the fitted step
        self.unit, self.intra, self.limit, self.n = p.unit_D / f, p.intra_step_D * f, p.limit_D * f, p.levels_D
        self.v = self.e = self.sign = None
        self.x = None  # the reconstruction in units (states plus dither)

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounding == "stochastic":
            return torch.floor(x + torch.rand(x.shape, generator=self.gen))
        return torch.round(x)

    def units(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """tau = ((x - mean) @ R) / unit on this coder's grid (quant/predictive.to_units at adapt 0)."""
        return ((x_BTD.float() - self.p.mean_D) @ self.p.rotation_DD) / self.unit

    def code(self, x_BTD: torch.Tensor) -> torch.Tensor:
        p, n = self.p, self.n
        tau = self.units(x_BTD)
        d = torch.zeros_like(tau)
        if self.rounding == "subtractive":  # 0 on uncoded components (they have no levels)
            d = (torch.rand(tau.shape, generator=self.gen) - 0.5) * (p.bits_D > 0)
        c_i = torch.clamp(self._round(((tau - 2 * self.intra * d) / self.intra + n) / 2), torch.zeros_like(n), n).long()
        v_i = self.intra * (2 * c_i - n)
        x_i = v_i + 2 * self.intra * d
        if self.v is None:
            self.v, self.e, self.sign, self.x = v_i, torch.zeros_like(v_i), torch.zeros_like(v_i), x_i
            return self._values()
        s = p.inter_step_D * 2 ** (self.e + self.E)
        lo = (-torch.div(self.v + self.limit - n * s, 2 * s, rounding_mode="floor")).clamp_min(0)
        hi = torch.minimum(torch.div(n * s + self.limit - self.v, 2 * s, rounding_mode="floor"), n.expand_as(self.v))
        c = self._round(((tau - self.v.float() - 2 * s * d) / s.float() + n) / 2)
        c = torch.minimum(torch.maximum(c, lo.float()), hi.float()).long()
        v_p = self.v + s * (2 * c - n)
        if self.compand:
            v_p = self._companded(tau, s, v_p)
        x_p = v_p + 2 * s * d
        w = self.unit**2
        inter = (((tau - x_p) ** 2 * w).sum(-1) <= ((tau - x_i) ** 2 * w).sum(-1)).unsqueeze(-1)
        q = 2 * c - n
        if self.E:
            one_bit = n == 1
            grow = torch.where(one_bit, q.sign() == self.sign, (c == 0) | (c == n))
            shrink = torch.where(one_bit, q.sign() != self.sign, q.abs() == 1) & ~grow
            self.e = torch.where(inter, (self.e + grow.long() - shrink.long()).clamp(-self.E, 1), 0)
        self.sign = torch.where(inter, q.sign(), 0)
        self.v = torch.where(inter, v_p, v_i)
        self.x = torch.where(inter, x_p, x_i)
        return self._values()

    def _companded(self, tau: torch.Tensor, s: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
        """Inter levels s * g(q), g(q) = sign(q) (q^2 + 1) / 2 for q = 2c - n (1, 5, 13, 25: fine near
        no change, a wide reach) on 2- and 3-bit components, the nearest one within the anchor range;
        the linear levels elsewhere."""
        n = self.n
        q = 2 * torch.arange(8) - n.unsqueeze(-1)  # [D, 8] candidates c = 0..7
        g = q.sign() * (q * q + 1) // 2
        lev = self.v.unsqueeze(-1) + s.unsqueeze(-1) * g  # [B, T, D, 8] states
        ok = (torch.arange(8) <= n.unsqueeze(-1)) & (lev.abs() <= self.limit.unsqueeze(-1))
        dist = torch.where(ok, (tau.unsqueeze(-1) - lev).abs(), torch.inf)
        best = torch.gather(lev, -1, dist.argmin(-1, keepdim=True)).squeeze(-1)
        return torch.where((n == 3) | (n == 7), best, linear)

    def _values(self) -> torch.Tensor:
        return (self.unit * self.x.float()) @ self.p.rotation_DD.T + self.p.mean_D


class FakePredictiveCache(KVCache):
    """The fp cache holding each frame as a predictive recipe reconstructs it (keys coded pre-rotary)."""

    def __init__(self, recipe, window: int, sink_frames: int, rounding: str = "nearest", adapt: int = 0,
                 unit_scale: float | str = 1.0, seed: int = 0):
        super().__init__(recipe.model.num_layers, window, sink_frames)
        gen = torch.Generator().manual_seed(seed)
        if unit_scale == "reach":  # the same levels and steps; states may go twice as far (one more anchor bit)
            scaled = lambda p: dataclasses.replace(p, anchor_bits_D=torch.where(p.bits_D > 0, p.anchor_bits_D + 1, 0))
        elif unit_scale == "compand":
            scaled = lambda p: p
        elif unit_scale == "intra":  # intra levels twice as far apart (states beyond the anchor range allowed)
            scaled = lambda p: dataclasses.replace(p, intra_step_D=p.intra_step_D * 2)
        else:  # every level and step, same bits
            scaled = lambda p: dataclasses.replace(p, unit_D=p.unit_D * unit_scale)
        self.coders = [{kv: [HeadCoder(scaled(head_params(recipe.layer_tensors(layer, kv), h)), rounding, adapt, gen,
                                       compand=unit_scale == "compand")
                             for h in range(recipe.model.num_kv_heads)] for kv in "kv"}
                       for layer in range(self.num_layers)]
        self.cov = None  # sums of e e^T of the stored error (keys pre-rotary), [B, L, 2, H, D, D] float64
        self.count = torch.zeros(self.num_layers)  # tokens summed per trajectory

    def append(self, layer, k_BHTD, v_BHTD, key_rope) -> int:
        k = torch.stack([c.code(k_BHTD[:, h]) for h, c in enumerate(self.coders[layer]["k"])], 1)
        v = torch.stack([c.code(v_BHTD[:, h]) for h, c in enumerate(self.coders[layer]["v"])], 1)
        B, H, T, D = k.shape
        if self.cov is None:
            self.cov = torch.zeros(B, self.num_layers, 2, H, D, D, dtype=torch.float64)
        for i, (x_hat, x) in enumerate(((k, k_BHTD), (v, v_BHTD))):
            e = (x_hat - x).double()
            self.cov[:, layer, i] += torch.einsum("bhtd,bhte->bhde", e, e)
        self.count[layer] += T
        return super().append(layer, k, v, key_rope)


class GaussianTwinCache(KVCache):
    """The fp cache plus N(0, C) on every stored token's keys (before the rotary) and values, C one
    covariance per trajectory, layer, K/V and head [B, L, 2, H, D, D]: C = the scheme's error
    covariance is its *shaped* twin (the same directions, independent across tokens and frames);
    C = its trace / D times the identity is the isotropic twin of evaluate/twin.py (rotation-invariant)."""

    def __init__(self, num_layers: int, window: int, sink_frames: int, cov: torch.Tensor, seed: int = TWIN_SEED):
        super().__init__(num_layers, window, sink_frames)
        evals, evecs = torch.linalg.eigh(cov)
        self.root = (evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)).float()  # C = root root^T
        self.gen = torch.Generator().manual_seed(seed)

    def _noise(self, x_BHTD: torch.Tensor, root_BHDD: torch.Tensor) -> torch.Tensor:
        z = torch.randn(x_BHTD.shape, generator=self.gen)
        return x_BHTD + torch.einsum("bhte,bhde->bhtd", z, root_BHDD).to(x_BHTD.dtype)

    def append(self, layer, k_BHTD, v_BHTD, key_rope) -> int:
        root = self.root[:, layer]
        return super().append(layer, self._noise(k_BHTD, root[:, 0]), self._noise(v_BHTD, root[:, 1]), key_rope)


def where_the_error_lies(world, recipe, families: list[str], frames: int, window: int, sinks: int, device) -> list[dict]:
    rows = []
    for family in families:
        rec = FrameRecorder(world.info.num_layers, window, sinks)
        rollout_batch(world, make_trajectories([family], "evaluation", 1, frames), rec, device, keep_frames=False)
        for (layer, kv), xs in sorted(rec.frames.items()):
            x = torch.stack(xs, 2)[0]  # [H, F, T, D]
            tensors = recipe.layer_tensors(layer, kv)
            sig = err = eu = uu = 0.0
            parts = {True: [0.0, 0.0], False: [0.0, 0.0]}  # uncoded? -> [error energy, static energy] (frames 16+)
            for h in range(x.shape[0]):
                p = head_params(tensors, h)
                xh = x[h : h + 1]
                e = (P.fake_quant_sequence(xh, p) - xh) @ p.rotation_DD  # error in the code's basis
                u = (xh - p.mean_D) @ p.rotation_DD  # the centred signal in the same basis
                sig, err = sig + float(xh.double().pow(2).sum()), err + float(e.double().pow(2).sum())
                eu, uu = eu + float((e.double() * u.double()).sum()), uu + float(u.double().pow(2).sum())
                late = e[:, 16:].double()
                for uncoded in (True, False):
                    sel = late[..., (p.bits_D == 0) == uncoded]
                    parts[uncoded][0] += float(sel.pow(2).sum())
                    parts[uncoded][1] += float(sel.mean(1).pow(2).sum()) * sel.shape[1]
            total = parts[True][0] + parts[False][0]
            rows.append({"family": family, "layer": layer, "kv": kv, "sqnr_db": 10 * torch.log10(torch.tensor(sig / err)).item(),
                         "uncoded_share": parts[True][0] / total,
                         # the error's regression on the centred signal: e = -beta u + rest (beta > 0: shrinkage)
                         "shrink": -eu / uu, "shrink_share": (eu / uu) ** 2 * uu / err,
                         "uncoded_static": parts[True][1] / max(parts[True][0], 1e-30),
                         "coded_static": parts[False][1] / max(parts[False][0], 1e-30)})
    return rows


def roll_variant(world, recipe, trajs, rounding: str, adapt: int, unit_scale: float | str, window: int, sinks: int, device,
                 shape: bool = False, make=None) -> dict:
    """PSNR vs fp per window and family of one variant and its noise twin, and its stored SQNR; with
    `shape`, also its shaped and isotropic Gaussian twins (`GaussianTwinCache`). `make() -> cache`
    replaces the variant's `FakePredictiveCache` (static_oracles.py's oracles)."""
    L = world.info.num_layers
    make = make or (lambda: FakePredictiveCache(recipe, window, sinks, rounding, adapt, unit_scale))
    fp = ShadowCache(L, window, sinks, {"x": make()}, attention=False, stored=True)
    ref, truth = rollout_batch(world, trajs, fp, device)
    quant, _ = rollout_batch(world, trajs, make(), device, truth=truth)
    stored = fp.stored["x"]
    twin, _ = rollout_batch(world, trajs, NoiseTwinCache(L, window, sinks, stored.noise_std(), TWIN_SEED), device, truth=truth)
    shaped = None
    if shape:  # the same stored error (as stored, each token once) with its directions kept, or spread evenly
        fake = fp.shadows["x"]
        cov = fake.cov / fake.count.view(1, -1, 1, 1, 1, 1).double()
        D = cov.shape[-1]
        iso = torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1, keepdim=True).unsqueeze(-1) / D * torch.eye(D, dtype=cov.dtype)
        shaped = {name: rollout_batch(world, trajs, GaussianTwinCache(L, window, sinks, c), device, truth=truth)[0]
                  for name, c in (("shaped", cov), ("isotropic", iso))}
    sqnr = stored.sqnr_db().mean(1)  # [B, 2]: mean over layers
    out = {}
    for b, t in enumerate(trajs):
        out[t.family] = {"sqnr_k": float(sqnr[b, 0]), "sqnr_v": float(sqnr[b, 1]),
                         "scheme": M.window_means(M.psnr(quant[b], ref[b])), "twin": M.window_means(M.psnr(twin[b], ref[b])),
                         "flicker": float(M.flicker_series(quant[b], ref[b]).mean())}
        for name, frames in (shaped or {}).items():
            out[t.family][name] = M.window_means(M.psnr(frames[b], ref[b]))
    return out


def markdown(decomp: list[dict], variants: dict, command: str, minutes: float, frames: int, recipe: str) -> str:
    lines = ["# Coherent error of the shipped recipe: where it lies, and the encoder changes tried", "",
             f"Command: `{command}`, {minutes:.1f} min on this 2-core CPU (torch threads {torch.get_num_threads()}, "
             "the other core busy). Held-out rollouts (evaluation seeds, one per family), "
             f"{frames} frames, `{recipe}`. The method is in the module docstring of "
             "`benchmarks/coherence_study.py`.", "",
             "## 1. Where the stored error lies (teacher-forced)", "",
             "Shrinkage: the error regressed on the centred signal, e = -beta u + rest; beta > 0 means the code "
             "pulls values toward the mean (uncoded components, clipped tails), which moves every history key's "
             "logit the same way, unlike noise.", "",
             "| family | layer | K/V | stored SQNR dB | share of the error in uncoded components | of it, the same in every frame "
             "| coded components' error, the same in every frame | shrinkage beta | share of the error it explains |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in decomp:
        lines.append(f"| {r['family']} | {r['layer']} | {r['kv'].upper()} | {r['sqnr_db']:.1f} | {100 * r['uncoded_share']:.0f}% "
                     f"| {100 * r['uncoded_static']:.0f}% | {100 * r['coded_static']:.0f}% | {r['shrink']:.4f} "
                     f"| {100 * r['shrink_share']:.0f}% |")
    if not variants:
        return "\n".join(lines) + "\n"
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
    shipped = variants.get("shipped", {})
    if "shaped" in shipped.get(fams[0], {}):
        lines += ["", "### Time or direction? The shipped recipe against twins of two shapes", "",
                  "Both twins draw independent Gaussian error per token and frame from the recipe's stored error "
                  "covariance per trajectory, layer, K/V and head (keys before the rotary), each token counted once: "
                  "*shaped* keeps its directions, *isotropic* spreads its power evenly (as evaluate/twin.py does). "
                  "If the shaped twin falls to the scheme, the error hurts by where it points; if it stays with the "
                  f"isotropic one, by repeating over tokens and frames. PSNR vs fp, frames {late}:", "",
                  "| family | scheme | shaped twin | isotropic twin |", "|---|---|---|---|"]
        for f in fams:
            r = shipped[f]
            lines.append(f"| {f} | {r['scheme'][late]:.1f} | {r['shaped'][late]:.1f} | {r['isotropic'][late]:.1f} |")
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
    p.add_argument("--model", default="tinyworld", help="a conf/model preset with a shipped recipe (tinyworld, wanworld)")
    args = p.parse_args(argv)
    unknown = [name for name in args.variants.split(",") if name and name not in VARIANTS]
    if args.frames <= 16 or unknown:
        problem = f"--frames must be above 16 (the error is split on frames 16 on), got {args.frames}" if not unknown \
            else f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}"
        print(f"coherence_study: {problem}", file=sys.stderr)
        return 2
    t0 = time.time()
    device = torch.device("cpu")
    try:
        cfg, world, path, recipe = shipped_setup(args.model, device=device)
    except ValueError as err:
        print(f"coherence_study: {err}", file=sys.stderr)
        return 2
    window, sinks = cfg.model.cache.window, cfg.model.cache.sink_frames
    decomp = where_the_error_lies(world, recipe, ["static", "pan", "orbit"], min(args.frames, 128), window, sinks, device)
    trajs = make_trajectories(["static", "pan", "orbit", "dolly"], "evaluation", 4, args.frames)
    variants = {name: roll_variant(world, recipe, trajs, *VARIANTS[name], window, sinks, device, shape=name == "shipped")
                for name in args.variants.split(",") if name}
    command = command_line("coherence_study", argv)
    md = markdown(decomp, variants, command, (time.time() - t0) / 60, args.frames,
                  f"recipes/{path.name}, window {window} + {sinks} sink")
    name = report_name("coherence_study", args.model)
    write_report(args.out, name, md, {"decomposition": decomp, "variants": variants})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Roll out schemes on held-out trajectories and measure what long rollouts show.

For each batch of trajectories (equal length) the full-precision reference rollout runs once,
through a `ShadowCache` that also feeds every scheme's quantized cache the same K/V (per-layer
attention KL, most-attended-frame agreement, output error: teacher-forced). Then each scheme
rolls out on its own through its packed runtime (`fastcache.FastKVCache`), and the per-frame
series are computed against the fp rollout and the ground truth. Memory is counted from the
runtime's tensors after every frame (the report takes the most). With `twin`, each
scheme's stored error is measured teacher-forced in the same shadows and its noise twin
(evaluate/twin.py) rolls out after it: series `psnr_twin`, and the stored SQNR per trajectory.

Each finished (scheme, batch) is written to `partial/<scheme>.<batch>.safetensors` in the run
dir; a run restarted with the same `hydra.run.dir` picks those up instead of recomputing. A
partial file is keyed by everything its numbers depend on (`partial_key`: the recipe's bytes,
the model's weights fingerprint, the trajectories and how they are batched, window, sinks,
attention metrics, device type): a file of another key, e.g. of another recipe under the same
scheme name, is recomputed and overwritten, with one line in the log saying so. Frame sheets
(`on_rollout`) are written before the partial file they go with, so a partial file that is
reused always has its sheets on disk (under a directory the caller keys by `setting_key`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from calibrate.adapters.base import WorldAdapter
from calibrate.evaluate import metrics as M
from calibrate.evaluate.twin import TWIN_SEED, NoiseTwinCache
from calibrate.io import safetensors_bytes, write_bytes_atomic
from calibrate.recipe import Recipe, to_bytes
from calibrate.replay import batches, rollout_batch
from calibrate.fastcache import FastKVCache, check_runnable
from calibrate.shadow import ShadowCache
from calibrate.tiers import fp16_device_bytes
from calibrate.types import ModelInfo, Trajectory
from calibrate.world.trajectories import revisit_pairs

log = logging.getLogger(__name__)

PARTIAL_VERSION = "4"  # partial files without this version (or key) are recomputed


@dataclass
class TrajResult:
    """Per-frame series of one scheme on one trajectory, plus scalars."""

    family: str
    seed: int
    series: dict[str, Tensor]  # name -> [N] (flicker: [N-1])
    revisit_q: float | None
    revisit_fp: float | None
    static_q: float | None
    static_fp: float | None
    sqnr_db: dict[str, list[float]] | None = None  # stored K and V SQNR per layer (measured with a twin)


@dataclass
class SchemeRun:
    recipe: Recipe
    trajs: list[TrajResult]
    memory: dict
    attention: dict
    worst: tuple[float, Tensor, Tensor] | None = None  # (mean psnr_ref, ref frames, quant frames)
    frames: list[dict[str, Tensor]] | None = None  # per batch: reference, quantized, ground_truth


def _traj_results(trajs: list[Trajectory], ref: Tensor, quant: Tensor, truth: Tensor, twin: Tensor | None = None,
                  sqnr_BL2: Tensor | None = None, has_truth: bool = True) -> list[TrajResult]:
    """Each trajectory's series and scalars, among them how much the quantized and the fp rollout
    move (`motion_quant`, `motion_fp`: metrics.frame_change) and, with a renderer's ground truth
    (`has_truth`), the truth (`motion_gt`)."""
    out = []
    for b, traj in enumerate(trajs):
        r, q, g = ref[b], quant[b], truth[b]
        series = {
            "psnr_ref": M.psnr(q, r),
            "ssim_ref": M.ssim(q, r),
            "psnr_gt": M.psnr(q, g),
            "psnr_fp_gt": M.psnr(r, g),
            "err": M.error_series(q, r),
            "flicker": M.flicker_series(q, r),
            "motion_quant": M.frame_change(q),
            "motion_fp": M.frame_change(r),
        }
        if has_truth:
            series["motion_gt"] = M.frame_change(g)
        if twin is not None:
            series["psnr_twin"] = M.psnr(twin[b], r)
        pairs = revisit_pairs(traj) if traj.family == "revisit" else []
        rq = M.revisit_consistency(q, pairs)[0] if pairs else None
        rf = M.revisit_consistency(r, pairs)[0] if pairs else None
        sq = float(M.flicker_static(q)) if traj.family == "static" else None
        sf = float(M.flicker_static(r)) if traj.family == "static" else None
        sqnr = None if sqnr_BL2 is None else {"k": sqnr_BL2[b, :, 0].tolist(), "v": sqnr_BL2[b, :, 1].tolist()}
        out.append(TrajResult(traj.family, traj.seed, series, rq, rf, sq, sf, sqnr))
    return out


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def setting_key(info: ModelInfo, trajs: list[Trajectory], window: int, sink_frames: int, batch_size: int,
                device: torch.device) -> str:
    """What every scheme's rollout in an evaluation depends on besides its recipe: the model's
    weights, the trajectories (their poses and actions, not just their names) and their batches,
    the cache's window and sinks, the device type (float arithmetic differs between devices)."""
    h = hashlib.sha256()
    for t in trajs:
        h.update(f"{t.family}/{t.seed}/{t.num_frames};".encode())
        h.update(t.poses.detach().float().cpu().contiguous().numpy().tobytes())
        h.update(t.actions.detach().float().cpu().contiguous().numpy().tobytes())
    return _digest({"version": PARTIAL_VERSION, "model": info.fingerprint, "trajectories": h.hexdigest(),
                    "window": window, "sink_frames": sink_frames, "batch_size": batch_size, "device": device.type})


def partial_key(setting: str, recipe: Recipe, attention: bool, twin: bool = False) -> str:
    """The key of a scheme's partial results: `setting_key`, the recipe's bytes, the metrics
    computed (attention, noise twin)."""
    return _digest({"setting": setting, "recipe": hashlib.sha256(to_bytes(recipe)).hexdigest(), "attention": attention,
                    "twin": twin})


def _save_partial(path, results: list[TrajResult], memory: dict, attention: dict, key: str, frames: bool) -> None:
    # float64 as computed: a resumed run's report is the uninterrupted run's, to the last bit
    tensors = {f"{i}.{k}": v.double().contiguous() for i, r in enumerate(results) for k, v in r.series.items()}
    meta = {"memory": json.dumps(memory), "attention": json.dumps(attention), "key": key, "frames": str(int(frames)),
            "trajs": json.dumps([[r.family, r.seed, r.revisit_q, r.revisit_fp, r.static_q, r.static_fp, r.sqnr_db]
                                 for r in results])}
    write_bytes_atomic(path, safetensors_bytes(tensors, meta))


def _partial_meta(path: Path) -> dict[str, str] | None:
    """A partial file's metadata; None if there is no readable file."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # safetensors raises several types for a bad header: the file is recomputed
        return {}


def _load_partial(path) -> tuple[list[TrajResult], dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:  # one read of the file: metadata and tensors
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    results = []
    for i, (family, seed, rq, rf, sq, sf, sqnr) in enumerate(json.loads(meta["trajs"])):
        series = {name.partition(".")[2]: t.double() for name, t in tensors.items() if name.partition(".")[0] == str(i)}
        results.append(TrajResult(family, seed, series, rq, rf, sq, sf, sqnr))
    return results, json.loads(meta["memory"]), json.loads(meta["attention"])


def _reusable(partial_dir: Path | None, keys: dict[str, str], num_batches: int, need_frames: bool,
              keep_frames: bool) -> dict[str, set[int]]:
    """Per scheme, the batches whose partial file holds results of the same key (with their frame
    sheets if `need_frames`). A scheme with files of another key gets one line in the log; those
    files are removed, so they can never be taken for the frame sheets written next."""
    out: dict[str, set[int]] = {name: set() for name in keys}
    if partial_dir is None or keep_frames:  # frames.safetensors needs every rollout's frames
        return out
    for name, key in keys.items():
        stale, other_key = [], False
        for bi in range(num_batches):
            path = partial_dir / f"{name}.{bi}.safetensors"
            meta = _partial_meta(path)
            if meta is None:
                continue
            if meta.get("key") == key and (meta.get("frames") == "1" or not need_frames):
                out[name].add(bi)
            else:
                stale.append(path)
                other_key = other_key or meta.get("key") != key
        if stale:
            why = ("were computed for another recipe or setting (model, trajectories, window, sinks, device or metrics)"
                   if other_key else "have no frame sheets")
            log.warning("partial results of '%s' in %s %s: recomputing %d of %d batches", name, partial_dir, why,
                        len(stale), num_batches)
            for path in stale:
                path.unlink(missing_ok=True)
    return out


def evaluate(world: WorldAdapter, recipes: dict[str, Recipe], trajs: list[Trajectory], window: int, sink_frames: int,
             device: torch.device, batch_size: int = 8, attention: bool = True, partial_dir=None,
             keep_frames: bool = False, on_rollout=None, twin: bool = False) -> dict[str, SchemeRun]:
    """Evaluate every recipe on `trajs`; returns per-scheme results (see `report.build`).

    `on_rollout(name, first, ref, quant, truth)`, if given, sees each fresh (scheme, batch) rollout
    as it finishes: frames [B, N, C, H, W] of `SchemeRun.trajs[first:first + B]`, truth None for a
    model without a renderer (e.g. `sheets.FrameSheets`, which writes them for report.html).
    `twin` rolls out each scheme's noise twin too (not for a memory plan, whose held frames differ
    from the fp cache's). Each rollout shows its frames as a progress bar with an ETA.
    """
    for r in recipes.values():  # before any rollout
        check_runnable(r)
    runs = {name: SchemeRun(r, [], {}, {}) for name, r in recipes.items()}
    groups = batches(trajs, batch_size)
    layers = world.info.num_layers
    attn_sums = {name: None for name in recipes}
    partial_dir = Path(partial_dir) if partial_dir is not None else None
    keys = {}
    if partial_dir is not None:
        setting = setting_key(world.info, trajs, window, sink_frames, batch_size, device)
        keys = {name: partial_key(setting, r, attention, twin and r.scheme.policy.plan is None)
                for name, r in recipes.items()}
    reuse = _reusable(partial_dir, keys, len(groups), on_rollout is not None, keep_frames)
    bar = tqdm(total=len(groups) * len(recipes), desc="evaluate", unit="run")
    first = 0
    for bi, group in enumerate(groups):
        todo = [n for n in recipes if bi not in reuse.get(n, ())]
        ref = truth = None
        has_truth = False
        if todo:  # the fp reference is rolled out only for schemes that are computed
            truth = world.ground_truth(group, device)
            has_truth = truth is not None
            # attention metrics compare with a float cache of the same frames: not for a memory plan,
            # whose device tier holds other frames (its own window, recalled slots)
            shadows = {n: FastKVCache.from_recipe(recipes[n], window, sink_frames, device) for n in todo
                       if (attention or twin) and recipes[n].scheme.policy.plan is None}
            if (attention or twin) and len(shadows) < len(todo):
                log.info("attention metrics and noise twin left out for %s: a memory plan's cache holds other frames "
                         "than the float reference", ", ".join(n for n in todo if n not in shadows))
            fp_cache = ShadowCache(layers, window, sink_frames, shadows, attention, stored=twin)
            where = f"batch {bi + 1}/{len(groups)}"
            ref, _ = rollout_batch(world, group, fp_cache, device, truth=truth, desc=f"fp reference, {where}")
            if truth is None:  # no renderer (e.g. Wan): "ground truth" is the full-precision rollout
                truth = ref
        for name in recipes:
            path = partial_dir / f"{name}.{bi}.safetensors" if partial_dir else None
            if name not in todo:
                results, memory, attn = _load_partial(path)
            else:
                cache = FastKVCache.from_recipe(recipes[name], window, sink_frames, device)
                held = []  # the cache's bytes after each frame: their most is what it needs (deferred spans vary)
                quant, _ = rollout_batch(world, group, cache, device, truth=truth, desc=f"{name}, {where}",
                                         on_frames=lambda: held.append(cache.nbytes()))
                twin_frames = sqnr = None
                if twin and name in shadows:
                    stored = fp_cache.stored[name]
                    twin_cache = NoiseTwinCache(layers, window, sink_frames, stored.noise_std(), TWIN_SEED + bi)
                    twin_frames, _ = rollout_batch(world, group, twin_cache, device, truth=truth,
                                                   desc=f"{name} noise twin, {where}")
                    sqnr = stored.sqnr_db()
                results = _traj_results(group, ref, quant, truth, twin_frames, sqnr, has_truth)
                n = cache.num_frames_seen  # appended frames (frame 0 is given, not generated)
                memory = {"bytes": cache.nbytes(), "peak_bytes": max(held, default=cache.nbytes()),
                          "predicted_bytes": cache.predicted_nbytes(n, len(group)),
                          "fp16_bytes": fp16_device_bytes(recipes[name].model, recipes[name].scheme, n, window, sink_frames,
                                                          len(group))}
                attn = fp_cache.errors[name].sums if attention and name in shadows else {}
                _track_worst(runs[name], results, ref, quant)
                if on_rollout is not None:  # before the partial file: a reused file always has its sheets
                    on_rollout(name, first, ref, quant, truth if has_truth else None)
                if path is not None:
                    _save_partial(path, results, memory, attn, keys[name], on_rollout is not None)
                if keep_frames:
                    runs[name].frames = (runs[name].frames or []) + [
                        {"reference": ref.cpu(), "quantized": quant.cpu(), "ground_truth": truth.cpu()}]
            runs[name].trajs.extend(results)
            runs[name].memory = _add(runs[name].memory, memory)
            attn_sums[name] = _add(attn_sums[name] or {}, attn)
            bar.update(1)
        first += len(group)
    bar.close()
    for name, run in runs.items():
        run.attention = attn_sums[name] or {}
    return runs


def _track_worst(run: SchemeRun, results: list[TrajResult], ref: Tensor, quant: Tensor) -> None:
    for b, r in enumerate(results):
        score = float(r.series["psnr_ref"].mean())
        if run.worst is None or score < run.worst[0]:
            run.worst = (score, ref[b].cpu(), quant[b].cpu())


def _add(a: dict, b: dict) -> dict:
    """Elementwise sum of dicts of numbers or lists of numbers (memory and attention sums)."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, list):
            out[k] = [x + y for x, y in zip(out[k], v)]
        else:
            out[k] = out[k] + v
    return out

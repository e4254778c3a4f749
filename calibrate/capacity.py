"""`task=capacity`: how many frames of KV cache fit on a device beside the model, from bytes alone.

The first question of anyone running a video world model is whether it fits: how many latent
frames of history a 24 GB card holds next to the weights, and what a longer rollout would have
to keep elsewhere. This answers it from the memory model (`memory.py`, `tiers.py`: the bytes the
runtime really holds, tested against its packed tensors), without weights, replay or rollouts:

- **the model**: its cache shape (`ModelInfo`: layers, KV heads, head_dim, tokens per cache
  frame), latent frames per cache frame (a chunk) and parameter count. For `model=wan_diffusers`
  all three come from a Wan config (`model.wan.config`, a diffusers directory's config.json, or
  the tiny model's) and `model.wan` (chunking, latent grid), without loading weights; another
  model is loaded once to read them. `capacity.num_layers=...` (with num_kv_heads, head_dim,
  tokens_per_latent_frame, num_params, chunk_frames) gives a shape directly.
- **the budget**: `memory.device_budget` is the device's memory here; the bf16 weights
  (2 bytes per parameter) and `capacity.reserve` come off first, and the rest is the cache's
  budget: what `memory.device_budget` means for `task=calibrate`'s plan search.
- **per scheme** (every baseline, every shipped recipe, and `recipe=` when given): the largest
  window of cache frames (besides `model.cache.sink_frames` sinks) whose steady-state bytes fit
  (`tiers.steady_device_bytes`, the bytes a memory plan is admitted by), the latent frames that
  makes, and the host bytes a host tier needs to keep the rest of a `capacity.rollout_frames`
  rollout (`tiers.predicted_host_bytes`). The window is capped at the rollout.
- **a recipe fitted for another shape** (the shipped TinyWorld recipe on Wan: other heads and
  head_dim) cannot run on this model: it is counted at the bits/element its own memory metadata
  records, scaled to this model's float16 cache (marked `estimate`): what a recipe fitted for
  this model at the same budget would hold, since a fitted recipe's budget counts every byte.
  A recipe of this shape is counted exactly.

Speed: bytes are a sum over layers and heads (`memory.predicted_cache_bytes`), so a recipe is
counted one distinct layer at a time, times how often it occurs, and a baseline (the same specs
on every layer and head) is built and counted for one layer and one head, times their number;
a test holds the result to `predicted_cache_bytes` and `steady_device_bytes` of the whole
scheme. The boundary window is found from a straight-line guess checked with exact bytes.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from calibrate.config_memory import byte_count
from calibrate.io import write_text_atomic
from calibrate.memory import fp16_cache_bytes, steady_phases, steady_state_frames
from calibrate.plan import MemoryPlan
from calibrate.recipe import Recipe, Scheme, load_recipe
from calibrate.schemes import BASELINES, preset_scheme
from calibrate.shipped import resolve_recipe, shipped_recipes
from calibrate.tiers import check_plan, predicted_host_bytes, steady_device_bytes
from calibrate.types import ModelInfo

WEIGHT_BYTES = 2  # bf16 weights
GIB = 2**30


@dataclass
class Shape:
    """What capacity needs of a model: its cache shape, latent frames per cache frame, parameters."""

    info: ModelInfo
    chunk_frames: int
    num_params: int
    source: str  # where the shape came from, for the report


@dataclass
class Group:
    """Part of a cache whose bytes are `count` times those of `scheme` on the model `info`: one
    distinct layer of a recipe (info: one layer), or one head of a baseline (info: one layer, one head)."""

    info: ModelInfo
    scheme: Scheme
    count: int


@dataclass
class Counted:
    """A scheme as capacity counts it: groups whose bytes add up to the scheme's, or a bits/element
    estimate for a recipe of another shape."""

    name: str
    origin: str  # baseline | shipped recipe | recipe
    groups: list[Group] | None
    estimate_bits: float | None = None
    note: str = ""


# ---- the model's shape ----------------------------------------------------------------------------
def model_shape(cfg) -> Shape:
    """The shape of `cfg.model` (or the explicit `cfg.capacity` shape)."""
    c = cfg.capacity
    if c.num_layers is not None:
        chunk = c.chunk_frames or 1
        return Shape(ModelInfo(name="explicit", num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, tokens_per_frame=c.tokens_per_latent_frame * chunk,
                               fingerprint="(shape only)"), chunk, c.num_params, "capacity.* (explicit)")
    if cfg.model.name == "wan_diffusers":
        return wan_shape(cfg.model)
    from calibrate.pipeline import load_adapter  # any other model: load it once to read its shape
    import torch

    adapter = load_adapter(cfg.model, torch.device("cpu"))
    modules = [m for m in vars(adapter).values() if isinstance(m, torch.nn.Module)]
    params = sum(p.numel() for m in modules for p in m.parameters())
    return Shape(adapter.info, 1, params, f"model={cfg.model.name} (loaded)")


def wan_shape(model) -> Shape:
    """A Wan's shape from its config, without loading weights: `model.wan.config`, else the config.json
    of a diffusers directory, else Wan2.1-T2V-1.3B's for a checkpoint file, else the tiny model's."""
    from calibrate.adapters import wan_checkpoint as wc
    from calibrate.adapters.wan_diffusers import TINY

    w = model.wan
    weights = Path(model.weights) if model.weights else None
    if w.config is not None:
        config, source = wc.read_config(w.config), f"model.wan.config={w.config}"
    elif weights is not None and weights.is_dir():
        config, source = wc.read_config(str(weights)), f"{weights}/config.json"
    elif weights is not None:
        config, source = wc.read_config(wc.DEFAULT_CONFIG), f"{wc.DEFAULT_CONFIG} (assumed for a checkpoint file; " \
                                                             f"model.wan.config names another)"
    else:
        config, source = dict(TINY), "the tiny random Wan (set model.wan.config for a real model)"
    patch = tuple(config.get("patch_size", (1, 2, 2)))
    if w.latent_height % patch[1] or w.latent_width % patch[2]:
        raise ValueError(f"config: model.wan latent {w.latent_height}x{w.latent_width} is not divisible by the patch "
                         f"size {patch[1]}x{patch[2]}")
    per_frame = (w.latent_height // patch[1]) * (w.latent_width // patch[2])
    info = ModelInfo(name="wan_diffusers", num_layers=config["num_layers"], num_kv_heads=config["num_attention_heads"],
                     head_dim=config["attention_head_dim"], tokens_per_frame=w.chunk_frames * per_frame,
                     fingerprint="(config only)")
    return Shape(info, w.chunk_frames, wc.num_params(config), source)


# ---- the schemes ----------------------------------------------------------------------------------
def layer_groups(info: ModelInfo, scheme: Scheme) -> list[Group]:
    """Distinct layers of `scheme`, each as a one-layer scheme with how many layers it stands for."""
    one = replace(info, num_layers=1)
    groups: list[Group] = []
    for layer in scheme.layers:
        same = next((g for g in groups if g.scheme.layers[0] == layer), None)
        if same is not None:
            same.count += 1
        else:
            groups.append(Group(one, replace(scheme, layers=[layer]), 1))
    return groups


def baseline_groups(name: str, info: ModelInfo) -> list[Group]:
    """Baseline `name` built for one layer and one head, standing for every layer and head: the
    baselines apply the same specs everywhere. With keys stored before the rotary encoding the
    per-layer coordinates are counted once per layer, so the heads stay together then."""
    single = replace(info, num_layers=1, num_kv_heads=1)
    scheme = preset_scheme(name, single)
    if scheme.layers[0].k.rotary_coords:
        single = replace(info, num_layers=1)
        return [Group(single, preset_scheme(name, single), info.num_layers)]
    return [Group(single, scheme, info.num_layers * info.num_kv_heads)]


def same_shape(a: ModelInfo, b: ModelInfo) -> bool:
    return (a.num_layers, a.num_kv_heads, a.head_dim) == (b.num_layers, b.num_kv_heads, b.head_dim)


def count_recipe(name: str, origin: str, recipe: Recipe, info: ModelInfo) -> Counted:
    if same_shape(recipe.model, info):
        fitted = json.loads(recipe.metadata.get("memory", "{}")).get("window")
        note = f"codes fitted for window {fitted}" if fitted and any(
            s.kind == "predictive" for layer in recipe.scheme.layers for s in (layer.k, layer.v)) else ""
        return Counted(name, origin, layer_groups(info, recipe.scheme), note=note)
    m = recipe.model
    bits = json.loads(recipe.metadata.get("memory", "{}")).get("bits_per_element")
    shape = f"{m.name}: {m.num_layers} layers x {m.num_kv_heads} heads x {m.head_dim}"
    if bits is None:
        return Counted(name, origin, None, note=f"skipped: fitted for {shape} and records no bits/element")
    return Counted(name, origin, None, estimate_bits=float(bits),
                   note=f"estimate: fitted for {shape}, counted at its {bits:.2f} bits/element; "
                        f"fit one for this model (task=calibrate) to run it")


def schemes_to_count(info: ModelInfo, recipe: str | None) -> list[Counted]:
    """Every baseline (built for one layer of `info`), every shipped recipe, and `recipe` when given."""
    out = [Counted(name, "baseline", baseline_groups(name, info)) for name in BASELINES]
    paths = {name: (path, "shipped recipe") for name, path in shipped_recipes().items()}
    if recipe:
        path = resolve_recipe(recipe)
        paths[path.stem] = (path, "recipe" if path not in {p for p, _ in paths.values()} else "shipped recipe")
    for name, (path, origin) in paths.items():
        out.append(count_recipe(name, origin, load_recipe(path), info))
    return out


# ---- bytes --------------------------------------------------------------------------------------
def device_bytes(info: ModelInfo, c: Counted, window: int, sink_frames: int) -> int:
    """Steady-state device bytes per trajectory of a cache of `window` + `sink_frames` frames:
    `tiers.steady_device_bytes` (exact; by layer groups where that is exact) or the estimate."""
    plan = MemoryPlan(device_budget_bytes=1, window=window, sink_frames=sink_frames)
    if c.groups is None:
        n = steady_state_frames(window, sink_frames)
        return math.ceil(fp16_cache_bytes(info, n, window, sink_frames) * c.estimate_bits / 16)
    if len(c.groups) == 1 or all(steady_phases(g.scheme) == 1 for g in c.groups):
        # bytes are a sum over layers and heads; the sum of each group's maximum over phases is
        # the maximum of the sum when there is one group or one phase
        return sum(g.count * steady_device_bytes(g.info, g.scheme, plan) for g in c.groups)
    layers = [layer for g in c.groups for layer in g.scheme.layers * g.count]
    return steady_device_bytes(info, replace(c.groups[0].scheme, layers=layers), plan)


def bits_per_element(info: ModelInfo, nbytes: int, window: int, sink_frames: int) -> float:
    """Stored bits per cached element of `nbytes` at steady state (as `memory.bits_per_element`)."""
    n = steady_state_frames(window, sink_frames)
    return 16.0 * nbytes / fp16_cache_bytes(info, n, window, sink_frames)


def largest_window(bytes_at: Callable[[int], int], budget: int, most: int) -> int:
    """The largest window in [1, most] whose device bytes `bytes_at(window)` fit `budget` (0: not even one).

    Bytes grow with the window, so the boundary is found by search; exact bytes of a large window
    cost time (a cache of hundreds of frames, times the span phases of kind prq), so the search
    starts from a straight line through two small windows and checks it with exact bytes: usually
    the exact bytes of the estimate and of one window more settle it.
    """
    fits = lambda w: bytes_at(w) <= budget
    if budget <= 0 or not fits(1):
        return 0
    a, b = min(4, most), min(20, most)
    if a == b:
        guess = a
    else:
        ba, bb = bytes_at(a), bytes_at(b)
        guess = a + int((budget - ba) * (b - a) / max(bb - ba, 1))
    guess = max(1, min(most, guess))
    if fits(guess):  # gallop up to a window that does not fit (or `most`)
        lo, step = guess, 1
        while lo < most and fits(min(lo + step, most)):
            lo, step = min(lo + step, most), 2 * step
        hi = min(lo + step, most + 1)
    else:  # gallop down to one that fits (window 1 does)
        hi, step = guess, 1
        while not fits(max(hi - step, 1)):
            hi, step = max(hi - step, 1), 2 * step
        lo = max(hi - step, 1)
    while hi - lo > 1:  # lo fits, hi does not (or hi = most + 1)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def host_bytes(info: ModelInfo, c: Counted, plan: MemoryPlan, num_appended: int) -> tuple[int | None, str]:
    """(bytes a host tier holds after `num_appended` frames under `plan`, or None and why not)."""
    if c.groups is None:
        return None, "no host form without a recipe for this model"
    try:
        for g in c.groups:
            check_plan(Recipe(g.info, replace(g.scheme, policy=replace(g.scheme.policy, plan=plan)), {}))
    except ValueError as e:
        return None, str(e).split(": ", 1)[-1]
    return sum(g.count * predicted_host_bytes(g.info, g.scheme, plan, num_appended) for g in c.groups), ""


# ---- the task ---------------------------------------------------------------------------------
def capacity(shape: Shape, device_budget: int, reserve: int, sink_frames: int, rollout_frames: int,
             schemes: list[Counted]) -> dict:
    """The capacity report: the budget's split and one row per scheme."""
    info, cf = shape.info, shape.chunk_frames
    weights = WEIGHT_BYTES * shape.num_params
    budget = device_budget - weights - reserve
    chunks = math.ceil(rollout_frames / cf)
    most = max(chunks - sink_frames, 1)
    rows = []
    for c in schemes:
        row = {"scheme": c.name, "origin": c.origin, "counted": "estimate" if c.groups is None else "exact",
               "note": c.note}
        if c.groups is None and c.estimate_bits is None:
            rows.append(row | {"window": None})
            continue
        bytes_at = functools.lru_cache(maxsize=None)(lambda w, c=c: device_bytes(info, c, w, sink_frames))
        w = largest_window(bytes_at, budget, most)
        if w == 0:
            why = ("does not fit: the weights and reserve leave no room" if budget <= 0 else
                   f"does not fit: window 1 needs {bytes_at(1)} B")
            rows.append(row | {"window": 0, "latent_frames": 0, "device_bytes": 0, "host_bytes": None,
                               "note": "; ".join(filter(None, [c.note, why]))})
            continue
        nbytes = bytes_at(w)
        rest = max(chunks - w - sink_frames, 0)
        plan = MemoryPlan(device_budget_bytes=budget, window=w, sink_frames=sink_frames, host_frames=rest,
                          recall="none")
        host, why = host_bytes(info, c, plan, chunks) if rest else (0, "")
        rows.append(row | {"window": w, "latent_frames": (w + sink_frames) * cf, "device_bytes": nbytes,
                           "bits_per_element": bits_per_element(info, nbytes, w, sink_frames),
                           "bytes_per_chunk": bytes_at(w + 1) - nbytes,  # what one more chunk of history costs
                           "plan": plan.label(), "whole_rollout": rest == 0, "host_bytes": host,
                           "note": "; ".join(filter(None, [c.note, why and f"host tier: {why}"]))})
    return {"model": {"source": shape.source, "num_layers": info.num_layers, "num_kv_heads": info.num_kv_heads,
                      "head_dim": info.head_dim, "tokens_per_chunk": info.tokens_per_frame, "chunk_frames": cf,
                      "num_params": shape.num_params},
            "device_budget_bytes": device_budget, "weight_bytes": weights, "reserve_bytes": reserve,
            "cache_budget_bytes": budget, "sink_frames": sink_frames, "rollout_frames": rollout_frames,
            "rollout_chunks": chunks, "rows": rows}


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def markdown(rep: dict, command: str) -> str:
    m = rep["model"]
    lines = [
        "# Capacity: KV cache beside the weights",
        "",
        f"- command: `{command}`",
        f"- model: {m['num_layers']} layers x {m['num_kv_heads']} KV heads x head_dim {m['head_dim']}, "
        f"{m['tokens_per_chunk']} tokens per cache frame (a chunk of {m['chunk_frames']} latent frames); "
        f"{m['num_params']:,} parameters ({m['source']})",
        f"- device {gib(rep['device_budget_bytes'])} GiB - weights {gib(rep['weight_bytes'])} GiB (bf16) - reserve "
        f"{gib(rep['reserve_bytes'])} GiB = cache budget {gib(rep['cache_budget_bytes'])} GiB "
        + (f"(`task=calibrate memory.device_budget={rep['cache_budget_bytes']}` plans under it)"
           if rep["cache_budget_bytes"] > 0 else "(the weights and reserve alone exceed the device: nothing fits)"),
        f"- {rep['sink_frames']} sink chunk(s); rollout of {rep['rollout_frames']} latent frames "
        f"({rep['rollout_chunks']} chunks): what the window leaves out goes to a host tier",
        "- bytes from the memory model (`memory.predicted_cache_bytes`, equal to the runtime's packed tensors); "
        "text encoder, VAE, activations and the CUDA context are not counted (`capacity.reserve`)",
        "",
        "| scheme | bits/elem | MiB per chunk | window (chunks) | latent frames on device | device GiB | "
        "host GiB for the rest | counted | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rep["rows"]:
        if r.get("window") is None:
            lines.append(f"| {r['scheme']} | - | - | - | - | - | - | - | {r['note']} |")
            continue
        frames = f"{r['latent_frames']}" + (" (whole rollout)" if r.get("whole_rollout") else "")
        bits = f"{r['bits_per_element']:.2f}" if "bits_per_element" in r else "-"
        per = f"{r['bytes_per_chunk'] / 2**20:.1f}" if "bytes_per_chunk" in r else "-"
        lines.append(f"| {r['scheme']} | {bits} | {per} | {r['window']} | {frames} | {gib(r['device_bytes'])} | "
                     f"{gib(r['host_bytes'])} | {r['counted']} | {r['note']} |")
    return "\n".join(lines) + "\n"


def run_capacity(cfg, out_dir: Path) -> dict:
    """capacity.json and capacity.md in the run dir; the table on stdout."""
    device = byte_count(cfg.memory.device_budget)
    shape = model_shape(cfg)
    schemes = schemes_to_count(shape.info, cfg.recipe)
    rep = capacity(shape, device, cfg.capacity.reserve_bytes(), cfg.model.cache.sink_frames,
                   cfg.capacity.rollout_frames, schemes)
    md = markdown(rep, "python -m calibrate " + " ".join(sys.argv[1:]))
    write_text_atomic(out_dir / "capacity.json", json.dumps(rep, indent=2, sort_keys=True, allow_nan=False) + "\n")
    write_text_atomic(out_dir / "capacity.md", md)
    print(md)
    return {"capacity": str(out_dir / "capacity.json"), "cache_budget_bytes": rep["cache_budget_bytes"]}


__all__ = ["Counted", "Group", "Shape", "capacity", "device_bytes", "largest_window", "markdown", "model_shape", "run_capacity",
           "schemes_to_count"]

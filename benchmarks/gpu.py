"""The fast runtime on one GPU: a Wan2.1-1.3B-shaped model (random weights) in bfloat16, float vs recipe caches.

    python -m benchmarks.gpu [--chunks 8] [--window 4] [--out artifacts/benchmarks]

Builds diffusers' `WanTransformer3DModel` with Wan2.1-T2V-1.3B's shape (30 layers, 12 heads x 128,
ffn 8960, text 4096, 16 latent channels, patches 1x2x2) from random weights directly on the GPU,
in bfloat16, behind the project's adapter (`adapters/wan_diffusers.py`: 60 x 104 latents = 1560
tokens per latent frame, chunks of 3 latent frames = one cache frame of 4680 tokens). Then:

1. equivalence on CUDA: three clean chunks through the cache, chunk by chunk, against one uncached
   diffusers forward with the cache's block-causal mask (the float cache, and the fast runtime with
   the float16 recipe), max |difference| relative to the output's scale;
2. a predictive recipe fitted (`benchmarks/predictive_fit.py`, 2.5 bits per component, keys before
   the rotary) on two chunks of the float rollout;
3. the compiler itself on this model (`calibration.fit`, every fit setting at its default): a replay of
   `--calib-trajectories` trajectories of `--chunks` chunks, the bounded trace, the streaming
   objective and the mixed-precision search on the GPU (no closed-loop selection: off by default); wall time and
   peak `torch.cuda.max_memory_allocated` per phase, the trace's bytes, bits per element;
4. rollouts of `--chunks` chunks (4 denoising passes + 1 clean pass each) with window `--window` +
   1 sink through: the float cache (`KVCache`), the float16 recipe, naive2, kivi2, the predictive
   recipe and the recipe calibrated in step 3 on the fast runtime (compiled decode, bfloat16
   attention): ms per chunk, peak `torch.cuda.max_memory_allocated`, KV bytes measured (= predicted),
   and the rollout's distance to the float cache's.

Writes gpu.md and gpu.json. Sized for one H200 in well under 10 minutes. Without a CUDA device it
prints one line and exits 2.

    python -m benchmarks.gpu --cpu-smoke [--out DIR]

runs the same steps on the CPU with the adapter's tiny random Wan (2 layers, 16 x 16 latents), in
bfloat16, with the decode uncompiled: a check of this script's plumbing where no GPU is lent (its
numbers measure nothing); it writes gpu_smoke.md and gpu_smoke.json (tests/test_gpu_script.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
GIB = 2**30


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        print("no CUDA device: benchmarks.gpu needs one GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(2)
    return torch.device("cuda")


class Clock:
    """Synchronization and peak memory of the device the script runs on (the CPU smoke run has neither)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "CPU (smoke run: no measurement)"


def build(device: torch.device, settings, smoke: bool):
    import diffusers

    from calibrate.adapters import wan_diffusers as wan

    if smoke:
        model = wan.tiny_transformer().to(torch.bfloat16)
        text = wan.load_text_embedding(None, model.config.text_dim)
        return wan.WanAdapter(model, settings, text)
    torch.manual_seed(0)
    with torch.device(device):
        model = diffusers.WanTransformer3DModel(**WAN_1_3B)
    model = model.to(torch.bfloat16)
    text = torch.randn(64, WAN_1_3B["text_dim"], generator=torch.Generator().manual_seed(1))
    return wan.WanAdapter(model, settings, text, name="wan2.1-1.3b-shaped (random weights)")


class PhaseMeter(logging.Handler):
    """Wall time and peak device memory of every phase the compiler logs (calibration.phase)."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock, self.phases, self._start = clock, {}, {}

    def emit(self, record: logging.LogRecord) -> None:
        name, event = getattr(record, "phase", None), getattr(record, "event", None)
        if event == "start":
            self.clock.sync()
            self.clock.reset_peak()
            self._start[name] = time.perf_counter()
        elif event == "end":
            self.clock.sync()
            self.phases[name] = {"seconds": time.perf_counter() - self._start[name], "peak_gib": self.clock.peak() / GIB}


def calibrate_on_device(adapter, device, clock: Clock, chunks: int, window: int, trajectories: int):
    """`calibration.fit` on this model and device, every fit setting at its default: (measurements, recipe)."""
    from dataclasses import replace

    from calibrate import calibration, trace
    from calibrate.config import CacheConfig, Config, TrajectoriesConfig, validate

    cfg = Config(task="calibrate", device=str(device))
    cfg.model.name, cfg.model.wan, cfg.model.cache = "wan_diffusers", adapter.cfg, CacheConfig(window=window, sink_frames=1)
    n = adapter.cfg.chunk_frames * chunks
    cfg.trajectories = TrajectoriesConfig(num_trajectories=trajectories, num_frames=n, batch_size=trajectories)
    cfg.fit = replace(cfg.fit, closed_loop_frames=n, closed_loop_trajectories=1)
    cfg.check.num_frames, cfg.check.num_trajectories = n, 1
    validate(cfg)
    meter = PhaseMeter(clock)
    logger = logging.getLogger("calibrate.calibration")
    logger.addHandler(meter)
    logger.setLevel(logging.INFO)
    sizes = {}
    allocate = trace.Trace._allocate

    def measured_allocate(self, A):
        allocate(self, A)
        sizes.update(trace_gib=self.nbytes() / GIB, trace_slots=self.plan.num_slots)
    trace.Trace._allocate = measured_allocate
    t0 = time.perf_counter()
    try:
        recipe, record = calibration.fit(cfg, adapter, device)
    finally:
        trace.Trace._allocate = allocate
        logger.removeHandler(meter)
    return {"seconds": time.perf_counter() - t0, "phases": meter.phases, **sizes,
            "bits_per_element": record["bits_per_element"], "upgrades": len(record["upgrades"]),
            "closed_loop": record.get("closed_loop", {}).get("chosen", "off"), "trajectories": trajectories, "chunks": chunks}, recipe


def equivalence(adapter, device, caches: dict) -> dict:
    """max |cached - uncached| / max |uncached| over three clean chunks, per cache."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from calibrate.cache import block_mask

    cf = adapter.cfg.chunk_frames
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, adapter.channels, 3 * cf, adapter.cfg.latent_height, adapter.cfg.latent_width, generator=g).to(device)
    per_chunk = adapter.info.tokens_per_frame
    mask = block_mask(3, per_chunk, 2, 1).to(device)

    class Masked:
        def __init__(self):
            self.inner = WanAttnProcessor()

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            return self.inner(attn, hidden_states, None, mask, rotary_emb)

    model = adapter.transformer
    saved = model.attn_processors
    model.set_attn_processor({n: Masked() if ".attn1." in n else WanAttnProcessor() for n in saved})
    with torch.no_grad():
        text = adapter.text.to(device, adapter.dtype)[None]
        ref = model(latents.to(adapter.dtype), torch.zeros(1, device=device), text, return_dict=False)[0].float()
    model.set_attn_processor(saved)
    out = {}
    for name, make in caches.items():
        cache = make(window=2)
        with torch.no_grad():
            got = torch.cat([adapter.forward_chunk(cache, latents[:, :, c * cf:(c + 1) * cf], c * cf, 0.0, True).float()
                             for c in range(3)], dim=2)
        out[name] = float((got - ref).abs().max() / ref.abs().max())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--window", type=int, default=4, help="cache frames (chunks) besides the sink")
    parser.add_argument("--calib-trajectories", type=int, default=2, help="calibration trajectories (step 3)")
    parser.add_argument("--out", type=Path, default=Path("artifacts/benchmarks"))
    parser.add_argument("--cpu-smoke", action="store_true", help="the same steps on the CPU with a tiny Wan (a script check)")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    device = torch.device("cpu") if smoke else require_cuda()
    clock = Clock(device)
    stem = "gpu_smoke" if smoke else "gpu"

    from benchmarks.predictive_fit import MomentCache, Moments, predictive_recipe
    from calibrate.adapters.wan_diffusers import WanSettings
    from calibrate.cache import KVCache
    from calibrate.fastcache import FastKVCache
    from calibrate.io import write_text_atomic
    from calibrate.memory import fp16_cache_bytes
    from calibrate.schemes import build_baseline
    from calibrate.world.trajectories import make_trajectories

    torch.backends.cuda.matmul.allow_tf32 = True
    t_start = time.perf_counter()
    settings = WanSettings(chunk_frames=3, latent_height=16 if smoke else 60, latent_width=16 if smoke else 104,
                           dtype="bfloat16")
    adapter = build(device, settings, smoke)
    info = adapter.info
    L, W, S = info.num_layers, args.window, 1
    fast = dict(device=device, compute_dtype=torch.bfloat16, workspace_bytes=2 * GIB)

    def fast_cache(recipe, compile_backend):
        def make(window=W):
            return FastKVCache.from_recipe(recipe, window, S, compile=compile_backend, **fast)
        return make

    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": clock.name(),
           "torch": torch.__version__, "model": info.name, "tokens_per_cache_frame": info.tokens_per_frame,
           "window_chunks": W, "sink_chunks": S, "chunks": args.chunks}
    fp16 = build_baseline("fp16", info)
    res["equivalence_rel_max"] = equivalence(adapter, device, {"KVCache (float32)": lambda window: KVCache(L, window, S),
                                                               "fast, fp16 recipe": fast_cache(fp16, None)})
    print(json.dumps(res["equivalence_rel_max"]), flush=True)

    trajs = make_trajectories(["orbit"], "evaluation", 1, 3 * args.chunks, 0)
    moments = Moments(L)
    with torch.no_grad():
        adapter.rollout(make_trajectories(["orbit"], "calibration", 1, 6, 0), MomentCache(L, W, S, moments, True), device)
    res["calibrate"], calibrated = calibrate_on_device(adapter, device, clock, args.chunks, W, args.calib_trajectories)
    print(json.dumps(res["calibrate"]), flush=True)
    recipes = {"fp16": fp16, "naive2": build_baseline("naive2", info), "kivi2": build_baseline("kivi2", info),
               "predictive 2.5 bits": predictive_recipe(info, moments, 2.5, rotary_coords=1),
               "calibrated here": calibrated}
    rows, ref_frames = [], None
    caches = {"KVCache (float32, the model's own)": lambda: KVCache(L, W, S)}
    for name, recipe in recipes.items():
        compiled = "inductor" if recipe.scheme.layers[0].k.kind == "predictive" and not smoke else None
        caches[f"fast, {name}"] = fast_cache(recipe, compiled)
    for name, make in caches.items():
        clock.reset_peak()
        base = clock.allocated()
        cache = make()
        try:
            with torch.no_grad():
                adapter.rollout(trajs[:1], cache, device)  # warm-up (compilation)
                cache = make()
                clock.sync()
                clock.reset_peak()
                t0 = time.perf_counter()
                frames = adapter.rollout(trajs, cache, device)
                clock.sync()
        except Exception as e:  # a compile failure on this machine: say so, run uncompiled
            if "predictive" not in name:
                raise
            print(f"{name}: compiled decode failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); running eager",
                  flush=True)
            cache = fast_cache(recipes["predictive 2.5 bits"], None)()
            clock.reset_peak()
            t0 = time.perf_counter()
            with torch.no_grad():
                frames = adapter.rollout(trajs, cache, device)
            clock.sync()
            name += " (eager decode)"
        ms = (time.perf_counter() - t0) * 1e3 / args.chunks
        row = {"cache": name, "ms_per_chunk": ms, "peak_gib": (clock.peak() - base) / GIB,
               "kv_gib": cache.nbytes() / GIB}
        if hasattr(cache, "predicted_nbytes"):
            row["kv_bytes_equal_predicted"] = cache.nbytes() == cache.predicted_nbytes(args.chunks)
        if ref_frames is None:
            ref_frames = frames
        row["rollout_rel_rmse_vs_float"] = float((frames - ref_frames).pow(2).mean().sqrt() / ref_frames.pow(2).mean().sqrt())
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cache, frames
    res["rows"] = rows
    res["fp16_kv_gib"] = fp16_cache_bytes(info, args.chunks, W, S) / GIB
    res["seconds"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / f"{stem}.json", json.dumps(res, indent=2) + "\n")
    lines = [f"# Fast runtime on {res['device']}: {info.name}, bfloat16", "",
             f"- date: {res['date']}; command: `python -m benchmarks.gpu --chunks {args.chunks} --window {W}"
             f"{' --cpu-smoke' if smoke else ''}`; torch {res['torch']}",
             f"- {info.num_layers} layers x {info.num_kv_heads} heads x {info.head_dim}; {info.tokens_per_frame} tokens per "
             f"cache frame (3 latent frames of {settings.latent_height} x {settings.latent_width} latents); window {W} "
             f"chunks + {S} sink; {args.chunks} chunks of "
             "4 denoising + 1 clean pass; peak = max_memory_allocated above the weights",
             "- cached vs uncached (3 clean chunks, block-causal mask), max |diff| / max |out|: "
             + ", ".join(f"{k} {v:.2e}" for k, v in res["equivalence_rel_max"].items()), "",
             f"## The compiler on this device (`calibration.fit`, default fit settings, {args.calib_trajectories} "
             f"trajectories x {args.chunks} chunks)", "",
             f"{res['calibrate']['seconds']:.0f} s in all; trace {res['calibrate'].get('trace_gib', 0):.2f} GiB "
             f"({res['calibrate'].get('trace_slots', 0)} token slots per frame); "
             f"{res['calibrate']['bits_per_element']:.3f} bits/element; {res['calibrate']['upgrades']} upgrades; "
             f"closed-loop selection: {res['calibrate']['closed_loop']}", "",
             "| phase | seconds | peak GiB |", "|---|---:|---:|",
             *[f"| {k} | {v['seconds']:.1f} | {v['peak_gib']:.2f} |" for k, v in res["calibrate"]["phases"].items()], "",
             "| cache | ms / chunk | peak GiB | KV GiB | KV bytes = predicted | rollout rel. RMSE vs float cache |",
             "|---|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['ms_per_chunk']:.0f} | {r['peak_gib']:.2f} | {r['kv_gib']:.3f} | "
                     f"{r.get('kv_bytes_equal_predicted', '-')} | {r['rollout_rel_rmse_vs_float']:.3g} |")
    lines += ["", f"float16 K/V of the same frames: {res['fp16_kv_gib']:.3f} GiB. Total {res['seconds']:.0f} s.", ""]
    write_text_atomic(args.out / f"{stem}.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""KV-cache memory of the real Wan-2.1 1.3B causal models, computed from their configuration.

    python -m benchmarks.wan_memory [--out artifacts/benchmarks]

No weights are needed: the runtime predicts a cache's bytes from a recipe and the model's shape
alone (`memory.predicted_cache_bytes`, which a test checks equals the bytes measured from the
packed tensors). Shape of Wan2.1-T2V-1.3B (and its causal fine-tunes Self-Forcing, CausVid):
30 layers x 12 heads x head_dim 128; a 480x832 video is 60x104 latents, patches 1x2x2, so
1560 tokens per latent frame; chunks of 3 latent frames (one cache frame = 4680 tokens).
For the calibration-free baselines the bytes come from their actual recipes; a fitted recipe
holds at most `fit.budget_bits` bits per element by construction (its budget counts every
per-frame byte). Writes `wan_memory.md` and `wan_memory.json`.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

from calibrate.io import write_text_atomic
from calibrate.recipe import ModelInfo
from calibrate.memory import fp16_cache_bytes, predicted_cache_bytes
from calibrate.schemes import build_baseline

WAN_1_3B = ModelInfo(name="wan2.1-t2v-1.3b", num_layers=30, num_kv_heads=12, head_dim=128,
                     tokens_per_frame=3 * 1560, fingerprint="(config only)")
WINDOWS = (1, 4, 7, 12)  # cache frames (chunks of 3 latent frames) besides the sink; 7 chunks = 21 latent frames
SCHEMES = ("fp16", "naive2", "kivi2", "kivi4", "quarot2")
BUDGET_BITS = 2.5
GIB = 2**30


def table(info: ModelInfo, windows=WINDOWS, sink: int = 1) -> list[dict]:
    rows = []
    recipes = {name: build_baseline(name, info) for name in SCHEMES}
    for w in windows:
        frames = w + sink + 8  # a rollout long enough that eviction has reached steady state
        fp16 = fp16_cache_bytes(recipes["fp16"].model, frames, w, sink)
        row = {"window_chunks": w, "latent_frames_cached": 3 * (w + sink), "fp16_gib": fp16 / GIB,
               "fitted_2.5bit_gib": fp16 * BUDGET_BITS / 16 / GIB}
        for name, recipe in recipes.items():
            if name != "fp16":
                row[f"{name}_gib"] = predicted_cache_bytes(recipe.model, recipe.scheme, frames, w, sink) / GIB
        rows.append(row)
    return rows


def markdown(rows: list[dict], info: ModelInfo) -> str:
    cols = [c for c in rows[0] if c.endswith("_gib")]
    lines = [
        "# KV-cache memory of Wan2.1-T2V-1.3B (batch 1), from its configuration",
        "",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        "- command: `python -m benchmarks.wan_memory --out artifacts/benchmarks`",
        f"- shape: {info.num_layers} layers x {info.num_kv_heads} heads x head_dim {info.head_dim}; "
        f"{info.tokens_per_frame} tokens per cache frame (a chunk of 3 latent frames of 1560 tokens, 480x832 video); "
        "1 sink chunk",
        "- bytes of the baselines from their recipes (`memory.predicted_cache_bytes`, equal to the packed tensors' "
        "bytes); the fitted recipe at its budget of 2.5 bits/element",
        "",
        "| window (chunks) | latent frames cached | " + " | ".join(c.removesuffix("_gib") + " GiB" for c in cols) + " |",
        "|---:|---:|" + "---:|" * len(cols),
    ]
    for r in rows:
        lines.append(f"| {r['window_chunks']} | {r['latent_frames_cached']} | "
                     + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    lines += ["", "Per latent frame the fp16 cache holds 2 x 30 x 12 x 128 x 1560 x 2 B = "
              f"{2 * 30 * 12 * 128 * 1560 * 2 / 2**20:.1f} MiB. For scale, the 1.3 B-parameter model itself is about 2.4 GiB in bf16.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/benchmarks"))
    args = parser.parse_args()
    rows = table(WAN_1_3B)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "wan_memory.json", json.dumps({"model": WAN_1_3B.name, "rows": rows}, indent=2) + "\n")
    md = markdown(rows, WAN_1_3B)
    write_text_atomic(args.out / "wan_memory.md", md)
    print(md)


if __name__ == "__main__":
    main()

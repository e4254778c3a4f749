"""task=train_world: train TinyWorld, or WanWorld with model=wanworld, into the run directory
(resuming from its checkpoint when one is there); the weights to ship are printed."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from calibrate.config import Config


def run_train_world(cfg: Config, out_dir: Path) -> dict:
    """Train TinyWorld (or WanWorld, model=wanworld) into `out_dir` (resumes from its checkpoint when one is there)."""
    if cfg.model.name == "wanworld":
        from calibrate.wanworld.train import sampler, train as train_wan
        from calibrate.wanworld.weights import save_weights as save_wan

        model = train_wan(cfg.train_wan, out_dir, resume=True)
        path = out_dir / "wanworld.safetensors"
        save_wan(model, path, sampler(cfg.train_wan, model), {"train_config": asdict(cfg.train_wan)})
        print(f"weights: {path} (copy to artifacts/models/wanworld.safetensors to ship them)")
        return {"weights": str(path)}
    from calibrate.world.train import train
    from calibrate.world.weights import save_weights

    model = train(cfg.train, out_dir, resume=True)
    path = out_dir / "tinyworld.safetensors"
    save_weights(model, path, {"train_config": asdict(cfg.train)})
    print(f"weights: {path} (copy to artifacts/models/tinyworld.safetensors to ship them)")
    return {"weights": str(path)}

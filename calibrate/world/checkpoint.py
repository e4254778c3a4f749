"""Resumable training, shared by both models' trainers (world/train.py, wanworld/train.py).

A checkpoint is one safetensors file, written atomically: the model's tensors (`model.*`), AdamW's
moments (`optim.<param>.exp_avg`, `.exp_avg_sq`), and in the metadata the step, the model and
training configs, each parameter's AdamW step and the loss log. Loading restores the model and
the optimizer so that a resumed run takes the same steps as an uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from calibrate.io import safetensors_bytes, write_bytes_atomic


def self_forcing_share(step: int, cfg) -> float:
    """The share of batches trained on the model's own rollout at `step` (0, then a ramp to the max)."""
    if step < cfg.self_forcing_start:
        return 0.0
    return cfg.self_forcing_max * min(1.0, (step - cfg.self_forcing_start + 1) / max(1, cfg.self_forcing_ramp))


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float) -> float:
    """One AdamW step on `loss` at learning rate `lr`, gradients clipped to norm 1; the loss as a float."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def save_checkpoint(path: Path, model, opt, step: int, losses: list, cfg, fmt: str) -> None:
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    opt_steps = {}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                tensors[f"optim.{names[p]}.exp_avg"] = state["exp_avg"].contiguous()
                tensors[f"optim.{names[p]}.exp_avg_sq"] = state["exp_avg_sq"].contiguous()
                opt_steps[names[p]] = float(state["step"])
    meta = {"format": fmt, "step": str(step), "model_config": json.dumps(model.cfg.to_dict()),
            "train_config": json.dumps(asdict(cfg)), "optim_steps": json.dumps(opt_steps), "losses": json.dumps(losses)}
    write_bytes_atomic(path, safetensors_bytes(tensors, meta))


def checkpoint_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def load_checkpoint(path: Path, model, opt) -> tuple[int, list]:
    """Restore `model` and `opt` from `path`: (the step to continue from, the loss log)."""
    meta = checkpoint_metadata(path)
    tensors = load_file(str(path))
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    opt_steps = json.loads(meta["optim_steps"])
    for name, p in model.named_parameters():
        if name in opt_steps:
            opt.state[p] = {"step": torch.tensor(opt_steps[name]), "exp_avg": tensors[f"optim.{name}.exp_avg"],
                            "exp_avg_sq": tensors[f"optim.{name}.exp_avg_sq"]}
    return int(meta["step"]), json.loads(meta["losses"])

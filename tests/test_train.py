"""TinyWorld training: the loss decreases on a tiny config, a resumed run equals an uninterrupted
one, and the clip mix follows the config."""

import pytest
import torch

from calibrate.world.model import TinyWorld, TinyWorldConfig
from calibrate.world.train import ClipSource, TrainConfig, frame_loss, load_init_weights, train
from calibrate.world.trajectories import SEED_RANGES, make_trajectory
from calibrate.world.weights import save_weights

TINY_MODEL = dict(dim=64, num_layers=1, num_heads=1, rope_xy_pairs=4, rope_bearing_pairs=8)


def tiny(**overrides) -> TrainConfig:
    base = dict(steps=40, batch_size=4, clip_frames=4, new_per_step=2, replay_steps=5, warmup_steps=5, lr=3e-3,
                self_forcing_start=1000, checkpoint_every=5, num_threads=1, model=TINY_MODEL)
    return TrainConfig(**{**base, **overrides})


def losses(out_dir) -> list[float]:
    import json

    return [json.loads(line)["loss"] for line in (out_dir / "loss.jsonl").read_text().splitlines()]


def test_loss_decreases_on_a_tiny_config(tmp_path):
    train(tiny(), tmp_path)
    log = losses(tmp_path)
    assert len(log) == 40
    assert sum(log[-8:]) / 8 < 0.8 * sum(log[:8]) / 8


def test_resumed_training_equals_uninterrupted(tmp_path):
    cfg = tiny(steps=8, self_forcing_start=2, self_forcing_ramp=2)  # self-forced batches included
    whole = train(cfg, tmp_path / "whole")
    train(tiny(steps=5, self_forcing_start=2, self_forcing_ramp=2), tmp_path / "split")  # "interrupted" at 5
    resumed = train(cfg, tmp_path / "split")  # continues from the step-5 checkpoint
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert losses(tmp_path / "whole") == losses(tmp_path / "split")


def test_clip_mix_follows_the_config():
    source = ClipSource(tiny(revisit_share=0.0, motion_families=["dolly"]))
    lo, hi = SEED_RANGES["train"]
    for clip_id in range(6):
        _, poses, _ = source.clip(clip_id)
        assert torch.equal(poses, make_trajectory("dolly", lo + clip_id % (hi - lo), 4).poses)


def test_a_stage_starts_from_init_weights_and_new_heads_keep_their_init(tmp_path):
    """Weights trained before a head existed load; the missing head keeps its (zero) init."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    trained = TinyWorld(TinyWorldConfig(**TINY_MODEL))
    for p in trained.parameters():
        torch.nn.init.normal_(p, std=0.02)
    save_weights(trained, tmp_path / "full.safetensors")
    older = {k: v for k, v in load_file(tmp_path / "full.safetensors").items() if not k.startswith("patch_out.")}
    save_file(older, tmp_path / "older.safetensors")  # as if patch_out had been added since

    fresh = TinyWorld(TinyWorldConfig(**TINY_MODEL))
    assert load_init_weights(fresh, tmp_path / "older.safetensors") == ["patch_out.bias", "patch_out.weight"]
    for name, t in fresh.state_dict().items():
        expected = torch.zeros_like(t) if name.startswith("patch_out.") else trained.state_dict()[name]
        assert torch.equal(t, expected), name

    # lr 0: the stage's model is exactly the init weights (the optimizer is fresh, nothing moves)
    model = train(tiny(steps=2, lr=0.0, init_weights=str(tmp_path / "older.safetensors")), tmp_path / "stage")
    assert torch.equal(model.blocks[0].qkv.weight, trained.blocks[0].qkv.weight)


def test_init_weights_of_another_architecture_name_the_tensor(tmp_path):
    save_weights(TinyWorld(TinyWorldConfig(**{**TINY_MODEL, "dim": 128, "num_heads": 2})), tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match=r"w.safetensors: tensor '.*' has shape"):
        load_init_weights(TinyWorld(TinyWorldConfig(**TINY_MODEL)), tmp_path / "w.safetensors")


def test_log_mse_loss_is_minus_the_mean_per_frame_psnr():
    """Hand-computed: frames off by 0.1 and by 0.001 everywhere have MSE 1e-2 and 1e-6."""
    target = torch.zeros(1, 2, 3, 4, 4)
    pred = target.clone()
    pred[0, 0] += 0.1
    pred[0, 1] += 0.001
    cfg = tiny(loss="log_mse", log_mse_eps=1e-4)
    expected = (10 * torch.log10(torch.tensor(1e-2 + 1e-4)) + 10 * torch.log10(torch.tensor(1e-6 + 1e-4))) / 2
    assert frame_loss(pred, target, cfg).item() == pytest.approx(expected.item(), rel=1e-5)
    assert frame_loss(pred, target, tiny()).item() == pytest.approx((1e-2 + 1e-6) / 2, rel=1e-5)  # plain MSE

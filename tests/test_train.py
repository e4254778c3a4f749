"""TinyWorld training: the loss decreases on a tiny config, a resumed run equals an uninterrupted
one, and the clip mix follows the config."""

import torch

from calibrate.world.train import ClipSource, TrainConfig, train
from calibrate.world.trajectories import SEED_RANGES, make_trajectory

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

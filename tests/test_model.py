import pytest
import torch

from calibrate.cache import KVCache
from calibrate.world.model import TinyWorld, TinyWorldConfig, block_mask, warp
from calibrate.world.rollout import rollout

from toys import TINY_WORLD


def _clip(B=2, N=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    frames = torch.rand(B, N, 3, 32, 32, generator=g)
    poses = torch.cumsum(torch.randn(B, N, 3, generator=g) * 0.1, dim=1) + torch.tensor([4.0, 4.0, 0.0])
    actions = torch.randn(B, N, 3, generator=g) * 0.1
    return frames, poses, actions


def _model(seed=0):
    torch.manual_seed(seed)
    model = TinyWorld(TINY_WORLD).eval()
    # the output heads start at zero; give them weights so the test sees every layer and the warp
    torch.nn.init.normal_(model.patch_out.weight, std=0.02)
    torch.nn.init.normal_(model.flow_out.weight, std=0.05)
    return model


def test_block_mask_mirrors_cache_policy():
    m = block_mask(num_steps=6, tokens_per_frame=1, window=2, sink_frames=1)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 0, 1, 1, 0, 0],
            [1, 0, 0, 1, 1, 0],
            [1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, expected)


def test_shapes():
    model = _model()
    frames, poses, actions = _clip()
    pred = model(frames, poses, actions, window=16, sink_frames=1)
    assert pred.shape == (2, 6, 3, 32, 32)
    assert TINY_WORLD.tokens_per_frame == 16 and TINY_WORLD.head_dim == 64


@pytest.mark.parametrize("window, sink", [(16, 1), (3, 1), (2, 0)])
def test_parallel_forward_equals_cached_steps(window, sink):
    """Training (masked, parallel) and rollout (through the cache) compute the same function."""
    model = _model()
    frames, poses, actions = _clip()
    parallel = model(frames, poses, actions, window=window, sink_frames=sink)
    cache = KVCache(TINY_WORLD.num_layers, window=window, sink_frames=sink)
    stepped = [
        model.step(cache, frames[:, t - 1], poses[:, t - 1], poses[:, t], actions[:, t])
        for t in range(1, frames.shape[1])
    ]
    torch.testing.assert_close(torch.stack(stepped, 1), parallel, atol=2e-5, rtol=1e-4)


def test_rollout_deterministic_and_uses_cache():
    model = _model()
    frames, poses, actions = _clip(N=10)
    run = lambda w: rollout(model, KVCache(TINY_WORLD.num_layers, w, 1), frames[:, 0], poses, actions)
    a, b = run(16), run(16)
    assert torch.equal(a, b)
    assert a.shape == frames.shape and torch.equal(a[:, 0], frames[:, 0])
    assert not torch.equal(a, run(1)), "cache contents must influence the output"


# ---- the warp readout ---------------------------------------------------------------------------
def test_zero_flow_is_exactly_the_identity():
    frames = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(warp(frames, torch.zeros(2, 2, 16, 16)), frames)


def test_whole_pixel_flow_shifts_and_pads_with_the_border():
    frames = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    right = warp(frames, torch.tensor([1.0, 0.0]).view(1, 2, 1, 1).expand(1, 2, 4, 4))  # sample one column right
    assert torch.allclose(right[..., :-1], frames[..., 1:], atol=1e-6)
    assert torch.allclose(right[..., -1], frames[..., -1], atol=1e-6)  # border padding
    up = warp(frames, torch.tensor([0.0, -2.0]).view(1, 2, 1, 1).expand(1, 2, 4, 4))  # two rows up
    assert torch.allclose(up[..., 2:, :], frames[..., :-2, :], atol=1e-6)


def test_half_pixel_flow_averages_neighbours():
    """Hand-computed: a ramp 0, 1, 2, ... sampled half a pixel to the right reads 0.5, 1.5, ..."""
    ramp = torch.arange(8.0).view(1, 1, 1, 8).expand(1, 3, 8, 8)
    out = warp(ramp, torch.tensor([0.5, 0.0]).view(1, 2, 1, 1).expand(1, 2, 8, 8))
    assert torch.allclose(out[0, 0, 0], torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.0]), atol=1e-6)


def test_untrained_model_copies_the_newest_frame():
    """Both heads start at zero, so before training the prediction is the input frame."""
    torch.manual_seed(0)
    model = TinyWorld(TINY_WORLD).eval()
    frames, poses, actions = _clip()
    pred = model(frames, poses, actions, window=16, sink_frames=1)
    assert torch.equal(pred, frames[:, :-1])


def test_flow_stride_must_divide_the_patch():
    with pytest.raises(ValueError, match="flow_stride"):
        TinyWorldConfig(flow_stride=3)

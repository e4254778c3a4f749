"""Every baseline of schemes.py runs end to end on the shipped TinyWorld through the one runtime,
with exact byte accounting; plus KIVI's per-channel 2-bit arithmetic checked against hand-computed codes."""

import pytest
import torch

from calibrate.adapters import as_world
from calibrate.codec import HeadParams, decode, encode, fake_quant
from calibrate.memory import fp16_cache_bytes
from calibrate.pipeline import kv_sample
from calibrate.quant.packing import unpack
from calibrate.recipe import TensorSpec
from calibrate.replay import Recorder, record, rollout_batch
from reference_runtime import ReferenceCache
from calibrate.schemes import BASELINES, CALIBRATED, build_baseline
from calibrate.world.trajectories import make_trajectories
from calibrate.world.weights import load_weights

WINDOW, SINK, FRAMES = 16, 1, 24
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world():
    """Model, its info, a 2-trajectory batch with ground truth, and a small calibration sample."""
    model = load_weights()
    info = as_world(model).info
    trajs = make_trajectories(["orbit", "stress"], "evaluation", 2, FRAMES)
    recorder = Recorder.create(info, sample_tokens=256, seed=0)
    record(as_world(model), make_trajectories(["orbit", "pan"], "calibration", 2, 8), recorder, WINDOW, SINK, CPU)
    return model, info, trajs, as_world(model).ground_truth(trajs, CPU), kv_sample(recorder)


def test_calibration_sample_shape(world):
    _, info, _, _, sample = world
    assert sample.k_LHND.shape[:2] == (info.num_layers, info.num_kv_heads)
    assert sample.k_LHND.shape == sample.v_LHND.shape and sample.k_LHND.shape[-1] == info.head_dim
    assert sample.k_LHND.shape[2] > 0 and torch.isfinite(sample.k_LHND).all()


@pytest.mark.parametrize("name", BASELINES)
def test_baseline_runs_end_to_end(world, name):
    model, info, trajs, truth, sample = world
    recipe = build_baseline(name, info, sample)
    cache = ReferenceCache.from_recipe(recipe, window=WINDOW, sink_frames=SINK)
    frames, _ = rollout_batch(as_world(model), trajs, cache, CPU, truth=truth)
    assert frames.shape == truth.shape
    assert torch.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    n = cache.num_frames_seen
    assert n == FRAMES - 1  # frame 0 is given; frames 1..N-1 are generated, one append each
    measured = cache.nbytes()
    assert measured == cache.predicted_nbytes(n, batch=len(trajs))
    ratio = measured / fp16_cache_bytes(recipe.model, n, WINDOW, SINK, batch=len(trajs))
    if name == "fp16":
        assert ratio == 1.0
    else:
        assert ratio < 1.0
    if name in ("naive2", "quarot2"):  # 2-bit with no full-precision window: ~1/8 plus parameters
        assert 1 / 8 < ratio < 1 / 6, ratio


def test_calibrated_baselines_need_a_sample(world):
    _, info, *_ = world
    for name in CALIBRATED:
        with pytest.raises(ValueError, match="calibration data"):
            build_baseline(name, info)


def test_kivi_per_channel_2bit_codes_by_hand():
    # K of one head: T = 4 tokens, D = 2 channels; KIVI keys are per channel, asymmetric min/max,
    # scale = (max - min) / (2^2 - 1), zero = min, code = round_half_even((x - min) / scale).
    #   channel 0: [-1, 0.5, 2, 0.25]: min -1, max 2 -> scale 1, zero -1
    #              (x + 1) / 1 = 0, 1.5, 3, 1.25   -> codes 0, 2, 3, 1   (1.5 rounds to 2)
    #   channel 1: [0, 6, 5, 1]:       min 0, max 6  -> scale 2, zero 0
    #              x / 2       = 0, 3, 2.5, 0.5    -> codes 0, 3, 2, 0   (2.5 -> 2, 0.5 -> 0: to even)
    # every value above is exact in float16, so storing the parameters in float16 changes nothing.
    k_BTD = torch.tensor([[[-1.0, 0.0], [0.5, 6.0], [2.0, 5.0], [0.25, 1.0]]])
    expected_codes = torch.tensor([[[0, 0], [2, 3], [3, 2], [1, 0]]], dtype=torch.uint8)
    spec, p = TensorSpec(bits=2, axis="channel"), HeadParams(bits=2)
    stored = encode(k_BTD, spec, p)
    assert torch.equal(unpack(stored["codes"], 2, 2), expected_codes)
    assert stored["p_scale"].flatten().tolist() == [1.0, 2.0] and stored["p_zero"].flatten().tolist() == [-1.0, 0.0]
    assert stored["codes"].shape == (1, 4, 2)  # 2 codes of 2 bits, padded to 8 codes = 2 bytes per token
    _, codes = fake_quant(k_BTD, spec, p)
    assert torch.equal(codes, expected_codes)
    # decode: code * scale + zero
    expected_values = torch.tensor([[[-1.0, 0.0], [1.0, 6.0], [2.0, 4.0], [0.0, 0.0]]])
    assert torch.equal(decode(stored, spec, p, 2), expected_values)

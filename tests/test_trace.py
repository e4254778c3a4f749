"""The fit's bounded trace (calibrate/trace.py): its byte formula, its token sample, and what it holds."""

import pytest
import torch

from calibrate.adapters import as_world
from calibrate.cache import KVCache
from calibrate.replay import Recorder, RecordingCache, record, rollout_batch
from calibrate.trace import LayerTraces, Trace, plan_trace, slot_bytes
from calibrate.types import ModelInfo
from calibrate.world.trajectories import make_trajectories

CPU = torch.device("cpu")
WAN13 = ModelInfo("wan", num_layers=30, num_kv_heads=12, head_dim=128, tokens_per_frame=4680, fingerprint="x")


def test_slot_count_follows_the_formula():
    per_slot = 4 * 40 * (3 * 30 * 12 * 128 * 4 + 4 * 64)  # B' F (3 L H D e + 4 A)
    assert slot_bytes(30, 12, 128, 4, 40, 4) == per_slot
    plan = plan_trace(WAN13, 4, 40, 512, 8 << 30)
    assert plan.num_slots == (8 << 30) // per_slot and plan.nbytes() <= 8 << 30
    assert plan_trace(WAN13, 4, 40, 64, 8 << 30).num_slots == 64  # capped by fit.trace_tokens
    assert plan_trace(WAN13, 1, 2, 10**6, 1 << 40).num_slots == 4680  # every slot when all fit
    bf16 = plan_trace(WAN13, 4, 40, 512, 8 << 30, dtype=torch.bfloat16)
    assert bf16.num_slots > plan.num_slots  # half the bytes per element


def test_slots_are_a_seeded_sorted_sample_without_repeats():
    a, b = plan_trace(WAN13, 4, 40, 100, 1 << 40, seed=3), plan_trace(WAN13, 4, 40, 100, 1 << 40, seed=3)
    assert torch.equal(a.slots_S, b.slots_S)
    assert a.slots_S.unique().numel() == 100 and torch.equal(a.slots_S, a.slots_S.sort().values)
    assert not torch.equal(a.slots_S, plan_trace(WAN13, 4, 40, 100, 1 << 40, seed=4).slots_S)


def test_a_budget_without_one_slot_is_refused_in_one_line():
    with pytest.raises(ValueError, match="fit.trace_bytes") as e:
        plan_trace(WAN13, 4, 40, 512, 1 << 20)
    assert "\n" not in str(e.value)


class _Frames(KVCache):
    """The fp cache keeping every frame's q, pre- and post-rotary k, v and angles (the full trace)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.frames = []

    def observe(self, seen):
        self.frames.append((seen.layer, seen.index, seen.q_BHTD, seen.k_BHTD, seen.k_rot_BHTD, seen.v_BHTD,
                            seen.key_rope.angles_BTA))


@pytest.mark.parametrize("tokens", [16, 5])
def test_trace_holds_the_sampled_slots_of_what_the_cache_saw(tiny_world, tokens):
    world = as_world(tiny_world)
    info = world.info
    trajs = make_trajectories(["orbit", "stress", "pan"], "calibration", 3, 10)
    full = _Frames(info.num_layers, 16, 1)
    rollout_batch(world, trajs, full, CPU)
    plan = plan_trace(info, 2, 6, tokens, 1 << 30, seed=1)
    trace = Trace(plan)
    rollout_batch(world, trajs, RecordingCache(info.num_layers, 16, 1, Recorder.create(info, 64), trace), CPU)
    assert trace.nbytes() == plan.nbytes() == tokens * slot_bytes(info.num_layers, info.num_kv_heads, info.head_dim,
                                                                   2, 6, 4)
    assert trace.num_frames == 6
    s = plan.slots_S
    for layer, index, q, k_pre, k_rot, v, angles in full.frames:
        if index >= 6:
            continue
        lt = trace.layer(layer, 16, 1)
        assert torch.equal(lt.q[:, :, index], q[:2][:, :, s])
        assert torch.equal(lt.k_pre[:, :, index], k_pre[:2][:, :, s])
        assert torch.equal(lt.v[:, :, index], v[:2][:, :, s])
        assert torch.equal(lt.angles[:, index], angles[:2][:, s])
        # keys rotated again from their angles: the rotation the cache applied, up to the last bit of cos/sin
        torch.testing.assert_close(lt.k[:, :, index], k_rot[:2][:, :, s], atol=1e-6, rtol=1e-6)
    assert len(LayerTraces(trace, 16, 1)) == info.num_layers
    assert LayerTraces(trace, 16, 1, trajectories=1)[0].q.shape[0] == 1


def _traced(world, trajs, batch_size: int, trajectories: int):
    plan = plan_trace(world.info, trajectories, 6, 5, 1 << 30, seed=1)
    return record(world, trajs, Recorder.create(world.info, 64, plan), 16, 1, CPU, batch_size).traces[0]


def test_the_trace_spans_replay_batches_row_by_row(tiny_world):
    """The first trajectories fill the trace whichever batches they replay in: each row holds
    exactly what replaying its trajectory's own batch records (batches of 2 + 1, and of 1)."""
    world = as_world(tiny_world)
    trajs = make_trajectories(["orbit", "stress", "pan"], "calibration", 3, 10)
    pair = _traced(world, trajs[:2], 2, 2)
    alone = [_traced(world, [t], 1, 1) for t in trajs]
    for batch_size, expected in ((2, [(pair, 0), (pair, 1), (alone[2], 0)]), (1, [(a, 0) for a in alone])):
        trace = _traced(world, trajs, batch_size, 3)
        assert trace.num_frames == 6 and trace.q[0].shape[0] == 3
        for layer in range(world.info.num_layers):
            for row, (ref, r) in enumerate(expected):
                for name in ("q", "k_pre", "v"):
                    assert torch.equal(getattr(trace, name)[layer][row], getattr(ref, name)[layer][r]), (batch_size, row)
                assert torch.equal(trace.angles[row], ref.angles[r])
    two = _traced(world, trajs, 1, 2)  # trajectories past the trace's are replayed, not traced
    assert two.q[0].shape[0] == 2 and torch.equal(two.v[1][1], alone[1].v[1][0])

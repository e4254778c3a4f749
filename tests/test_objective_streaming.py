"""The streaming objective (fit/objective.py) against the dense one it replaced, and blockwise attention.

The dense reference below is the objective as it was before it streamed: one [F*T, F*T] logit
matrix per head with every precision class selected by mask. The streaming version must equal it
bitwise when one block covers every frame, and within float rounding when it takes query frames
a block at a time, or a single frame's keys a block at a time with an online softmax.
"""

import math

import pytest
import torch

from calibrate import cache as cache_mod
from calibrate.cache import KVCache, Rope, block_mask, blocked_attention, query_blocks, softmax_attention
from calibrate.fit.objective import LayerTrace, attention_outputs, query_frame_blocks


def dense_attention_outputs(trace, k_hat=None, v_hat=None, recent=None, sink=None, keyframe=None, shift=None):
    """The objective before it streamed (reference)."""
    B, H, F, T, D = trace.q.shape
    flat = lambda x: None if x is None else x.reshape(B, H, F * T, D)
    q, k, v = flat(trace.q), flat(trace.k), flat(trace.v)
    visible = block_mask(F, T, trace.window, trace.sink_frames)
    own = block_mask(F, T, 1, 0)
    j = torch.arange(F).repeat_interleave(T).unsqueeze(0).expand(F * T, -1)
    classes = [("own", own, k, v)]
    taken = own.clone()
    for name, c in (("recent", recent), ("sink", sink), ("keyframe", keyframe)):
        if c is None or c[0] <= 0:
            continue
        m = {"recent": lambda: block_mask(F, T, c[0] + 1, 0), "sink": lambda: j < c[0],
             "keyframe": lambda: j % c[0] == 0}[name]() & ~taken
        classes.append((name, m, flat(c[1]), flat(c[2])))
        taken |= m
    classes.append(("other", ~taken, flat(k_hat), flat(v_hat)))
    logits = torch.zeros(B, H, F * T, F * T)
    for name, mask, kc, _ in classes:
        cl = torch.einsum("bhnd,bhmd->bhnm", q, k if kc is None else kc) * (1.0 / math.sqrt(D))
        if shift is not None and name in shift:
            cl = cl - shift[name].reshape(B, H, F * T, 1)
        logits = torch.where(mask, cl, logits)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return sum((probs * mask) @ (v if vc is None else vc) for _, mask, _, vc in classes).reshape(B, H, F, T, D)


def toy_trace(F=11, T=3, window=4, sink=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, F, T, 8, generator=g) * 2 for _ in range(3))
    noisy = lambda x: x + 0.3 * torch.randn(x.shape, generator=g)
    trace = LayerTrace(q, k, v, window=window, sink_frames=sink)
    classes = dict(recent=(2, noisy(k), noisy(v)), sink=(1, noisy(k), None), keyframe=(3, noisy(k), noisy(v)))
    shift = {name: torch.rand(2, 2, F, T, generator=g) for name in ("other", "keyframe")}
    return trace, noisy(k), noisy(v), classes, shift


@pytest.mark.parametrize("window,sink", [(4, 1), (1, 0), (3, 2), (20, 1)])
def test_one_block_is_the_dense_objective_bitwise(window, sink):
    trace, k_hat, v_hat, classes, shift = toy_trace(window=window, sink=sink)
    want = dense_attention_outputs(trace, k_hat, v_hat, **classes, shift=shift)
    assert torch.equal(attention_outputs(trace, k_hat, v_hat, **classes, shift=shift), want)
    assert torch.equal(attention_outputs(trace), dense_attention_outputs(trace))


@pytest.mark.parametrize("budget", [2 * 2 * 9 * 27, 2 * 2 * 3 * 9, 2 * 2 * 3 * 3, 1])
@pytest.mark.parametrize("window,sink", [(4, 1), (1, 0), (3, 2), (20, 1)])
def test_streaming_equals_the_dense_objective(budget, window, sink):
    """Blocks of query frames (first budget), single frames over their window, and single frames
    whose keys come a frame at a time through the online softmax (the last two)."""
    trace, k_hat, v_hat, classes, shift = toy_trace(window=window, sink=sink)
    want = dense_attention_outputs(trace, k_hat, v_hat, **classes, shift=shift)
    got = attention_outputs(trace, k_hat, v_hat, **classes, shift=shift, budget=budget)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_query_blocks_hold_the_budget_and_cover_every_frame():
    for F, T, heads, window, sink, budget in [(48, 16, 12, 16, 1, 1 << 16), (40, 100, 4, 7, 1, 1 << 20), (5, 2, 1, 1, 0, 1)]:
        blocks = query_frame_blocks(F, T, heads, window, sink, budget)
        assert [f for b in blocks for f in b] == list(range(F))
        for b in blocks:
            keys = {j for f in b for j in range(F) if j <= f and (j > f - window or j < sink)}
            assert len(b) == 1 or heads * len(b) * T * len(keys) * T <= budget


# ---- blockwise attention in the cache (replay at Wan's size) --------------------------------------------
def test_blocked_attention_equals_one_softmax():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g)
    bias = torch.randn(2, 3, 10, 30, generator=g)
    for b in (None, bias):
        want = softmax_attention(q, k, v, b)
        assert torch.equal(blocked_attention(q, k, v, b), want)  # one block: the same arithmetic
        for budget in (2 * 3 * 30, 2 * 3 * 30 * 3, 1):
            torch.testing.assert_close(blocked_attention(q, k, v, b, budget), want, atol=1e-6, rtol=1e-6)
    assert [(r.start, r.stop) for r in query_blocks(2, 3, 10, 30, 2 * 3 * 30 * 4)] == [(0, 4), (4, 8), (8, 10)]


class _Seen(KVCache):
    def __init__(self, *a):
        super().__init__(*a)
        self.seen = []

    def observe(self, seen):
        self.seen.append(seen)


def test_attend_and_its_logit_blocks_hold_one_block_of_rows(monkeypatch):
    """With a tiny score budget a frame's attention is taken a row at a time: the outputs and the
    logits observers see equal the one-block computation within float rounding."""
    g = torch.Generator().manual_seed(2)
    frames = [(torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g),
               torch.randn(1, 2, 6, 8, generator=g), Rope(torch.rand(1, 6, 4, generator=g))) for _ in range(5)]
    full, rows = _Seen(1, 3, 1), _Seen(1, 3, 1)
    want = [full.attend(0, *f) for f in frames]
    monkeypatch.setattr(cache_mod, "SCORE_BLOCK_ELEMENTS", 2 * 18)  # one query row at a time
    for f, w, seen in zip(frames, want, full.seen):
        torch.testing.assert_close(rows.attend(0, *f), w, atol=1e-6, rtol=1e-6)
        blocks = list(rows.seen[-1].logit_blocks())
        assert len(blocks) > 1 and all(b.numel() <= 2 * 18 or b.shape[2] == 1 for _, b in blocks)
        torch.testing.assert_close(torch.cat([b for _, b in blocks], dim=2),
                                   torch.cat([b for _, b in seen.logit_blocks()], dim=2), atol=1e-6, rtol=1e-6)

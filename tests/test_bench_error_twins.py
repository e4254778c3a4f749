"""The error variants (benchmarks/error_twins.py) destroy the property they name and keep the energy."""

import pytest
import torch

from benchmarks.error_twins import reshaped_error


def error(seed=0):
    return torch.randn(2, 3, 10, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_shipped_is_the_error_itself():
    e = error()
    assert torch.equal(reshaped_error(e, "shipped", torch.Generator()), e)


def test_random_direction_keeps_each_tokens_norm_and_loses_its_direction():
    e = error()
    got = reshaped_error(e, "random direction", torch.Generator().manual_seed(1))
    torch.testing.assert_close(got.norm(dim=-1), e.norm(dim=-1))
    cos = (got * e).sum(-1) / (got.norm(dim=-1) * e.norm(dim=-1))
    assert cos.abs().mean() < 0.5  # random directions in 8 dimensions: |cos| about 0.27


def test_tokens_shuffled_moves_the_same_vectors_to_other_tokens():
    e = error()
    got = reshaped_error(e, "tokens shuffled", torch.Generator().manual_seed(1))
    for b in range(2):
        for h in range(3):  # the same set of vectors in every frame and head
            key = lambda x: x[torch.argsort(x[:, 0])]
            assert torch.equal(key(got[b, h]), key(e[b, h]))
    assert not torch.equal(got, e)


def test_random_sign_flips_whole_tokens_only():
    e = error()
    got = reshaped_error(e, "random sign", torch.Generator().manual_seed(1))
    same, flipped = (got == e).all(-1), (got == -e).all(-1)
    assert bool((same | flipped).all()) and bool(same.any()) and bool(flipped.any())


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        reshaped_error(error(), "rotated", torch.Generator())


def test_per_token_uniform_hits_min_and_max_and_errs_at_most_half_a_step():
    from benchmarks.error_twins import per_token_uniform

    x = error()
    for bits in (2, 4, 8):
        q = per_token_uniform(x, bits)
        step = (x.amax(-1) - x.amin(-1)) / (2**bits - 1)
        torch.testing.assert_close(q.amin(-1), x.amin(-1))
        torch.testing.assert_close(q.amax(-1), x.amax(-1))
        assert bool(((q - x).abs().amax(-1) <= step / 2 + 1e-12).all())
        assert len(torch.unique(q[0, 0, 0])) <= 2**bits

"""The vector-code study's codes (benchmarks/vector_study.py): exact on data they can hold."""

import torch

from benchmarks.vector_study import codebook_error, kmeans, uniform_error


def test_a_codebook_with_a_word_per_point_cluster_stores_them_exactly():
    points = torch.tensor([[0.0, 0.0], [1.0, 3.0], [-2.0, 1.0], [4.0, -1.0]], dtype=torch.float64)
    data = points.repeat_interleave(50, 0) + 1e-9 * torch.randn(200, 2, dtype=torch.float64)
    assert codebook_error(data, points, 4) < 1e-12
    assert torch.equal(kmeans(data, 4), kmeans(data, 4))  # seeded: the same codebook each time


def test_uniform_levels_hold_their_own_grid_and_lloyd_max_is_no_worse():
    step = 0.7
    levels = step * torch.tensor([-3.0, -1.0, 1.0, 3.0], dtype=torch.float64)  # 2 bits, mid-rise
    data = levels.repeat(100)
    assert uniform_error(data, levels, 2) < 1e-6 * float(levels.pow(2).sum())  # the step is found to 1e-3 or better
    gauss = torch.randn(4000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    test = torch.randn(4000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert codebook_error(gauss[:, None], test[:, None], 4) <= uniform_error(gauss, test, 2) * 1.01

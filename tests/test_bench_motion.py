"""The motion study's shifts (benchmarks/motion_study.py): hand-checked on a 3 x 3 grid."""

import torch

from benchmarks.motion_study import moved, residuals, shifted


def grid():
    return torch.arange(9, dtype=torch.float64).reshape(1, 1, 3, 3, 1)  # rows 0 1 2 / 3 4 5 / 6 7 8


def test_a_shift_moves_the_grid_and_keeps_the_slots_it_cannot_fill():
    down = shifted(grid(), 1, 0)[0, 0, :, :, 0]
    assert down.tolist() == [[0, 1, 2], [0, 1, 2], [3, 4, 5]]  # row 0 has no source: keeps its own
    left = shifted(grid(), 0, -1)[0, 0, :, :, 0]
    assert left.tolist() == [[1, 2, 2], [4, 5, 5], [7, 8, 8]]
    assert torch.equal(shifted(grid(), 0, 0), grid())


def test_a_half_shift_is_the_mean_of_its_two_whole_shifts():
    assert torch.equal(moved(grid(), 1.0, -1.0), shifted(grid(), 1, -1))
    assert torch.allclose(moved(grid(), 0.5, 0.0), (grid() + shifted(grid(), 1, 0)) / 2)
    assert torch.allclose(moved(grid(), -0.5, 0.5), (grid() + shifted(grid(), -1, 0) + shifted(grid(), 0, 1)
                                                     + shifted(grid(), -1, 1)) / 4)


def test_content_that_moves_one_slot_is_found_by_the_best_shift():
    torch.manual_seed(0)
    frames = [torch.randn(1, 2, 16, 3, dtype=torch.float64)]
    for _ in range(20):  # each frame: the last one moved one slot right, a new column entering
        g = frames[-1].reshape(1, 2, 4, 4, 3)
        new = shifted(g, 0, 1)
        new[:, :, :, 0] = torch.randn(1, 2, 4, 3, dtype=torch.float64)
        frames.append(new.reshape(1, 2, 16, 3))
    r = residuals(frames, side=4, reach=1)
    assert r["moved"] == r["decisions"] == 2 * (21 - 16)
    assert r["best shift"] < 0.5 * r["same slot"]  # only the entering column is left


def test_a_study_main_refuses_bad_input_in_one_line_and_writes_its_reports_atomically(tmp_path, capsys):
    """benchmarks/kv_stats.run_study, the tail both K/V studies' mains share."""
    from benchmarks.kv_stats import run_study

    def unknown(name):
        raise ValueError(f"config: unknown model '{name}'")

    render = lambda results, command, minutes: f"# {command}: {[r['model'] for r in results]}\n"
    assert run_study("motion_study", ["--models", "nosuch"], "nosuch", 64, 16, str(tmp_path), unknown, render) == 2
    assert run_study("motion_study", [], "a", 17, 16, str(tmp_path), lambda n: {"model": n}, render) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: config: unknown model 'nosuch'", "error: --frames must be above 17 (frames 16 on are measured)"]
    assert not list(tmp_path.iterdir())
    assert run_study("vector_study", ["--frames", "18"], "a,b", 18, 16, str(tmp_path), lambda n: {"model": n}, render) == 0
    assert (tmp_path / "vector_study.md").read_text() == "# python -m benchmarks.vector_study --frames 18: ['a', 'b']\n"
    assert (tmp_path / "vector_study.json").read_text() == '[\n {\n  "model": "a"\n },\n {\n  "model": "b"\n }\n]'

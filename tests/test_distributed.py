"""Two CPU processes (torchrun + gloo + PartialState(cpu=True), the DESIGN section 8 recipe)
reduce to exactly the single-process statistics.

This file is also the worker script: torchrun runs it with `--worker OUT_DIR`.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calibrate import stats as S
from calibrate.distributed import finish, reduce_queries, reduce_stats, shard, shard_indices
from calibrate.sample import QuerySample

L, H, D, T = 2, 2, 8, 4
NUM_TRAJECTORIES, NUM_FRAMES = 5, 6
CFG = S.KVStatsConfig(num_layers=L, num_heads=H, head_dim=D, num_bins=32, hist_range=(-4.0, 4.0),
                      bucket_size=2, max_frames=8, max_age=4)
REPO = Path(__file__).resolve().parents[1]


def _collect(trajectories):
    """Stats and query sample of the given trajectories, each a deterministic random rollout."""
    st = S.KVStats(CFG)
    qs = QuerySample(num_layers=L, num_heads=H, head_dim=D, capacity=16)
    for traj in trajectories:
        g = torch.Generator().manual_seed(traj)
        for f in range(NUM_FRAMES):
            for layer in range(L):
                k, v, q = (torch.randn(1, H, T, D, generator=g) * (1 + traj) for _ in range(3))
                st.update(layer, k, v, f)
                q[..., 0] = 1000 * traj + T * f + torch.arange(T)  # a unique id per query token
                qs.update(layer, q)
                kept = list(range(max(0, f - 2), f + 1))
                probs = torch.softmax(torch.randn(1, H, len(kept), generator=g), -1)
                st.update_attention(layer, probs, kept, f)
    return st, qs


def _worker(out_dir: str) -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True)
    assert state.num_processes == 2 and torch.distributed.get_backend() == "gloo"
    st, qs = _collect(shard(list(range(NUM_TRAJECTORIES)), state))
    st = reduce_stats(st, state)
    qs = reduce_queries(qs, state)
    st.save(Path(out_dir) / f"rank{state.process_index}.safetensors", model={"world": 2}, samples={"q": qs})
    finish(state)
    assert not torch.distributed.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_shard_indices_cover_every_item_once(world):
    for n in (0, 1, 5, 12):
        parts = [shard_indices(n, rank, world) for rank in range(world)]
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_shard_and_reduce_are_identity_for_one_process():
    assert shard(["a", "b", "c"], None) == ["a", "b", "c"]
    st, _ = _collect([0])
    assert reduce_stats(st, None) is st
    with pytest.raises(ValueError):
        shard_indices(3, 2, 2)


def test_two_gloo_processes_reduce_exactly(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           __file__, "--worker", str(tmp_path)]
    run = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    ranks = [S.load_stats(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]
    single, _ = _collect(range(NUM_TRAJECTORIES))
    for name, t in single.tensors.items():
        t0, t1 = ranks[0].stats[name], ranks[1].stats[name]
        assert torch.equal(t0, t1), name  # every rank holds the same result
        if t.dtype == torch.int64 or S.merge_rule(name) != "sum":
            assert torch.equal(t0, t), name  # counts, histograms, min/max: exact
        else:
            torch.testing.assert_close(t0, t, rtol=1e-9, atol=1e-12, msg=name)

    q0, q1 = ranks[0].samples['q'], ranks[1].samples['q']
    for layer in range(L):
        assert torch.equal(q0.samples(layer), q1.samples(layer))
        assert len(q0.samples(layer)) == 16 and int(q0.num_seen_L[layer]) == NUM_TRAJECTORIES * NUM_FRAMES * T
        ids = q0.samples(layer)[:, 0, 0].long()
        assert ids.unique().numel() == 16
        assert ((ids // 1000 < NUM_TRAJECTORIES) & (ids % 1000 < NUM_FRAMES * T)).all()


def _cli_once_and_on_two_ranks(args: list[str], tmp_path: Path) -> None:
    """`python -m calibrate *args` into tmp_path/single and the same under torchrun with 2 CPU
    processes into tmp_path/torchrun; both exit 0 and no rank aborts at exit."""
    runs = {"single": [sys.executable, "-m", "calibrate"],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "calibrate"]}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    for name, cmd in runs.items():
        run = subprocess.run([*cmd, *args, f"hydra.run.dir={tmp_path / name}"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "terminate called" not in run.stderr


@pytest.mark.slow
def test_torchrun_stats_cli_writes_the_single_process_statistics(tiny_weights, tmp_path):
    """`torchrun --nproc_per_node 2 -m calibrate task=stats device=cpu` (the README's command):
    both ranks exit 0 (each tears its gloo group down) and rank 0 writes the statistics a
    single process writes, counts exactly."""
    _, weights = tiny_weights
    _cli_once_and_on_two_ranks(["task=stats", "device=cpu", "trajectories=quick", "trajectories.num_frames=12",
                                f"model.weights={weights}"], tmp_path)
    out = {name: S.load_stats(tmp_path / name / "stats.safetensors").stats.tensors for name in ("single", "torchrun")}
    assert out["single"].keys() == out["torchrun"].keys()
    for name, t in out["single"].items():
        if t.dtype == torch.int64:
            assert torch.equal(out["torchrun"][name], t), name



def test_torchrun_calibrate_writes_the_single_process_recipe(tiny_weights, tmp_path):
    """`torchrun --nproc_per_node 2 -m calibrate device=cpu`: the replay shards trajectories, the
    trace goes to each layer's owner, the predictive fit shards the layers (one per rank here),
    and rank 0 alone evaluates and writes: the same recipe as one process. Its integer tensors,
    scheme, memory and every choice are equal; float tensors agree within 1e-6, PCA rotations within
    1e-4, because the all-reduce sums the float64 statistics in another order and an eigenvector
    moves by that change over its eigenvalue gap (natively 1 ulp; under MKL_CBWR=AVX2 on an AVX-512
    CPU up to 1.8e-5, the bound README states for recipes fitted on another CPU). Both
    runs batch 2 trajectories: TinyWorld's float32 rollout of a trajectory can differ in the last
    bit with the batch size (MKL picks kernels by matrix size)."""
    from safetensors import safe_open

    _, weights = tiny_weights
    args = ["device=cpu", f"model.weights={weights}", "trajectories.families=[orbit,stress,pan]",
            "trajectories.num_trajectories=4", "trajectories.num_frames=12", "trajectories.batch_size=2",
            "fit.trace_frames=8", "fit.sample_tokens=64", "fit.closed_loop_frames=8", "fit.closed_loop_trajectories=1",
            "fit.intra_mults=[1.0,1.3]", "fit.inter_mults=[0.7,1.0]", "fit.closed_loop_scales=[1.0,1.4]",
            "check.num_trajectories=1", "check.num_frames=8", "eval.strips=false", "eval.attention=false"]
    _cli_once_and_on_two_ranks(args, tmp_path)
    recipes = {}
    for name in ("single", "torchrun"):
        with safe_open(tmp_path / name / "recipe.safetensors", "pt") as f:
            recipes[name] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
    (single, meta1), (multi, meta2) = recipes["single"], recipes["torchrun"]
    assert single.keys() == multi.keys()
    for key, t in single.items():  # integer codes exactly; floats within the float64 statistics' summation order
        if t.dtype == torch.int64:
            assert torch.equal(multi[key], t), key
        else:
            atol = 1e-4 if key.endswith(".rotation") else 1e-6
            torch.testing.assert_close(multi[key], t, atol=atol, rtol=0, msg=key)
    assert meta1["scheme"] == meta2["scheme"] and meta1["memory"] == meta2["memory"]
    fit1, fit2 = json.loads(meta1["fit"]), json.loads(meta2["fit"])
    assert fit1["head_bits"] == fit2["head_bits"] and fit1["closed_loop"]["chosen"] == fit2["closed_loop"]["chosen"]
    assert [(u["layer"], u["tensor"], u["head"]) for u in fit1["upgrades"]] == \
        [(u["layer"], u["tensor"], u["head"]) for u in fit2["upgrades"]]
    assert [{k: e[k]["intra_mult"] + e[k]["inter_mult"] for k in "kv"} for e in fit1["layers"]] == \
        [{k: e[k]["intra_mult"] + e[k]["inter_mult"] for k in "kv"} for e in fit2["layers"]]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])

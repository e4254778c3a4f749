"""Reliability: resumable statistics, crash-safe export, determinism, clear errors on bad state.

Everything runs on a tiny random TinyWorld on the CPU, in process, except where the contract is
about a process: a SIGKILL during export, and the CLI's exit code and one-line stderr.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from benchmarks.reproducibility import ANOTHER_CPU
from calibrate import calibration, pipeline, replay
from calibrate.adapters import as_world
from calibrate.config import Config, FitConfig, TrajectoriesConfig
from calibrate.recipe import load_recipe, save_recipe
from calibrate.replay import NonFiniteError, Recorder
from calibrate.schemes import build_baseline
from calibrate.stats import load_stats
from calibrate.world.weights import save_weights

from toys import TINY_WORLD, make_tiny_world

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_world):
    return tiny_world


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # it would turn errors into tracebacks
    return {**e, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "calibrate", *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def last_line(text: str) -> str:
    lines = [l for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


# ---- interrupted statistics collection resumes exactly ---------------------------------------
def stats_cfg(**traj) -> Config:
    cfg = Config()
    cfg.trajectories = TrajectoriesConfig(families=["orbit", "revisit", "stress"], num_trajectories=3, num_frames=12,
                                          batch_size=1, **traj)
    cfg.fit = replace(FitConfig(), sample_tokens=64)  # 3 x 11 frames x 16 tokens >> 64: the reservoirs draw randomly
    return cfg


class CountingRollout:
    """Stands in for `replay.rollout_batch`: counts calls and raises KeyboardInterrupt on call `interrupt_at`."""

    def __init__(self, interrupt_at: int | None = None):
        self.calls, self.interrupt_at, self.real = 0, interrupt_at, replay.rollout_batch

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


def assert_same_recorder(a: Recorder, b: Recorder) -> None:
    assert set(a.stats.tensors) == set(b.stats.tensors)
    for name, t in a.stats.tensors.items():
        assert torch.equal(t, b.stats.tensors[name]), f"stats tensor {name} differs"
    for kind in ("q", "k", "v"):
        sa, sb = getattr(a, kind), getattr(b, kind)
        assert torch.equal(sa.num_seen_L, sb.num_seen_L), f"{kind} reservoir saw different counts"
        assert torch.equal(sa.q_LCQD, sb.q_LCQD), f"{kind} reservoir kept different tokens"


@pytest.fixture(scope="module")
def uninterrupted(model, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("full") / "ckpt.safetensors"
    return pipeline.collect(stats_cfg(), model, CPU, checkpoint=ckpt), ckpt


def test_interrupted_collection_resumes_to_identical_statistics(model, uninterrupted, tmp_path, monkeypatch):
    full, full_ckpt = uninterrupted
    assert load_stats(full_ckpt).extra["batches_done"] == "3"
    ckpt = tmp_path / "ckpt.safetensors"
    interrupting = CountingRollout(interrupt_at=2)
    monkeypatch.setattr(replay, "rollout_batch", interrupting)
    with pytest.raises(KeyboardInterrupt):
        pipeline.collect(stats_cfg(), model, CPU, checkpoint=ckpt)
    assert load_stats(ckpt).extra["batches_done"] == "1"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    counting = CountingRollout()
    monkeypatch.setattr(replay, "rollout_batch", counting)
    resumed = pipeline.collect(stats_cfg(), model, CPU, checkpoint=ckpt)
    assert counting.calls == 2  # the finished batch was not replayed again
    assert_same_recorder(resumed, full)


def test_checkpoint_of_another_config_or_model_is_ignored(model, uninterrupted, tmp_path, monkeypatch):
    full_ckpt = tmp_path / "ckpt.safetensors"
    full_ckpt.write_bytes(uninterrupted[1].read_bytes())
    other_cfg = stats_cfg(seed=1)
    fresh = pipeline.collect(other_cfg, model, CPU)
    counting = CountingRollout()
    monkeypatch.setattr(replay, "rollout_batch", counting)
    # the finished checkpoint of stats_cfg() would skip all 3 batches if it were (wrongly) taken
    again = pipeline.collect(other_cfg, model, CPU, checkpoint=full_ckpt)
    assert counting.calls == 3
    assert_same_recorder(again, fresh)

    counting.calls = 0
    pipeline.collect(stats_cfg(), make_tiny_world(seed=1), CPU, checkpoint=full_ckpt)
    assert counting.calls == 3


def test_interrupted_task_stats_rerun_in_same_dir_gives_identical_file(model, tmp_path, monkeypatch):
    """task=stats end to end: interrupted, rerun into the same run dir -> the same stats.safetensors bytes."""
    weights = tmp_path / "tiny.safetensors"
    save_weights(model, weights)
    cfg = stats_cfg()
    cfg.task, cfg.device, cfg.model.weights = "stats", "cpu", str(weights)
    pipeline.run_stats(cfg, tmp_path / "full")

    monkeypatch.setattr(replay, "rollout_batch", CountingRollout(interrupt_at=3))
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_stats(cfg, tmp_path / "resumed")
    assert not (tmp_path / "resumed" / "stats.safetensors").exists()
    assert load_stats(tmp_path / "resumed" / "stats.partial.rank0.safetensors").extra["batches_done"] == "2"
    counting = CountingRollout()
    monkeypatch.setattr(replay, "rollout_batch", counting)
    pipeline.run_stats(cfg, tmp_path / "resumed")
    assert counting.calls == 1
    full, resumed = (tmp_path / d / "stats.safetensors" for d in ("full", "resumed"))
    assert resumed.read_bytes() == full.read_bytes()
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["stats.json", "stats.png", "stats.safetensors"]


# ---- a SIGKILL during export never leaves a partial recipe ------------------------------------
WRITER = textwrap.dedent("""
    import sys, torch
    from calibrate.recipe import ModelInfo, Recipe, TensorSpec, TokenPolicy, save_recipe, uniform_scheme
    from calibrate.quant.rotation import random_hadamard
    L, H, D = 48, 8, 128  # 48 layers x 8 heads x 128^2 float32 rotations: ~25 MB per write
    info = ModelInfo("big", L, H, D, 16, "0123456789abcdef")
    spec = TensorSpec(bits=2, rotation="hadamard")
    rot = torch.stack([random_hadamard(D, seed=h) for h in range(H)])
    tensors = {f"layers.{i}.k.rotation": rot.clone() for i in range(L)}
    recipe = Recipe(info, uniform_scheme("big", L, spec, TensorSpec(bits=2), TokenPolicy()), tensors)
    print("writing", flush=True)
    n = 0
    while True:
        recipe.metadata["calibration"] = '{"write": %d}' % n
        save_recipe(recipe, sys.argv[1])
        n += 1
        print("wrote", flush=True)
""")


def leftovers(directory: Path, target: Path) -> list[str]:
    """Names in `directory` other than `target` (a kill before the writer made the directory: none)."""
    return sorted(p.name for p in directory.iterdir() if p != target) if directory.is_dir() else []


def test_sigkill_during_export_never_leaves_a_partial_recipe(tmp_path):
    """Kills land at random points of a write; the kill times are fractions of the writes this
    machine measured (no fixed sleeps), so a loaded machine tests the same phases as an idle one."""
    target = tmp_path / "out" / "recipe.safetensors"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    rng = random.Random(0)
    seen_complete, killed_mid_write = 0, 0
    for round_ in range(4):
        proc = subprocess.Popen([sys.executable, str(script), str(target)], cwd=REPO, env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
            start = time.monotonic()
            # round 0 kills early in the first write (maybe before the directory exists), later
            # rounds after 1-2 finished writes, at a random fraction of how long one write took here
            waits = 0 if round_ == 0 else rng.choice([1, 2])
            for _ in range(waits):
                assert proc.stdout.readline().strip() == "wrote", proc.stderr.read()
            one_write = (time.monotonic() - start) / waits if waits else 0.3
            time.sleep(rng.uniform(0.05, 0.95) * one_write)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        if target.exists():
            recipe = load_recipe(target)  # a complete, valid file
            assert len(recipe.tensors) == 48 and "write" in recipe.section("calibration")
            seen_complete += 1
        # leftovers of a killed write are hidden temp files: never the target, never a *.safetensors
        left = leftovers(target.parent, target)
        for name in left:
            assert name.startswith(".recipe.safetensors.") and name.endswith(".tmp"), name
        killed_mid_write += bool(left)
    assert seen_complete >= 1  # rounds 1-3 kill after at least one finished write

    # the next write into the directory removes the temp files of the killed writers
    save_recipe(load_recipe(target), target)
    assert leftovers(target.parent, target) == []


def test_a_killed_writers_temp_file_is_removed_by_the_next_write_and_a_live_ones_kept(tmp_path):
    from calibrate.io import write_bytes_atomic

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f".report.json.pid{dead_pid}.abc123.tmp"
        busy = tmp_path / f".stats.safetensors.pid{live.pid}.xyz789.tmp"
        own = tmp_path / f".other.pid{os.getpid()}.q1w2e3.tmp"  # this process's own writes are never stale
        user = tmp_path / ".notes.tmp"  # not a name write_atomic makes
        for p in (stale, busy, own, user):
            p.write_bytes(b"partial")
        write_bytes_atomic(tmp_path / "recipe.safetensors", b"data")
        assert not stale.exists()
        assert busy.exists() and own.exists() and user.exists()
        assert (tmp_path / "recipe.safetensors").read_bytes() == b"data"
    finally:
        live.kill()
        live.wait()


# ---- same config and seed -> byte-identical recipe --------------------------------------------
def test_a_write_failing_without_a_file_name_names_its_target_and_leaves_it_alone(tmp_path):
    """A full disk (ENOSPC from write or fsync) names no file; the error must name the target."""
    import errno

    from calibrate.io import write_atomic

    target = tmp_path / "check.json"
    target.write_text("earlier")

    def full_disk(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as e:
        write_atomic(target, full_disk)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target) and str(target) in str(e.value)
    assert target.read_text() == "earlier" and [p.name for p in tmp_path.iterdir()] == ["check.json"]


def test_baseline_recipe_bytes_identical_in_process_and_across_processes(model, tmp_path):
    info = as_world(model).info
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_recipe(build_baseline("quarot2", info), a)
    save_recipe(build_baseline("quarot2", info), b)
    assert a.read_bytes() == b.read_bytes()
    # another process, another hash seed: nothing may depend on dict/set iteration order
    code = ("import json, sys; from calibrate.recipe import ModelInfo, save_recipe; "
            "from calibrate.schemes import build_baseline; "
            "save_recipe(build_baseline('quarot2', ModelInfo(**json.loads(sys.argv[1]))), sys.argv[2])")
    c = tmp_path / "c.safetensors"
    run = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(info)), str(c)], cwd=REPO,
                         env={**env(), "PYTHONHASHSEED": "12345"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert c.read_bytes() == a.read_bytes()


def test_fit_twice_gives_byte_identical_recipe_files(model, tmp_path):
    cfg = Config()
    cfg.trajectories = TrajectoriesConfig(families=["orbit", "revisit"], num_trajectories=2, num_frames=12)
    cfg.fit = replace(FitConfig(), closed_loop_frames=8, closed_loop_trajectories=1, trace_frames=8,
                      sample_tokens=128, clip_grid=[1.0, 0.8], rotations=["none", "hadamard"])
    paths = []
    for name in ("a", "b"):
        recipe, _ = calibration.fit(cfg, model, CPU)
        save_recipe(recipe, tmp_path / f"{name}.safetensors")
        paths.append(tmp_path / f"{name}.safetensors")
    assert paths[0].read_bytes() == paths[1].read_bytes()


FIT_IN_A_PROCESS = textwrap.dedent("""
    import sys
    from dataclasses import replace
    import torch
    from calibrate import calibration
    from calibrate.config import Config, FitConfig, TrajectoriesConfig
    from calibrate.recipe import save_recipe
    from toys import make_tiny_world
    cfg = Config()
    cfg.trajectories = TrajectoriesConfig(families=["orbit", "revisit"], num_trajectories=2, num_frames=12)
    cfg.fit = replace(FitConfig(), closed_loop_frames=8, closed_loop_trajectories=1, trace_frames=8, sample_tokens=128,
                      clip_grid=[1.0, 0.8], rotations=["none", "hadamard"])
    save_recipe(calibration.fit(cfg, make_tiny_world(0), torch.device("cpu"))[0], sys.argv[1])
""")
# what a recipe fitted on another CPU may differ in (README, "Reproducibility", ANOTHER_CPU): MKL picks
# its kernels by CPU, so sums run in another order; measured here up to 2 ulps of the means, 1.6e-5
# relative in the units and 3.5e-5 in the PCA rotations (eigenvectors of near-equal eigenvalues move most)


def test_a_recipe_fitted_under_another_mkl_kernel_set_makes_the_same_choices(tmp_path):
    """The same fit under MKL_CBWR=COMPATIBLE and AVX2 (two kernel sets of one machine, as two CPUs
    would pick): the scheme (every choice) and every integer tensor are identical, the float
    tensors agree within ANOTHER_CPU, the fit record differs only in its float scores."""
    from safetensors import safe_open

    paths = {}
    for cbwr in ("COMPATIBLE", "AVX2"):
        paths[cbwr] = tmp_path / f"{cbwr}.safetensors"
        run = subprocess.run([sys.executable, "-c", FIT_IN_A_PROCESS, str(paths[cbwr])], cwd=REPO / "tests",
                             env={**env(), "MKL_CBWR": cbwr}, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
    (meta_a, a), (meta_b, b) = ((f.metadata(), {k: f.get_tensor(k) for k in f.keys()})
                                for f in (safe_open(str(paths[c]), "pt") for c in ("COMPATIBLE", "AVX2")))
    assert {k: v for k, v in meta_a.items() if k != "fit"} == {k: v for k, v in meta_b.items() if k != "fit"}
    assert a.keys() == b.keys()
    for name in a:
        if not a[name].is_floating_point():
            assert torch.equal(a[name], b[name]), name
        else:
            atol, rtol = ANOTHER_CPU[name.rsplit(".", 1)[1]]
            torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


@pytest.mark.slow  # 2 threads on a busy 2-core machine: minutes
def test_thread_count_does_not_change_the_recipe_or_the_rollouts(model):
    """The CLI picks torch's thread count from the machine's load (__main__.torch_threads): a
    recipe and its evaluation must not depend on it."""
    from calibrate.evaluate.run import evaluate
    from calibrate.recipe import to_bytes
    from calibrate.world.trajectories import make_trajectories

    cfg = Config()
    cfg.trajectories = TrajectoriesConfig(families=["orbit", "stress"], num_trajectories=2, num_frames=12)
    cfg.fit = replace(FitConfig(), closed_loop_frames=8, closed_loop_trajectories=1, trace_frames=8, sample_tokens=128)
    trajs = make_trajectories(["orbit", "revisit"], "evaluation", 2, 24)
    threads = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            recipe, _ = calibration.fit(cfg, model, CPU)
            run = evaluate(as_world(model), {"fitted": recipe}, trajs, 16, 1, CPU, keep_frames=True)["fitted"]
            out.append((to_bytes(recipe), run.frames[0]["reference"], run.frames[0]["quantized"]))
    finally:
        torch.set_num_threads(threads)
    assert out[0][0] == out[1][0]
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][2], out[1][2])


# ---- non-finite K/V are reported with layer, head and frame -----------------------------------
def k_index(head: int, channel: int = 3) -> int:
    """Output index of qkv (laid out [3, H, D]) of K's `channel` in `head`."""
    return TINY_WORLD.dim + head * TINY_WORLD.head_dim + channel


def replay_one(model, num_frames: int = 10):
    cfg = Config()
    cfg.trajectories = TrajectoriesConfig(families=["orbit"], num_trajectories=1, num_frames=num_frames)
    cfg.fit = replace(FitConfig(), sample_tokens=64)
    return pipeline.collect(cfg, model, CPU)


def test_nan_in_weights_reported_with_layer_head_frame():
    model = make_tiny_world()
    with torch.no_grad():
        model.blocks[1].qkv.bias[k_index(head=1)] = float("nan")
    with pytest.raises(NonFiniteError) as e:
        replay_one(model)
    msg = str(e.value)
    assert "non-finite K" in msg and "layer 1" in msg and "head 1" in msg and "frame 0" in msg, msg
    assert "\n" not in msg


def test_nan_appearing_mid_rollout_names_its_frame(model):
    """A NaN that shows up only at frame 5 of layer 0, head 0 (a forward hook injects it)."""
    calls = []

    def poison(module, inputs, out):
        calls.append(1)
        if len(calls) == 6:  # the 6th step of layer 0 stores frame 5
            out = out.clone()
            out[..., k_index(head=0)] = float("inf")
            return out
        return out

    handle = model.blocks[0].qkv.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteError, match=r"layer 0, head 0, frame 5\b"):
            replay_one(model)
    finally:
        handle.remove()


def test_cli_rejects_nan_weights_in_one_line(tmp_path):
    model = make_tiny_world()
    with torch.no_grad():
        model.blocks[1].qkv.bias[k_index(head=1)] = float("nan")
    weights = tmp_path / "nan.safetensors"
    save_weights(model, weights)
    run_dir = tmp_path / "run"
    run = cli("task=stats", f"model.weights={weights}", "trajectories=quick", "trajectories.num_frames=4",
              f"hydra.run.dir={run_dir}")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    line = last_line(run.stderr)
    assert line.startswith("error:") and "blocks.1.qkv.bias" in line and "NaN" in line, run.stderr
    assert [l for l in run.stderr.splitlines() if l.startswith("error:")] == [line]
    assert not (run_dir / "stats.safetensors").exists()


# ---- an output dir that cannot be written: one clear line, exit 2 -----------------------------
@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_output_dir_is_one_clear_line(tmp_path, where):
    if where == "under_a_file":
        (tmp_path / "file.txt").write_text("not a directory")
        run_dir = tmp_path / "file.txt" / "sub"  # fails even as root (chmod does not stop root)
    else:
        run_dir = Path("/proc/forbidden")
    run = cli("task=stats", "trajectories=quick", "trajectories.num_frames=4", f"hydra.run.dir={run_dir}")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    line = last_line(run.stderr)
    assert line.startswith("error:") and str(run_dir) in line, run.stderr

"""The command line contract (DESIGN.md section 8): outputs under fixed names, and bad input gives a
non-zero exit with one clear line on stderr, no traceback, and nothing overwritten.

The smoke test and a few bad inputs run `python -m calibrate` in a subprocess (the process's
exit code and stderr are the contract). The rest of the bad-input suite calls the same entry
point, `calibrate.__main__.main`, in process with `sys.argv` set: Hydra parses the same
arguments, and its exit code (SystemExit) and stderr are observed the same way, ~10x faster.
Recipes, weights and trajectories are made for a tiny random TinyWorld (`model.weights=...`),
so every failure below is the one the case is about.
"""

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from calibrate.adapters import as_world
from calibrate.io import safetensors_bytes
from calibrate.quant.rotation import random_hadamard
from calibrate.recipe import ModelInfo, Recipe, TensorSpec, TokenPolicy, load_recipe, save_recipe, uniform_scheme
from calibrate.world.trajectories import make_trajectories, save_trajectories

from toys import predictive_roles

REPO = Path(__file__).resolve().parents[1]
# a finished run's outputs and records, which a failed rerun into its directory must leave alone
SENTINELS = {"recipe.safetensors": b"sentinel recipe", "stats.safetensors": b"sentinel stats",
             "report.json": b'{"sentinel": true}', "stats.json": b'{"sentinel": 1}', "config.yaml": b"window: 16",
             ".hydra/config.yaml": b"window: 16", ".hydra/hydra.yaml": b"hydra: {}", ".hydra/overrides.yaml": b"[]"}
# what a failed run may leave in its run dir besides the untouched sentinels
ALLOWED_AFTER_FAILURE = {"__main__.log"}


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # it would turn errors into tracebacks
    return {**e, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def run_subprocess(args: list[str]) -> tuple[int, str, str]:
    run = subprocess.run([sys.executable, "-m", "calibrate", *args], cwd=REPO, env=env(), capture_output=True,
                         text=True, timeout=600)
    return run.returncode, run.stdout, run.stderr


def run_in_process(args: list[str], capsys) -> tuple[int, str, str]:
    """`python -m calibrate ARGS` in this process: (exit code, stdout, stderr)."""
    from calibrate.__main__ import main

    root = logging.getLogger()
    handlers, level, argv, threads = root.handlers[:], root.level, sys.argv, torch.get_num_threads()
    capsys.readouterr()
    sys.argv = ["calibrate", *args]
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)  # the CLI sets torch's threads for its process
        for h in root.handlers:  # Hydra adds a console and a run-dir file handler per run
            if h not in handlers:
                h.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    out = capsys.readouterr()
    return code, out.out, out.err


def nonempty_lines(text: str) -> list[str]:
    return [l for l in text.splitlines() if l.strip()]


# ---- fixtures: a tiny model, a valid recipe for it, and malformed variants ----------------------
@pytest.fixture(scope="module")
def tiny(tiny_weights):
    return tiny_weights


def valid_recipe(info: ModelInfo) -> Recipe:
    """Static per-channel K with a rotation, per-token V: a tensor for every check to break."""
    H, D = info.num_kv_heads, info.head_dim
    k = TensorSpec(bits=2, axis="channel", static=True, rotation="hadamard")
    v = TensorSpec(bits=4, axis="token", group_size=16)
    tensors = {}
    for i in range(info.num_layers):
        tensors[f"layers.{i}.k.rotation"] = torch.stack([random_hadamard(D, seed=10 * i + h) for h in range(H)])
        tensors[f"layers.{i}.k.scale"] = torch.full((H, D), 0.5)
        tensors[f"layers.{i}.k.zero_point"] = -torch.ones(H, D)
    return Recipe(info, uniform_scheme("cli-test", info.num_layers, k, v, TokenPolicy(sink_frames=1)), tensors)


def raw_parts(blob_path: Path) -> tuple[dict, dict]:
    with safe_open(str(blob_path), framework="pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory):
    """Every input file the suite uses, by name."""
    model, weights = tiny
    d = tmp_path_factory.mktemp("inputs")
    info = as_world(model).info
    good = d / "good.safetensors"
    save_recipe(valid_recipe(info), good)
    load_recipe(good, info)  # the base recipe is valid for the tiny model: each variant breaks one thing
    meta, tensors = raw_parts(good)
    paths = {"weights": weights, "good": good, "missing": d / "does-not-exist.safetensors"}

    def variant(name: str, meta_patch: dict | None = None, tensor_patch: dict | None = None, drop=()) -> None:
        m = {**meta, **(meta_patch or {})}
        t = {k: v for k, v in {**tensors, **(tensor_patch or {})}.items() if k not in drop}
        paths[name] = d / f"{name}.safetensors"
        paths[name].write_bytes(safetensors_bytes(t, m))

    blob = good.read_bytes()
    paths["truncated"] = d / "truncated.safetensors"
    paths["truncated"].write_bytes(blob[: len(blob) // 2])
    paths["text"] = d / "notes.safetensors"
    paths["text"].write_text("this is not a safetensors file\n")
    H, D = info.num_kv_heads, info.head_dim
    scale = tensors["layers.1.k.scale"]
    variant("wrong_format", {"format": "kv-stats"})
    variant("major_version", {"format_version": "2.0"})
    variant("bad_json", {"scheme": "{not json"})
    scheme = json.loads(meta["scheme"])
    scheme["layers"][0]["v"]["bits"] = 5
    variant("bad_bits", {"scheme": json.dumps(scheme)})
    variant("missing_tensor", drop=("layers.1.k.scale",))
    variant("wrong_shape", tensor_patch={"layers.1.k.scale": torch.full((H, D - 1), 0.5)})
    variant("nan_scale", tensor_patch={"layers.1.k.scale": scale.clone().index_fill_(1, torch.tensor([3]), float("nan"))})
    variant("zero_scale", tensor_patch={"layers.1.k.scale": scale.clone().index_fill_(1, torch.tensor([3]), 0.0)})
    variant("not_orthogonal", tensor_patch={"layers.0.k.rotation": tensors["layers.0.k.rotation"] * 1.1})
    variant("unknown_role", tensor_patch={"layers.0.k.mystery": torch.zeros(H)})
    other = json.loads(meta["model"])
    other["fingerprint"] = "0123456789abcdef"
    variant("other_model", {"model": json.dumps(other)})
    with_comp = json.loads(meta["scheme"])
    with_comp["layers"][0]["k"]["comp_rank"] = 2
    variant("comp_wrong_shape", {"scheme": json.dumps(with_comp)},
            {"layers.0.k.comp_down": torch.zeros(H, D, 3), "layers.0.k.comp_up": torch.zeros(H, 2, D)})
    variant("logit_bias_wrong_shape", tensor_patch={"layers.0.k.logit_bias": torch.zeros(H, D - 1)})
    negative_keyframes = json.loads(meta["scheme"])
    negative_keyframes["policy"]["keyframe_interval"] = -1
    variant("keyframe_interval_negative", {"scheme": json.dumps(negative_keyframes)})
    mixed = json.loads(meta["scheme"])  # layer 0: per-frame K with a logit correction, predictive V (valid; refused)
    roles = predictive_roles(torch.randn(1, H, 6, info.tokens_per_frame, D, generator=torch.Generator().manual_seed(3)))
    mixed["layers"][0]["v"] = {"bits": 2, "kind": "predictive", "rotation": "learned",
                               "token_bits": roles["channel_bits"].sum(-1).tolist(),
                               "anchor_token_bits": roles["anchor_bits"].sum(-1).tolist()}
    variant("mixed_layer", {"scheme": json.dumps(mixed)},
            {**{f"layers.0.v.{r}": t for r, t in roles.items()}, "layers.0.k.logit_bias": torch.zeros(H, D)})

    trajs = make_trajectories(["orbit"], "calibration", 1, 8)
    tgood = d / "trajs.safetensors"
    save_trajectories(tgood, trajs)
    tmeta, ttensors = raw_parts(tgood)
    paths["traj_garbage"] = d / "garbage.safetensors"
    paths["traj_garbage"].write_bytes(os.urandom(64))
    paths["traj_missing_tensor"] = d / "traj_missing.safetensors"
    paths["traj_missing_tensor"].write_bytes(safetensors_bytes({"0.poses": ttensors["0.poses"]}, tmeta))

    paths["weights_corrupt"] = d / "weights_corrupt.safetensors"
    paths["weights_corrupt"].write_bytes(weights.read_bytes()[:1000])
    wmeta, wtensors = raw_parts(weights)
    wmeta["config"] = json.dumps({**json.loads(wmeta["config"]), "dim": 64})
    paths["weights_shape"] = d / "weights_shape.safetensors"
    paths["weights_shape"].write_bytes(safetensors_bytes(wtensors, wmeta))
    return paths


# ---- the bad-input suite ------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    args: list[str]  # "{name}" is replaced by files[name]
    expect: list[str]  # substrings the error line must contain (case-insensitive)
    subprocess: bool = False  # run as a real process (a few, to pin the contract end to end)


TINY_MODEL = ["model.weights={weights}"]
QUICK = ["trajectories=quick", "trajectories.num_frames=4", "trajectories.num_trajectories=1"]
EVAL = ["task=evaluate", *TINY_MODEL]
CASES = [
    # recipes
    Case("recipe-truncated", [*EVAL, "recipe={truncated}"], ["truncated.safetensors", "not a readable safetensors"], subprocess=True),
    Case("recipe-not-safetensors", [*EVAL, "recipe={text}"], ["notes.safetensors", "not a readable safetensors"]),
    Case("recipe-wrong-format", [*EVAL, "recipe={wrong_format}"], ["'format'", "kv-stats"]),
    Case("recipe-major-version", ["task=check", *TINY_MODEL, "recipe={major_version}"], ["format_version", "2.0"]),
    Case("recipe-bad-json", [*EVAL, "recipe={bad_json}"], ["bad_json.safetensors", "json"]),
    Case("recipe-bad-bits", [*EVAL, "recipe={bad_bits}"], ["layers[0].v.bits", "5"]),
    Case("recipe-missing-tensor", [*EVAL, "recipe={missing_tensor}"], ["layers.1.k.scale", "missing"]),
    Case("recipe-wrong-shape", [*EVAL, "recipe={wrong_shape}"], ["layers.1.k.scale", "shape"]),
    Case("recipe-nan-scale", ["task=check", *TINY_MODEL, "recipe={nan_scale}"], ["layers.1.k.scale", "nan"]),
    Case("recipe-non-positive-scale", [*EVAL, "recipe={zero_scale}"], ["layers.1.k.scale", "non-positive"]),
    Case("recipe-not-orthogonal", [*EVAL, "recipe={not_orthogonal}"], ["layers.0.k.rotation", "orthogonal"]),
    Case("recipe-unknown-role", [*EVAL, "recipe={unknown_role}"], ["layers.0.k.mystery", "role"]),
    Case("recipe-mixed-layer", ["task=check", *TINY_MODEL, "recipe={mixed_layer}"],
         ["the runtime has no path", "layer 0 mixes a predictive and a per-frame kind", "logit correction on its keys"]),
    Case("recipe-other-model", ["task=check", *TINY_MODEL, "recipe={other_model}"], ["fingerprint", "recalibrate"]),
    Case("recipe-compensator-shape", ["task=check", *TINY_MODEL, "recipe={comp_wrong_shape}"],
         ["layers.0.k.comp_down", "shape", "[2, 64, 3]"]),
    Case("recipe-logit-bias-shape", ["task=check", *TINY_MODEL, "recipe={logit_bias_wrong_shape}"],
         ["layers.0.k.logit_bias", "shape", "[2, 63]"], subprocess=True),
    Case("recipe-keyframe-interval-negative", ["task=check", *TINY_MODEL, "recipe={keyframe_interval_negative}"],
         ["policy.keyframe_interval", ">= 0"]),
    Case("recipe-missing-file", [*EVAL, "recipe={missing}"], ["does-not-exist.safetensors", "no such"]),
    Case("recipe-not-given", ["task=evaluate"], ["recipe=path"]),
    # trajectory files
    Case("trajectories-garbage", ["task=stats", *TINY_MODEL, "trajectories.file={traj_garbage}"],
         ["garbage.safetensors", "not a readable"], subprocess=True),
    Case("trajectories-wrong-format", ["task=stats", *TINY_MODEL, "trajectories.file={good}"], ["good.safetensors", "format"]),
    Case("trajectories-missing-tensor", ["task=stats", *TINY_MODEL, "trajectories.file={traj_missing_tensor}"],
         ["traj_missing.safetensors", "0.actions"]),
    Case("trajectories-missing-file", ["task=stats", *TINY_MODEL, "trajectories.file={missing}"], ["does-not-exist.safetensors"]),
    # configs
    Case("unknown-task", ["task=nope"], ["unknown task 'nope'"]),
    Case("unknown-group-option", ["quant=nope"], ["unknown option 'nope' for quant", "kivi2"], subprocess=True),
    Case("unknown-trajectory-set", ["trajectories=nope"], ["unknown option 'nope' for trajectories", "quick"]),
    Case("unknown-option-in-sweep", ["-m", "quant=kivi2,nope"], ["unknown option 'nope' for quant"]),
    Case("unknown-key", ["+foo=1"], ["unknown key 'foo'"]),
    Case("misspelt-key", ["fit.budgt_bits=2"], ["unknown key 'fit.budgt_bits'", "did you mean fit.budget_bits"],
         subprocess=True),
    Case("misspelt-nested-key", ["task=stats", "model.cache.windw=4"], ["model.cache.windw", "model.cache.window"]),
    Case("unparseable-override", ["fit.clip_grid=[1.0"], ["cannot parse", "fit.clip_grid=[1.0"]),
    Case("wan-setting-for-tinyworld", ["model.wan.chunk_frames=3"],
         ["model=tinyworld has no setting 'model.wan.chunk_frames'", "model=wan_diffusers, wanworld"], subprocess=True),
    Case("wan-setting-wanworld-lacks", ["model=wanworld", "model.wan.config=x"],
         ["model=wanworld has no setting 'model.wan.config'", "conf/model/wanworld.yaml"]),
    Case("fitter-set-budget", ["quant.budget_bits=3"], ["quant.budget_bits", "fit.budget_bits"]),
    Case("check-shorter-set", ["task=check", "recipe=tinyworld-ours-2bit", "check.num_frames=8"],
         ["measured on check (4 x 128 frames)", "replay check (4 x 8 frames)", "check.min_psnr_db"]),
    Case("check-another-set", ["task=check", "recipe=tinyworld-ours-2bit", "trajectories=quick"],
         ["measured on check (4 x 128 frames)", "replay quick", "check.max_flicker"]),
    Case("negative-num-frames", ["trajectories.num_frames=-1"], ["trajectories.num_frames", "-1"], subprocess=True),
    Case("zero-num-trajectories", ["trajectories.num_trajectories=0"], ["trajectories.num_trajectories", "0"]),
    Case("unknown-family", ["trajectories.families=[orbit,nope]"], ["family", "nope"]),
    Case("unknown-train-family", ["task=train_world", "train.motion_families=[dolly,nope]"],
         ["train.motion_families", "nope"]),
    Case("bad-device", ["device=tpu"], ["device", "tpu"]),
    Case("non-numeric-value", ["trajectories.num_frames=abc"], ["trajectories.num_frames", "abc"]),
    Case("clip-above-one", ["fit.clip_grid=[1.0,1.5]"], ["fit.clip_grid", "1.5"]),
    Case("unknown-rotation", ["fit.rotations=[none,spin]"], ["fit.rotations", "spin"]),
    Case("zero-window", ["model.cache.window=0"], ["model.cache.window"]),
    Case("unknown-model", ["task=stats", "model.name=bigworld"], ["bigworld"]),
    Case("budget-below-2-bits", ["task=calibrate", *TINY_MODEL, *QUICK, "trajectories.families=[orbit]",
                                 "fit.budget_bits=1.0", "fit.trace_frames=4", "fit.sample_tokens=64",
                                 "fit.clip_grid=[1.0]", "fit.rotations=[none]"], ["budget_bits", "1.0"]),
    Case("budget-nan", ["task=calibrate", *TINY_MODEL, "fit.budget_bits=nan"], ["fit.budget_bits", "finite"]),
    Case("anchor-reach-nan", ["task=calibrate", *TINY_MODEL, "fit.anchor_sd=nan"], ["fit.anchor_sd", "finite number > 0"]),
    Case("anchor-peak-negative", ["task=calibrate", *TINY_MODEL, "fit.anchor_peak_mult=-1"], ["fit.anchor_peak_mult", "finite number >= 0"]),
    Case("refresh-negative", ["task=calibrate", *TINY_MODEL, "fit.sink_refresh=-1"], ["fit.sink_refresh", ">= 0 frames"]),
    Case("base-width-too-wide", ["task=calibrate", *TINY_MODEL, "fit.base_bits_max=3"], ["fit.base_bits_max", "[1, 2]"]),
    Case("budget-below-predictive-floor", ["task=calibrate", *TINY_MODEL, "fit.budget_bits=1.01"],
         ["fit.budget_bits=1.01", "window=16"]),
    Case("unknown-scheme", ["task=compare", *TINY_MODEL, "schemes=[fp16,nope]"], ["unknown scheme 'nope'"]),
    Case("ours-without-a-shipped-recipe", ["task=compare", "model=wan_diffusers", "schemes=[ours]"],
         ["scheme 'ours': no shipped recipe for model 'wan_diffusers'", "wan_diffusers-ours-2bit.safetensors"]),
    Case("unknown-preset", ["task=calibrate", *TINY_MODEL, "quant.preset=nope"],
         ["unknown scheme 'nope'", "kivi2_lowmem", "turbo2.5", "jensen2", "qvg2_static"]),
    Case("preset-over-budget", ["task=calibrate", *TINY_MODEL, "quant=kivi2", "fit.budget_bits=2.5"],
         ["preset 'kivi2'", "9.3", "fit.budget_bits=2.5", "turbo2.5 (2.38)"], subprocess=True),
    Case("comp-rank-above-head-dim", ["task=calibrate", *TINY_MODEL, *QUICK, "trajectories.families=[orbit]",
                                      "fit.comp_rank=65", "fit.trace_frames=4", "fit.sample_tokens=64",
                                      "fit.clip_grid=[1.0]", "fit.rotations=[none]"], ["fit.comp_rank=65", "head_dim 64"]),
    Case("keyframe-interval-zero", ["fit.keyframes=true", "fit.keyframe_intervals=[8,0]"],
         ["fit.keyframe_intervals", "[8, 0]"]),
    # weights
    Case("weights-missing", ["task=stats", "model.weights={missing}"], ["does-not-exist.safetensors", "not found"]),
    Case("weights-corrupt", ["task=stats", "model.weights={weights_corrupt}"], ["weights_corrupt.safetensors", "not a readable"],
         subprocess=True),
    Case("weights-shape-mismatch", ["task=stats", "model.weights={weights_shape}"], ["weights_shape.safetensors", "shape"]),
    Case("train-unknown-loss", ["task=train_world", "train.loss=l1"], ["train.loss", "l1"]),
    Case("train-init-weights-missing", ["task=train_world", "train.init_weights={missing}"],
         ["train.init_weights", "does-not-exist.safetensors", "not found"]),
    Case("train-init-weights-other-architecture", ["task=train_world", "train.init_weights={weights}"],
         ["train.init_weights", "shape", "the model needs"]),
]
if not torch.cuda.is_available():
    CASES.append(Case("cuda-without-gpu", ["task=stats", *TINY_MODEL, "device=cuda:0"], ["device=cuda:0", "cuda"]))


def test_suite_is_large_enough():
    assert len(CASES) >= 25 and sum(c.subprocess for c in CASES) >= 3


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_with_one_clear_line_and_overwrites_nothing(case, files, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    run_dir = tmp_path / "run"
    for name, data in SENTINELS.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    args = [a.format(**{k: str(v) for k, v in files.items()}) for a in case.args] + [f"hydra.run.dir={run_dir}"]
    if case.subprocess:
        code, _, err = run_subprocess(args)
    else:
        code, _, err = run_in_process(args, capsys)

    assert "Traceback" not in err, err
    lines = nonempty_lines(err)
    assert lines, "no message on stderr"
    assert code == 2, err
    errors = [l for l in lines if l.startswith("error:")]
    assert errors == [lines[-1]], f"expected exactly one 'error:' line, last on stderr:\n{err}"
    text = lines[-1].lower()
    for word in case.expect:
        assert word.lower() in text, f"{word!r} not in {text!r}"
    for name, data in SENTINELS.items():
        assert (run_dir / name).read_bytes() == data, f"{name} was overwritten"
    left = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()} - set(SENTINELS) - ALLOWED_AFTER_FAILURE
    assert not left, f"a failed run left {sorted(left)}"


def test_an_empty_run_dir_is_refused_before_anything_is_written():
    """hydra.run.dir= (empty) would write the run's files into the current directory."""
    from calibrate.__main__ import check_overrides

    for value in ("", "''", "  "):
        with pytest.raises(ValueError, match="hydra.run.dir is empty"):
            check_overrides(["task=stats", f"hydra.run.dir={value}"])
    check_overrides(["task=stats", "hydra.run.dir=out"])


def test_version_names_calibrate():
    run = subprocess.run([sys.executable, "-m", "calibrate", "--version"], cwd=REPO, env=env(), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("calibrate 0.") and "Hydra" in run.stdout, run.stdout


# ---- the happy path, --help, --cfg ---------------------------------------------------------------
def test_stats_smoke_writes_fixed_names(tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = run_subprocess(["task=stats", "trajectories=quick", "trajectories.num_frames=8",
                                   "trajectories.num_trajectories=2", f"hydra.run.dir={run_dir}"])
    assert code == 0, err
    for name in ("stats.safetensors", "stats.json", "stats.png", "config.yaml"):
        assert (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0, name
    assert json.loads((run_dir / "stats.json").read_text())
    # the per-batch resume checkpoint and temporary files are gone after a finished run
    assert not [p.name for p in run_dir.iterdir() if "partial" in p.name or p.name.endswith(".tmp")]
    # the records Hydra would write before the task, written once it succeeded
    assert "task: stats" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert "trajectories.num_frames=8" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "run:" in (run_dir / ".hydra" / "hydra.yaml").read_text()
    assert "torch threads: 1 (OMP_NUM_THREADS)" in (run_dir / "__main__.log").read_text()


def test_a_failed_rerun_leaves_a_finished_runs_records_alone(tiny, tmp_path, capsys):
    """A run that gets past Hydra and fails in the task (here: the model's weights are gone)."""
    _, weights = tiny
    run_dir = tmp_path / "run"
    args = ["task=stats", f"model.weights={weights}", *QUICK, f"hydra.run.dir={run_dir}"]
    code, _, err = run_in_process(args, capsys)
    assert code == 0, err
    records = {p: p.read_bytes() for p in run_dir.rglob("*.yaml")}
    assert len(records) == 4  # config.yaml, .hydra/{config,hydra,overrides}.yaml
    code, _, err = run_in_process([*args, "model.cache.window=4", f"model.weights={tmp_path / 'gone.safetensors'}"],
                                  capsys)
    assert code == 2, err
    assert {p: p.read_bytes() for p in run_dir.rglob("*.yaml")} == records


def test_torch_threads_follow_omp_num_threads_else_the_idle_cpus(monkeypatch):
    import calibrate.__main__ as cli

    assert 1 <= cli.usable_cpus() <= (os.cpu_count() or 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cli.torch_threads()[0] == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(cli, "usable_cpus", lambda: 8)
    for load, threads in ((0.0, 8), (2.4, 6), (7.6, 1), (30.0, 1)):
        monkeypatch.setattr(cli.os, "getloadavg", lambda: (load, 0.0, 0.0))
        n, why = cli.torch_threads()
        assert n == threads and "8 usable CPUs" in why and "OMP_NUM_THREADS" in why


def test_help_lists_the_tasks():
    code, out, err = run_subprocess(["--help"])
    assert code == 0, err
    for task in ("calibrate", "stats", "evaluate", "compare", "check", "train_world"):
        assert task in out


def test_cfg_job_prints_the_config(capsys, monkeypatch, tmp_path):
    code, out, err = run_in_process(["--cfg", "job", "task=stats", "trajectories=quick", f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 0, err
    assert "task: stats" in out and "num_frames: 48" in out and "budget_bits:" in out
    assert not list(tmp_path.iterdir())  # printing the config runs nothing

"""Wan checkpoints as published (original Wan layout, wrapped, prefixed) load into the same model as
their diffusers directory; what is not a Wan checkpoint, or carries code, fails in one line.

The original layout is written here from the tiny random model with a rename table taken from
the two published layouts (Wan's own `WanModel` module names and diffusers' `WanTransformer3DModel`),
not from diffusers' converter, so the loader's conversion is checked against an independent copy.
"""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

diffusers = pytest.importorskip("diffusers")

from calibrate.adapters import wan_checkpoint as wc  # noqa: E402
from calibrate.adapters import wan_diffusers as wan  # noqa: E402
from calibrate.adapters.wan_diffusers import WanSettings  # noqa: E402
from calibrate.config import ModelConfig  # noqa: E402
from calibrate.pipeline import load_adapter  # noqa: E402
from calibrate.world.trajectories import make_trajectories  # noqa: E402
from calibrate.cache import KVCache  # noqa: E402

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]

# diffusers name fragment -> original Wan name fragment (Wan 2.1 `WanModel` vs diffusers
# `WanTransformer3DModel`); the original's `norm3` is the cross-attention norm, diffusers' `norm2`
TO_ORIGINAL = [
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    (".attn1.to_out.0.", ".self_attn.o."), (".attn2.to_out.0.", ".cross_attn.o."),
    (".attn1.to_q.", ".self_attn.q."), (".attn1.to_k.", ".self_attn.k."), (".attn1.to_v.", ".self_attn.v."),
    (".attn2.to_q.", ".cross_attn.q."), (".attn2.to_k.", ".cross_attn.k."), (".attn2.to_v.", ".cross_attn.v."),
    (".attn1.norm_", ".self_attn.norm_"), (".attn2.norm_", ".cross_attn.norm_"),
    (".norm2.", ".norm3."), (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."),
    (".scale_shift_table", ".modulation"),
]
TOP_LEVEL = {"proj_out.weight": "head.head.weight", "proj_out.bias": "head.head.bias",
             "scale_shift_table": "head.modulation"}


def original_layout(state: dict) -> dict:
    out = {}
    for key, tensor in state.items():
        name = TOP_LEVEL.get(key, key)
        for new, old in TO_ORIGINAL:
            name = name.replace(new, old)
        out[name] = tensor.clone()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random Wan as a diffusers directory, and its weights in the original layout."""
    d = tmp_path_factory.mktemp("wan")
    model = wan.tiny_transformer()
    model.save_pretrained(d / "tiny")
    return d, original_layout(model.state_dict())


def write(d: Path, name: str, orig: dict, prefix: str = "", wrap: str | None = None) -> Path:
    state = {prefix + k: v for k, v in orig.items()}
    path = d / name
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save({wrap: state, "step": 1000} if wrap else state, path)
    return path


FORMATS = [  # (file name, key prefix, wrapper key)
    ("plain.safetensors", "", None),
    ("prefixed.safetensors", "model.", None),
    ("comfy.safetensors", "model.diffusion_model.", None),
    ("plain.pt", "", None),
    ("generator.pt", "model.", "generator"),  # Self-Forcing / CausVid: the wrapper's `.model`
    ("generator.pth", "generator.", None),
]


def rollout(adapter, frames: int = 4) -> torch.Tensor:
    trajs = make_trajectories(["orbit"], "calibration", 2, frames)
    return adapter.rollout(trajs, KVCache(adapter.info.num_layers, 2, 1), CPU)


@pytest.mark.parametrize("name,prefix,wrap", FORMATS, ids=[f[0] for f in FORMATS])
def test_original_layout_loads_into_the_same_model_as_the_diffusers_directory(tiny, name, prefix, wrap):
    d, orig = tiny
    path = write(d, name, orig, prefix, wrap)
    settings = WanSettings(config=str(d / "tiny"), denoise_timesteps=[1000, 500])
    from_file = load_adapter(ModelConfig(name="wan_diffusers", weights=str(path), wan=settings), CPU)
    from_dir = load_adapter(ModelConfig(name="wan_diffusers", weights=str(d / "tiny"),
                                        wan=WanSettings(denoise_timesteps=[1000, 500])), CPU)
    assert from_file.info == from_dir.info  # same weights fingerprint
    a, b = from_file.transformer.state_dict(), from_dir.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert torch.equal(rollout(from_file), rollout(from_dir))


def test_bfloat16_keeps_the_modules_diffusers_keeps_in_float32(tiny):
    d, orig = tiny
    path = write(d, "bf16.pt", {k: v.bfloat16() for k, v in orig.items()}, "model.", "generator")
    from_file = wan.load(str(path), WanSettings(config=str(d / "tiny"), dtype="bfloat16"), CPU).transformer
    dtypes = {k: v.dtype for k, v in from_file.state_dict().items()}
    from_dir = wan.load(str(d / "tiny"), WanSettings(dtype="bfloat16"), CPU).transformer.state_dict()
    assert dtypes == {k: v.dtype for k, v in from_dir.items()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16 and dtypes["scale_shift_table"] == torch.float32


def test_which_wrapped_state_dict_is_taken(tiny, tmp_path, caplog):
    d, orig = tiny
    other = {k: torch.zeros_like(v) for k, v in orig.items()}
    path = tmp_path / "sf.pt"
    torch.save({"generator": other, "generator_ema": orig, "critic": {"x": torch.zeros(1)}}, path)
    state, kind, notes = wc.read_checkpoint(path)
    assert kind == "original" and notes == ["took the state dict under 'generator_ema'"]
    assert torch.equal(state["head.head.weight"], orig["head.head.weight"])
    state, _, notes = wc.read_checkpoint(path, key="generator")
    assert notes == ["took the state dict under 'generator'"] and not state["head.head.weight"].any()
    with caplog.at_level("INFO"):
        wan.load(str(path), WanSettings(config=str(d / "tiny")), CPU)
    assert "took the state dict under 'generator_ema'" in caplog.text
    with pytest.raises(wan.AdapterError, match=r"no state dict under model.wan.checkpoint_key='ema'.*'generator'"):
        wc.read_checkpoint(path, key="ema")
    torch.save({"a": orig, "b": orig}, tmp_path / "two.pt")
    with pytest.raises(wan.AdapterError, match="state dicts under 'a', 'b': choose one with model.wan.checkpoint_key"):
        wc.read_checkpoint(tmp_path / "two.pt")


class Payload:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_bad_checkpoints_fail_with_one_line(tiny, tmp_path):
    d, orig = tiny
    torch.save({"generator": orig, "hook": Payload()}, tmp_path / "code.pt")
    (tmp_path / "raw.pth").write_bytes(pickle.dumps(Payload()))
    save_file({"encoder.weight": torch.zeros(2), "decoder.bias": torch.zeros(2)}, tmp_path / "vae.safetensors")
    save_file({**orig, "blocks.0.action_model.mouse.weight": torch.zeros(2)}, tmp_path / "actions.safetensors")
    bad_shape = dict(orig)
    bad_shape["blocks.1.ffn.0.weight"] = torch.zeros(255, 128)
    save_file(bad_shape, tmp_path / "shape.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(os.urandom(64))
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "text.pt").write_text("hello")
    (tmp_path / "prose.pt").write_text("not a checkpoint\n")  # torch: "Unsupported operand 110", not code
    torch.save(orig, tmp_path / "full.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "full.pt").read_bytes()[:300])
    cases = {
        "code.pt": "refused: it pickles Python objects, not only tensors",
        "raw.pth": "refused",
        "vae.safetensors": "not a Wan transformer checkpoint in the original Wan or the diffusers layout: 2 tensors, "
                           "first keys decoder.bias, encoder.weight",  # (safetensors sorts its keys)
        "actions.safetensors": "has 1 tensors diffusers' WanTransformer3DModel does not (e.g. "
                               "blocks.0.action_model.mouse.weight)",
        "shape.safetensors": "blocks.1.ffn.net.0.proj.weight has shape [255, 128], the config needs [256, 128]",
        "garbage.safetensors": "not a readable safetensors file",
        "notes.txt": "not a diffusers model directory, a .safetensors file or a state dict",
        "missing.pt": "no such file or directory",
        "text.pt": "is not a readable checkpoint",
        "prose.pt": "is not a readable checkpoint",
        "cut.pt": "is not a readable checkpoint",
    }
    for name, message in cases.items():
        with pytest.raises(wan.AdapterError) as e:
            wan.load(str(tmp_path / name), WanSettings(config=str(d / "tiny")), CPU)
        assert message in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    # without a config, weights of another size than Wan2.1-T2V-1.3B name what they are
    with pytest.raises(wan.AdapterError, match=r"has dim 128, in_channels 4, num_layers 2, ffn_dim 256, not "
                                               r"Wan2.1-T2V-1.3B's \(dim 1536, 30 layers\): pass its config"):
        wan.load(str(write(d, "noconfig.safetensors", orig)), WanSettings(), CPU)
    with pytest.raises(wan.AdapterError, match="model.wan.config=x needs model.weights"):
        wan.load(None, WanSettings(config="x"), CPU)


def test_cli_loads_a_checkpoint_file_and_refuses_code_in_one_line(tiny, tmp_path):
    d, orig = tiny
    good = write(d, "cli.pt", orig, "model.", "generator")
    torch.save({"generator": orig, "hook": Payload()}, tmp_path / "code.pt")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    common = ["task=stats", "model=wan_diffusers", "trajectories=quick", "trajectories.num_frames=4",
              "trajectories.num_trajectories=1", "model.wan.denoise_timesteps=[1000]", f"model.wan.config={d / 'tiny'}"]

    def run(*args):
        return subprocess.run([sys.executable, "-m", "calibrate", *common, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)

    ok = run(f"model.weights={good}", f"hydra.run.dir={tmp_path / 'ok'}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "ok" / "stats.safetensors").is_file()  # the replay ran on the converted weights
    assert "took the state dict under 'generator'; stripped 'model.'" in (tmp_path / "ok" / "__main__.log").read_text()
    bad = run(f"model.weights={tmp_path / 'code.pt'}", f"hydra.run.dir={tmp_path / 'bad'}")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "refused" in lines[0], bad.stderr


# ---- configs -------------------------------------------------------------------------------------
# Wan2.1-T2V-1.3B as published: diffusers' transformer/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers,
# and the original release's config.json
PUBLISHED_DIFFUSERS = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
                       "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
                       "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": None,
                       "added_kv_proj_dim": None}
PUBLISHED_ORIGINAL = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": 1536, "eps": 1e-06,
                      "ffn_dim": 8960, "freq_dim": 256, "in_dim": 16, "model_type": "t2v", "num_heads": 12,
                      "num_layers": 30, "out_dim": 16, "text_len": 512}


def test_shipped_config_is_the_published_one_and_original_configs_map_to_it(tmp_path):
    shipped = wc.read_config("wan2.1-t2v-1.3b")
    assert {k: shipped[k] for k in PUBLISHED_DIFFUSERS} == PUBLISHED_DIFFUSERS
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_ORIGINAL))
    mapped = wc.read_config(str(tmp_path))
    assert {k: mapped[k] for k in PUBLISHED_DIFFUSERS} == PUBLISHED_DIFFUSERS
    with pytest.raises(wan.AdapterError, match="not a shipped config"):
        wc.read_config(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("config", [
    wan.TINY,
    PUBLISHED_DIFFUSERS,
    {**PUBLISHED_DIFFUSERS, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 1536},  # an i2v layout
    {**wan.TINY, "cross_attn_norm": False, "pos_embed_seq_len": 4, "image_dim": 16, "added_kv_proj_dim": 128},
], ids=["tiny", "wan2.1-t2v-1.3b", "i2v", "variants"])
def test_num_params_counts_what_diffusers_builds(config):
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**config)
    assert wc.num_params(config) == sum(p.numel() for p in model.parameters())

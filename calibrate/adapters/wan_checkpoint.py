"""Wan transformer checkpoints as their authors publish them, loaded into diffusers' Wan.

Self-Forcing, CausVid and LongLive publish their causal Wan-2.1 fine-tunes as one file in the
*original* Wan layout (`blocks.0.self_attn.q.weight`, `head.modulation`, ...), not as a diffusers
model directory, and often wrapped by their training code:

- a `.pt` / `.pth` file holding a dict around the state dict: Self-Forcing `{"generator": ...,
  "generator_ema": ...}` (its inference takes `generator_ema` with `--use_ema`), CausVid and
  LongLive `{"generator": ...}`;
- keys under the wrapper module's name: `model.` (the `WanDiffusionWrapper` whose `.model` is
  the Wan), `generator.`, or ComfyUI's `model.diffusion_model.`;
- or a plain `.safetensors` (Matrix-Game 2.0, ComfyUI repacks).

`load` reads such a file (safetensors, or `torch.load(weights_only=True)`: tensors and plain
containers only, never code: a pickle that carries objects is refused), takes the state dict out
of its wrapper (`checkpoint_key`, else the first of `WRAPPER_KEYS` present, and says which),
strips a wrapper prefix, recognises the layout (original Wan or diffusers), renames original
keys with diffusers' own converter (the one `from_single_file` applies), checks every tensor
against the config (names and shapes, so a checkpoint of another size or with modules diffusers'
Wan lacks fails in one line naming them), sets dtypes as `from_pretrained` would and loads it
with `WanTransformer3DModel.from_single_file(state_dict, config=<local dir>)`. No network: the
config is local.

The config: `model.wan.config` (a shipped name from `wan_configs/`, a directory holding
`config.json`, or a `config.json` in diffusers' or the original Wan's format), else the shipped
Wan2.1-T2V-1.3B config when the weights have its width and depth. The number of heads cannot be
read from the weights (every q/k/v/norm tensor spans all heads), so a checkpoint of another size
needs its config.

`num_params` counts a config's parameters without building the model (importing diffusers
takes seconds; `task=capacity` answers in less): a test holds it to diffusers' own count.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch
from torch import Tensor

from calibrate.adapters.base import AdapterError

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "wan_configs"
DEFAULT_CONFIG = "wan2.1-t2v-1.3b"
# where training code keeps the weights inside a checkpoint file, in order of preference
WRAPPER_KEYS = ("generator_ema", "generator", "model", "state_dict", "module", "ema")
# prefixes wrapper modules put on every key (stripped while every key has one)
PREFIXES = ("model.diffusion_model.", "generator.", "model.", "module.", "_orig_mod.", "diffusion_model.")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
ORIGINAL_KEYS = ("patch_embedding.weight", "blocks.0.self_attn.q.weight", "head.head.weight")
DIFFUSERS_KEYS = ("patch_embedding.weight", "blocks.0.attn1.to_q.weight", "proj_out.weight")
CLIP_DIM = 1280  # image embedding width of Wan's image-conditioned (i2v) models
TEXT_DIM = 4096  # UMT5-XXL, the text encoder of every Wan-2.1 model


# ---- configs ---------------------------------------------------------------------------------
def config_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def read_config(spec: str) -> dict:
    """diffusers `WanTransformer3DModel` keyword arguments from a shipped name, a directory with
    `config.json`, or a `config.json` (diffusers' format, or the original Wan's: `dim`, `num_heads`)."""
    path = CONFIG_DIR / f"{spec}.json" if spec in config_names() else Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise AdapterError(f"model.wan.config: {spec} is not a shipped config ({', '.join(config_names())}), "
                           f"a directory with config.json, or a config file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"model.wan.config: cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"model.wan.config: {path} is not a JSON object")
    config = from_original_config(raw) if "dim" in raw and "num_heads" in raw else raw
    need = ("num_attention_heads", "attention_head_dim", "num_layers")
    missing = [k for k in need if k not in config]
    if missing:
        raise AdapterError(f"model.wan.config: {path} has no {', '.join(missing)}: not a Wan transformer config")
    return {k: v for k, v in config.items() if not k.startswith("_")}


def from_original_config(raw: dict) -> dict:
    """The original Wan `config.json` (`WanModel`: dim, num_heads, in_dim, ...) as diffusers'
    keyword arguments, as diffusers' own conversion script maps it (scripts/convert_wan_to_diffusers.py):
    head_dim = dim / num_heads; image-conditioned models (`model_type` i2v / flf2v) add the CLIP
    image embedder and the image key/value projections of width dim."""
    dim, heads = int(raw["dim"]), int(raw["num_heads"])
    if dim % heads:
        raise AdapterError(f"model.wan.config: dim {dim} is not a multiple of num_heads {heads}")
    image = raw.get("model_type", "t2v") in ("i2v", "flf2v")
    return {"patch_size": list(raw.get("patch_size", (1, 2, 2))), "num_attention_heads": heads,
            "attention_head_dim": dim // heads, "in_channels": int(raw.get("in_dim", 16)),
            "out_channels": int(raw.get("out_dim", 16)), "text_dim": int(raw.get("text_dim", TEXT_DIM)),
            "freq_dim": int(raw.get("freq_dim", 256)), "ffn_dim": int(raw["ffn_dim"]),
            "num_layers": int(raw["num_layers"]), "eps": float(raw.get("eps", 1e-6)),
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
            "image_dim": CLIP_DIM if image else None, "added_kv_proj_dim": dim if image else None}


def num_params(config: dict) -> int:
    """Parameters of diffusers' `WanTransformer3DModel` built from `config` (its modules, counted
    from diffusers' constructor: transformer_wan.py); a test compares it with the built model."""
    heads, head_dim = config["num_attention_heads"], config.get("attention_head_dim", 128)
    d, ffn, layers = heads * head_dim, config.get("ffn_dim", 13824), config["num_layers"]
    patch = config.get("patch_size", (1, 2, 2))
    in_ch, freq, text = config.get("in_channels", 16), config.get("freq_dim", 256), config.get("text_dim", 4096)
    out_ch = config.get("out_channels") or in_ch
    linear = lambda i, o: i * o + o
    total = in_ch * d * math.prod(patch) + d  # patch embedding (Conv3d)
    total += linear(freq, d) + linear(d, d) + linear(d, 6 * d)  # time embedder + projection
    total += linear(text, d) + linear(d, d)  # text embedder
    image = config.get("image_dim")
    if image:  # norm1, ff (image -> image -> d), norm2 (+ a learned position table)
        total += 2 * image + linear(image, image) + linear(image, d) + 2 * d
        total += (config.get("pos_embed_seq_len") or 0) * image
    attention = 4 * linear(d, d) + 2 * d  # q, k, v, out + RMS norms of q and k
    block = 2 * attention + linear(d, ffn) + linear(ffn, d) + 6 * d  # + the block's modulation table
    if config.get("cross_attn_norm", True):
        block += 2 * d
    kv = config.get("added_kv_proj_dim")
    if kv:
        block += 2 * linear(kv, d) + d
    return total + layers * block + linear(d, out_ch * math.prod(patch)) + 2 * d


# ---- reading a checkpoint file -----------------------------------------------------------------
def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, Tensor) for v in obj.values())


def _pickled(path: Path) -> bool:
    """torch.save's zip container, or a raw pickle (protocol 2+ opens with PROTO, 0x80): text that
    happens to parse as a few pickle opcodes is neither."""
    with open(path, "rb") as f:
        return zipfile.is_zipfile(path) or f.read(1) == b"\x80"


def read_file(path: Path, mmap: bool = True):
    """What the file holds: safetensors' tensors, or a pickle read with `weights_only=True`."""
    if not path.is_file():
        raise AdapterError(f"model.weights: {path} is not a diffusers model directory or a checkpoint file "
                           f"(no such file or directory)")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise AdapterError(f"model.weights: {path} is not a readable safetensors file "
                               f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    if path.suffix not in PICKLE_SUFFIXES:
        raise AdapterError(f"model.weights: {path} is not a diffusers model directory, a .safetensors file or a "
                           f"state dict ({', '.join(PICKLE_SUFFIXES)})")
    import pickle

    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr: one line is the contract
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        if not str(e).startswith("Weights only load failed") or not _pickled(path):  # not a pickle at all
            raise AdapterError(f"model.weights: {path} is not a readable checkpoint ({str(e).splitlines()[0]})") from None
        found = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        raise AdapterError(f"model.weights: {path} was refused: it pickles Python objects, not only tensors"
                           f"{f' ({found})' if found else ''}; calibrate reads .pt/.pth files with "
                           f"torch.load(weights_only=True) and never runs their code: save the state dict alone "
                           f"(or as .safetensors)") from None
    except (OSError, RuntimeError, EOFError, ValueError, KeyError) as e:  # a damaged or foreign file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AdapterError(f"model.weights: {path} is not a readable checkpoint ({first})") from None


def unwrap(obj, path: Path, key: str | None = None) -> tuple[dict[str, Tensor], str | None]:
    """(the state dict, the wrapper key it was taken from, or None when the file is the state dict)."""
    if not isinstance(obj, dict):
        raise AdapterError(f"model.weights: {path} holds a {type(obj).__name__}, not a dict of tensors")
    if key is not None:
        if not _is_state_dict(obj.get(key)):
            inner = [k for k, v in obj.items() if _is_state_dict(v)]
            raise AdapterError(f"model.weights: {path} has no state dict under model.wan.checkpoint_key={key!r}; "
                               f"it has {', '.join(map(repr, inner)) or 'none'}")
        return obj[key], key
    if _is_state_dict(obj):
        return obj, None
    inner = {k: v for k, v in obj.items() if _is_state_dict(v)}
    for name in WRAPPER_KEYS:
        if name in inner:
            return inner[name], name
    if len(inner) == 1:
        return next(iter(inner.items()))[::-1]
    top = ", ".join(repr(k) for k in list(obj)[:6])
    what = f"state dicts under {', '.join(map(repr, inner))}: choose one with model.wan.checkpoint_key" if inner \
        else f"no dict of tensors (top-level keys: {top})"
    raise AdapterError(f"model.weights: {path} holds {what}")


def strip_prefixes(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], str]:
    """The state dict without the wrapper prefixes every key carries, and what was stripped."""
    stripped = ""
    while True:
        prefix = next((p for p in PREFIXES if all(k.startswith(p) for k in state)), None)
        if prefix is None:
            return state, stripped
        state = {k[len(prefix):]: v for k, v in state.items()}
        stripped += prefix


def layout(state: dict[str, Tensor], path: Path) -> str:
    """'original' (Wan's own key names) or 'diffusers'; one line naming what was found otherwise."""
    if all(k in state for k in ORIGINAL_KEYS):
        return "original"
    if all(k in state for k in DIFFUSERS_KEYS):
        return "diffusers"
    first = ", ".join(list(state)[:4])
    raise AdapterError(f"model.weights: {path} is not a Wan transformer checkpoint in the original Wan or the diffusers "
                       f"layout: {len(state)} tensors, first keys {first}")


def read_checkpoint(path: str | Path, key: str | None = None) -> tuple[dict[str, Tensor], str, list[str]]:
    """(state dict with wrapper prefixes stripped, its layout, notes on what was done to get it)."""
    path = Path(path)
    state, taken = unwrap(read_file(path), path, key)
    state, prefix = strip_prefixes(state)
    notes = ([f"took the state dict under {taken!r}"] if taken else []) + ([f"stripped {prefix!r}"] if prefix else [])
    return state, layout(state, path), notes


# ---- which config --------------------------------------------------------------------------------
def weight_shape(state: dict[str, Tensor], kind: str) -> dict:
    """What the weights say about the architecture: width, depth, channels, feed-forward width."""
    patch = state["patch_embedding.weight"]
    ffn_key = "blocks.0.ffn.0.weight" if kind == "original" else "blocks.0.ffn.net.0.proj.weight"
    prefix = "blocks."
    depth = len({k.split(".")[1] for k in state if k.startswith(prefix)})
    return {"dim": patch.shape[0], "in_channels": patch.shape[1], "num_layers": depth,
            "ffn_dim": state[ffn_key].shape[0] if ffn_key in state else None}


def config_for(state: dict[str, Tensor], kind: str, spec: str | None, path: Path) -> tuple[dict, str]:
    """(the config for these weights, where it came from): `spec` when given, else the shipped
    Wan2.1-T2V-1.3B config if the weights have its width and depth."""
    if spec is not None:
        return read_config(spec), spec
    config = read_config(DEFAULT_CONFIG)
    found = weight_shape(state, kind)
    want = {"dim": config["num_attention_heads"] * config["attention_head_dim"], "num_layers": config["num_layers"]}
    if any(found[k] != v for k, v in want.items()):
        shape = ", ".join(f"{k} {v}" for k, v in found.items() if v is not None)
        raise AdapterError(f"model.weights: {path} has {shape}, not Wan2.1-T2V-1.3B's (dim {want['dim']}, "
                           f"{want['num_layers']} layers): pass its config with model.wan.config=DIR|config.json "
                           f"(the number of heads cannot be read from the weights)")
    return config, DEFAULT_CONFIG


def diffusers_names(state: dict[str, Tensor], kind: str) -> dict[str, Tensor]:
    """The state dict under diffusers' names, renamed by diffusers' own converter (the one
    `from_single_file` applies: single_file_utils.convert_wan_transformer_to_diffusers)."""
    if kind == "diffusers":
        return state
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(state))  # it pops from the dict it is given


def check_against(state: dict[str, Tensor], config: dict, path: Path) -> None:
    """Every tensor the config's model needs is in `state` (diffusers' names) with its shape, and
    nothing else is."""
    import diffusers

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in diffusers.WanTransformer3DModel(**config).state_dict().items()}
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    if missing:
        raise AdapterError(f"model.weights: {path} lacks {len(missing)} tensors its config needs "
                           f"(e.g. {', '.join(missing[:3])}): another model, or the config of another size "
                           f"(model.wan.config)")
    if extra:
        raise AdapterError(f"model.weights: {path} has {len(extra)} tensors diffusers' WanTransformer3DModel does not "
                           f"(e.g. {', '.join(extra[:3])}): modules it cannot run (action modules, LoRA adapters) or "
                           f"the config of another model")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise AdapterError(f"model.weights: {path}: tensor {k} has shape {list(state[k].shape)}, the config "
                               f"needs {list(shape)}: pass this model's config with model.wan.config")


def to_dtype(model, dtype: torch.dtype, keep_fp32: list[str]):
    """Floating parameters in `dtype`, those of the modules diffusers keeps in float32 left in float32:
    the rule `from_pretrained` applies (model_loading_utils.load_model_dict_into_meta), so a checkpoint
    file loads into the same model as its diffusers directory, in bfloat16 too (`from_single_file`
    with a dtype would cast those modules as well). The model holds the file's values in float32,
    so each value is cast once, from what the file stores."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and not any(m in name.split(".") for m in keep_fp32):
            param.data = param.data.to(dtype)
    return model


def load(path: str | Path, spec: str | None, dtype: torch.dtype, key: str | None = None):
    """A `WanTransformer3DModel` from a single checkpoint file (original Wan or diffusers layout)."""
    import diffusers

    cls = diffusers.WanTransformer3DModel
    path = Path(path)
    state, kind, notes = read_checkpoint(path, key)
    config, source = config_for(state, kind, spec, path)
    state = diffusers_names(state, kind)
    check_against(state, config, path)
    log.info("model.weights: %s (%s layout%s), config %s", path, kind, "; " + "; ".join(notes) if notes else "", source)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", **config}))
        # no torch_dtype: the model holds the file's values in float32; no network: a local config
        model = cls.from_single_file(state, config=tmp, torch_dtype=None, local_files_only=True)
    return to_dtype(model, dtype, list(cls._keep_in_fp32_modules or []))


__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "config_names", "from_original_config", "load", "num_params",
           "read_checkpoint", "read_config"]

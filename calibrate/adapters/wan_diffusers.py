"""diffusers' `WanTransformer3DModel` (the Wan-2.1 backbone of Self-Forcing, CausVid, LongLive,
Rolling Forcing, Matrix-Game 2.0) rolled out autoregressively, chunk by chunk, through our KVCache.

diffusers' Wan has no KV cache: its self-attention sees the whole clip at once. We attach the
cache without forking any diffusers file, by giving every block's self-attention (`attn1`) a
`CachedSelfAttention` processor (diffusers' attention-processor hook). The processor computes
q, k, v with the block's own projections and q/k RMS norms, rotates q by Wan's 3D RoPE at the
chunk's *absolute* positions (frame index offset by the chunk's first latent frame, so chunk c
sees the same position code as in one uncached forward over the whole clip), and hands q, the
pre-rotary k, v and the key rotation to the cache. Cross-attention (text) is untouched.

One generation step = one chunk of `chunk_frames` latent frames = one *cache frame*:

1. start from seeded noise, run the few-step flow-matching sampler of Self-Forcing/CausVid
   (`denoise_timesteps`, shifted by `shift`): at each step the model predicts the flow
   v = noise - x0, x0 = x_t - sigma * v, and the next step re-noises x0 with fresh noise. These
   passes attend to the cache *without* writing to it (`attend_uncommitted`);
2. run one clean pass of the generated x0 at timestep 0: its self-attention K/V are what the
   cache stores (`attend`), and what every later chunk attends to (block-causal attention to
   cached chunks, within the cache's window and sink frames).

The equivalence test (tests/test_wan_adapter.py) checks that clean passes chunk by chunk equal
one uncached diffusers forward over all chunks with the cache's block-causal mask.

Conditioning is a fixed text-embedding tensor (no text encoder is downloaded): a .safetensors
file with `text_embedding` [L, text_dim] (e.g. UMT5 output computed once offline), or, when
none is given, a seeded random one. The first chunk is generated from noise alone (no image
conditioning). Frames are latents; `preview` shows their first three channels.

A Wan trained as a world model of a renderer (WanWorld, calibrate/wanworld/) passes a
`WorldInputs` instead of the text embedding: per chunk, its cross-attention tokens come from
the chunk's camera (`context`: the same `encoder_hidden_states` input, filled per chunk); the
rollout starts from the true first chunk, written to the cache by a clean pass as an
image-conditioned model's given frame; its frames are latents the transformer reads normalized
(`normalize` / `denormalize`, as pipelines normalize VAE latents), and each generated chunk is
denormalized, clamped to the frames' range and normalized again before its clean pass caches
it; the true frames and an RGB preview come from it.

Weights: `model.weights` is a diffusers model directory (`config.json` and
`diffusion_pytorch_model*.safetensors`, e.g. the `transformer/` folder of
Wan-AI/Wan2.1-T2V-1.3B-Diffusers), or one checkpoint file as Self-Forcing, CausVid and LongLive
publish them (original Wan layout, `.safetensors` or a `.pt` state dict: wan_checkpoint.py, with
`model.wan.config` for a model other than Wan2.1-T2V-1.3B; a directory brings its own config.json).
With no weights, `TINY` builds a small random model (tests, CPU smoke runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
from safetensors.torch import load_file
from torch import Tensor

from calibrate.adapters.base import AdapterError  # noqa: F401  (re-exported for callers)
from calibrate.cache import KVCache, Rope
from calibrate.types import ModelInfo, Trajectory, weights_fingerprint

# A small random Wan for tests and CPU runs: 2 layers x 2 heads x head_dim 64 (Wan's RoPE splits
# head_dim into 24 time + 20 height + 20 width channels), 4 latent channels, patch (1, 2, 2).
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=256, num_layers=2, rope_max_seq_len=1024)
TINY_SEED = 0
TEXT_TOKENS = 8  # length of the seeded random text embedding
ROPE_THETA = 10000.0


WAN_DTYPES = ("float32", "bfloat16")


@dataclass
class WanSettings:
    """How the adapter rolls Wan out (`model.wan` in the Hydra config, which uses this class as its schema)."""

    chunk_frames: int = 1  # latent frames per generated chunk = one cache frame (Self-Forcing: 3)
    latent_height: int = 16  # latent grid (480x832 video with Wan's VAE: 60 x 104)
    latent_width: int = 16
    denoise_timesteps: list[int] = field(default_factory=lambda: [1000, 750, 500, 250])  # few-step sampler
    shift: float = 5.0  # flow-matching timestep shift (sigma' = shift*s / (1 + (shift-1)*s))
    text_embedding: str | None = None  # .safetensors with `text_embedding` [L, text_dim]; None = seeded random
    dtype: str = "float32"  # one of WAN_DTYPES
    config: str | None = None  # a checkpoint file's config (wan_checkpoint.read_config); None = Wan2.1-T2V-1.3B's
    checkpoint_key: str | None = None  # entry of a checkpoint file that wraps its state dict; None = wan_checkpoint.WRAPPER_KEYS

    def check(self, where: str = "model.wan") -> None:
        """One-line ValueError naming the first field out of range."""
        for name in ("chunk_frames", "latent_height", "latent_width", "shift"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {where}.{name} must be > 0, got {getattr(self, name)}")
        if not self.denoise_timesteps or any(not 0 < t <= 1000 for t in self.denoise_timesteps):
            raise ValueError(f"config: {where}.denoise_timesteps must be a non-empty list in (0, 1000], "
                             f"got {self.denoise_timesteps}")
        if self.dtype not in WAN_DTYPES:
            raise ValueError(f"config: {where}.dtype must be float32 or bfloat16, got '{self.dtype}'")


def _diffusers():
    try:
        import diffusers
    except ImportError:
        raise AdapterError('model=wan_diffusers needs diffusers: pip install -e ".[diffusers]"') from None
    return diffusers


# ---- Wan's 3D RoPE as our Rope ---------------------------------------------------------------
def rope_angles(head_dim: int, frames: range, height: int, width: int, theta: float = ROPE_THETA) -> Tensor:
    """Angles [F*H*W, head_dim/2] of Wan's RoPE for latent frames `frames` of an H x W token grid.

    Wan splits head_dim into time, height and width parts (2*(head_dim//6) each for height and
    width, the rest time) and rotates pair i by position * theta^(-2i/dim) of its part; pairs are
    interleaved (2i, 2i+1), as `Rope` expects. Computed in float64 as diffusers does.
    """
    h_dim = w_dim = 2 * (head_dim // 6)
    t_dim = head_dim - h_dim - w_dim

    def part(positions: Tensor, dim: int) -> Tensor:
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim)
        return torch.outer(positions.to(torch.float64), inv)

    f, h, w = len(frames), height, width
    at = part(torch.tensor(list(frames)), t_dim)[:, None, None].expand(f, h, w, -1)
    ah = part(torch.arange(h), h_dim)[None, :, None].expand(f, h, w, -1)
    aw = part(torch.arange(w), w_dim)[None, None, :].expand(f, h, w, -1)
    return torch.cat((at, ah, aw), dim=-1).reshape(f * h * w, -1)


def shifted_sigmas(timesteps: list[int], shift: float) -> list[float]:
    """The sampler's noise levels: timestep t of 1000 shifted as sigma = shift*s / (1 + (shift-1)*s), s = t/1000."""
    return [shift * (t / 1000) / (1 + (shift - 1) * (t / 1000)) for t in timesteps]


# ---- the cache hook ----------------------------------------------------------------------------
@dataclass
class ChunkState:
    """What the processors of one forward pass share: the cache, whether to store, the chunk's RoPE."""

    cache: KVCache | None = None
    commit: bool = True
    rope: Rope | None = None


class CachedSelfAttention:
    """Attention processor for a Wan block's self-attention that reads and writes our cache."""

    def __init__(self, layer: int, state: ChunkState):
        self.layer = layer
        self.state = state

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None) -> Tensor:
        s = self.state
        if s.cache is None or s.rope is None:
            raise RuntimeError("CachedSelfAttention called outside WanAdapter.forward_chunk")
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(hidden_states))
        v = attn.to_v(hidden_states)
        # [B, H, T, D] in float32 whatever the model's dtype: the cache's statistics, codecs and the
        # fp reference all compute in float32 (a bf16 model's fp cache then holds 2x its bf16 bytes)
        q, k, v = (x.unflatten(2, (attn.heads, -1)).transpose(1, 2).float() for x in (q, k, v))
        attend = s.cache.attend if s.commit else s.cache.attend_uncommitted
        out = attend(self.layer, s.rope.apply(q), k, v, s.rope)
        out = out.transpose(1, 2).flatten(2, 3).type_as(hidden_states)
        return attn.to_out[1](attn.to_out[0](out))


# ---- a world model's inputs ---------------------------------------------------------------------
class WorldInputs(Protocol):
    """What makes a Wan a world model of a renderer (WanWorld's: calibrate/wanworld/model.py)."""

    weights: torch.nn.Module  # every learned weight of the world model, transformer included (the fingerprint)
    bounds: tuple[float, float]  # generated frames are clamped to this range before they are cached

    def normalize(self, frames: Tensor) -> Tensor:
        """Frames (what the rollout returns) -> the transformer's latents (as pipelines normalize VAE latents)."""
        ...

    def denormalize(self, x: Tensor) -> Tensor:
        """The transformer's latents -> frames (the inverse of `normalize`)."""
        ...

    def context(self, trajs: list[Trajectory], device: torch.device) -> Tensor:
        """Per chunk cross-attention tokens, [B, num_chunks, L, text_dim] (in place of the text embedding)."""
        ...

    def ground_truth(self, trajs: list[Trajectory], device: torch.device, num_frames: int | None = None) -> Tensor:
        """True latent frames [B, N, C, H, W] (the first `num_frames` only, when given)."""
        ...

    def preview(self, frames: Tensor) -> Tensor:
        """Latent frames [..., C, H, W] as RGB [..., 3, H', W'] in [0, 1]."""
        ...


# ---- the adapter -----------------------------------------------------------------------------
class WanAdapter:
    def __init__(self, transformer, cfg: WanSettings, text_embedding: Tensor | None, name: str = "wan_diffusers",
                 world: WorldInputs | None = None):
        """A text-conditioned Wan (`text_embedding` [L, text_dim]) or a world model (`world`), not both."""
        if (text_embedding is None) == (world is None):
            raise AdapterError("WanAdapter takes a text embedding or world inputs, exactly one of them")
        self.transformer = transformer.eval()
        self.cfg = cfg
        c = transformer.config
        self.patch = tuple(c.patch_size)
        if self.patch[0] != 1:
            raise AdapterError(f"model.weights: temporal patch size {self.patch[0]} is not supported (Wan uses 1)")
        if cfg.latent_height % self.patch[1] or cfg.latent_width % self.patch[2]:
            raise AdapterError(f"config: model.wan latent {cfg.latent_height}x{cfg.latent_width} is not divisible "
                               f"by the patch size {self.patch[1]}x{self.patch[2]}")
        if text_embedding is not None and (text_embedding.ndim != 2 or text_embedding.shape[1] != c.text_dim):
            raise AdapterError(f"model.wan.text_embedding: expected [L, {c.text_dim}], got {list(text_embedding.shape)}")
        self.grid = (cfg.latent_height // self.patch[1], cfg.latent_width // self.patch[2])
        self.channels = c.in_channels
        self.head_dim = c.attention_head_dim
        self.dtype = transformer.dtype
        self.text = text_embedding
        self.world = world
        self.state = ChunkState()
        transformer.set_attn_processor(self._processors())
        self.info = ModelInfo(name=name, num_layers=c.num_layers, num_kv_heads=c.num_attention_heads,
                              head_dim=c.attention_head_dim,
                              tokens_per_frame=cfg.chunk_frames * self.grid[0] * self.grid[1],
                              fingerprint=weights_fingerprint(world.weights if world is not None else transformer))

    def _processors(self) -> dict:
        """Our processor on every `attn1`, diffusers' own on the rest (cross-attention)."""
        procs = {}
        for name, proc in self.transformer.attn_processors.items():
            parts = name.split(".")  # blocks.<i>.attn1.processor
            procs[name] = CachedSelfAttention(int(parts[1]), self.state) if parts[2] == "attn1" else proc
        return procs

    # ---- one pass of one chunk -------------------------------------------------------------
    def forward_chunk(self, cache: KVCache, latents_BCFHW: Tensor, first_frame: int, timestep: float,
                      commit: bool, context_BLD: Tensor | None = None) -> Tensor:
        """The transformer on one chunk at absolute latent frames first_frame.. : flow prediction.

        `context_BLD` is the chunk's `encoder_hidden_states` (a world model's camera tokens); None =
        the text embedding."""
        B, _, F = latents_BCFHW.shape[:3]
        self.state.cache, self.state.commit = cache, commit
        self.state.rope = self.rope(torch.full((B, 1), float(first_frame), device=latents_BCFHW.device), F)
        try:
            t = torch.full((B,), float(timestep), device=latents_BCFHW.device)
            if context_BLD is None:
                context_BLD = self.text.to(latents_BCFHW.device).expand(B, -1, -1)
            return self.transformer(latents_BCFHW.to(self.dtype), t, context_BLD.to(self.dtype), return_dict=False)[0]
        finally:
            self.state.cache, self.state.rope = None, None

    def rope(self, first_frame_B1: Tensor, num_frames: int) -> Rope:
        """Wan's 3D RoPE of a chunk of `num_frames` latent frames starting at `first_frame_B1`
        (the same for every row of a batch); the start frame is its coordinate (`Rope.at`)."""
        first = int(first_frame_B1[0, 0])
        angles = rope_angles(self.head_dim, range(first, first + num_frames), *self.grid)
        return Rope(angles.to(device=first_frame_B1.device, dtype=torch.float32).unsqueeze(0), coords_BP=first_frame_B1,
                    at=lambda coords: self.rope(coords, num_frames))

    def sigmas(self) -> list[float]:
        return shifted_sigmas(self.cfg.denoise_timesteps, self.cfg.shift)

    # ---- the adapter API -------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, trajs: list[Trajectory], cache: KVCache, device: torch.device, truth: Tensor | None = None,
                keep_frames: bool = True, progress: Callable[[int], None] | None = None,
                teacher_forced: bool = False) -> Tensor:
        """Generate every latent frame of `trajs`, chunk by chunk: [B, N, C, H, W].

        The noise of trajectory b comes from a generator seeded with its seed, so a rollout is
        a function of (weights, trajectory) whatever the batch. A text-conditioned Wan ignores
        poses and actions and generates every chunk; a world model (`world`) is conditioned on
        them per chunk and starts from the true first chunk (from `truth` when given), which the
        returned frames include. `teacher_forced` (world models): after generating chunk c the
        cache receives the *true* chunk c, so every chunk is a one-step prediction from true
        history (the frames returned are still the generated ones).
        """
        n, cf = trajs[0].num_frames, self.cfg.chunk_frames
        if n % cf:
            raise AdapterError(f"model.wan.chunk_frames={cf} does not divide the trajectory length {n}")
        if teacher_forced and self.world is None:
            raise AdapterError("a teacher-forced rollout needs true frames: a world model's (WanWorld)")
        gens = [torch.Generator().manual_seed(t.seed) for t in trajs]
        shape = (self.channels, cf, self.cfg.latent_height, self.cfg.latent_width)
        noise = lambda: torch.stack([torch.randn(shape, generator=g) for g in gens]).to(device, torch.float32)
        sigmas = self.sigmas()
        context: list[Tensor | None] = [None] * (n // cf)
        chunks, start = [], 0
        if self.world is not None:
            context = list(self.world.context(trajs, device).unbind(1))
            if truth is None:
                truth = self.world.ground_truth(trajs, device, None if teacher_forced else cf)
            given = truth[:, :cf].to(device, torch.float32)  # [B, F, C, H, W]
            self.forward_chunk(cache, self.world.normalize(given).transpose(1, 2), 0, 0.0, commit=True,
                               context_BLD=context[0])
            chunks.append(given)
            start = 1
            if progress is not None:
                progress(cf)
        for c in range(start, n // cf):
            x = noise()
            for i, sigma in enumerate(sigmas):
                flow = self.forward_chunk(cache, x, c * cf, sigma * 1000, commit=False, context_BLD=context[c]).float()
                x0 = x - sigma * flow
                x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * noise() if i + 1 < len(sigmas) else x0
            frames = x0.transpose(1, 2)  # [B, F, C, H, W]
            cached = x0
            if self.world is not None:
                frames = self.world.denormalize(frames).clamp(*self.world.bounds)
                given = truth[:, c * cf : (c + 1) * cf].to(device, torch.float32) if teacher_forced else frames
                cached = self.world.normalize(given).transpose(1, 2)
            self.forward_chunk(cache, cached, c * cf, 0.0, commit=True, context_BLD=context[c])  # the clean pass writes the cache
            chunks = chunks + [frames] if keep_frames else [frames[:, -1:]]
            if progress is not None:
                progress(cf)
        return torch.cat(chunks, dim=1)

    def ground_truth(self, trajs: list[Trajectory], device: torch.device) -> Tensor | None:
        """A world model's true latent frames; None for a text-conditioned Wan (no renderer)."""
        return None if self.world is None else self.world.ground_truth(trajs, device)

    def preview(self, frames: Tensor) -> Tensor:
        """A world model's RGB decoding; else the first three latent channels, [-2, 2] mapped to [0, 1]."""
        if self.world is not None:
            return self.world.preview(frames)
        return ((frames[..., :3, :, :].float() + 2) / 4).clamp(0, 1)


# ---- loading ---------------------------------------------------------------------------------
def tiny_transformer():
    """`TINY` with diffusers' own initialization, drawn from a fixed seed (same weights every time)."""
    diffusers = _diffusers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return diffusers.WanTransformer3DModel(**TINY)


def load_transformer(weights: str | None, dtype: torch.dtype, config: str | None = None,
                     checkpoint_key: str | None = None):
    """The transformer of `weights`: None = the tiny random model; a diffusers model directory; or
    one checkpoint file in the original Wan or the diffusers layout (wan_checkpoint.py), whose
    config is `config` (default: Wan2.1-T2V-1.3B's when the weights have its shapes)."""
    if weights is None:
        if config is not None:
            raise AdapterError(f"model.wan.config={config} needs model.weights (a checkpoint of that model); "
                               f"without both, the tiny random model is built")
        model = tiny_transformer()
        return model if dtype == torch.float32 else model.to(dtype)
    path = Path(weights)
    if not path.is_dir():
        _diffusers()
        from calibrate.adapters import wan_checkpoint

        return wan_checkpoint.load(path, config, dtype, checkpoint_key)
    if not (path / "config.json").is_file():
        raise AdapterError(f"model.weights: {path} is not a diffusers model directory (no config.json there)")
    diffusers = _diffusers()
    try:
        return diffusers.WanTransformer3DModel.from_pretrained(path, torch_dtype=dtype)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AdapterError(f"model.weights: {path} does not load as WanTransformer3DModel: {first}") from None


def load_text_embedding(path: str | None, text_dim: int) -> Tensor:
    if path is None:
        g = torch.Generator().manual_seed(TINY_SEED + 1)
        return torch.randn(TEXT_TOKENS, text_dim, generator=g)
    try:
        tensors = load_file(path)
    except (OSError, ValueError, RuntimeError) as e:
        raise AdapterError(f"model.wan.text_embedding: cannot read {path}: {str(e).splitlines()[0]}") from None
    if "text_embedding" not in tensors:
        raise AdapterError(f"model.wan.text_embedding: {path} has no tensor 'text_embedding'")
    return tensors["text_embedding"].float()


def load(weights: str | None, cfg: WanSettings, device: torch.device) -> WanAdapter:
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    transformer = load_transformer(weights, dtype, cfg.config, cfg.checkpoint_key).to(device)
    text = load_text_embedding(cfg.text_embedding, transformer.config.text_dim)
    return WanAdapter(transformer, cfg, text)


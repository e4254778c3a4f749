"""The KV cache: the one seam between models and everything else.

A model never keeps its own keys and values. For every layer and every generated frame it
hands the cache the frame's queries, (pre-rotary) keys and values and the rotary encoding of
those keys, and gets back the attention output over everything the cache holds:

    out_BHTD = cache.attend(layer, q_BHTD, k_BHTD, v_BHTD, key_rope)

`attend` is written once, here, for every cache:

1. `append` stores the frame's K/V and evicts what the token policy no longer keeps;
2. `gather` returns the keys/values the frame attends to: the kept history as stored (`read`),
   then the frame's own fresh K/V (the runtime quantizes only what it stores);
3. they are scored (`attention_logits`, plus the cache's `logit_bias`), and the output is the
   softmax of the logits times the values (`blocked_attention`);
4. `observe` is handed all of it as an `Attended` record.

Implementations change how a frame is stored and read back (`append`/`read`: the packed
runtimes, which keep their own records; or only the per-frame hooks `_store`/`_load` of this
class's records: the noise twin), the logit bias (the runtime's key-noise correction), or what
they observe (recording statistics, shadowing quantized caches); none rewrites `attend`, so
recording or shadowing can never change a rollout. The model does not know which cache it has.

Scores are never held for all of a frame's queries at once when they would be large: `attend`
computes the output a block of query rows at a time (`query_blocks`: at most
`SCORE_BLOCK_ELEMENTS` logits, [B, H, rows, N]), and observers that need attention
probabilities (the recorder's attention mass, the shadows' KL) recompute them the same way
(`Attended.logit_blocks`). At TinyWorld's size one block holds every row, so the arithmetic is
one softmax over the whole row block as always; at Wan's 1560-4680 tokens per frame the scores
of one frame would take gigabytes per trajectory.

Shape legend: B batch (trajectories rolled out together), H kv heads, T tokens of one frame,
D head_dim, N cached tokens (frames x T), F cached frames.

Token policy of the full-precision cache: the first `sink_frames` frames ever appended stay
forever (attention sinks / anchors, as in LongLive and Self-Forcing); of the rest only the
newest `window` frames are kept (the new frame counts as one of them). Frames are numbered by
the order of their append, from 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rope:
    """A rotary encoding: rotate pairs (2i, 2i+1) of the last axis by `angles[..., i]`.

    `angles_BTA` has A = D/2 angles per token and broadcasts over heads. Orthogonal, so
    `q.k` after rotation depends only on the angle difference of query and key.

    A model whose angles are a function of a few numbers per frame (TinyWorld: the camera pose;
    Wan: the chunk's first latent frame) also passes those coordinates `coords_BP` and the
    function `at(coords_BP) -> Rope`. A cache may then store keys *before* the rotation plus
    the P coordinates of their frame, and rotate them when it reads them: a runtime that codes
    keys across frames needs that, because the rotation of a moving camera changes the rotated
    keys from frame to frame even where the content stays. `at(coords_BP)` must return exactly
    the angles the model would compute for those coordinates.
    """

    angles_BTA: Tensor
    coords_BP: Tensor | None = None
    at: Callable[[Tensor], "Rope"] | None = field(default=None, compare=False, repr=False)

    def apply(self, x_BHTD: Tensor) -> Tensor:
        return rotate_pairs(x_BHTD, self.angles_BTA.cos().unsqueeze(1), self.angles_BTA.sin().unsqueeze(1))


SLOT_BASE = 1 << 40  # frame keys of a memory plan's recall slots (tiers.py): past any frame index


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary rotation of channel pairs (2i, 2i+1) of the last axis by angles given as cos, sin."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def rotate_pairs_complex(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`rotate_pairs` as one complex product (pair i as x_2i + j x_2i+1, times cos + j sin), 5-12x
    faster on a CPU. A vectorised complex product may round differently (an ulp here and there), so
    only the runtimes' decode of stored keys uses it; the models rotate with `rotate_pairs`."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)


def kept_frames(num_appended: int, window: int, sink_frames: int) -> list[int]:
    """Indices of the frames a sink+window policy holds after `num_appended` appends."""
    sinks = list(range(min(sink_frames, num_appended)))
    recent_start = max(sink_frames, num_appended - window)
    return sinks + list(range(recent_start, num_appended))


def block_mask(num_steps: int, tokens_per_frame: int, window: int, sink_frames: int) -> Tensor:
    """The token policy as a boolean [S*T, S*T] mask: step i sees step j iff the cache holds frame j.

    After appending frame i the cache keeps frames j <= i with j > i - window or j < sink. An
    uncached forward over S frames with this mask equals S cached steps (models test this).
    """
    i = torch.arange(num_steps).unsqueeze(1)
    j = torch.arange(num_steps).unsqueeze(0)
    visible_SS = (j <= i) & ((j > i - window) | (j < sink_frames))
    return visible_SS.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)


def attention_logits(q_BHTD: Tensor, k_BHND: Tensor, bias_BHTN: Tensor | None = None) -> Tensor:
    """Scaled dot-product logits q.k / sqrt(D), plus an additive bias if given."""
    logits_BHTN = torch.einsum("bhtd,bhnd->bhtn", q_BHTD, k_BHND) * (1.0 / math.sqrt(q_BHTD.shape[-1]))
    return logits_BHTN if bias_BHTN is None else logits_BHTN + bias_BHTN


def attention_output(logits_BHTN: Tensor, v_BHND: Tensor) -> Tensor:
    """softmax(logits) @ v: the attention output of the rows of `logits`."""
    return torch.einsum("bhtn,bhnd->bhtd", logits_BHTN.softmax(dim=-1), v_BHND)


def softmax_attention(q_BHTD: Tensor, k_BHND: Tensor, v_BHND: Tensor, bias_BHTN: Tensor | None = None) -> Tensor:
    """Plain scaled dot-product attention of one frame's queries over the cached tokens.

    `bias_BHTN` is added to the logits (the runtime's key-noise logit correction); None = none.
    """
    return attention_output(attention_logits(q_BHTD, k_BHND, bias_BHTN), v_BHND)


SCORE_BLOCK_ELEMENTS = 1 << 25  # logits one block of query rows may hold (128 MiB in float32)


def query_blocks(B: int, H: int, T: int, N: int, budget: int | None = None) -> list[slice]:
    """Row blocks of T queries whose [B, H, rows, N] logits hold at most `budget` elements (>= 1 row;
    default `SCORE_BLOCK_ELEMENTS`)."""
    rows = max(1, (budget or SCORE_BLOCK_ELEMENTS) // max(B * H * N, 1))
    return [slice(t0, min(t0 + rows, T)) for t0 in range(0, T, rows)]


def bias_rows(bias_BHTN: Tensor | None, rows: slice) -> Tensor | None:
    """The query rows `rows` of a logit bias that broadcasts to [B, H, T, N] (a size-1 T axis stays)."""
    if bias_BHTN is None or bias_BHTN.dim() < 2 or bias_BHTN.shape[-2] == 1:
        return bias_BHTN
    return bias_BHTN[..., rows, :]


def blocked_attention(q_BHTD: Tensor, k_BHND: Tensor, v_BHND: Tensor, bias_BHTN: Tensor | None = None,
                      budget: int | None = None) -> Tensor:
    """`softmax_attention`, a block of query rows at a time (rows are independent: each row's
    softmax is the same arithmetic as in one pass). One block: exactly `softmax_attention`. On
    CUDA without a bias the blocks go to torch's fused attention, which never forms the scores."""
    B, H, T, _ = q_BHTD.shape
    blocks = query_blocks(B, H, T, k_BHND.shape[2], budget)
    if q_BHTD.is_cuda and bias_BHTN is None:
        return torch.nn.functional.scaled_dot_product_attention(q_BHTD, k_BHND, v_BHND)
    if len(blocks) == 1:
        return softmax_attention(q_BHTD, k_BHND, v_BHND, bias_BHTN)
    out = q_BHTD.new_empty(B, H, T, v_BHND.shape[-1])
    for rows in blocks:
        out[:, :, rows] = softmax_attention(q_BHTD[:, :, rows], k_BHND, v_BHND, bias_rows(bias_BHTN, rows))
    return out


@dataclass(frozen=True)
class Attended:
    """One `attend` call as `KVCache.observe` sees it (N = tokens of `frames`)."""

    layer: int
    index: int  # the frame just appended
    frames: list[int]  # frames of the keys attended to, oldest first; the fresh frame `index` last
    q_BHTD: Tensor
    k_BHTD: Tensor  # the frame's keys as the model passed them (pre-rotary)
    v_BHTD: Tensor
    key_rope: Rope
    k_rot_BHTD: Tensor  # the same keys post-rotary (what a cache stores)
    k_BHND: Tensor  # every key attended to, post-rotary, as the cache holds it (fresh frame last)
    v_BHND: Tensor
    bias_BHTN: Tensor | None  # the cache's logit bias (None: none)
    out_BHTD: Tensor | None = None  # what `attend` returns

    def logit_blocks(self, budget: int | None = None) -> Iterator[tuple[slice, Tensor]]:
        """The attention logits (bias included), a block of query rows at a time: (rows, [B, H, rows, N])."""
        B, H, T, _ = self.q_BHTD.shape
        for rows in query_blocks(B, H, T, self.k_BHND.shape[2], budget):
            yield rows, attention_logits(self.q_BHTD[:, :, rows], self.k_BHND, bias_rows(self.bias_BHTN, rows))


class KVCache:
    """Base class and the full-precision implementation (sink frames + rolling window).

    Subclasses change how a frame is stored and read back (`append`/`read`, or only the per-frame
    hooks `_store`/`_load`), the logit bias (`logit_bias`) or what they `observe`; `attend` lives
    here once.
    """

    def __init__(self, num_layers: int, window: int = 16, sink_frames: int = 1):
        if window < 1:
            raise ValueError(f"cache window must be >= 1 frame, got {window}")
        if sink_frames < 0:
            raise ValueError(f"cache sink_frames must be >= 0, got {sink_frames}")
        self.num_layers = num_layers
        self.window = window
        self.sink_frames = sink_frames
        # per layer: frame index -> whatever the implementation stores for that frame
        self._frames: list[dict[int, object]] = [{} for _ in range(num_layers)]
        self._num_appended = [0] * num_layers

    # ---- the seam -------------------------------------------------------------------
    def attend(self, layer: int, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> Tensor:
        """Append this frame's K/V to `layer`, evict, and attend `q` over what is kept."""
        index = self.append(layer, k_BHTD, v_BHTD, key_rope)
        k_rot_BHTD = key_rope.apply(k_BHTD)
        history = self.history(layer)
        k_BHND, v_BHND = self.read_with(layer, history, k_rot_BHTD, v_BHTD)
        bias_BHTN = self.logit_bias(layer, q_BHTD, history)
        out_BHTD = blocked_attention(q_BHTD, k_BHND, v_BHND, bias_BHTN)
        self.observe(Attended(layer, index, history + [index], q_BHTD, k_BHTD, v_BHTD, key_rope, k_rot_BHTD,
                              k_BHND, v_BHND, bias_BHTN, out_BHTD))
        return out_BHTD

    def expect(self, coords_BP: Tensor) -> None:
        """The rotary coordinates of the frame about to be generated (TinyWorld: its camera pose),
        told once per step before its layers attend. The plain cache ignores them; a tiered
        cache recalls the held frames nearest them (tiers.py). Without the call, such a cache
        recalls by the newest key's coordinates: the frame being continued, one step behind."""

    def observe(self, seen: Attended) -> None:
        """Called by `attend` with everything it read and computed (recording, shadowing); the
        full-precision cache observes nothing."""

    def attend_uncommitted(self, layer: int, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> Tensor:
        """Attend as `attend` would, but store nothing (the denoising passes of a diffusion model).

        `q` sees exactly the frames `attend` would let it see (those kept once this frame is
        appended) plus its own fresh K/V, with the same logit bias; the cache is left unchanged.
        """
        new = self._num_appended[layer]
        visible = [f for f in kept_frames(new + 1, self.window, self.sink_frames) if f != new]
        k_BHND, v_BHND = self.read_with(layer, visible, key_rope.apply(k_BHTD), v_BHTD)
        return blocked_attention(q_BHTD, k_BHND, v_BHND, self.logit_bias(layer, q_BHTD, visible))

    def history(self, layer: int) -> list[int]:
        """Frames the newest frame of `layer` attends to besides itself, oldest first."""
        newest = self._num_appended[layer] - 1
        return [f for f in self.frame_indices(layer) if f != newest]

    def gather(self, layer: int, k_new_BHTD: Tensor, v_new_BHTD: Tensor) -> tuple[Tensor, Tensor]:
        """Keys/values the newest frame attends to: its `history` as held + its own fresh (post-rotary) K/V."""
        return self.read_with(layer, self.history(layer), k_new_BHTD, v_new_BHTD)

    def logits(self, layer: int, q_BHTD: Tensor, k_BHND: Tensor, frames: list[int] | None = None) -> Tensor:
        """Attention logits of `q` over `k_BHND` = the keys of `frames` (default: `history`) then
        the fresh frame's: `attention_logits` plus this cache's `logit_bias`. Every cache, and
        every observer comparing caches, scores attention through this one function."""
        return attention_logits(q_BHTD, k_BHND, self.logit_bias(layer, q_BHTD, frames))

    def logit_bias(self, layer: int, q_BHTD: Tensor, frames: list[int] | None = None) -> Tensor | None:
        """Additive attention logits for `frames` then the fresh frame (None: full precision, none)."""
        return None

    def append(self, layer: int, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> int:
        """Store one frame's keys (pre-rotary) and values; returns the frame's index."""
        index = self._num_appended[layer]
        self._frames[layer][index] = self._store(layer, index, key_rope.apply(k_BHTD), v_BHTD)
        self._num_appended[layer] = index + 1
        keep = set(kept_frames(index + 1, self.window, self.sink_frames))
        for old in [f for f in self._frames[layer] if f not in keep]:
            del self._frames[layer][old]
        return index

    def read(self, layer: int, frames: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """Post-rotary keys and values of the kept frames (or of `frames`), oldest first: (k_BHND, v_BHND)."""
        frames = self.frame_indices(layer) if frames is None else frames
        loaded = [self._load(layer, f, self._frames[layer][f]) for f in frames]
        return torch.cat([k for k, _ in loaded], dim=2), torch.cat([v for _, v in loaded], dim=2)

    def read_with(self, layer: int, frames: list[int], k_new_BHTD: Tensor, v_new_BHTD: Tensor) -> tuple[Tensor, Tensor]:
        """K/V of the held `frames` (none is fine), oldest first, followed by a fresh frame's post-rotary K/V."""
        if not frames:
            return k_new_BHTD, v_new_BHTD
        k_old, v_old = self.read(layer, frames)
        return torch.cat((k_old, k_new_BHTD), dim=2), torch.cat((v_old, v_new_BHTD), dim=2)

    def frame_indices(self, layer: int = 0) -> list[int]:
        """Indices of the frames currently held for `layer`, oldest first."""
        return sorted(self._frames[layer])

    @property
    def num_frames_seen(self) -> int:
        return self._num_appended[0]

    # ---- storage (full precision) ----------------------------------------------------
    def _store(self, layer: int, index: int, k_BHTD: Tensor, v_BHTD: Tensor) -> object:
        return (k_BHTD, v_BHTD)

    def _load(self, layer: int, index: int, stored: object) -> tuple[Tensor, Tensor]:
        return stored  # type: ignore[return-value]

    def nbytes(self) -> int:
        """Bytes of the tensors this cache holds right now, counted from the tensors."""
        total = 0
        for frames in self._frames:
            for stored in frames.values():
                for t in stored:  # type: ignore[union-attr]
                    total += t.numel() * t.element_size()
        return total

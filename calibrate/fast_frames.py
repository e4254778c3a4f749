"""The fast runtime's storage of per-frame codes (every per-frame kind): one pool per class.

`FrameStore` keeps one pool per precision class (fast_pools.py: which class, which capacity), each
a set of buffers [B, Hg, capacity, ...] per group of heads stored alike (`quant/headcodec.GroupCodec`:
same width, same clip ratio, compensator or not), allocated at the first frame. A frame gets a
slot in its class's pool when it is coded (at once, or when it leaves the recent window, from
its float16 copy) and gives it back when evicted.

Kind prq with stages (Quant VideoGen) codes a frame against its span's centroids: per head, the
span's first frame coded below 16 bits (in any class) fits them (`GroupCodec.fit_span_state`, the
package's k-means for every head of a group at once), they live in a slot (`fast_pools.SpanStates`) while a
kept frame of the span is held below 16 bits for that head, and decoding picks each frame's state.

A deferred span (`prq_deferred`, Quant VideoGen's own schedule) holds its frames in a `pending`
pool of float16 slots until its last frame is appended; then each head fits the span's state on
the tokens of the frames it codes below 16 bits among those held before the step's eviction (frame
order), and the frames kept go to their classes' pools.

Attention reads a pool as blocks of its live slots, every group decoded at once
(`GroupCodec.decode`), heads put back in order; the key-noise logit correction applies to the
heads of a pool whose class width is the head's own width below 16 (recipes/FORMAT.md); the
Jensen correction (quant/jensen.py) lowers each key's logit by its own grid steps, read from the
block's stored scales (`GroupCodec.key_steps`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.cache import SLOT_BASE, kept_frames, rotate_pairs_complex
from calibrate.codec import span_of, span_pending, span_state_nbytes
from calibrate.codes import KINDS
from calibrate.fast_blocks import IndexTensors, token_block
from calibrate.fast_pools import CLASSES, Pool, SpanStates, capacities, span_capacity
from calibrate.memory import frame_class
from calibrate.quant.headcodec import GroupCodec
from calibrate.quant.jensen import jensen_bias
from calibrate.quant.logit_noise import logit_inflation
from calibrate.recipe import TensorSpec


class FrameStore:
    """One layer's K and V coded per frame, or the one of them that is (`kinds`; see the module docstring)."""

    def __init__(self, recipe, layer: int, window: int, sink_frames: int, device, frame_block: int | None = None,
                 recall_slots: int = 0, keep_evicted: bool = False, kinds: str = "kv"):
        self.policy = pol = recipe.scheme.policy
        self.window, self.sink = window, sink_frames
        info = recipe.model
        self.H, self.D, self.T = info.num_kv_heads, info.head_dim, info.tokens_per_frame
        self.kinds, self.specs = kinds, {kind: recipe.spec(layer, kind) for kind in kinds}
        self.first = self.specs[kinds[0]]  # deferred spans: K's and V's are the same (pair_problem)
        self.pre_rotary = "k" in kinds and self.specs["k"].rotary_coords > 0
        self.device = torch.device(device)
        tensors = {kind: {k: v.to(self.device) for k, v in recipe.layer_tensors(layer, kind).items()} for kind in kinds}
        self.var_HD = tensors.get("k", {}).get("logit_bias")
        self.jensen = "k" in kinds and self.specs["k"].jensen  # quant/jensen.py: each key's own grid steps lower its logits
        self.k_rotation = tensors.get("k", {}).get("rotation")
        native = {kind: [spec.bits_of(h) for h in range(self.H)] for kind, spec in self.specs.items()}
        widths_of = {"recent": [pol.recent_bits] * self.H, "sink": [pol.sink_bits] * self.H,
                     "key": [pol.keyframe_bits] * self.H, "pending": [16] * self.H}  # main, recall: native
        capacity = capacities(pol, window, sink_frames)
        self.deferred = self.first.prq_deferred
        capacity["pending"] = self.first.prq_span_frames if self.deferred else 0  # a span not yet complete
        # a memory plan's host tier (tiers.py): evicted frames leave as their main slot's codes, and
        # the recall slots are a pool of main-width slots, filled by the tiers, not by `step`
        capacity["recall"] = recall_slots if capacity["main"] else 0
        self.keep_evicted, self._evicted = keep_evicted, None  # _evicted: (frame, host form) of the last step
        self.pools: dict[str, Pool] = {}
        self.groups: dict[str, dict[str, list[GroupCodec]]] = {}
        for name in (*CLASSES, "pending", "recall"):
            if capacity[name]:
                widths = {kind: widths_of.get(name, native[kind]) for kind in kinds}
                self.pools[name] = Pool(name, widths, capacity[name])
                self.groups[name] = {kind: self._groups(self.specs[kind], tensors[kind], widths[kind]) for kind in kinds}
        # heads whose keys of a class get the key-noise correction: held at the head's own width < 16
        self.corrected = {name: torch.tensor([w == native["k"][h] < 16 for h, w in enumerate(p.widths["k"])],
                                             device=self.device) for name, p in self.pools.items() if "k" in kinds}
        self.frame_block, self.token_block, self.write_block = frame_block, self.T, self.T  # write: tokens coded at a time
        self.B, self._index = None, IndexTensors(self.device)
        # kind prq with stages: per kind, the states of the spans a kept frame below 16 bits uses
        self.spanned = [kind for kind in kinds if span_of(self.specs[kind], 0) is not None]
        self.spans = {kind: SpanStates() for kind in self.spanned}

    def _groups(self, spec: TensorSpec, tensors: dict, widths: list[int]) -> list[GroupCodec]:
        """Heads stored alike: same width, same clip, compensator or not (codec.head_params)."""
        keys: dict[tuple, list[int]] = {}
        clip = tensors.get("clip")
        for h, b in enumerate(widths):
            c = spec.clip if clip is None else float(clip[h])
            keys.setdefault((b, c, b == spec.bits_of(h)), []).append(h)
        return [GroupCodec(spec, tensors, heads, b, self.D, self.device) for (b, _, _), heads in keys.items()]

    # ---- buffers --------------------------------------------------------------------------------
    def allocate(self, xs: dict) -> None:
        B = next(iter(xs.values())).shape[0]
        if self.B is not None:
            if B != self.B:
                raise ValueError(f"the cache was filled with batch {self.B}, got a frame of batch {B}")
            return
        self.B = B
        xs = {kind: x if isinstance(x, Tensor) else x.full() for kind, x in xs.items()}
        for name, pool in self.pools.items():
            for kind, x in xs.items():
                bufs = []
                for g in self.groups[name][kind]:
                    state = None
                    if kind in self.spanned:  # shapes only: a state of zeros
                        spec = self.specs[kind]
                        state = x.new_zeros(B, len(g.heads), spec.prq_stages, spec.prq_centroids, self.D, dtype=torch.float16)
                    sample = g.encode(x[:, g.heads], state)
                    bufs.append({key: torch.zeros(t.shape[0], t.shape[1], pool.capacity, *t.shape[2:], dtype=t.dtype,
                                                  device=t.device) for key, t in sample.items()})
                    pool.slot_bytes += sum(t.numel() * t.element_size() for t in sample.values())
                pool.buffers[kind] = bufs
        for kind in self.spanned:
            spec = self.specs[kind]
            spans = span_capacity(spec, self.policy, self.window, self.sink)
            self.spans[kind].states = torch.zeros(B, self.H, spans, spec.prq_stages, spec.prq_centroids, self.D,
                                                  dtype=torch.float16, device=self.device)

    def _write(self, name: str, slot: int, xs: dict, index: int) -> None:
        """Code frame `index` into `slot` of a pool a token block at a time (small temporaries): per-token
        codes at once, dynamic per-channel ranges (kind uniform) gathered over the blocks first. Dense-
        and-sparse values, other per-channel kinds, frame-wide kinds (`Kind.frame_wide`) and span
        centroids see the whole frame; a span's first frame coded below 16 bits fits the span's state first."""
        pool = self.pools[name]
        for kind, x in xs.items():
            spec = self.specs[kind]
            spanned = self._spanned(name, kind)
            ranged = spec.axis == "channel" and not spec.static
            by_tokens = (spec.sparse_fraction == 0 and not spanned and not KINDS[spec.kind].frame_wide
                         and (not ranged or spec.kind == "uniform"))
            step = self.write_block if by_tokens else self.T
            if step == self.T and not isinstance(x, Tensor):
                x = x.full()  # per-channel ranges, frame-wide scales and span centroids need the whole frame
            heads = lambda t, g: t if len(g.heads) == self.H else t[:, g.heads]
            state = None
            if spanned:  # heads coding their span's first frame below 16 bits fit its state on it
                span = span_of(spec, index)
                spans = self.spans[kind]
                s = spans.slot_of(span)
                for g in self.groups[name][kind]:
                    todo = [i for i, h in enumerate(g.heads) if h not in spans.fitted[span]] if g.bits < 16 else []
                    if todo:
                        spans.states[:, [g.heads[i] for i in todo], s] = g.fit_span_state(heads(x, g))[:, todo]
                        spans.fitted[span].update(g.heads)
                state = spans.states[:, :, s]
            blocks = [slice(t0, t0 + step) for t0 in range(0, self.T, step)] if step < self.T else [slice(None)]
            groups = self.groups[name][kind]
            stats = [None] * len(groups)
            if ranged and by_tokens:  # the frame's per-channel ranges first, block by block (exact)
                for tokens in blocks:
                    xt = token_block(x, tokens)
                    stats = [g.channel_stats(heads(xt, g)) if s is None else torch.maximum(s, g.channel_stats(heads(xt, g)))
                             for g, s in zip(groups, stats)]
            for tokens in blocks:
                xt = token_block(x, tokens)
                for g, bufs, s in zip(groups, pool.buffers[kind], stats):
                    for key, t in g.encode(heads(xt, g), None if state is None else heads(state, g), s).items():
                        target = bufs[key][:, :, slot]
                        if target.dim() > 2 and target.shape[2] == self.T:  # a token axis
                            target[:, :, tokens] = t
                        else:  # the frame's per-channel parameters
                            target.copy_(t)

    def _spanned(self, name: str, kind: str) -> bool:
        """The pool codes some head of `kind` against span states."""
        return kind in self.spanned and any(g.bits < 16 for g in self.groups[name][kind])

    def _live_spans(self, kind: str) -> dict[int, set[int]]:
        """span -> the heads that hold a kept frame of it below 16 bits."""
        live: dict[int, set[int]] = {}
        for name, pool in self.pools.items():
            low = {h for g in self.groups[name][kind] if g.bits < 16 for h in g.heads}
            for f in pool.frame_slot if low else ():
                live.setdefault(span_of(self.specs[kind], f), set()).update(low)
        return live

    def _decode(self, name: str, kind: str, slots: Tensor, tokens: slice = slice(None),
                frames: list[int] | None = None) -> Tensor:
        """[B, H, J, Tb, D] of the pool's `slots` (their `tokens`), every head; `frames` (those slots'
        frames) pick the span states of kind prq."""
        state = None
        if self._spanned(name, kind):
            spans = self.spans[kind]
            slots_of = self._index([spans.slot[span_of(self.specs[kind], f)] for f in frames])
            state = spans.states.index_select(2, slots_of)  # [B, H, J, stages, C, D]
        return self._per_group(name, kind, slots, tokens,
                               lambda g, stored: g.decode(stored, self.T, None if state is None else state[:, g.heads]))

    def _per_group(self, name: str, kind: str, slots: Tensor, tokens: slice, read) -> Tensor:
        """`read(group, stored)` of every group of heads of the pool's `slots`, heads put back in
        order: [B, H, ...]. Every stored tensor with a token axis is cut to `tokens`; per-channel
        parameters are not."""
        cut = tokens != slice(None)
        out = None
        groups = self.groups[name][kind]
        for g, bufs in zip(groups, self.pools[name].buffers[kind]):
            x = read(g, {key: (t[:, :, :, tokens] if cut and t.dim() > 3 and t.shape[3] == self.T else t).index_select(2, slots)
                         for key, t in bufs.items()})
            if len(groups) == 1:
                return x
            if out is None:
                out = x.new_empty(x.shape[0], self.H, *x.shape[2:])
            out[:, g.heads] = x
        return out

    # ---- a step ---------------------------------------------------------------------------------
    @property
    def single_block(self) -> bool:
        return not self.frame_block and self.token_block >= self.T

    def plan(self, B: int, budget: int) -> int:
        """Set the frames (and, without dense-and-sparse, tokens) per block from a workspace
        `budget` in bytes, and the tokens of a frame coded at a time; returns the keys of one block."""
        per_token = B * self.H * self.D * 4 * 4  # decoded K and V and their intermediates
        most = self.sink + self.window
        frames = max(1, budget // (per_token * self.T))
        self.frame_block = None if frames >= most else frames
        self.token_block = self.T
        coded = budget // per_token  # a frame is coded a block of tokens at a time, one frame's temporaries
        self.write_block = min(self.T, max(8, coded - coded % 8))
        if frames == 1 and not any(spec.sparse_fraction > 0 for spec in self.specs.values()) and not self.spanned:
            self.frame_block = most  # every frame of a pool, a few tokens of each at a time
            tokens = budget // (per_token * most)
            self.token_block = min(self.T, max(8, tokens - tokens % 8))
            return most * self.token_block
        return min(frames, most) * self.T

    def step(self, index: int, k_BHTD: Tensor, v_BHTD: Tensor, rope=None, decode: bool = True):
        """Store frame `index` (K as stored, V), move the frame leaving the recent window to its
        class, evict; then (when `decode`) the history blocks of the frame."""
        xs = {kind: x for kind, x in zip("kv", (k_BHTD, v_BHTD)) if kind in self.kinds}  # the tensors held here
        self.allocate(xs)
        pol, n = self.policy, index
        post = set(kept_frames(n + 1, self.window, self.sink))
        for pool in self.pools.values():  # evict first: their slots take the new frames
            if pool.name in ("recall", "pending"):  # pending: a span completing now fits on them first
                continue
            for f in [f for f in pool.frame_slot if f not in post]:
                if self.keep_evicted:
                    assert pool.name == "main", "check_plan: no key frames with a host tier"
                    self._evicted = (f, self._slot_record(pool, pool.frame_slot[f], copy=True))
                pool.release(f)
        R, leaving = pol.recent_frames, index - pol.recent_frames
        if R and leaving >= 0 and leaving in post and leaving in self.pools["recent"].frame_slot:
            slot = self.pools["recent"].frame_slot[leaving]
            recent = self.pools["recent"].buffers  # float16 frames are coded from their copy, block by block
            x = {kind: recent[kind][0]["fp16"][:, :, slot] if "fp16" in recent[kind][0] and len(recent[kind]) == 1
                 else self._decode("recent", kind, self._index([slot]), frames=[leaving])[:, :, 0] for kind in self.kinds}
            self.pools["recent"].release(leaving)
            name = frame_class(pol, leaving, n + 1)
            self._write(name, self.pools[name].alloc(leaving), x, leaving)
        name = "pending" if self.deferred else frame_class(pol, index, n + 1)
        self._write(name, self.pools[name].alloc(index), xs, index)
        if self.deferred:
            if not span_pending(self.first, index, n + 1):
                self._complete_span(span_of(self.first, index), post, n + 1)
            for f in [f for f in self.pools["pending"].frame_slot if f not in post]:
                self.pools["pending"].release(f)
        for kind in self.spanned:  # each head's span states no kept frame below 16 bits uses any more go
            self.spans[kind].release(self._live_spans(kind))
        if decode:
            yield from self.history(n + 1, rope, exclude=index)

    # ---- a memory plan's host tier and recall slots ------------------------------------------------
    def _slot_record(self, pool: Pool, slot: int, copy: bool = False) -> dict:
        """A frame's codes in a pool slot: per kind, per group of heads, tensors [B, Hg, ...]."""
        return {kind: [{key: t[:, :, slot].clone() if copy else t[:, :, slot] for key, t in bufs.items()}
                       for bufs in pool.buffers[kind]] for kind in self.kinds}

    def take_evicted(self) -> tuple[int, dict] | None:
        """(frame, host form) of the frame the last step evicted, once."""
        out, self._evicted = self._evicted, None
        return out

    def slot_views(self, s: int) -> dict:
        """Recall slot s as views of its buffers, shaped like a host form."""
        return self._slot_record(self.pools["recall"], s)

    def set_filled(self, filled: int) -> None:
        if "recall" in self.pools:
            self.pools["recall"].frame_slot = {SLOT_BASE + s: s for s in range(filled)}

    def recalled(self, rope=None):
        """Blocks (k post-rotary, v, corrections) of the filled recall slots."""
        if "recall" in self.pools:
            yield from self.history(0, rope, names=["recall"])

    def _complete_span(self, span: int, post: set[int], n: int) -> None:
        """A deferred span's last frame is in: per head, fit the state on the tokens (frame order,
        decoded from float16) of the span's frames held before this step's eviction that the head
        codes below 16 bits, with the parameters of the first one's class; then code the frames
        kept (`post`) into their classes."""
        pending = self.pools["pending"]
        frames = sorted(f for f in pending.frame_slot if span_of(self.first, f) == span)
        raw = {kind: self._decode("pending", kind, self._index([pending.frame_slot[f] for f in frames]))
               for kind in self.kinds}  # [B, H, F, T, D]
        classes = [frame_class(self.policy, f, n) for f in frames]
        for kind in self.kinds:
            B, H, F, T, D = raw[kind].shape
            for h in range(H):
                coded = [j for j, c in enumerate(classes) if self.pools[c].widths[kind][h] < 16]
                if coded:  # the group of h in the first coded frame's class, fitted on h's frames
                    g = next(g for g in self.groups[classes[coded[0]]][kind] if h in g.heads)
                    x = raw[kind][:, g.heads][:, :, coded].reshape(B, len(g.heads), len(coded) * T, D)
                    spans = self.spans[kind]
                    spans.states[:, h, spans.slot_of(span)] = g.fit_span_state(x)[:, g.heads.index(h)]
                    spans.fitted[span].add(h)
        for j, f in enumerate(frames):
            pending.release(f)
            if f in post:
                self._write(classes[j], self.pools[classes[j]].alloc(f), {kind: x[:, :, j] for kind, x in raw.items()}, f)

    def history(self, n: int, rope=None, exclude: int | None = None, names=None):
        """Blocks (k [B, H, N, D] post-rotary, v, corrected heads or None) of the held frames but
        `exclude`, in pools `names` (default: all but the recall slots, read after the step's recall)."""
        if self.B is None:
            return
        for name in names or [name for name in self.pools if name != "recall"]:
            frames = sorted(f for f in self.pools[name].frame_slot if f != exclude)
            step = self.frame_block or len(frames) or 1
            for i in range(0, len(frames), step):
                chunk = frames[i: i + step]
                for t0 in range(0, self.T, self.token_block):
                    yield self._block(name, chunk, rope, slice(t0, t0 + self.token_block))

    def _block(self, name: str, frames: list[int], rope, tokens: slice = slice(None)):
        slots = self._index([self.pools[name].frame_slot[f] for f in frames])
        k, v = (self._decode(name, kind, slots, tokens, frames) if kind in self.kinds else None for kind in "kv")
        if self.pre_rotary:
            cos, sin = rope(frames)
            k = rotate_pairs_complex(k, cos[:, None, :, tokens], sin[:, None, :, tokens])
        B, H, J, T, D = (k if k is not None else v).shape
        corr = self.corrected[name] if self.var_HD is not None and bool(self.corrected[name].any()) else None
        if self.jensen and any(g.bits < 16 for g in self.groups[name]["k"]):
            corr = self._key_steps(name, slots, tokens).reshape(B, H, J * T, D)
        flat = lambda t: None if t is None else t.reshape(B, H, J * T, D)
        return flat(k), flat(v), corr

    def _key_steps(self, name: str, slots: Tensor, tokens: slice = slice(None)) -> Tensor:
        """Grid steps [B, H, J, Tb, D] of the keys in the pool's `slots` (the Jensen correction)."""
        return self._per_group(name, "k", slots, tokens, lambda g, stored: g.key_steps(stored, len(range(self.T)[tokens])))

    def bias_fn(self, q_BHTD: Tensor):
        """A block's third element -> additive logits: corrected heads [H] -> [B, H, T, 1] (minus the
        expected key-noise inflation), or (Jensen) key steps [B, H, N, D] -> [B, H, T, N]."""
        if self.jensen:
            return lambda steps: -jensen_bias(q_BHTD, steps, self.k_rotation).to(q_BHTD.dtype)
        if self.var_HD is None:
            return None
        c = logit_inflation(q_BHTD, self.var_HD, self.k_rotation)  # [B, H, T]
        return lambda corr: -(c * corr.to(c.dtype)[None, :, None]).unsqueeze(-1)

    # ---- reading (materializing) -------------------------------------------------------------------
    def read(self, n: int, frames: list[int], rope) -> tuple[Tensor, Tensor]:
        """Post-rotary K and V [B, H, F*T, D] of held `frames`, in that order (each pool decoded once)."""
        ks, vs, order = [], [], []
        for name, pool in self.pools.items():
            fs = [f for f in frames if f in pool.frame_slot]
            if fs:
                k, v, _ = self._block(name, fs, rope)
                ks, vs, order = ks + [k], vs + [v], order + fs
        if not order:
            raise ValueError("no frames to read")
        pos = torch.tensor([order.index(f) for f in frames], device=self.device)
        pick = lambda x: x.view(x.shape[0], self.H, len(order), self.T, self.D).index_select(2, pos).flatten(2, 3)
        return tuple(None if parts[0] is None else pick(torch.cat(parts, dim=2)) for parts in (ks, vs))

    def logit_bias(self, n: int, q_BHTD: Tensor, frames: list[int]) -> Tensor | None:
        """As KVCache.logit_bias: [B, H, T, N] for `frames` then the T fresh keys."""
        B, H, T, D = q_BHTD.shape
        if self.jensen:
            steps = [self._key_steps(name, self._index([pool.frame_slot[f]]))[:, :, 0]
                     for f in frames for name, pool in self.pools.items() if f in pool.frame_slot]
            steps.append(q_BHTD.new_zeros(B, H, T, D))
            return -jensen_bias(q_BHTD, torch.cat(steps, dim=2), self.k_rotation).to(q_BHTD.dtype)
        if self.var_HD is None:
            return None
        pool_of = lambda f: next(name for name, pool in self.pools.items() if f in pool.frame_slot)
        cols = [self.corrected[pool_of(f)].to(q_BHTD.dtype) for f in frames]
        corrected_HF = torch.stack(cols, dim=1) if cols else q_BHTD.new_zeros(H, 0)
        mask_HN = torch.cat([corrected_HF.repeat_interleave(T, dim=1), corrected_HF.new_zeros(H, T)], dim=1)
        c_BHT = logit_inflation(q_BHTD, self.var_HD, self.k_rotation)
        return -c_BHT.unsqueeze(-1) * mask_HN[None, :, None, :]

    # ---- bytes ----------------------------------------------------------------------------------------
    def nbytes(self, n: int) -> int:
        spans = 0
        for kind in self.spanned:  # one state per head and span with a kept frame below 16 bits
            heads = sum(len(h) for h in self._live_spans(kind).values())
            spans += heads * span_state_nbytes(self.specs[kind], self.B or 0, self.D)
        return spans + sum(len(pool.frame_slot) * pool.slot_bytes for pool in self.pools.values())

    def capacity_nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for pool in self.pools.values() for bufs in pool.buffers.values()
                    for b in bufs for t in b.values())
                + sum(s.states.numel() * s.states.element_size() for s in self.spans.values() if s.states is not None))

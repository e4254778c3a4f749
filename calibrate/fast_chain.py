"""The fast runtime's storage of predictive tensors: preallocated rings of packed chain frames.

`ChainStore` holds one layer's K and V (both `kind="predictive"`, stacked as G = 2H heads) the
way `chain.py` defines their stored forms, in fixed buffers allocated once:

    codes   uint8 [B, M, C, T]        delta frames: every head's code fields of a token in one row
                                      (`RowLayout.concat` of the heads' rows, C = sum of their bytes),
                                      stored byte-major (`RowLayout.unpack_columns`)
    modes   uint8 [B, M, G, ceil(T/8)] one bit per token and head (1 = inter)
    anchor  uint8 [B, Ca, T]          the one anchor frame (the oldest window frame, once the window
                                      has slid past the sinks: chain.frame_role allows no other)
    recent  float16 [B, G, R, T, D]   the newest `recent_frames` frames, ring by frame % R

with M = sink_frames + window - recent_frames main slots: frame f < sink in slot f, later frames
in slot sink + (f - sink) % (window - recent), which is exactly the slot of the frame evicted when
f is coded. A step never moves a frame and allocates no storage.

Decoding a step (`step`, blockwise over tokens: every token's chain is independent):

1. unpack the codes and modes of the held chain frames, oldest first; intra values
   s^I (2c - n), inter steps s^P (2c - n); the anchor's states replace its frame's (a reset);
2. `quant/chainscan.segmented_states`: every frame's integer states in one scan;
3. code the frame that joins the chain (the new one, or the one leaving the recent window)
   against its predecessor's states, exactly as `quant/predictive.encode` (same float32
   operations, so the same codes), write its codes and modes into its slot, and re-anchor the
   frame that became the oldest;
4. values = (unit * v) @ R^T + mean, keys rotated by their frame's rotary (pre-rotary keys),
   handed to the attention as one block of keys per token block. unit * v is one matmul of the
   coded components with a matrix holding unit[d] where component d sits: each output is one
   product and exact zeros, so it equals the reference's elementwise product bit for bit.

The integer states are those of `chain.ChainCodec` (tests hold them equal); values agree to
float rounding. Bytes held (`nbytes`) count the forms each kept frame is in, which is what
`memory.predicted_cache_bytes` predicts; the slots not in use at the moment (the anchor frame's
delta slot, warm-up) are capacity (`capacity_nbytes`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.cache import SLOT_BASE, kept_frames, rotate_pairs
from calibrate.quant.bitrows import RowLayout
from calibrate.quant.chainscan import segmented_states
from calibrate.quant import predictive

FP = torch.float16
SCAN_MATMUL_FRAMES = 32  # chains up to this long are scanned by one matmul, longer ones by a running sum


class IndexTensors:
    """Index tensors of integer lists, made once per list: a step's slot lists repeat from step to
    step, and a host-to-device tensor per list and step would be work on the hot path."""

    def __init__(self, device: torch.device, capacity: int = 256):
        self.device, self.capacity = device, capacity
        self.made: dict[tuple, Tensor] = {}

    def __call__(self, values: list[int]) -> Tensor:
        key = tuple(values)
        if key not in self.made:
            if len(self.made) > self.capacity:
                self.made.clear()
            self.made[key] = torch.tensor(values, dtype=torch.long, device=self.device)
        return self.made[key]


class ChainStore:
    """One layer's predictive K and V (see the module docstring)."""

    def __init__(self, tensors_k: dict, tensors_v: dict, pre_rotary: bool, temporal: bool, policy, window: int,
                 sink_frames: int, tokens_per_frame: int, device, token_block: int | None = None,
                 recall_slots: int = 0, keep_evicted: bool = False):
        cat = lambda role: torch.cat([tensors_k[role], tensors_v[role]]).to(device)
        self.H = tensors_k["mean"].shape[0]
        self.G, self.D = 2 * self.H, tensors_k["mean"].shape[1]
        self.mean, self.rotation, self.unit = cat("mean"), cat("rotation"), cat("unit")
        bits, self.s_intra, self.s_inter = cat("channel_bits"), cat("intra_step"), cat("inter_step")
        anchor_bits = cat("anchor_bits")
        self.levels = (1 << bits) - 1
        self.offset = torch.where(anchor_bits > 0, 1 << (anchor_bits - 1).clamp_min(0), 0)
        self.params = predictive.PredictiveParams(self.mean[:, None], self.rotation, self.unit[:, None], bits[:, None],
                                                  self.s_intra[:, None], self.s_inter[:, None], anchor_bits[:, None])
        self.s32 = [t.to(torch.int32) for t in (self.levels, self.s_intra, self.s_inter)]
        self.codes_layout = RowLayout.concat(bits.tolist(), device)
        self.anchor_layout = RowLayout.concat(anchor_bits.tolist(), device)
        # Decoding tracks only coded components (b_i > 0): the others are 0 in every state. Per head
        # the coded ones come first, padded to Dc with components that decode to 0.
        coded = (bits > 0).cpu()
        self.Dc = Dc = max(int(coded.sum(-1).max()), 1)
        order = torch.sort((~coded).to(torch.int8), dim=-1, stable=True).indices[:, :Dc]  # [G, Dc]
        valid = torch.gather(coded, 1, order)
        self.comp = order.to(device)
        self.comp_valid = valid.to(device)
        fields = (torch.arange(self.G)[:, None] * self.D + order).flatten()
        self.codes_c = self.codes_layout.select(fields, valid.flatten())
        self.anchor_c = self.anchor_layout.select(fields, valid.flatten())
        # position of component d among the coded ones (Dc: the zero column appended on expansion)
        pos = torch.full((self.G, self.D), Dc, dtype=torch.long)
        pos.scatter_(1, torch.where(valid, order, self.D - 1), torch.where(valid, torch.arange(Dc).expand(self.G, -1), Dc))
        pos[~coded] = Dc
        self.pos = pos.to(device)
        pick = lambda t: torch.where(self.comp_valid, torch.gather(t, 1, self.comp), torch.zeros((), dtype=t.dtype, device=device))
        self.n_c, self.si_c, self.sp_c = (pick(t).float()[:, None, :] for t in (self.levels, self.s_intra, self.s_inter))
        self.offset_c = pick(self.offset).float()
        self.minus_n_c, self.si_minus_sp_c = -self.n_c, self.si_c - self.sp_c
        # unit * v from the coded components: spread[g, k, d] = unit[g, d] where d is coded component k
        spread = torch.zeros(self.G, Dc + 1, self.D, device=device)
        self.spread = spread.scatter_(1, self.pos[:, None, :], self.unit[:, None, :])[:, :Dc].contiguous()
        self.rotation_t = self.rotation.transpose(-1, -2)
        self.pre_rotary, self.temporal = pre_rotary, temporal
        self.T, self.window, self.sink = tokens_per_frame, window, sink_frames
        self.R = policy.recent_frames
        self.Wm = max(window - self.R, 0)
        self.M = sink_frames + self.Wm
        self.device = torch.device(device)
        self.set_block(token_block or tokens_per_frame)
        self.bit_shift = torch.arange(8, dtype=torch.int32, device=self.device)
        self.bit_shift_u8 = self.bit_shift.to(torch.uint8)
        self.anchor_frame: int | None = None
        self._scan_core, self._values_core = self._scan, self._values
        self.B: int | None = None
        self._index = IndexTensors(self.device)
        # a memory plan's host tier (tiers.py): the host form of the frame a step evicts, and the
        # recall slots (host forms: anchors, or intra delta frames without `temporal`)
        self.keep_evicted, self.recall_slots, self.filled = keep_evicted, recall_slots, 0
        self._evicted: tuple[int, dict] | None = None

    # ---- buffers ----------------------------------------------------------------------------
    def allocate(self, B: int) -> None:
        if self.B is not None:
            if B != self.B:
                raise ValueError(f"the cache was filled with batch {self.B}, got a frame of batch {B}")
            return
        T, G, D, dev = self.T, self.G, self.D, self.device
        self.B = B
        self.codes = torch.zeros(B, self.M, self.codes_layout.nbytes, T, dtype=torch.uint8, device=dev)
        self.modes = torch.zeros(B, self.M, G, -(-T // 8), dtype=torch.uint8, device=dev)
        self.anchor = torch.zeros(B, self.anchor_layout.nbytes, T, dtype=torch.uint8, device=dev)
        self.recent = torch.zeros(B, G, self.R, T, D, dtype=FP, device=dev)
        S = self.recall_slots
        self.slots = {name: t.new_zeros(t.shape[0], S, *t.shape[2:]) for name, t in
                      ((("anchor", self.anchor[:, None]),) if self.temporal else (("codes", self.codes), ("modes", self.modes)))}

    def slot(self, f: int) -> int:
        return f if f < self.sink else self.sink + (f - self.sink) % self.Wm

    def chain(self, n: int) -> list[int]:
        """Frames held as chain frames (kept, not recent) after n appends, oldest first."""
        return [f for f in kept_frames(n, self.window, self.sink) if f < n - self.R]

    def recent_frames(self, n: int) -> list[int]:
        return [f for f in kept_frames(n, self.window, self.sink) if f >= n - self.R]

    def anchor_of(self, chain: list[int]) -> int | None:
        """The chain frame whose predecessor is not held (chain.frame_role), if any."""
        if not self.temporal:
            return None
        held = set(chain)
        anchors = [f for f in chain if f > 0 and f - 1 not in held]
        assert len(anchors) <= 1, anchors
        return anchors[0] if anchors else None

    # ---- the code ---------------------------------------------------------------------------
    def scan(self, chain: list[int], tokens: slice) -> Tensor:
        """Integer states of the chain frames for `tokens`, coded components only: float32 (exact
        integers) [B, Tb, G, J, Dc] (`expand` gives [..., D]).

        states_j = sum of contrib_i over i from the token's last reset L(j) to j: for short chains
        a 0/1 matrix W per token (i <= j and i >= L(j)) times contrib (one batched matmul, O(J^2)),
        for long ones `chainscan.segmented_states` (running sum and gather, O(J)). Every partial
        sum is an integer below J * 2^16 in magnitude: exact in float32 up to J = 255 frames
        (float64 beyond).
        """
        slots = self._index([self.slot(f) for f in chain])
        a = self.anchor_of(chain)
        t0, t1 = tokens.start, tokens.stop
        codes = self.codes[..., tokens].index_select(1, slots)  # [B, J, C, Tb]
        modes = self.modes[..., t0 // 8: -(-t1 // 8)].index_select(1, slots)  # [B, J, G, Tb/8]
        anchor = self.anchor[..., tokens] if a is not None else None  # [B, Ca, Tb]
        return self._scan_core(codes, modes, anchor, chain.index(a) if a is not None else -1,
                               len(chain) > SCAN_MATMUL_FRAMES)

    def _scan(self, codes: Tensor, modes: Tensor, anchor: Tensor | None, j: int, long: bool) -> Tensor:
        """`scan` on the packed forms of the chain frames (tensors in, tensors out: compilable)."""
        c = self.codes_c.unpack_columns(codes)  # [B, J, G*Dc, Tb]
        B, J, _, Tb = c.shape
        dtype = torch.float32 if J < 256 else torch.float64
        c = c.view(B, J, self.G, self.Dc, Tb).permute(0, 4, 2, 1, 3)  # [B, Tb, G, J, Dc]
        k2 = torch.add(self.minus_n_c.to(dtype), c, alpha=2, out=torch.empty(c.shape, dtype=dtype, device=c.device))  # 2c - n, contiguous
        bits = (modes.unsqueeze(-1) >> self.bit_shift_u8) & 1
        reset = (bits.flatten(-2)[..., :Tb] == 0).permute(0, 3, 2, 1)  # [B, Tb, G, J]
        if anchor is not None:
            reset = reset.clone()
            reset[..., j] = True
        resetf = reset.to(dtype).unsqueeze(-1)
        contrib = k2 * (self.sp_c + resetf * self.si_minus_sp_c)
        if anchor is not None:
            contrib[..., j, :] = self._anchor_states(anchor, dtype)
        if long:  # long chains: one running sum (quant/chainscan.py), O(J)
            return segmented_states(contrib, reset.unsqueeze(-1), dim=3)
        positions = torch.arange(J, device=c.device)
        last = torch.cummax(torch.where(reset, positions, -1), dim=-1).values  # [B, Tb, G, J]
        W = (positions <= positions[:, None]) & (positions >= last.unsqueeze(-1))  # [B, Tb, G, J(j), J(i)]
        return W.to(dtype) @ contrib

    def _anchor_states(self, anchor: Tensor, dtype=torch.float32) -> Tensor:
        """Packed anchors [..., Ca, Tb] -> their states, coded components [..., Tb, G, Dc]."""
        fields = self.anchor_c.unpack_columns(anchor)
        *lead, _, Tb = fields.shape
        return fields.view(*lead, self.G, self.Dc, Tb).movedim(-1, -3).to(dtype) - self.offset_c

    def compile(self, backend: str = "inductor") -> None:
        """Run the decode through `torch.compile` (fuses unpacking, the scan's elementwise steps and
        the rotary into few kernels: the CUDA path; `backend="eager"` checks the capture on a CPU)."""
        self._scan_core = torch.compile(self._scan, dynamic=True, backend=backend)
        self._values_core = torch.compile(self._values, dynamic=True, backend=backend)

    def expand(self, states: Tensor) -> Tensor:
        """Coded components [..., G, Dc] -> int64 states [..., G, D] (0 where uncoded)."""
        ext = torch.nn.functional.pad(states, (0, 1))
        return torch.gather(ext, -1, self.pos.expand(*ext.shape[:-1], self.D)).to(torch.int64)

    def compact(self, v: Tensor) -> Tensor:
        """int64 states [..., G, D] -> coded components [..., G, Dc] (float32)."""
        return torch.gather(v, -1, self.comp.expand(*v.shape[:-1], self.Dc)).float() * self.comp_valid

    def encode(self, x_BGTD: Tensor, v_prev: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """quant/predictive.encode itself, every head at once (its parameters stacked [G, 1, D] to
        broadcast over [B, G, T, D]): (inter [B,G,T], codes, states [B,G,T,D] int64)."""
        return predictive.encode(x_BGTD, self.params, v_prev)

    def values(self, states: Tensor) -> Tensor:
        """(unit * v) @ R^T + mean: states [B, Tb, G, J, Dc] -> [B, G, J, Tb, D] float32."""
        return self._values_core(states)

    def _values(self, states: Tensor) -> Tensor:
        # the reference's own steps, (unit * v) @ R^T + mean over every component, so the values
        # (not only the states) come out bitwise as the reference runtime's
        B, Tb, G, J, Dc = states.shape
        s = states.float().permute(0, 2, 3, 1, 4).reshape(B, G, J * Tb, Dc)
        x = (s @ self.spread) @ self.rotation_t + self.mean[:, None, :]  # unit * v (exact, see above), then R^T
        return x.view(B, G, J, Tb, self.D)

    # ---- a step -----------------------------------------------------------------------------
    @property
    def single_block(self) -> bool:
        return self.token_block >= self.T

    def set_block(self, tokens: int) -> None:
        """Decode `tokens` tokens of every held frame at a time (a multiple of 8: whole mode bytes)."""
        self.token_block = max(8, tokens - tokens % 8) if tokens < self.T else self.T

    def plan(self, B: int, budget: int) -> int:
        """Set the token block from a workspace `budget` in bytes; returns the keys of one block."""
        J = self.sink + self.window
        per_token = B * self.G * J * (2 * self.Dc + 2 * self.D + J) * 4
        self.set_block(max(1, budget // per_token))
        return J * self.token_block

    def bias_fn(self, q_BHTD: Tensor):
        return None  # predictive keys have no logit correction (recipes/FORMAT.md)

    def logit_bias(self, n: int, q_BHTD: Tensor, frames: list[int]) -> None:
        return None

    def step(self, index: int, k_BHTD: Tensor, v_BHTD: Tensor, rope=None, decode: bool = True):
        """Append frame `index` (K as stored: pre- or post-rotary, and V) and, when `decode`,
        yield the history it attends to as blocks (k [B, H, N, D] post-rotary, v, None).

        `rope(frames) -> (cos, sin)` [B, F, T, A] gives the rotary of held frames (pre-rotary keys).
        """
        return self._run(index, (k_BHTD, v_BHTD), rope, decode)

    def history(self, n: int, rope=None, exclude: int | None = None):
        """The held history without frame `exclude`, as blocks (an uncommitted pass: stores nothing)."""
        return self._run(n, None, rope, True, exclude)

    def read(self, n: int, frames: list[int], rope) -> tuple[Tensor, Tensor]:
        """Post-rotary K and V [B, H, F*T, D] of held `frames`, in that order."""
        held = self.chain(n) + self.recent_frames(n)
        k, v, _ = next(self._run(n, None, rope, True, None, block=self.T)) if self.B is not None else (None, None, None)
        if k is None or not frames:
            raise ValueError("no frames to read")
        B, H, _, D = k.shape
        pos = torch.tensor([held.index(f) for f in frames], device=k.device)
        pick = lambda x: x.view(B, H, len(held), self.T, D).index_select(2, pos).reshape(B, H, -1, D)
        return pick(k), pick(v)

    def _run(self, index: int, kv: tuple[Tensor, Tensor] | None, rope, decode: bool, exclude: int | None = None,
             block: int | None = None):
        n = index
        commit = kv is not None
        if commit:
            self.allocate(kv[0].shape[0])
        elif self.B is None:
            return
        chain_pre = self.chain(n)
        if commit:
            post = set(kept_frames(n + 1, self.window, self.sink))
            e = index - self.R
            code_e = e >= 0 and e in post
            prev = e - 1 if (self.temporal and code_e and e - 1 in chain_pre) else None
            chain_post = [f for f in chain_pre if f in post] + ([e] if code_e else [])
            recent_post = [f for f in self.recent_frames(n + 1) if f != index]
            anchor_post = self.anchor_of(chain_post)
        else:
            chain_post = [f for f in chain_pre if f != exclude]
            recent_post = [f for f in self.recent_frames(n) if f != exclude]
        hist_chain = [f for f in chain_post if f != index] if commit else chain_post
        pending = None  # the evicted delta frame whose anchor is packed block by block
        if commit and self.keep_evicted:
            gone = [f for f in chain_pre if f not in post]
            self._evicted = (gone[0], self._host_form(gone[0])) if gone else None
            if gone and self.temporal and gone[0] != self.anchor_frame:
                pending = gone[0]
        pre_set = set(chain_pre)
        keep_pos = self._index([j for j, f in enumerate(chain_pre) if f in set(hist_chain)])
        with_e = commit and code_e and e != index  # e's fresh states join the history (e left the recent ring)
        if decode and not hist_chain and not recent_post:
            decode = False
        cos = sin = None
        if decode and self.pre_rotary:
            cos, sin = rope(hist_chain + recent_post)
        recent_slots = self._index([f % self.R for f in recent_post]) if recent_post else None
        block = block or self.token_block
        for t0 in range(0, self.T, block):
            tokens = slice(t0, min(t0 + block, self.T))
            states = self.scan(chain_pre, tokens) if chain_pre else None
            v_e = None
            if pending is not None:
                self._pack_anchor(self.expand(states[:, :, :, chain_pre.index(pending)]), self._evicted[1]["anchor"][..., tokens])
            if commit:
                x = torch.cat((token_block(kv[0], tokens), kv[1][:, :, tokens]), dim=1)  # K then V: [B, G, Tb, D]
                v_e = self._commit(index, x, tokens, states, chain_pre, e if code_e else None, prev, anchor_post)
            if not decode:
                continue
            kept = states.index_select(3, keep_pos) if states is not None and any(f in pre_set for f in hist_chain) else None
            if with_e:
                v_e = self.compact(v_e.permute(0, 2, 1, 3)).unsqueeze(3)  # [B, Tb, G, 1, Dc]
                kept = v_e if kept is None else torch.cat((kept, v_e.to(kept.dtype)), dim=3)
            yield self._block(kept, recent_slots, tokens, cos, sin)
        if commit:
            self.anchor_frame = anchor_post

    def _commit(self, index, x_BGTD, tokens, states, chain_pre, e, prev, anchor_post):
        """Code frame e for `tokens` (x: the new frame's tokens), store the new frame, re-anchor;
        returns e's states [B, G, Tb, D]."""
        v_e = None
        if e is not None:
            if self.R:
                x_e = self.recent[:, :, e % self.R, tokens].float()
            else:
                x_e = x_BGTD
            v_prev = None
            if prev is not None:
                v_prev = self.expand(states[:, :, :, chain_pre.index(prev)]).permute(0, 2, 1, 3)  # [B, G, Tb, D]
            inter, c, v_e = self.encode(x_e, v_prev)
            slot = self.slot(e)
            B, G, Tb, D = c.shape
            self.codes_layout.pack(c.permute(0, 2, 1, 3).reshape(B, Tb, G * D), out=self.codes[:, slot, :, tokens].transpose(-1, -2))
            bits = inter if Tb % 8 == 0 else torch.nn.functional.pad(inter, (0, -Tb % 8))
            byte = (bits.view(B, G, -1, 8).to(torch.int32) << self.bit_shift).sum(-1, dtype=torch.int32)
            t0 = tokens.start // 8
            self.modes[:, slot, :, t0: t0 + byte.shape[-1]] = byte.to(torch.uint8)
        if self.R:
            self.recent[:, :, index % self.R, tokens] = x_BGTD.to(FP)
        if anchor_post is not None and anchor_post != self.anchor_frame:
            if anchor_post == e:
                v_a = v_e.permute(0, 2, 1, 3)
            else:
                v_a = self.expand(states[:, :, :, chain_pre.index(anchor_post)])  # [B, Tb, G, D]
            self._pack_anchor(v_a, self.anchor[..., tokens])
        return v_e

    def _pack_anchor(self, v_a: Tensor, out: Tensor) -> None:
        """Pack states [B, Tb, G, D] as an anchor into `out` [B, Ca, Tb]."""
        B, Tb = v_a.shape[:2]
        fields = v_a.reshape(B, Tb, self.G, self.D) + self.offset
        self.anchor_layout.pack(fields.reshape(B, Tb, -1), out=out.transpose(-1, -2))

    # ---- a memory plan's host tier and recall slots ------------------------------------------------
    def _host_form(self, f: int) -> dict:
        """Frame f (leaving the window) self-contained: its anchor (the held one, or a buffer the step
        packs from f's states), or without `temporal` its intra codes and modes as stored."""
        if not self.temporal:
            return {"codes": self.codes[:, self.slot(f)].clone(), "modes": self.modes[:, self.slot(f)].clone()}
        return {"anchor": self.anchor.clone() if f == self.anchor_frame else torch.empty_like(self.anchor)}

    def take_evicted(self) -> tuple[int, dict] | None:
        """(frame, host form) of the frame the last step evicted, once."""
        out, self._evicted = self._evicted, None
        return out

    def slot_views(self, s: int) -> dict:
        """Recall slot s as views of its buffers, shaped like a host form."""
        return {name: t[:, s] for name, t in self.slots.items()}

    def set_filled(self, filled: int) -> None:
        self.filled = filled

    def recalled(self, rope=None):
        """Blocks (k post-rotary, v, None) of the filled recall slots; `rope` as in `step`."""
        if not self.filled:
            return
        S = self.filled
        cos, sin = rope([SLOT_BASE + s for s in range(S)]) if self.pre_rotary else (None, None)
        for t0 in range(0, self.T, self.token_block):
            tokens = slice(t0, min(t0 + self.token_block, self.T))
            if self.temporal:  # [B, S, Tb, G, Dc] -> [B, Tb, G, S, Dc]
                states = self._anchor_states(self.slots["anchor"][:, :S, :, tokens]).permute(0, 2, 3, 1, 4)
            else:  # intra frames: a scan without predecessors
                modes = self.slots["modes"][:, :S, :, t0 // 8: -(-tokens.stop // 8)]
                states = self._scan_core(self.slots["codes"][:, :S, :, tokens], modes, None, -1, False)
            yield self._block(states, None, tokens, cos, sin)

    def _block(self, states, recent_slots, tokens: slice, cos, sin):
        """Keys (post-rotary) and values [B, H, N, D] of the decoded chain and recent frames."""
        parts = []
        if states is not None:
            parts.append(self.values(states))  # [B, G, J, Tb, D]
        if recent_slots is not None:
            parts.append(self.recent[:, :, recent_slots, tokens].float())
        x = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        k, v = x[:, : self.H], x[:, self.H:]
        if self.pre_rotary:
            k = rotate_pairs(k, cos[:, None, :, tokens], sin[:, None, :, tokens])
        B, H, F, Tb, D = k.shape
        return k.reshape(B, H, F * Tb, D), v.reshape(B, H, F * Tb, D), None

    # ---- bytes ------------------------------------------------------------------------------
    def nbytes(self, n: int) -> int:
        """Bytes of the forms the kept frames are held in after n appends (memory.py's count)."""
        if self.B is None:
            return 0
        chain = self.chain(n)
        a = self.anchor_of(chain)
        delta = self.codes[:, 0].numel() + self.modes[:, 0].numel()
        total = sum(self.anchor.numel() if f == a else delta for f in chain)
        slots = sum(t[:, : self.filled].numel() for t in self.slots.values())
        return total + slots + len(self.recent_frames(n)) * self.B * self.G * self.T * self.D * 2

    def capacity_nbytes(self) -> int:
        if self.B is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.codes, self.modes, self.anchor, self.recent,
                                                          *self.slots.values()))


def token_block(x, tokens: slice) -> Tensor:
    """Tokens of a frame given as a tensor [B, H, T, D] or as something with `block(tokens)`
    (`fastcache.RotatedKeys`: post-rotary keys made a block at a time)."""
    return x[:, :, tokens] if isinstance(x, Tensor) else x.block(tokens)


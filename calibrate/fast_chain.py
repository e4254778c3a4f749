"""The fast runtime's storage of predictive tensors: preallocated rings of packed chain frames.

`ChainStore` holds one layer's predictive tensors (K and V stacked as G = 2H heads, or the one of
them that is predictive, G = H: `fast_mixed.py` pairs it with the other's store) the way `chain.py`
defines their stored forms, in fixed buffers allocated once:

    codes   uint8 [B, M, C, T]        delta frames: every head's code fields of a token in one row
                                      (`RowLayout.concat` of the heads' rows, C = sum of their bytes),
                                      stored byte-major (`RowLayout.unpack_columns`)
    modes   uint8 [B, M, G, ceil(T/8)] one bit per token and head (1 = inter)
    anchor  uint8 [B, Ca, T]          the one anchor frame (the oldest window frame, once the window
                                      has slid past the sinks: chain.frame_role allows no other)
    sinks   uint8 [B, S, Cz, T]       with a sink code (format 1.3): the sink frames' codes (their
                                      main slots stay unused)
    recent  float16 [B, G, R, T, D]   the newest `recent_frames` frames, ring by frame % R
    holds   uint8 [B, M, G, ceil(T/8)] with a sink hold (format 1.4): one bit per token and head (1 =
                                      its uncoded components take the reference's), kept while the
                                      frame is the anchor (its slot is reused only when it leaves)
    reference uint8 [B, Cr, T]        with a sink refresh (format 1.5): the sink hold's reference, the
                                      uncoded components of the sink frame, then of the latest refresh frame

with M = sink_frames + window - recent_frames main slots: frame f < sink in slot f, later frames
in slot sink + (f - sink) % (window - recent), which is exactly the slot of the frame evicted when
f is coded. A step never moves a frame and allocates no storage.

Decoding a step (`step`, blockwise over tokens: every token's chain is independent):

1. unpack the codes and modes of the held chain frames, oldest first; intra values
   s^I (2c - n), inter steps s^P (2c - n); the anchor's states replace its frame's (a reset), and
   so do a sink code's states its sink frame's;
2. every frame's integer states, frame by frame (`ChainCode.scan`);
3. code the frame that joins the chain (the new one, or the one leaving the recent window)
   against its predecessor's states, exactly as `quant/predictive.encode` (same float32
   operations, so the same codes), write its codes and modes into its slot, and re-anchor the
   frame that became the oldest;
4. values = (unit * v) @ R^T + mean, one matmul of the coded components with unit R^T (its
   rows for the coded components only), plus the reference's uncoded part on held tokens (sink hold),
   keys rotated by their frame's rotary (pre-rotary keys), handed to the attention as one block
   of keys per token block.

The arithmetic of steps 1-4 on packed forms is `fast_chain_code.ChainCode`'s. The integer states
are those of the tests' oracle (tests/reference_runtime.py), held equal; values agree within
FORMAT.md's bound. Bytes held (`nbytes`) count the forms each kept frame is in (memory.py
predicts them); slots not in use at the moment are capacity (`capacity_nbytes`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.cache import kept_frames, rotate_pairs_complex
from calibrate.fast_blocks import IndexTensors, pack_token_bits, token_block, unpack_token_bits
from calibrate.fast_chain_code import ChainCode
from calibrate.fast_chain_host import ChainHostTier
from calibrate.quant.predictive import is_refresh_frame

FP = torch.float16


class ChainStore(ChainHostTier):
    """One layer's predictive tensors, `tensors` = {"k": roles, "v": roles} or one of them (see the
    module docstring)."""

    def __init__(self, tensors: dict[str, dict], pre_rotary: bool, temporal: bool, policy, window: int,
                 sink_frames: int, tokens_per_frame: int, device, token_block: int | None = None,
                 recall_slots: int = 0, keep_evicted: bool = False, hold: bool = False, refresh: int = 0):
        self.kinds = tuple(kind for kind in "kv" if kind in tensors)
        self.code = code = ChainCode([tensors[kind] for kind in self.kinds], device, hold, refresh)
        self.H, self.G, self.D = code.H, code.G, code.D
        self.pre_rotary, self.temporal = pre_rotary and "k" in self.kinds, temporal
        self.T, self.window, self.sink = tokens_per_frame, window, sink_frames
        self.R = policy.recent_frames
        self.Wm = max(window - self.R, 0)
        self.M = sink_frames + self.Wm
        self.S = sink_frames if code.has_sink else 0  # frames held in the sink code
        self.device = torch.device(device)
        self.set_block(token_block or tokens_per_frame)
        self.anchor_frame: int | None = None
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
        self.codes = torch.zeros(B, self.M, self.code.codes_layout.nbytes, T, dtype=torch.uint8, device=dev)
        self.modes = torch.zeros(B, self.M, G, -(-T // 8), dtype=torch.uint8, device=dev)
        self.anchor = torch.zeros(B, self.code.anchor_layout.nbytes, T, dtype=torch.uint8, device=dev)
        self.recent = torch.zeros(B, G, self.R, T, D, dtype=FP, device=dev)
        self.sinks = torch.zeros(B, self.S, self.code.sink_layout.nbytes if self.S else 0, T, dtype=torch.uint8, device=dev)
        self.holds = torch.zeros(B, self.M, G, -(-T // 8) if self.code.hold else 0, dtype=torch.uint8, device=dev)
        self.reference = torch.zeros(B, self.code.reference_layout.nbytes if self.code.refresh else 0, T,
                                     dtype=torch.uint8, device=dev)
        if self.code.refresh:  # w = 0 (no hold) until the sink frame is coded
            self.code.pack_sink(torch.zeros(B, T, G, D, dtype=torch.int64, device=dev), self.reference, reference=True)
        S = self.recall_slots  # a memory plan's recall slots, frames in host form
        held = {"anchor": self.anchor[:, None]} if self.temporal else {"codes": self.codes, "modes": self.modes}
        if self.code.hold:
            held["holds"] = self.holds
        self.slots = {name: t.new_zeros(B, S, *t.shape[2:]) for name, t in held.items()}

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
    def scan(self, chain: list[int], tokens: slice, sink_w: Tensor | None = None, sinks: bool = True) -> Tensor:
        """Integer states of the chain frames for `tokens`, coded components only: float32 (exact
        integers) [B, J, G, Tb, Dc] (`frame_states` gives one frame's [B, Tb, G, D]). With `sinks`
        false the states of frames held in the sink code are left out (any values there: their
        unused slots decode as all-intra zeros), for a step where no held or coded frame predicts
        from them.

        states_j = contrib_j where the token resets at frame j, else states_(j-1) + contrib_j: one
        pass over the frames, oldest first (`ChainCode.scan`). Every value is a state, within the
        anchor range (|v| < 2^15): exact in float32 for a chain of any length.
        """
        slots = self._index([self.slot(f) for f in chain])
        a = self.anchor_of(chain)
        t0, t1 = tokens.start, tokens.stop
        codes = self.codes[..., tokens].index_select(1, slots)  # [B, J, C, Tb]
        modes = self.modes[..., t0 // 8: -(-t1 // 8)].index_select(1, slots)  # [B, J, G, Tb/8]
        anchor = self.anchor[..., tokens] if a is not None else None  # [B, Ca, Tb]
        if sinks:
            sink_w = self._sink_code(self._sink_count(chain), tokens) if sink_w is None else sink_w  # `_run` unpacks it once
        sink_states = self.code.sink_states(sink_w) if sinks and sink_w is not None else None
        return self.code.scan(codes, modes, anchor, chain.index(a) if a is not None else -1, sink_states)

    def frame_states(self, states: Tensor, chain: list[int], f: int) -> Tensor:
        """Frame f's int64 states [B, Tb, G, D] from `scan`'s states of `chain`."""
        return self.code.expand(states[:, chain.index(f)].transpose(1, 2))

    def _sink_count(self, frames: list[int]) -> int:
        return sum(f < self.S for f in frames)  # sink frames come first

    def _sink_code(self, S: int, tokens: slice) -> Tensor | None:
        """The sink code w [B, S, G, Tb, D] of the first S sink frames for `tokens`, unpacked once
        per token block for both their states (the scan) and their values (`_block`)."""
        return self.code.sink_code_of(self.sinks[:, :S, :, tokens]) if S else None

    def _reference_w(self, tokens: slice, sink_w: Tensor | None) -> Tensor | None:
        """The sink hold's source for `tokens`, w [B, G, Tb, D]: the held reference with a sink
        refresh (0 before the sink frame is coded: no hold), else the first sink frame's code (of
        `sink_w` [B, S, G, Tb, D]; None: not coded yet)."""
        if self.code.refresh:
            return self.code.sink_code_of(self.reference[:, None, :, tokens], reference=True)[:, 0]
        return None if sink_w is None else sink_w[:, 0]

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
        per_token = B * self.G * J * (2 * self.code.Dc + 2 * self.D + 1) * 4  # codes, states, values, keys, a mode
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
        if (k is None and v is None) or not frames:
            raise ValueError("no frames to read")
        B, H, _, D = (k if k is not None else v).shape
        pos = torch.tensor([held.index(f) for f in frames], device=self.device)
        pick = lambda x: None if x is None else x.view(B, H, len(held), self.T, D).index_select(2, pos).reshape(B, H, -1, D)
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
        hist_slots = self._index([self.slot(f) for f in hist_chain]) if self.code.hold and hist_chain else None
        block = block or self.token_block
        pre_sinks, hist_sinks = self._sink_count(chain_pre), self._sink_count(hist_chain)
        # frame S (the first after the sink code's) is the one frame that predicts from a sink frame's states
        sinks_predict = self.S in chain_pre or (commit and code_e and e == self.S)
        for t0 in range(0, self.T, block):
            tokens = slice(t0, min(t0 + block, self.T))
            sink_w = self._sink_code(pre_sinks, tokens)
            states = self.scan(chain_pre, tokens, sink_w, sinks_predict) if chain_pre else None
            v_e = ref_w = None  # ref_w: the sink hold's reference after this step's commit, once unpacked
            if pending is not None:
                v_out = self.frame_states(states, chain_pre, pending)
                self.code.pack_anchor(v_out, self._evicted[1]["anchor"][..., tokens])
            if commit:
                x = torch.cat([token_block(kv[0], tokens) if kind == "k" else kv[1][:, :, tokens]
                               for kind in self.kinds], dim=1)  # K then V: [B, G, Tb, D]
                if not code_e and is_refresh_frame(e, self.code.refresh, self.sink):  # evicted uncoded: it still refreshes
                    ref_w = self._set_reference(self.recent[:, :, e % self.R, tokens].float(), tokens)
                v_e, coded_ref = self._commit(index, x, tokens, states, chain_pre, e if code_e else None, prev, anchor_post,
                                              sink_w)
                ref_w = ref_w if coded_ref is None else coded_ref
            if not decode:
                continue
            # the history's states, heads before frames: [B, G, J, Tb, Dc] (one copy that also transposes)
            kept = (states.transpose(1, 2).index_select(2, keep_pos)
                    if states is not None and any(f in pre_set for f in hist_chain) else None)
            if with_e:
                v_e = self.code.compact(v_e.transpose(1, 2)).transpose(1, 2).unsqueeze(2)  # [B, G, 1, Tb, Dc]
                kept = v_e if kept is None else torch.cat((kept, v_e), dim=2)
            if hist_sinks > pre_sinks:  # a sink frame coded this step: unpack after its commit
                sink_w = self._sink_code(hist_sinks, tokens)
            held = None  # the sink hold: (hold bits of the history's chain frames, the reference's part)
            if self.code.hold and kept is not None:
                ref_w = self._reference_w(tokens, sink_w) if ref_w is None else ref_w
                if ref_w is not None:
                    held = self._holds(self.holds.index_select(1, hist_slots), tokens), self.code.hold_part(ref_w)
            out = self._block(kept, recent_slots, tokens, cos, sin, sink_w[:, :hist_sinks] if hist_sinks else None, held)
            states = kept = held = v_e = None  # this block's temporaries are not alive while the next one decodes
            yield out
            out = None
        if commit:
            self.anchor_frame = anchor_post

    def _commit(self, index, x_BGTD, tokens, states, chain_pre, e, prev, anchor_post, sink_w):
        """Code frame e for `tokens` (x: the new frame's tokens), store the new frame, re-anchor;
        returns (e's states [B, G, Tb, D], the sink hold's reference w [B, G, Tb, D] e was coded
        against or set, else None). `sink_w`: the held sink frames' codes (the sink hold's source)."""
        v_e = ref_w = None
        if e is not None:
            x_e = self.recent[:, :, e % self.R, tokens].float() if self.R else x_BGTD
            if e < self.S:  # a sink frame: the sink code (the first: the sink hold's reference)
                w, v_e = self.code.encode_sink(x_e)
                self.code.pack_sink(w.permute(0, 2, 1, 3), self.sinks[:, e, :, tokens])
                if e == 0 and self.code.refresh:
                    ref_w = self._set_reference(x_e, tokens)
            else:
                v_prev = None
                if prev is not None:
                    v_prev = self.frame_states(states, chain_pre, prev).transpose(1, 2)  # [B, G, Tb, D]
                hold = None
                if self.code.hold:  # against e's own reference if it is a refresh frame
                    refresh = is_refresh_frame(e, self.code.refresh, self.sink)
                    ref_w = self._set_reference(x_e, tokens) if refresh else self._reference_w(tokens, sink_w)
                    hold = self.code.encode_hold(x_e, ref_w)
                v_e = self._store_delta(e, tokens, *self.code.encode(x_e, v_prev), hold)
        if self.R:
            self.recent[:, :, index % self.R, tokens] = x_BGTD.to(FP)
        if anchor_post is not None and anchor_post != self.anchor_frame:
            if anchor_post == e:
                v_a = v_e.permute(0, 2, 1, 3)
            else:
                v_a = self.frame_states(states, chain_pre, anchor_post)
            self.code.pack_anchor(v_a, self.anchor[..., tokens])
        return v_e, ref_w

    def _set_reference(self, x_BGTD: Tensor, tokens: slice) -> Tensor:
        """Hold the sink-code reference of a frame's `tokens` (the sink frame, or a refresh frame);
        returns its code w [B, G, Tb, D]."""
        w = self.code.encode_reference(x_BGTD)
        self.code.pack_sink(w.permute(0, 2, 1, 3), self.reference[..., tokens], reference=True)
        return w

    def _store_delta(self, e: int, tokens: slice, inter: Tensor, c: Tensor, v_e: Tensor, hold: Tensor | None) -> Tensor:
        """Write frame e's modes, codes (and holds) for `tokens` into its slot; returns its states."""
        slot = self.slot(e)
        B, G, Tb, D = c.shape
        self.code.codes_layout.pack(c.permute(0, 2, 1, 3).reshape(B, Tb, G * D), out=self.codes[:, slot, :, tokens].transpose(-1, -2))
        for bits, table in ((inter, self.modes), (hold, self.holds)):
            if bits is not None:
                pack_token_bits(bits, table[:, slot], tokens.start)
        return v_e

    def _holds(self, rows: Tensor, tokens: slice) -> Tensor:
        """Hold bits [B, G, J, Tb] bool of `tokens` from J rows of holds [B, J, G, ceil(T/8)]."""
        return unpack_token_bits(rows, tokens).transpose(1, 2)

    def _block(self, states, recent_slots, tokens: slice, cos, sin, sink_w: Tensor | None = None,
               held: tuple[Tensor, Tensor] | None = None):
        """Keys (post-rotary) and values [B, H, N, D] of the decoded chain (`states` [B, G, J, Tb,
        Dc]) and recent frames (None for a kind this store does not hold); the first chain frames
        are sink frames in the sink code when `sink_w` (their codes w [B, S, G, Tb, D]) is given,
        valued by it; `held` = (hold bits [B, G, J, Tb], the sink's part h [B, G, Tb, D]): the sink
        hold, x + h where set."""
        parts = []
        if states is not None:
            x = self.code.values(states)  # [B, G, J, Tb, D]
            if held is not None:
                x.addcmul_(held[0].unsqueeze(-1).to(x.dtype), held[1].unsqueeze(2))  # + h where held (0/1 * h: exact)
            if sink_w is not None:
                x[:, :, : sink_w.shape[1]] = self.code.sink_values(sink_w)
            parts.append(x)
        if recent_slots is not None:
            parts.append(self.recent[:, :, recent_slots, tokens].float())
        x = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        held = dict(zip(self.kinds, x.split(self.H, dim=1)))
        k, v = held.get("k"), held.get("v")
        if self.pre_rotary:
            k = rotate_pairs_complex(k, cos[:, None, :, tokens], sin[:, None, :, tokens])
        B, H, F, Tb, D = x.shape[0], self.H, *x.shape[2:]
        flat = lambda t: None if t is None else t.reshape(B, H, F * Tb, D)
        return flat(k), flat(v), None

    # ---- bytes ------------------------------------------------------------------------------
    def nbytes(self, n: int) -> int:
        """Bytes of the forms the kept frames are held in after n appends (memory.py's count)."""
        if self.B is None:
            return 0
        chain = self.chain(n)
        a = self.anchor_of(chain)
        delta, holds = self.codes[:, 0].numel() + self.modes[:, 0].numel(), self.holds[:, 0].numel()
        total = sum(self.sinks[:, 0].numel() if f < self.S else (self.anchor.numel() if f == a else delta) + holds
                    for f in chain)
        slots = sum(t[:, : self.filled].numel() for t in self.slots.values())
        return total + slots + self.reference.numel() + len(self.recent_frames(n)) * self.B * self.G * self.T * self.D * 2

    def capacity_nbytes(self) -> int:
        if self.B is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.codes, self.modes, self.anchor, self.recent, self.sinks,
                                                          self.holds, self.reference, *self.slots.values()))

"""The runtime: a packed, quantized KV cache with preallocated buffers and blockwise attention.

`FastKVCache.from_recipe(recipe)` (also `calibrate.QuantizedKVCache`) runs a recipe from the
recipe alone, with no Python loop over heads or frames on a steady step:

- per layer one store holds K and V in buffers allocated at the first frame: a predictive
  recipe in `fast_chain.ChainStore` (a ring of packed delta frames, one anchor, a float16 recent
  ring), per-frame codes in `fast_frames.FrameStore` (one ring per precision class). Sink,
  recent-window and anchor slots are addressed by frame index, so a steady-state step writes
  into existing storage and has no Python loop over heads or frames;
- attention never holds the decoded history in full precision: a store decodes it a block at a
  time (`quant/blockattn.OnlineSoftmax` merges the blocks; one block, the plain softmax, when it
  is small), so the extra memory of a step is one block's keys and values and its logits;
- keys stored before the rotary encoding are rotated by their frame's rotary, recomputed from the
  stored coordinates (`Rope.at`) once per step for all layers (`_RotaryMemo`);
- a memory plan (tiers.py) runs here too: each store hands the frame a step evicts to the host tier
  in its host form (`take_evicted`), the tiers copy this step's recalled frames into the stores'
  slot buffers (`slot_views`), and attention reads the slots after the window (`recalled`).

What it computes is what `KVCache.attend` computes (tests hold the integer codes and states equal
to those of the tests' oracle, `tests/reference_runtime.py`, which codes frame by frame and head by
head through codec.py, and the outputs within float rounding). Nothing observes it: shadowing
and recording need the materialized history of `KVCache.attend`; `read`/`gather`/`logits` are
there (materializing) for `shadow.ShadowCache` and tests.

A recipe this runtime cannot run is refused by `fast_path_problem` with one line naming the kind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from calibrate.cache import SLOT_BASE, KVCache, Rope, attention_logits, attention_output, kept_frames
from calibrate.fast_blocks import token_block
from calibrate.fast_chain import ChainStore
from calibrate.memory import check_fitted_window
from calibrate.quant.blockattn import OnlineSoftmax
from calibrate.recipe import Recipe, validate
from calibrate.tiers import Tiers, device_window, predicted_bytes

MIN_WORKSPACE = 4 * 2**20  # bytes per batch row of decoded history a block may take at least (small models: one block)


class FastPathError(ValueError):
    """A recipe the runtime has no path for (the message names the kind)."""


def fast_path_problem(recipe: Recipe) -> str | None:
    """Why `FastKVCache` cannot run this recipe (one line naming the kind), or None: predictive K
    and V with different `temporal`, or one with a sink code or sink hold, a layer mixing a predictive and a per-frame kind under a memory
    plan or with a logit correction on its keys, the Jensen correction on a kind without a uniform
    step, a head_dim that is not a multiple of 8. No preset or fit writes these."""
    from calibrate import fast_pools

    D = recipe.model.head_dim
    for i, pair in enumerate(recipe.scheme.layers):
        predictive = [spec.kind == "predictive" for spec in (pair.k, pair.v)]
        if all(predictive):
            if pair.k.temporal != pair.v.temporal:
                return f"layer {i}: predictive K and V with different 'temporal'"
            if (pair.k.sink_token_bits is None) != (pair.v.sink_token_bits is None):
                return f"layer {i}: predictive K and V, one with a sink code ('sink_token_bits') and one without"
            if pair.k.sink_hold != pair.v.sink_hold:
                return f"layer {i}: predictive K and V, one with a sink hold ('sink_hold') and one without"
            if pair.k.sink_refresh != pair.v.sink_refresh:
                return f"layer {i}: predictive K and V with different 'sink_refresh'"
            continue
        if any(predictive):
            mixes = f"layer {i} mixes a predictive and a per-frame kind (K {pair.k.kind}, V {pair.v.kind})"
            if recipe.scheme.policy.plan is not None:
                return f"{mixes} under a memory plan"
            if not predictive[0] and (pair.k.jensen or recipe.tensor(i, "k", "logit_bias") is not None):
                return f"{mixes} with a logit correction on its keys"
        elif problem := fast_pools.pair_problem(pair.k, pair.v):
            return f"layer {i}: {problem}"
        for kind, spec in [(kind, spec) for kind, spec, p in zip("kv", (pair.k, pair.v), predictive) if not p]:
            problem = fast_pools.problem(spec, D, recipe.scheme.policy)
            if problem:
                return f"layer {i} {kind}: {problem}"
    return None


def check_runnable(recipe: Recipe) -> None:
    """FastPathError (one line naming the kind) unless this runtime can run `recipe`."""
    problem = fast_path_problem(recipe)
    if problem is not None:
        raise FastPathError(f"recipe '{recipe.scheme.name}': the runtime has no path for it ({problem})")


class RotatedKeys:
    """A frame's post-rotary keys, computed a token block at a time when asked (`block`), or whole
    (`full`): a blockwise step never holds the frame's rotated keys and their temporaries at once."""

    def __init__(self, rope: Rope, k_BHTD: Tensor):
        self.rope, self.k, self.shape = rope, k_BHTD, k_BHTD.shape

    def block(self, tokens: slice) -> Tensor:
        return Rope(self.rope.angles_BTA[:, tokens]).apply(self.k[:, :, tokens])

    def full(self) -> Tensor:
        return self.rope.apply(self.k)


class _RotaryMemo:
    """cos/sin [B, F, T, A] of held frames' rotary, from their stored coordinates via `Rope.at`.

    Computed once per set of frames and shared by every layer of a step (their frames agree);
    `at` is called on all frames at once when it maps rows independently (checked once against
    per-frame calls), else once per frame. Workspace, not cache: it holds no K/V.
    """

    def __init__(self):
        self.at = None
        self.batched: bool | None = None
        self.memo: dict[tuple, tuple[Tensor, Tensor]] = {}

    def angles(self, coords_BFP: Tensor) -> Tensor:
        B, F, P = coords_BFP.shape
        if self.batched is False:
            return self._per_frame(coords_BFP)
        out = self.at(coords_BFP.reshape(B * F, P)).angles_BTA
        rows = out.shape[0] == B * F  # e.g. Wan's `at` gives one row for the whole batch
        if rows and self.batched:
            return out.reshape(B, F, *out.shape[1:])
        per_frame = self._per_frame(coords_BFP)
        if not rows:
            self.batched = False
        elif B * F > 1:  # a single row proves nothing either way
            self.batched = torch.equal(out.reshape(B, F, *out.shape[1:]), per_frame)
        return per_frame

    def _per_frame(self, coords_BFP: Tensor) -> Tensor:
        B = coords_BFP.shape[0]
        return torch.stack([self.at(coords_BFP[:, f]).angles_BTA.expand(B, -1, -1) for f in range(coords_BFP.shape[1])], 1)

    def get(self, frames: list[int], coords_BFP: Tensor) -> tuple[Tensor, Tensor]:
        key = tuple(frames)
        if key not in self.memo:
            if len(self.memo) >= 4:
                self.memo.pop(next(iter(self.memo)))
            a = self.angles(coords_BFP)
            self.memo[key] = (a.cos(), a.sin())
        return self.memo[key]


class FastKVCache(KVCache):
    def __init__(self, recipe: Recipe, window: int = 16, sink_frames: int = 1, device: str | torch.device = "cpu",
                 token_block: int | None = None, query_chunk: int | None = None, workspace_bytes: int | None = None,
                 compute_dtype: torch.dtype | None = None, compile: str | None = None):
        validate(recipe, f"recipe '{recipe.path or recipe.scheme.name}'")  # an in-memory one too; load_recipe did a file's
        check_runnable(recipe)
        window, sink_frames = device_window(recipe, window, sink_frames)  # a memory plan decides them
        check_fitted_window(recipe, window, sink_frames)
        super().__init__(recipe.model.num_layers, window, sink_frames)
        self.recipe = recipe
        self.policy = recipe.scheme.policy
        self.device = torch.device(device)
        self.query_chunk = query_chunk
        self.workspace_bytes = workspace_bytes
        self._planned = token_block is not None or query_chunk is not None
        self.key_block = None
        self.compute_dtype = compute_dtype  # attention matmuls (bfloat16 for a bf16 model on CUDA); None: the input's
        T = recipe.model.tokens_per_frame
        self.tiers = Tiers.of(recipe, self.device)
        tiered = {"recall_slots": self.tiers.plan.recall_slots if self.tiers else 0, "keep_evicted": self.tiers is not None}
        self.stores = []
        self.coords_dims = []
        for i, pair in enumerate(recipe.scheme.layers):
            self.coords_dims.append(pair.k.rotary_coords)
            predictive = "".join(kind for kind in "kv" if recipe.spec(i, kind).kind == "predictive")
            per_frame = "".join(kind for kind in "kv" if kind not in predictive)
            chain = frames = None
            if predictive:
                chain = ChainStore({kind: recipe.layer_tensors(i, kind) for kind in predictive}, pair.k.rotary_coords > 0,
                                   recipe.spec(i, predictive[0]).temporal, self.policy, window, sink_frames, T,
                                   self.device, token_block, **tiered, hold=recipe.spec(i, predictive[0]).sink_hold,
                                   refresh=recipe.spec(i, predictive[0]).sink_refresh)
            if per_frame:
                from calibrate.fast_frames import FrameStore

                frames = FrameStore(recipe, i, window, sink_frames, self.device, token_block, **tiered, kinds=per_frame)
            if chain and frames:
                from calibrate.fast_mixed import MixedStore

                self.stores.append(MixedStore(chain, frames, window, sink_frames))
            else:
                self.stores.append(chain or frames)
        if compile:
            for store in self.stores:
                if isinstance(store, ChainStore):
                    store.code.compile(compile)
        self._coords: list[Tensor | None] = [None] * self.num_layers  # [B, sink + window + slots, P] float32
        self._rotary = _RotaryMemo()

    @classmethod
    def from_recipe(cls, recipe: Recipe, window: int = 16, sink_frames: int = 1, device="cpu", **kw) -> "FastKVCache":
        return cls(recipe, window=window, sink_frames=sink_frames, device=device, **kw)

    # ---- frames ---------------------------------------------------------------------------------
    def frame_indices(self, layer: int = 0) -> list[int]:
        return kept_frames(self._num_appended[layer], self.window, self.sink_frames)

    def _ring(self, f: int) -> int:
        if f >= SLOT_BASE:  # a recall slot's row, after the window's
            return self.sink_frames + self.window + f - SLOT_BASE
        return f if f < self.sink_frames else self.sink_frames + (f - self.sink_frames) % self.window

    def _key_input(self, layer: int, k_BHTD: Tensor, key_rope: Rope, index: int) -> Tensor:
        """The keys the layer stores: post-rotary, or pre-rotary with the frame's coordinates kept."""
        P = self.coords_dims[layer]
        if not P:
            lazy = RotatedKeys(key_rope, k_BHTD)
            return lazy if not self.stores[layer].single_block else lazy.full()
        if key_rope.coords_BP is None or key_rope.at is None or key_rope.coords_BP.shape[-1] != P:
            got = "none" if key_rope.coords_BP is None else str(key_rope.coords_BP.shape[-1])
            raise ValueError(f"recipe {self.recipe.path or ''}: scheme.layers[{layer}].k.rotary_coords={P}: keys are "
                             f"stored before the rotary encoding, which needs {P} rotary coordinates per frame from "
                             f"the model; its Rope gives {got}")
        self._rotary.at = key_rope.at
        if self._coords[layer] is None:
            B = k_BHTD.shape[0]
            slots = self.tiers.plan.recall_slots if self.tiers else 0
            self._coords[layer] = torch.zeros(B, self.sink_frames + self.window + slots, P, device=k_BHTD.device)
        self._coords[layer][:, self._ring(index)] = key_rope.coords_BP.detach().to(torch.float32)
        return k_BHTD

    def _rope_fn(self, layer: int):
        def rope(frames: list[int]) -> tuple[Tensor, Tensor]:
            rows = torch.tensor([self._ring(f) for f in frames], device=self._coords[layer].device)
            coords = self._coords[layer].index_select(1, rows)
            if frames and frames[0] >= SLOT_BASE:  # recall slots change content: no memo
                a = self._rotary.angles(coords)
                return a.cos(), a.sin()
            return self._rotary.get(frames, coords)
        return rope

    def _plan(self, B: int) -> None:
        """Block sizes from the workspace budget (default: a quarter of a frame's float16 K/V, at least
        `MIN_WORKSPACE` per batch row): keys decoded per block, and queries per chunk so one block's
        logits fit. The floor scales with the batch so a small model decodes in one block at any
        batch (a fixed floor split TinyWorld's step in two at batch 8: twice the operators to save
        a few MiB)."""
        info = self.recipe.model
        budget = self.workspace_bytes or B * max(MIN_WORKSPACE, info.elements_per_frame // 2)  # a quarter frame, fp16
        keys = max(store.plan(B, budget) for store in self.stores)
        rows = max(1, budget // (B * info.num_kv_heads * keys * 4 * 2))
        self.query_chunk = None if rows >= info.tokens_per_frame else rows
        self.key_block = keys
        self._planned = True

    # ---- the seam -------------------------------------------------------------------------------
    def _check(self, layer: int, x_BHTD: Tensor) -> None:
        """The model's frame has the shape the recipe was made for (one line otherwise)."""
        info = self.recipe.model
        if x_BHTD.dim() != 4 or tuple(x_BHTD.shape[1:]) != (info.num_kv_heads, info.tokens_per_frame, info.head_dim):
            raise ValueError(f"recipe '{self.recipe.scheme.name}' ({info.name}) is for frames of {info.num_kv_heads} heads x "
                             f"{info.tokens_per_frame} tokens x head_dim {info.head_dim}; layer {layer} of the model "
                             f"gives {list(x_BHTD.shape)}")

    def _store_step(self, layer: int, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope, decode: bool):
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"recipe '{self.recipe.scheme.name}' has {self.num_layers} layers; the model uses layer {layer}")
        self._check(layer, k_BHTD)
        if not self._planned:
            self._plan(k_BHTD.shape[0])
        index = self._num_appended[layer]
        coords_out = None
        if self.tiers is not None:
            self.tiers.before_append(layer, index, key_rope)
            if self.coords_dims[layer] and self._coords[layer] is not None and index >= self.sink_frames + self.window:
                coords_out = self._coords[layer][:, self._ring(index)].clone()  # the evicted frame's: its row is reused
        k_in = self._key_input(layer, k_BHTD, key_rope, index)
        blocks = self.stores[layer].step(index, k_in, v_BHTD, self._rope_fn(layer), decode=decode)
        if self.tiers is not None:
            blocks = self._with_recall(layer, index, blocks, coords_out, decode)
        return index, k_in, blocks

    def _with_recall(self, layer: int, index: int, blocks, coords_out: Tensor | None, decode: bool):
        """The step's history blocks, then (the step done) the evicted frame to the host tier, this
        step's recall into the slots, and the slots' blocks."""
        yield from blocks
        store = self.stores[layer]
        gone = store.take_evicted()
        if gone is not None:
            frame, record = gone
            self.tiers.evicted(layer, frame, record if coords_out is None else {**record, "coords": coords_out})
        P = self.coords_dims[layer]
        row = lambda s: self._coords[layer][:, self._ring(SLOT_BASE + s)]
        self.tiers.recall(layer, index, lambda s, like: {**store.slot_views(s), **({"coords": row(s)} if P else {})})
        store.set_filled(self.tiers.filled)
        if decode:
            yield from store.recalled(self._rope_fn(layer))

    def attend(self, layer: int, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> Tensor:
        index, k_in, blocks = self._store_step(layer, k_BHTD, v_BHTD, key_rope, decode=True)
        k_rot = k_in if not self.coords_dims[layer] else RotatedKeys(key_rope, k_BHTD)
        out = self._attention(layer, q_BHTD, k_rot, v_BHTD, blocks)
        self._num_appended[layer] = index + 1
        return out

    def append(self, layer: int, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> int:
        index, _, blocks = self._store_step(layer, k_BHTD, v_BHTD, key_rope, decode=False)
        for _ in blocks:
            pass
        self._num_appended[layer] = index + 1
        return index

    def attend_uncommitted(self, layer: int, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> Tensor:
        n = self._num_appended[layer]
        gone = set(kept_frames(n, self.window, self.sink_frames)) - set(kept_frames(n + 1, self.window, self.sink_frames))
        blocks = self.stores[layer].history(n, self._rope_fn(layer), exclude=min(gone) if gone else None)
        return self._attention(layer, q_BHTD, RotatedKeys(key_rope, k_BHTD), v_BHTD, blocks)

    def _attention(self, layer: int, q_BHTD: Tensor, k_BHTD, v_BHTD: Tensor, blocks) -> Tensor:
        """softmax attention of q over the history blocks and the fresh frame's own K/V (its keys
        post-rotary: a tensor or `RotatedKeys`)."""
        store = self.stores[layer]
        if isinstance(k_BHTD, RotatedKeys) and (store.single_block and not self.query_chunk):
            k_BHTD = k_BHTD.full()
        bias = store.bias_fn(q_BHTD)  # per block: key-noise correction, or None
        if store.single_block and not self.query_chunk:  # small: one softmax over the whole history
            got = list(blocks)
            if not got:
                return attention_output(attention_logits(q_BHTD, k_BHTD), v_BHTD)
            k_all = torch.cat([k for k, _, _ in got] + [k_BHTD], dim=2)
            v_all = torch.cat([v for _, v, _ in got] + [v_BHTD], dim=2)
            mask = None
            if any(corr is not None for _, _, corr in got):  # each block's correction, 0 for the fresh frame
                B, H, T, _ = q_BHTD.shape
                mask = torch.cat([(bias(corr) if corr is not None else q_BHTD.new_zeros(1, 1, 1, 1)).expand(B, H, T, k.shape[2])
                                  for k, _, corr in got] + [q_BHTD.new_zeros(B, H, T, T)], dim=-1)
            if self.compute_dtype is not None and self.compute_dtype != q_BHTD.dtype:  # e.g. bf16 flash attention
                cd = self.compute_dtype
                out = F.scaled_dot_product_attention(q_BHTD.to(cd), k_all.to(cd), v_all.to(cd),
                                                     attn_mask=None if mask is None else mask.to(cd))
                return out.to(q_BHTD.dtype)
            return attention_output(attention_logits(q_BHTD, k_all, mask), v_all)
        acc = OnlineSoftmax(q_BHTD, self.query_chunk, self.compute_dtype, key_block=self.key_block)
        T = v_BHTD.shape[2]
        step = self.key_block or T
        for t0 in range(0, T, step):  # the fresh frame first: every row gets a finite logit
            tokens = slice(t0, t0 + step)
            acc.add(token_block(k_BHTD, tokens), v_BHTD[:, :, tokens])
        for k_h, v_h, corr in blocks:
            acc.add(k_h, v_h, None if corr is None else bias(corr))
            del k_h, v_h  # not alive while the next block decodes
        return acc.result()

    # ---- reading the history (materializing: shadows and tests) --------------------------------
    def read(self, layer: int, frames: list[int] | None = None) -> tuple[Tensor, Tensor]:
        frames = self.frame_indices(layer) if frames is None else frames
        return self.stores[layer].read(self._num_appended[layer], frames, self._rope_fn(layer))

    def logit_bias(self, layer: int, q_BHTD: Tensor, frames: list[int] | None = None) -> Tensor | None:
        frames = self.history(layer) if frames is None else frames
        return self.stores[layer].logit_bias(self._num_appended[layer], q_BHTD, frames)

    # ---- bytes ----------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of what the kept frames are held as (codes, parameters, anchors, recent frames,
        rotary coordinates): what `memory.predicted_cache_bytes` predicts."""
        total = 0
        slots = self.tiers.filled if self.tiers else 0
        for layer, store in enumerate(self.stores):
            n = self._num_appended[layer]
            total += store.nbytes(n)
            if self._coords[layer] is not None:
                c = self._coords[layer]
                frames = len(kept_frames(n, self.window, self.sink_frames)) + slots
                total += frames * c.shape[0] * c.shape[2] * c.element_size()
        return total

    def capacity_nbytes(self) -> int:
        """Bytes of every buffer allocated (slots not in use at the moment included)."""
        return (sum(s.capacity_nbytes() for s in self.stores)
                + sum(c.numel() * c.element_size() for c in self._coords if c is not None))

    def predicted_nbytes(self, num_appended: int, batch: int = 1) -> int:
        return predicted_bytes(self.recipe.model, self.recipe.scheme, num_appended, self.window, self.sink_frames, batch)

    def expect(self, coords_BP: Tensor) -> None:
        if self.tiers is not None:
            self.tiers.query = coords_BP

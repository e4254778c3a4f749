"""Teacher-forced attention error: quantized caches that shadow a full-precision rollout.

`ShadowCache` is the full-precision cache (the rollout it drives is the fp reference) that
also hands every frame's K/V to one or more quantized caches. For each layer and frame it
compares the attention of the same queries over the fp history and over each quantized
history, and accumulates:

- `kl`: KL(p_fp || p_quant) of attention rows (mean over rows),
- `top`: share of rows whose most-attended frame is unchanged,
- `err2` / `ref2`: squared norms of the attention-output error e_t = o_quant - o_fp and of
  o_fp, so that relative error = sqrt(err2 / ref2),
- `dt2`: squared norm of the frame-to-frame change e_t - e_{t-1} (the temporal term of the
  fitting objective: an error that jumps between frames is seen as flicker).

It also measures each quantized cache's *stored* error (`StoredError`): every time a frame
attends, the history a shadow holds (its decoded K/V, post-rotary) against the fp history of the
same frames, per trajectory, layer, K/V, head and window of steps. A frame counts once per step
it is attended to, so this is the error attention sees, recent full-precision frames and sinks
included. It is measured only when asked (`stored=True`: the noise twin's input,
evaluate/twin.py), and with `attention=False` it is all that is measured.

The quantized caches never influence the rollout, so every scheme is measured on exactly the
same K/V: this is the "history quantized, teacher-forced from the fp K/V" objective that the
fitters minimize and the evaluation reports per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from calibrate.cache import Attended, KVCache, attention_logits, bias_rows
from calibrate.evaluate.metrics import DEFAULT_WINDOWS, window_index

SUMS = ("rows", "kl", "top", "err2", "ref2", "dt2", "dt_rows")


@dataclass
class StoredError:
    """Sums of squared stored error and of the squared fp signal per window of steps (the
    evaluation's windows, metrics.DEFAULT_WINDOWS: a step's sums go to the window of the frame it
    appended), [W, B, L, 2 (K, V), H] float64, and the elements each sum runs over, [W, L]."""

    err2: Tensor
    sig2: Tensor
    count: Tensor

    @staticmethod
    def zeros(batch: int, num_layers: int, num_heads: int) -> "StoredError":
        z = torch.zeros(len(DEFAULT_WINDOWS), batch, num_layers, 2, num_heads, dtype=torch.float64)
        return StoredError(z, z.clone(), torch.zeros(len(DEFAULT_WINDOWS), num_layers, dtype=torch.float64))

    def add(self, layer: int, index: int, k_q: Tensor, v_q: Tensor, k_ref: Tensor, v_ref: Tensor) -> None:
        """Held K/V [B, H, N, D] of a cache against the fp K/V of the same frames, at the step that
        appended frame `index`."""
        w = window_index(index)
        for i, (q, r) in enumerate(((k_q, k_ref), (v_q, v_ref))):
            r64 = r.double()
            self.err2[w, :, layer, i] += (q.double() - r64).pow(2).sum((-2, -1)).cpu()
            self.sig2[w, :, layer, i] += r64.pow(2).sum((-2, -1)).cpu()
        self.count[w, layer] += k_ref.shape[-2] * k_ref.shape[-1]

    def sqnr_db(self, per_window: bool = False) -> Tensor:
        """10 log10(signal / error) of each trajectory, layer and K/V, summed over heads: over the
        whole rollout [B, L, 2], or per window [W, B, L, 2] with `per_window`."""
        sig2, err2 = self.sig2.sum(-1), self.err2.sum(-1)
        if not per_window:
            sig2, err2 = sig2.sum(0), err2.sum(0)
        return 10 * torch.log10(sig2 / err2.clamp_min(1e-300))

    def noise_std(self, per_window: bool = True) -> Tensor:
        """The root-mean-square stored error per element, the noise twin's std: per window
        [W, B, L, 2, H] (a window with no step takes the whole rollout's), or over the whole
        rollout [B, L, 2, H] with `per_window=False`."""
        whole = (self.err2.sum(0) / self.count.sum(0).clamp_min(1).view(1, -1, 1, 1)).sqrt()
        if not per_window:
            return whole
        per = (self.err2 / self.count.clamp_min(1)[:, None, :, None, None]).sqrt()
        return torch.where((self.count > 0)[:, None, :, None, None], per, whole)


@dataclass
class AttentionError:
    """Per-layer sums (see module docstring); merge by addition."""

    num_layers: int
    sums: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        for name in SUMS:
            self.sums.setdefault(name, [0.0] * self.num_layers)

    def add(self, layer: int, **values: float) -> None:
        for name, v in values.items():
            self.sums[name][layer] += v

    def kl(self) -> list[float]:
        return [k / max(r, 1) for k, r in zip(self.sums["kl"], self.sums["rows"])]

    def top_agreement(self) -> list[float]:
        return [t / max(r, 1) for t, r in zip(self.sums["top"], self.sums["rows"])]

    def rel_err(self) -> list[float]:
        return [math.sqrt(e / max(r, 1e-30)) for e, r in zip(self.sums["err2"], self.sums["ref2"])]

    def temporal(self) -> list[float]:
        """sqrt(mean ||e_t - e_{t-1}||^2 / mean ||o_t||^2): the relative frame-to-frame error change."""
        return [math.sqrt((d / max(n, 1)) / max(r / max(rows, 1), 1e-30))
                for d, n, r, rows in zip(self.sums["dt2"], self.sums["dt_rows"], self.sums["ref2"], self.sums["rows"])]

    def objective(self, lambda_temporal: float) -> float:
        """Mean over layers of relative output error + lambda * relative temporal change."""
        rel, tmp = self.rel_err(), self.temporal()
        return sum(a + lambda_temporal * b for a, b in zip(rel, tmp)) / self.num_layers


class ShadowCache(KVCache):
    """The full-precision cache that also feeds `shadows` every frame and compares their attention."""

    def __init__(self, num_layers: int, window: int, sink_frames: int, shadows: dict[str, KVCache],
                 attention: bool = True, stored: bool = False):
        super().__init__(num_layers, window, sink_frames)
        self.shadows = shadows
        self.attention = attention
        self.measure_stored = stored
        self.errors = {name: AttentionError(num_layers) for name in shadows}
        self.stored: dict[str, StoredError] = {}
        self._prev_err: dict[tuple[str, int], Tensor] = {}

    def expect(self, coords_BP: Tensor) -> None:
        for cache in self.shadows.values():
            cache.expect(coords_BP)

    def observe(self, seen: Attended) -> None:
        """Compare each shadow's attention with the fp attention of `seen`, a block of query rows at
        a time (`Attended.logit_blocks`: no more than one block of [B, H, T, N] logits at once)."""
        layer, q_BHTD, out = seen.layer, seen.q_BHTD, seen.out_BHTD
        T = q_BHTD.shape[2]
        rows_total = q_BHTD.shape[0] * q_BHTD.shape[1] * T
        for name, cache in self.shadows.items():
            cache.append(layer, seen.k_BHTD, seen.v_BHTD, seen.key_rope)
        reads = {name: cache.gather(layer, seen.k_rot_BHTD, seen.v_BHTD) for name, cache in self.shadows.items()}
        if self.measure_stored:
            self._add_stored(layer, reads, seen)
        if not self.attention:
            return
        biases = {name: cache.logit_bias(layer, q_BHTD) for name, cache in self.shadows.items()}  # key-noise corrections
        o_q = {name: torch.empty_like(out) for name in self.shadows}
        kl = dict.fromkeys(self.shadows, 0.0)
        top = dict.fromkeys(self.shadows, 0)
        for rows, logits in seen.logit_blocks():
            logp_ref = logits.log_softmax(-1)
            p_ref = logp_ref.exp()
            top_ref = p_ref.unflatten(-1, (-1, T)).sum(-1).argmax(-1)
            for name, (kq, vq) in reads.items():
                logp_q = attention_logits(q_BHTD[:, :, rows], kq, bias_rows(biases[name], rows)).log_softmax(-1)
                p_q = logp_q.exp()
                o_q[name][:, :, rows] = torch.einsum("bhtn,bhnd->bhtd", p_q, vq)
                top[name] += (p_q.unflatten(-1, (-1, T)).sum(-1).argmax(-1) == top_ref).sum().item()
                kl[name] += (p_ref * (logp_ref - logp_q)).sum(-1).clamp_min(0).sum().item()
        for name in self.shadows:
            err = o_q[name] - out
            values = dict(rows=rows_total, kl=kl[name], top=top[name], err2=err.pow(2).sum().item(),
                          ref2=out.pow(2).sum().item())
            prev = self._prev_err.get((name, layer))
            if prev is not None:
                values.update(dt2=(err - prev).pow(2).sum().item(), dt_rows=rows_total)
            self._prev_err[(name, layer)] = err
            self.errors[name].add(layer, **values)

    def _add_stored(self, layer: int, reads: dict[str, tuple[Tensor, Tensor]], seen: Attended) -> None:
        """Each shadow's held history (everything but the fresh frame, which is last) against the fp history."""
        held = seen.k_BHND.shape[2] - seen.q_BHTD.shape[2]
        for name, (kq, vq) in reads.items():
            if name not in self.stored:
                self.stored[name] = StoredError.zeros(seen.q_BHTD.shape[0], self.num_layers, seen.k_BHND.shape[1])
            if held:
                self.stored[name].add(layer, seen.index, kq[:, :, :held], vq[:, :, :held], seen.k_BHND[:, :, :held],
                                      seen.v_BHND[:, :, :held])

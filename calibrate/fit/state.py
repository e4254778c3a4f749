"""The fitter's working state of one tensor, and the per-layer objective it is scored on.

After the per-layer search (fitters.py) every (layer, K or V) has a `Choice` (rotation,
granularity, clips). What the later stages change on top of it is held in a `TensorState`:

- `knobs` (`Knobs`, frozen): per-head bits, outlier channels, the dense-and-sparse share, which
  the mixed-precision allocator (allocate.py) sets;
- `comp`: the low-rank compensator, fitted on the final bits (search.py);
- `logit_var`: the keys' logit correction, fitted last (logit_correction.py).

`layer_scores` is the per-head teacher-forced objective of one layer for given states and token
policy, with every precision class of the policy modelled as the runtime stores it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calibrate.codec import fake_quant_heads
from calibrate.fit.fitters import Choice, fitted_spec, with_bits
from calibrate.fit.logit_correction import logit_shift
from calibrate.fit.objective import LayerTrace, attention_outputs, head_scores
from calibrate.recipe import LayerSpec, ModelInfo, Recipe, Scheme, TensorSpec, TokenPolicy

KINDS = ("k", "v")


@dataclass(frozen=True)
class Knobs:
    """What mixed precision sets on one (layer, tensor)."""

    head_bits: tuple[int, ...]  # bits per head
    outliers: torch.Tensor | None = None  # [H, n] channels kept in float16, or none
    sparse: float = 0.0  # dense-and-sparse share of entries kept in float16


@dataclass
class TensorState:
    choice: Choice
    sample_HND: torch.Tensor
    knobs: Knobs
    comp: tuple[torch.Tensor, torch.Tensor] | None = None  # low-rank compensator, fitted after the bits
    logit_var: torch.Tensor | None = None  # keys: logit correction [H, D] (alpha * sigma^2), fitted last

    @property
    def head_bits(self) -> list[int]:
        return list(self.knobs.head_bits)

    def spec(self) -> TensorSpec:
        """The spec alone (what the memory model counts)."""
        return fitted_spec(self.choice.spec, self.head_bits, 0 if self.knobs.outliers is None else
                           self.knobs.outliers.shape[1], self.knobs.sparse,
                           0 if self.comp is None else self.comp[0].shape[-1])

    def spec_tensors(self):
        return with_bits(self.choice, self.sample_HND, self.head_bits, self.knobs.outliers, self.knobs.sparse,
                         self.comp, self.logit_var)

    def hat(self, x: torch.Tensor, bits: int | None = None) -> torch.Tensor | None:
        """Fake-quantized x (all heads at `bits` if given; 16 -> None = fp)."""
        if bits is not None and bits >= 16:
            return None
        spec, tensors = with_bits(self.choice, self.sample_HND, self.head_bits, self.knobs.outliers, self.knobs.sparse,
                                  self.comp)
        return fake_quant_heads(x, spec, tensors, [bits] * len(self.head_bits) if bits else self.head_bits)


def policy_classes(policy: TokenPolicy) -> dict[str, tuple[int, int]]:
    """The token policy's precision classes in use: name -> (count or interval, bits)."""
    classes = {"recent": (policy.recent_frames, policy.recent_bits), "sink": (policy.sink_frames, policy.sink_bits),
               "keyframe": (policy.keyframe_interval, policy.keyframe_bits)}
    return {name: c for name, c in classes.items() if c[0] > 0}


def layer_scores(trace: LayerTrace, reference, st: dict[str, TensorState], policy: TokenPolicy,
                 lam: float) -> list[float]:
    """Per-head objective of one layer with states `st` ({"k": ..., "v": ...}) under `policy`."""
    classes = policy_classes(policy)
    hats = {}
    for kind in KINDS:
        x = trace.k if kind == "k" else trace.v
        s = st[kind]
        hats[kind] = {"other": s.hat(x)}
        hats[kind].update({name: s.hat(x, bits=bits) for name, (_, bits) in classes.items()})
    out = attention_outputs(
        trace, hats["k"]["other"], hats["v"]["other"],
        **{name: (n, hats["k"][name], hats["v"][name]) for name, (n, _) in classes.items()},
        shift=logit_shift(trace.q, st["k"].logit_var, st["k"].choice.tensors.get("rotation"), st["k"].head_bits,
                          {name: bits for name, (_, bits) in classes.items()}),
    )
    return head_scores(reference, out).objective(lam).tolist()


def scheme_of(states: list[dict[str, TensorState]], policy: TokenPolicy, name: str = "ours") -> Scheme:
    layers = [LayerSpec(k=st["k"].spec(), v=st["v"].spec()) for st in states]
    return Scheme(name=name, layers=layers, policy=policy, notes="fitted by calibrate (see metadata 'fit')")


def assemble(info: ModelInfo, states: list[dict[str, TensorState]], policy: TokenPolicy, name: str = "ours") -> Recipe:
    """The recipe the states describe: their specs and every role tensor."""
    tensors = {}
    for i, st in enumerate(states):
        for kind in KINDS:
            _, ts = st[kind].spec_tensors()
            tensors.update({f"layers.{i}.{kind}.{role}": t for role, t in ts.items()})
    return Recipe(info, scheme_of(states, policy, name), tensors)

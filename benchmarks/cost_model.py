"""What the default `task=calibrate` costs, as formulas of the model's and the run's shape.

Symbols (the legend of every formula below): L layers, H kv heads, D head_dim, C model width,
M ffn width, X text tokens, E text width, T tokens per cache frame, F cache frames per
trajectory, n(f) frames the cache holds once frame f is appended (window + sinks at most),
P passes per cache frame (denoising steps + 1 clean pass), B' traced trajectories, F' traced
frames, S traced token slots per frame.

FLOPs (multiply-adds count 2):

    model, per token and layer      lin  = 2 (4 C^2 + 2 C^2 + 2 C M)         self q/k/v/o, cross q/o, ffn
    cross-attention keys, per pass  2 * 2 X C^2 * L                          (text tokens: small)
    attention, cache frame f        att(f) = 4 H D T * T n(f) * L            q.k and p.v
    one rollout of one trajectory   R = sum_f P (T lin L + att(f))
    replay, per trajectory          R + the recording of F x L cache frames (statistics with their Gram
                                    matrices, reservoirs, the attention mass: timed, `Throughput.record_s`)
    objective layer pass            4 B' H D S^2 sum_f' n(f')
    coded head sequence             4 B' F' S D^2
    counts (`fit_counts`)           L (1 + 2 grid) + 3 L + 3 U / H layer passes, L H (2 grid + 5) + 4 U
                                    sequences, 2 L H (grid + 2) + 2 U fitted codes; U upgrades

Phases: replay (N_cal trajectories), fit (objective calls), closed loop ((1 + candidates) x
N_cl rollouts), evaluation (2 rollouts + the shadows' attention per trajectory), check set (2
rollouts per trajectory).

Bytes (peak, the configured device): weights + B (fp cache + activations + one score block) +
statistics + trace (+ the fit's references: a third of the trace). fp cache = 2 n_max T H D L x 4
(float32, what the cache computes in); activations ~ 3 T max(M, 3 C) x 4; score block =
`cache.SCORE_BLOCK_ELEMENTS` x 4 x 2; statistics = 6 grams L H D^2 x 8 + 3 histograms L H D 256 x 8.

Time = FLOPs / throughput + fixed costs per unit of work (a model pass, a coded frame of one
head, a fitted head code), with the throughputs of the GEMM, attention and float64 shapes measured
on the machine (`benchmarks/scale.py` times them, and fits the fixed costs on the smallest size,
where they dominate) or assumed for a GPU (stated where used).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from calibrate.cache import kept_frames

GIB = 2**30


@dataclass(frozen=True)
class Model:
    layers: int
    heads: int
    head_dim: int
    width: int  # C
    ffn: int  # M
    tokens: int  # T per cache frame
    text_tokens: int = 64
    text_dim: int = 4096
    param_bytes: int = 4  # float32 weights on the CPU; bf16 = 2

    @property
    def params(self) -> int:
        """Transformer parameters: per block self q/k/v/o, cross q/k/v/o (text projected to C) and
        the ffn; the text embedder (E -> C -> C) and the timestep embedder (C -> C -> 6C)."""
        C, M = self.width, self.ffn
        return self.layers * (8 * C * C + 2 * C * M) + self.text_dim * C + C * C + 7 * C * C

    def linear_flops_per_token(self) -> float:
        C, M = self.width, self.ffn
        return 2.0 * (4 * C * C + 2 * C * C + 2 * C * M) * self.layers


@dataclass(frozen=True)
class Run:
    frames: int  # F cache frames per trajectory (all sets)
    window: int
    sinks: int
    passes: int  # denoising steps + 1
    calibration: int = 7  # trajectories
    closed_loop: int = 3
    closed_loop_frames: int | None = None  # default: frames
    candidates: int = 4  # fitted + rescaled closed-loop candidates within the budget
    evaluation: int = 7
    check: int = 4
    check_frames: int | None = None
    batch: int = 1  # trajectories per rollout batch
    trace_trajectories: int = 7
    trace_frames: int = 48
    trace_tokens: int = 512
    trace_bytes: int = 8 * GIB
    trace_element: int = 4
    grid: int = 9  # |intra_mults| x |inter_mults|
    refine_steps: bool = True  # the step grid searched again at the final widths (fit.refine_steps)
    upgrades: int | None = None  # U; default: estimated from the budget headroom
    headroom_bits: float = 0.18  # budget minus the base recipe's bits (U estimate): 2.5 - 2.32, as measured (scale.json)
    bits_step: float = 0.25
    attention_metrics: bool = True


def held(f: int, run: Run) -> int:
    """n(f): frames the cache holds once frame f (0-based) is appended."""
    return len(kept_frames(f + 1, run.window, run.sinks))


def attention_flops(m: Model, frames: int, run: Run) -> float:
    return sum(4.0 * m.heads * m.head_dim * m.tokens * m.tokens * held(f, run) * m.layers for f in range(frames))


def rollout_flops(m: Model, frames: int, run: Run) -> dict[str, float]:
    """One trajectory's rollout: linear (model) and attention FLOPs."""
    cross = 2.0 * 2 * m.text_tokens * m.width * m.width * m.layers
    return {"linear": run.passes * frames * (m.tokens * m.linear_flops_per_token() + cross),
            "attention": run.passes * attention_flops(m, frames, run)}


def trace_slots(m: Model, run: Run) -> tuple[int, int, int]:
    """(B', F', S) as `calibration.trace_plan` chooses them."""
    b, f = min(run.trace_trajectories, run.calibration), min(run.trace_frames, run.frames)
    per_slot = b * f * (3 * m.layers * m.heads * m.head_dim * run.trace_element + 2 * m.head_dim)
    return b, f, min(m.tokens, run.trace_tokens, run.trace_bytes // per_slot)


def upgrades(m: Model, run: Run) -> int:
    """U: upgrades of one head of one tensor by `bits_step` bits per component until the headroom is spent."""
    if run.upgrades is not None:
        return run.upgrades
    return int(run.headroom_bits * 2 * m.layers * m.heads / run.bits_step)


def fit_counts(m: Model, run: Run) -> dict[str, float]:
    """What the fit does, counted from fit/predictive_search.py (U upgrades):

    layer passes of the objective   L (1 + 2 grid) + 3 L       references, the step grid, pricing
    head passes after upgrades      3 U                        (each 1/H of a layer pass)
    coded head sequences            L H (2 grid + 5) + 4 U     (one head's F' frames, quant/predictive.py)
    fitted head codes               2 L H (grid + 2) + 2 U     (fit/predictive.fit_head: PCA + widths)

    and with `refine_steps` the step grid once more: L 2 grid layer passes, L H (2 grid + 1)
    sequences, 2 L H grid codes (at most: a tensor the allocator left at the base width reuses
    its first search, so this over-counts a model whose keys keep the base, as TinyWorld's do).
    """
    u, r = upgrades(m, run), int(run.refine_steps)
    L, H, g = m.layers, m.heads, run.grid
    return {"layer_passes": L * (1 + 2 * g) + 3 * L + 3 * u / H + r * L * 2 * g,
            "sequences": L * H * (2 * g + 5) + 4 * u + r * L * H * (2 * g + 1),
            "codes": 2 * L * H * (g + 2) + 2 * u + r * 2 * L * H * g}


def objective_flops(m: Model, run: Run) -> dict[str, float]:
    """One objective layer pass (attention of the trace's queries over their window, read as the
    runtime reads it), and one coded head sequence (two D x D products per frame and slot)."""
    b, f, s = trace_slots(m, run)
    band = sum(held(i, run) for i in range(f))
    return {"attention": 4.0 * b * m.heads * m.head_dim * s * s * band,
            "sequence": 4.0 * b * f * s * m.head_dim ** 2}


def phases(m: Model, run: Run) -> dict[str, dict[str, float]]:
    """FLOPs per phase, split by kind (linear / attention); the replay's recording is `record_s`."""
    r = rollout_flops(m, run.frames, run)
    cl = rollout_flops(m, run.closed_loop_frames or run.frames, run)
    ck = rollout_flops(m, run.check_frames or run.frames, run)
    o, c = objective_flops(m, run), fit_counts(m, run)
    shadow = attention_flops(m, run.frames, run) if run.attention_metrics else 0.0
    return {
        "replay": {k: run.calibration * v for k, v in r.items()},
        "fit": {"attention": c["layer_passes"] * o["attention"], "linear": c["sequences"] * o["sequence"]},
        "closed loop": {k: (1 + run.candidates) * run.closed_loop * v for k, v in cl.items()},
        "evaluation": {"linear": 2 * run.evaluation * r["linear"],
                       "attention": run.evaluation * (2 * r["attention"] + shadow)},
        "check set": {k: 2 * run.check * v for k, v in ck.items()},
    }


@dataclass
class Throughput:
    """What the time model needs of a machine at one size: FLOP/s of the model's GEMMs and of the
    cache's attention, and fixed costs per unit of work that FLOPs do not describe (kernel launches,
    Python, elementwise passes): the recording of one cache frame in one layer (statistics,
    reservoirs, attention mass), one frame of one head coded (quant/predictive.py), one head's code
    fitted (PCA, widths, steps), and a model pass's fixed part."""

    linear: float
    attention: float
    objective: float = 0.0  # the objective's attention (FLOP/s at the trace's shape); 0: `attention`
    record_s: float = 0.0  # per cache frame and layer, replay only
    quantized_s: float = 0.0  # per pass and layer through a packed cache, beyond the float cache's attention
    step_s: float = 0.0  # per coded frame of one head (its FLOPs included)
    code_s: float = 0.0  # per fitted head code
    per_pass_s: float = 0.0  # per model pass over a cache frame
    note: str = ""


def passes(run: Run) -> dict[str, int]:
    """Model passes per phase: trajectories x frames x passes per frame, per rollout."""
    per = lambda trajs, frames: trajs * frames * run.passes
    return {"replay": per(run.calibration, run.frames),
            "closed loop": (1 + run.candidates) * per(run.closed_loop, run.closed_loop_frames or run.frames),
            "evaluation": 2 * per(run.evaluation, run.frames),
            "check set": 2 * per(run.check, run.check_frames or run.frames), "fit": 0}


def seconds(m: Model, run: Run, tp: Throughput) -> dict[str, float]:
    """Predicted seconds per phase: FLOPs at their kind's rate, plus the fixed costs of its units."""
    counts, n = fit_counts(m, run), passes(run)
    b, f, s = trace_slots(m, run)
    out = {}
    for name, flops in phases(m, run).items():
        out[name] = sum(v / getattr(tp, kind) for kind, v in flops.items()) + n[name] * tp.per_pass_s
    out["replay"] += run.calibration * run.frames * m.layers * tp.record_s
    # passes through a packed cache: every candidate's rollout, the evaluated and the checked recipe's, and
    # the evaluation's shadow (the fp rollout's clean pass hands each frame to the packed cache and reads it back)
    per = lambda trajs, frames: trajs * frames * run.passes * m.layers * tp.quantized_s
    out["closed loop"] += run.candidates * per(run.closed_loop, run.closed_loop_frames or run.frames)
    out["evaluation"] += per(run.evaluation, run.frames) + run.attention_metrics * per(run.evaluation, run.frames) / run.passes
    out["check set"] += per(run.check, run.check_frames or run.frames)
    out["fit"] = (counts["layer_passes"] * objective_flops(m, run)["attention"] / (tp.objective or tp.attention)
                  + counts["sequences"] * f * tp.step_s + counts["codes"] * tp.code_s)
    return out


def peak_bytes(m: Model, run: Run, device_weights_bytes: int | None = None) -> dict[str, float]:
    """Bytes held at the peak of the replay and of the fit (module docstring)."""
    n_max = run.window + run.sinks
    weights = device_weights_bytes if device_weights_bytes is not None else m.params * m.param_bytes
    cache = 2 * n_max * m.tokens * m.heads * m.head_dim * m.layers * 4 * run.batch
    act = 3 * m.tokens * max(m.ffn, 3 * m.width) * 4 * run.batch
    scores = (1 << 25) * 4 * 2
    stats = 6 * m.layers * m.heads * m.head_dim ** 2 * 8 + 3 * m.layers * m.heads * m.head_dim * 256 * 8
    b, f, s = trace_slots(m, run)
    trace = s * b * f * (3 * m.layers * m.heads * m.head_dim * run.trace_element + 2 * m.head_dim)
    refs = trace // 3
    objective_block = (1 << 24) * 4 * 6
    return {"weights": weights, "replay": weights + cache + act + scores + stats + trace,
            "fit": weights + stats + trace + refs + objective_block, "trace": trace}

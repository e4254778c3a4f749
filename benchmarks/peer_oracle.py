"""Peers held to their own code: Quant VideoGen's and TurboQuant's packages against ours (issue 30).

    python -m benchmarks.peer_oracle [--frames 128] [--families orbit,pan,static] [--spans 8,16]
                                     [--span-families orbit] [--bf16-families orbit] [--draws 8]
                                     [--package-draws 1]
                                     [--out artifacts/benchmarks] [--write-golden] [--golden-only]

The oracle is an optional extra, not a project dependency. Quant VideoGen's package pins
torch==2.8.0, so it is installed without its dependencies next to the project's torch:

    pip install --no-deps quant-videogen triton einops loguru termcolor
    pip install --no-deps turboquant==0.2.0      # optional: the TurboQuant comparison

Without `quant_videogen` (or `triton`) the script prints one line and exits with status 2.
`calibrate/` never imports either package; only this script does.

What it measures. TinyWorld (artifacts/models) is rolled out on held-out trajectories (evaluation
seed offset 918273, one trajectory per family, `--frames` cache frames, window 16 + 1 sink, full
precision). A `KVCache` subclass records at the cache seam what a cache stores for every layer
and frame: the keys post-rotary (as the qvg2 runtime stores them) and the values; the model is not
hooked. Each layer's K and V [frames, heads, 16 tokens, 64] are cut into spans of S frames (the
tokens of a span: [B = spans, H, S*16, 64]) and coded, for S in `--spans`, by

(a) QVG's own code: `quant_videogen.compress.compress_kv_cache` with quant_type
    "triton-nstages-kmeans-int2" (its real path: a packed dict), decoded by
    `quant_videogen.uncompress.uncompress_kv_cache`, QuantizeConfig(num_prq_stages=1,
    cache_num_k_centroids=2, cache_num_v_centroids=2, kmeans_max_iters=2, quant_block_size=64),
    on float32 input and on bfloat16 input (`--bf16-families`). The package computes in its
    input's dtype: k-means distances (tl.dot of the input dtype, float32 accumulation), centroids
    (float32 sums cast to the input dtype), residual x - c (input dtype); the residual is quantized
    in float32 with FP8-E4M3 scales; the output is in the input dtype. Its Triton kernels run on
    the CPU under the Triton interpreter (TRITON_INTERPRET=1) behind the shims listed in `SHIMS`
    (installed here at import time, by monkeypatching; no package code is copied);
(b) ours, deferred as the package does: `calibrate.quant.qvg.fit_centroids` on all the span's
    tokens, `smooth`, `residual_scale` / `residual_codes` / `residual_values` on blocks of 64,
    `unsmooth` (the chain of calibrate/codec.py's kind "prq"), with our own k-means init draw
    (`--draws` seeds); (b') the same with the package's own init indices (captured from its
    `torch.randint` call), which takes the init RNG out of the comparison;
(c) ours, streaming (the `qvg2_lowmem` schedule): centroids fitted on the span's first
    frame only, every frame of the span smoothed with them.

SQNR per layer and tensor = 10 log10(sum x^2 / sum (x - x^)^2) over all spans, heads, tokens and
channels, x the recorded float32 values (the bf16 run is scored against them too). Done criterion:
(b) within 0.5 dB of (a, float32) for K and V on every layer.

TurboQuant: the `turboquant` 0.2.0 package (a third-party implementation; the paper's authors
published none) is pure PyTorch; its TurboQuantIP(bits=2) (keys) and TurboQuantMSE(bits=2)
(values) run against our `turbo2.5` (calibrate/quant/turbo.py) on the same recorded K/V, as
shipped and with our rotation, Lloyd-Max levels and QJL sketch put into its objects.

`--write-golden` also records tests/data/qvg_golden.safetensors (tests/test_peer_golden.py):
one head of one layer of the orbit rollout, 2 spans of `GOLDEN_SPAN_FRAMES` frames for K and for
V, run through the package in float32, with the init indices it drew, its ids, centroids, packed
codes, FP8 scales, k-means iterations and decoded output. `--golden-only` writes only that file.

Outputs `peer_oracle.md` and `peer_oracle.json` under `--out`, written atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import logging
import math
import os
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from benchmarks import cpu_model
from calibrate.cache import Attended, KVCache
from calibrate.io import safetensors_bytes, write_bytes_atomic, write_text_atomic
from calibrate.quant import affine, qvg
from calibrate.world.trajectories import make_trajectories

log = logging.getLogger(__name__)

COMMAND = "python -m benchmarks.peer_oracle"
FORMAT, FORMAT_VERSION = "peer-oracle-benchmark", "1.0"
GOLDEN_FORMAT, GOLDEN_VERSION = "qvg-golden", "1.0"
SEED = 918273  # held-out: offset into the evaluation seed range
WINDOW, SINK = 16, 1
CPU = torch.device("cpu")
QUANT_TYPE = "triton-nstages-kmeans-int2"
STAGES, CENTROIDS, ITERS, BLOCK, BITS = 1, 2, 2, 64, 2
QVG_CONFIG = dict(quant_type=QUANT_TYPE, num_prq_stages=STAGES, cache_num_k_centroids=CENTROIDS,
                  cache_num_v_centroids=CENTROIDS, kmeans_max_iters=ITERS, quant_block_size=BLOCK)
PACKAGE_TOL = 1e-4  # batch_kmeans_Euclid's default tol (prq_quant passes it)
CRITERION_DB = 0.5
GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "qvg_golden.safetensors"
GOLDEN_FAMILY, GOLDEN_LAYER, GOLDEN_HEAD, GOLDEN_FIRST_FRAME, GOLDEN_SPAN_FRAMES, GOLDEN_SEED = "orbit", 1, 0, 48, 6, 0
MISSING = ("peer_oracle: the oracle extra is not installed (needs quant_videogen and triton): "
           "pip install --no-deps quant-videogen triton einops loguru termcolor")

SHIMS = [
    "TRITON_INTERPRET=1: Triton runs the package's kernels on CPU tensors (numpy), one program at a time.",
    "triton.autotune -> one fixed config, the last listed (largest tile, after the kernel's own early prune): "
    "fewest interpreted programs; outputs checked equal to the first config's on the golden case.",
    "libdevice.round (the interpreter has no libdevice) -> numpy round half away from zero (CUDA roundf).",
    "Tensor.is_cuda reads True while a package call runs: its Python wrappers assert CUDA tensors "
    "(euclid_assign_triton, triton_centroid_update_sorted_euclid).",
    "interpreter float casts f32->fp8e4nv and f32<->bf16 through torch's correctly rounded casts (RTNE; e4m3 "
    "saturating at 448 as cvt.rn.satfinite): the interpreter's own fp8 cast drops the mantissa carry "
    "(2.3% of random scales: 1.98 -> 1.0) and its f32->bf16 cast truncates.",
    "bf16 runs only: element-wise bf16 ops, tl.dot on bf16 and tl.sum/min/max of bf16 computed in float32 and "
    "rounded to bf16 (the interpreter does integer arithmetic on bf16's uint16 storage); a GPU sums bf16 in "
    "another order.",
    "uncompress_kv_cache reads dict['info'] (quant_config, output_dtype), which the package's integrations add "
    "(_pack_info_into_kv_cache): added here, output_dtype = the input's dtype.",
    "observation only: torch.randint and quant_videogen.real.prq.batch_kmeans_Euclid wrapped during a call to "
    "record the k-means init indices the package drew and the iterations it ran.",
]
TURBO_SHIMS = [
    "turboquant/core.py loaded on its own (its __init__ imports transformers for the HuggingFace cache class only).",
    "numpy.trapz = numpy.trapezoid (removed in NumPy 2.4; the package integrates its 2-bit codebook with it).",
]


# ---- the Quant VideoGen package behind its shims ----------------------------------------------
class _FixedConfig:
    """Stands in for `triton.autotune`: launches the kernel with one config (`pick`: first or last)."""

    pick = "last"

    def __init__(self, fn, configs, prune_configs_by):
        self.fn, self.configs, self.prune = fn, configs, prune_configs_by or {}
        self.arg_names = fn.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            configs = self.configs
            if self.prune.get("early_config_prune"):
                named = dict(zip(self.arg_names, args))
                named.update(kwargs)
                configs = self.prune["early_config_prune"](configs, named)
            cfg = configs[0] if _FixedConfig.pick == "first" else configs[-1]
            return self.fn[grid](*args, **kwargs, **cfg.kwargs)

        return launch


def _install_triton_shims() -> None:
    """Shims 1-6 of `SHIMS` (call before any `quant_videogen` import)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter as interp

    triton.autotune = lambda configs, key=None, prune_configs_by=None, **kw: (
        lambda fn: _FixedConfig(fn, configs, prune_configs_by))

    def round_half_away(x, _semantic=None):
        d = x.handle.data
        t = np.trunc(d)
        out = (t + np.where(np.abs(d - t) >= 0.5, np.sign(d), 0)).astype(d.dtype)
        return tl.tensor(interp.TensorHandle(out, x.handle.dtype), x.type)

    libdevice.round = round_half_away

    # torch dtype, same-width signed int (torch view), numpy uint (the interpreter's storage)
    views = {"fp32": (torch.float32, torch.int32, np.int32, np.uint32), "bf16": (torch.bfloat16, torch.int16, np.int16, np.uint16),
             "fp8e4nv": (torch.float8_e4m3fn, torch.uint8, np.uint8, np.uint8)}
    convert = interp._convert_float

    def convert_float(data, src, dst, rounding_mode):
        if src.name not in views or dst.name not in views or rounding_mode == interp._ir.ROUNDING_MODE.RTZ:
            return convert(data, src, dst, rounding_mode)
        s_t, _, s_int, s_uint = views[src.name]
        d_t, d_tint, _, d_uint = views[dst.name]
        x = torch.from_numpy(np.ascontiguousarray(data).view(s_uint).view(s_int)).view(s_t)
        if d_t == torch.float8_e4m3fn and s_t != d_t:
            x = x.float().clamp(-448.0, 448.0)  # cvt.rn.satfinite
        return x.to(d_t).view(d_tint).numpy().view(d_uint).reshape(np.shape(data))

    interp._convert_float = convert_float

    def bf16_f32(u):
        return (np.asarray(u).astype(np.uint32) << 16).view(np.float32)

    def f32_bf16(f):
        t = torch.from_numpy(np.ascontiguousarray(f, dtype=np.float32)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().view(np.uint16)

    def is_bf16(h):
        return getattr(h.dtype, "scalar", h.dtype) == tl.bfloat16

    comparisons = {np.less, np.greater, np.less_equal, np.greater_equal, np.equal, np.not_equal}
    binary = interp.InterpreterBuilder.binary_op

    def binary_op(self, lhs, rhs, op):
        if not (is_bf16(lhs) and is_bf16(rhs)):
            return binary(self, lhs, rhs, op)
        out = binary(self, interp.TensorHandle(bf16_f32(lhs.data), tl.float32),
                     interp.TensorHandle(bf16_f32(rhs.data), tl.float32), op)
        return out if op in comparisons else interp.TensorHandle(f32_bf16(out.data), tl.bfloat16)

    dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a = interp.TensorHandle(bf16_f32(a.data), tl.float32) if is_bf16(a) else a
        b = interp.TensorHandle(bf16_f32(b.data), tl.float32) if is_bf16(b) else b
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    reduce_sum, reduce_min_max = interp.ReduceOps.sum, interp.ReduceOps.min_max

    def sum_(self, input):
        if input.dtype.scalar != tl.bfloat16:
            return reduce_sum(self, input)
        s = np.sum(bf16_f32(input.handle.data), axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(f32_bf16(np.asarray(s)), input.dtype)

    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        x = input[0] if isinstance(input, tuple) else input
        if x.dtype.scalar != tl.bfloat16:
            return reduce_min_max(self, input, val_reduce_op, idx_reduce_op)
        f = bf16_f32(x.handle.data)
        val = idx = None
        if val_reduce_op:
            v = val_reduce_op(f, axis=self.axis, keepdims=self.keep_dims)
            val = self.to_tensor(f32_bf16(np.asarray(v)), x.dtype)
        if idx_reduce_op:
            idx = self.to_tensor(idx_reduce_op(f, axis=self.axis, keepdims=self.keep_dims), tl.int32)
        if val is not None and idx is not None:
            return val, idx
        return val if val is not None else idx

    interp.InterpreterBuilder.binary_op = binary_op
    interp.InterpreterBuilder.create_dot = create_dot
    interp.ReduceOps.sum = sum_
    interp.ReduceOps.min_max = min_max


@contextlib.contextmanager
def _cuda_asserts_pass():
    own = torch.Tensor.__dict__.get("is_cuda")  # None: inherited from torch._C.TensorBase
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        if own is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = own


class QVGPackage:
    """`quant_videogen` 0.1.0 loaded behind `SHIMS`; `run` compresses and decodes one layer's K and V."""

    def __init__(self):
        _install_triton_shims()
        import triton
        import quant_videogen
        from quant_videogen import compress, uncompress
        from quant_videogen.real import prq
        from quant_videogen.sim.quant.quantize_config import QuantizeConfig

        self.compress, self.uncompress = compress, uncompress
        self.config = QuantizeConfig(**QVG_CONFIG)
        self.quantize_fn = compress.get_quantize_fn(QUANT_TYPE, self.config)
        self.iters: list[int] = []
        kmeans = prq.batch_kmeans_Euclid

        def recording_kmeans(*args, **kwargs):
            out = kmeans(*args, **kwargs)
            self.iters.append(int(out[3]))
            return out

        prq.batch_kmeans_Euclid = recording_kmeans
        from importlib.metadata import version

        self.versions = {"quant-videogen": version("quant-videogen"), "triton": triton.__version__,
                         "torch": torch.__version__, "numpy": np.__version__}
        self.path = str(Path(quant_videogen.__file__).parent)

    def run(self, k_BHND: Tensor, v_BHND: Tensor, dtype: torch.dtype, seed: int) -> dict:
        """compress_kv_cache + uncompress_kv_cache of K and V in `dtype` after torch.manual_seed(seed)."""
        draws: list[Tensor] = []
        randint = torch.randint

        def recording_randint(*args, **kwargs):
            out = randint(*args, **kwargs)
            draws.append(out.clone())
            return out

        self.iters = []
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        torch.randint = recording_randint
        try:
            with _cuda_asserts_pass(), np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kq, vq = self.compress.compress_kv_cache(k_BHND.to(dtype).contiguous(), v_BHND.to(dtype).contiguous(),
                                                         QUANT_TYPE, self.config, self.quantize_fn)
                for d in (kq, vq):
                    d["info"] = {"quant_config": self.config, "output_dtype": dtype}
                k_hat, v_hat = self.uncompress.uncompress_kv_cache(kq, vq)
        finally:
            torch.randint = randint
        if len(draws) != 2 * STAGES or len(self.iters) != 2 * STAGES:
            raise RuntimeError(f"expected {2 * STAGES} k-means runs, saw {len(draws)} draws and {len(self.iters)} runs")
        return {"k": k_hat.float(), "v": v_hat.float(), "k_state": kq, "v_state": vq,
                "k_init": draws[0], "v_init": draws[STAGES], "k_iters": self.iters[0], "v_iters": self.iters[STAGES],
                "seconds": time.perf_counter() - t0}


# ---- recording K/V at the cache seam ------------------------------------------------------------
class RecordingCache(KVCache):
    """The full-precision cache that keeps a copy of what it stores for every frame: post-rotary
    keys and values (through `observe`: recording never changes a rollout)."""

    def __init__(self, num_layers: int):
        super().__init__(num_layers, WINDOW, SINK)
        self.k: list[list[Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[Tensor]] = [[] for _ in range(num_layers)]

    def observe(self, seen: Attended) -> None:
        self.k[seen.layer].append(seen.k_rot_BHTD[0].detach().clone())
        self.v[seen.layer].append(seen.v_BHTD[0].detach().clone())


def record(world, family: str, frames: int) -> tuple[list[Tensor], list[Tensor]]:
    """Per layer K and V [frames, H, T, D] (float32) of one held-out trajectory of `family`."""
    trajs = make_trajectories([family], "evaluation", 1, frames + 1, base_seed=SEED)
    cache = RecordingCache(world.info.num_layers)
    with torch.no_grad():
        world.rollout(trajs, cache, CPU, keep_frames=False)
    return [torch.stack(x) for x in cache.k], [torch.stack(x) for x in cache.v]


def spans(x_FHTD: Tensor, S: int) -> Tensor:
    """[F, H, T, D] -> [F // S, H, S * T, D]: the tokens of each span of S frames (a remainder is dropped)."""
    F, H, T, D = x_FHTD.shape
    n = F // S
    return x_FHTD[: n * S].reshape(n, S, H, T, D).transpose(1, 2).reshape(n, H, S * T, D)


# ---- ours ---------------------------------------------------------------------------------------
def prq_decode(x_RND: Tensor, centroids_RSCD: Tensor) -> Tensor:
    """The codec's kind "prq" chain on rows of tokens: smooth, INT2 residual with FP8 scales per
    block of 64, dequantize, unsmooth."""
    r, ids = qvg.smooth(x_RND, centroids_RSCD)
    g = affine.group_view(r, BLOCK)
    scale = qvg.residual_scale(g, BITS)
    rv = affine.ungroup(qvg.residual_values(qvg.residual_codes(g, scale, BITS), scale, BITS))
    return qvg.unsmooth(rv, centroids_RSCD, ids)


def ours_deferred(x_RND: Tensor, seed: int) -> Tensor:
    return prq_decode(x_RND, qvg.fit_centroids(x_RND, STAGES, CENTROIDS, ITERS, seed))


def ours_package_init(x_RND: Tensor, init_RC: Tensor) -> Tensor:
    """(b'): our k-means from the package's own init indices (one row at a time: it draws per row)."""
    cents = [qvg.kmeans(x_RND[r : r + 1], CENTROIDS, ITERS, init_RC[r])[1] for r in range(x_RND.shape[0])]
    return prq_decode(x_RND, torch.cat(cents).to(torch.float16).unsqueeze(1))


def ours_stream(x_RND: Tensor, tokens_per_frame: int, seed: int) -> Tensor:
    """(c): centroids fitted on the span's first frame, every frame of the span smoothed with them."""
    return prq_decode(x_RND, qvg.fit_centroids(x_RND[:, :tokens_per_frame], STAGES, CENTROIDS, ITERS, seed))


def sqnr_db(x: Tensor, x_hat: Tensor) -> float:
    x, x_hat = x.double(), x_hat.double()
    err = ((x - x_hat) ** 2).sum().item()
    if not math.isfinite(err):
        return float("nan")
    return 10 * math.log10((x**2).sum().item() / err) if err > 0 else float("inf")


def stats(values: list[float]) -> dict:
    finite = [v for v in values if math.isfinite(v)]
    return {"mean": sum(finite) / len(finite) if finite else float("nan"),
            "min": min(finite, default=float("nan")), "max": max(finite, default=float("nan")), "draws": values}


# ---- the comparison -----------------------------------------------------------------------------
def compare_qvg(pkg: QVGPackage, K: list[Tensor], V: list[Tensor], S: int, dtypes: list[torch.dtype],
                draws: int, package_draws: int) -> list[dict]:
    """Per layer: {k, v} -> SQNR of (b), (b'), (c), (a) per dtype; plus the package's k-means iterations."""
    rows = []
    for layer, (k_FHTD, v_FHTD) in enumerate(zip(K, V)):
        T = k_FHTD.shape[2]
        x = {"k": spans(k_FHTD, S), "v": spans(v_FHTD, S)}
        flat = {kind: t.flatten(0, 1) for kind, t in x.items()}  # [spans * H, S*T, D]: the package's B*H rows
        row: dict = {"layer": layer, "spans": x["k"].shape[0]}
        for kind in "kv":
            row[kind] = {"ours_deferred": stats([sqnr_db(flat[kind], ours_deferred(flat[kind], s)) for s in range(draws)]),
                         "ours_stream": stats([sqnr_db(flat[kind], ours_stream(flat[kind], T, s)) for s in range(draws)])}
        for kind in "kv":
            row[kind]["ours_package_init"] = []
            row[kind]["package_iters"] = []
        for dtype in dtypes:
            name = f"qvg_{str(dtype).removeprefix('torch.')}"
            for kind in "kv":
                row[kind][name] = []
                row[kind][name + "_nan"] = 0
            for d in range(package_draws):
                out = pkg.run(x["k"], x["v"], dtype, seed=d)
                log.info("  S=%d layer %d %s draw %d: package %.1f s (k-means iterations K %d, V %d)", S, layer,
                         name, d, out["seconds"], out["k_iters"], out["v_iters"])
                for kind in "kv":
                    x_hat = out[kind]
                    row[kind][name + "_nan"] += int(torch.isnan(x_hat).sum())
                    row[kind][name].append(sqnr_db(x[kind], x_hat))
                    if dtype == torch.float32:
                        init = out[f"{kind}_init"]
                        row[kind]["ours_package_init"].append(sqnr_db(flat[kind], ours_package_init(flat[kind], init)))
                        row[kind]["package_iters"].append(out[f"{kind}_iters"])
            for kind in "kv":
                row[kind][name] = stats(row[kind][name])
        for kind in "kv":
            row[kind]["ours_package_init"] = stats(row[kind]["ours_package_init"])
            a = row[kind].get("qvg_float32", {}).get("mean", float("nan"))
            row[kind]["gap_db"] = row[kind]["ours_deferred"]["mean"] - a
            row[kind]["within"] = bool(abs(row[kind]["gap_db"]) <= CRITERION_DB)
        rows.append(row)
    return rows


# ---- TurboQuant ---------------------------------------------------------------------------------
def load_turboquant():
    """turboquant.core (TURBO_SHIMS) or None if the package is not installed."""
    spec = importlib.util.find_spec("turboquant")
    if spec is None or not spec.submodule_search_locations:
        return None
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid
    core = importlib.util.spec_from_file_location("turboquant_core",
                                                  Path(spec.submodule_search_locations[0]) / "core.py")
    module = importlib.util.module_from_spec(core)
    core.loader.exec_module(module)
    from importlib.metadata import version

    module.VERSION = version("turboquant")
    return module


def ip_slope(x_HND: Tensor, x_hat_HND: Tensor, queries: int = 64, seed: int = 0) -> float:
    """Least-squares slope of <q, x^> on <q, x> over Gaussian queries q (per head) and every token:
    1 for an unbiased inner-product estimator, < 1 for one that shrinks the logits."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(x_HND.shape[0], x_HND.shape[-1], queries, generator=g, dtype=torch.float64)
    s, s_hat = x_HND.double() @ q, x_hat_HND.double() @ q
    return float((s * s_hat).sum() / (s * s).sum())


def compare_turbo(tq, info, K: list[Tensor], V: list[Tensor]) -> dict:
    """Per layer SQNR of our turbo2.5 and of the package (as shipped; with our rotation, levels and sketch),
    and for keys the inner-product slope (`ip_slope`)."""
    from calibrate import codec
    from calibrate.schemes import build_baseline

    recipe = build_baseline("turbo2.5", info)
    D = info.head_dim
    shipped = {"k": tq.TurboQuantIP(D, bits=2, device="cpu", seed=42), "v": tq.TurboQuantMSE(D, bits=2, device="cpu", seed=42)}
    rows = []
    for layer, (k_FHTD, v_FHTD) in enumerate(zip(K, V)):
        row = {"layer": layer}
        for kind, x_FHTD in (("k", k_FHTD), ("v", v_FHTD)):
            spec, tensors = recipe.spec(layer, kind), recipe.layer_tensors(layer, kind)
            ours, pkg, injected = [], [], []
            for h in range(x_FHTD.shape[1]):
                x = x_FHTD[:, h]  # [F, T, D]
                p = codec.head_params(spec, tensors, h)
                ours.append(codec.fake_quant(x, spec, p)[0])
                q = shipped[kind]
                pkg.append(q.dequantize(*q.quantize(x)))
                q2 = (tq.TurboQuantIP if kind == "k" else tq.TurboQuantMSE)(D, bits=2, device="cpu", seed=42)
                R = p.rotation_DD  # ours: y = x R, decoded y R^T; the package: y = x rotation_t, x = y rotation
                q2.rotation_t, q2.rotation, q2.codebook = R.clone(), R.T.contiguous(), p.lloyd_max_L.clone()
                if kind == "k":
                    q2.S = p.qjl_MD @ R.T  # our sketch acts on the rotated residual: S r_y = (S R^T) r_x
                injected.append(q2.dequantize(*q2.quantize(x)))
            x_all = x_FHTD.transpose(0, 1)  # [H, F, T, D]
            got = {"ours": torch.stack(ours), "package": torch.stack(pkg), "package_ours_injected": torch.stack(injected)}
            row[kind] = {name: sqnr_db(x_all, x_hat) for name, x_hat in got.items()}
            if kind == "k":
                row["k_ip_slope"] = {name: ip_slope(x_all.flatten(1, 2), x_hat.flatten(1, 2)) for name, x_hat in got.items()}
        rows.append(row)
    levels = {"k_1bit": {"ours": recipe.tensor(0, "k", "lloyd_max")[0].tolist(), "package": shipped["k"].codebook.tolist()},
              "v_2bit": {"ours": recipe.tensor(0, "v", "lloyd_max")[0].tolist(), "package": shipped["v"].codebook.tolist()}}
    return {"version": tq.VERSION, "rows": rows, "levels": levels,
            "qjl_scale_note": "package: S = randn(d, d) / sqrt(d), decode sqrt(pi/2) / d * gamma * z S: the sketch "
                              "term is 1/sqrt(d) of the paper's (ours: S ~ N(0, 1))"}


# ---- golden vectors -----------------------------------------------------------------------------
def write_golden(pkg: QVGPackage, K: list[Tensor], V: list[Tensor], path: Path) -> dict:
    """Two spans of GOLDEN_SPAN_FRAMES frames of one head, K and V, through the package in float32."""
    f0, S = GOLDEN_FIRST_FRAME, GOLDEN_SPAN_FRAMES
    pick = lambda x: spans(x[f0 : f0 + 2 * S, GOLDEN_HEAD : GOLDEN_HEAD + 1], S)  # [2, 1, S*T, D]
    # the package gets float16-representable values (stored small); it computes in float32
    k, v = pick(K[GOLDEN_LAYER]).half().float(), pick(V[GOLDEN_LAYER]).half().float()
    out = pkg.run(k, v, torch.float32, GOLDEN_SEED)
    _FixedConfig.pick = "first"
    try:
        first = pkg.run(k, v, torch.float32, GOLDEN_SEED)
    finally:
        _FixedConfig.pick = "last"
    same = all(torch.equal(out[n], first[n]) for n in ("k", "v", "k_init", "v_init"))
    if not same:
        raise RuntimeError("the package's outputs depend on the autotune config picked: the fixed-config shim is not neutral")
    tensors = {}
    for kind, x in (("k", k), ("v", v)):
        st = out[f"{kind}_state"]
        tensors[f"{kind}.x"] = x[:, 0].half()  # [2 spans, S*T, D]
        tensors[f"{kind}.init"] = out[f"{kind}_init"].long()  # [2 rows, C]
        tensors[f"{kind}.ids"] = st["cluster_ids_list"][0][:, 0].to(torch.uint8)  # [2, S*T]
        tensors[f"{kind}.centroids"] = st["centroids_list"][0][:, 0].float()  # [2, C, D]
        tensors[f"{kind}.codes_packed"] = st["residual_quant"][:, 0].contiguous()  # [2, S*T, D/4] uint8
        tensors[f"{kind}.scales_fp8"] = st["scales"][:, 0].contiguous().view(torch.uint8)  # [2, S*T, D/64]
        tensors[f"{kind}.decoded"] = out[kind][:, 0].float()  # [2, S*T, D]
    settings = dict(QVG_CONFIG, kmeans_tol=PACKAGE_TOL, compute_dtype="float32", output_dtype="float32",
                    scale_precision="float8_e4m3fn", pack_output_int8=True, cluster_id_int8=True)
    meta = {"format": GOLDEN_FORMAT, "format_version": GOLDEN_VERSION,
            "settings": json.dumps(settings, sort_keys=True),
            "source": json.dumps({"model": "tinyworld", "family": GOLDEN_FAMILY, "seed_offset": SEED, "split": "evaluation",
                                  "layer": GOLDEN_LAYER, "head": GOLDEN_HEAD, "frames": [f0, f0 + 2 * S],
                                  "span_frames": S, "keys": "post-rotary", "inputs": "rounded to float16",
                                  "torch_manual_seed": GOLDEN_SEED}, sort_keys=True),
            "kmeans_iterations": json.dumps({"k": out["k_iters"], "v": out["v_iters"]}),
            "package": json.dumps(pkg.versions, sort_keys=True),
            "generated_by": f"{COMMAND} --write-golden",
            "autotune_first_and_last_config_equal": "true"}
    write_bytes_atomic(path, safetensors_bytes(tensors, meta))
    log.info("golden vectors: %s (%d bytes; k-means iterations K %d, V %d)", path, path.stat().st_size,
             out["k_iters"], out["v_iters"])
    shown = path.relative_to(GOLDEN.parents[2]) if path.is_relative_to(GOLDEN.parents[2]) else path
    return {"path": str(shown), "bytes": path.stat().st_size, "kmeans_iterations": {"k": out["k_iters"], "v": out["v_iters"]}}


# ---- report -------------------------------------------------------------------------------------
def _f(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.2f}"


def _span(s: dict) -> str:
    if len(s["draws"]) == 1:
        return _f(s["mean"])
    return f"{_f(s['mean'])} [{_f(s['min'])}, {_f(s['max'])}]"


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


ATTRIBUTION = {"total": "(b) - (a f32): ours vs the package", "formula": "(b') - (a f32): formula deviations",
               "init_rng": "(b) - (b'): k-means init RNG", "dtype": "(a bf16) - (a f32): the package's dtype",
               "schedule": "(c) - (b): streaming schedule"}


def attribution(report: dict) -> dict:
    """Mean dB differences over every (family, S, layer, tensor): what each deviation costs."""
    acc: dict[str, list[float]] = {k: [] for k in ATTRIBUTION}
    for fam in report["qvg"].values():
        for rows in fam.values():
            for row in rows:
                for kind in "kv":
                    r = row[kind]
                    a = r["qvg_float32"]["mean"]
                    acc["total"].append(r["gap_db"])
                    acc["formula"].append(r["ours_package_init"]["mean"] - a)
                    acc["init_rng"].append(r["ours_deferred"]["mean"] - r["ours_package_init"]["mean"])
                    if "qvg_bfloat16" in r:
                        acc["dtype"].append(r["qvg_bfloat16"]["mean"] - a)
                    acc["schedule"].append(r["ours_stream"]["mean"] - r["ours_deferred"]["mean"])
    return {k: {"mean": _mean(v), "min": min(v, default=float("nan")), "max": max(v, default=float("nan")), "n": len(v)}
            for k, v in acc.items()}


def render_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# Peers held to their own code (issue 30)", "",
             f"- command: `{report['command']}`",
             f"- date: {report['date']}; machine: {report['machine']}; torch threads: {report['threads']} "
             f"(OMP_NUM_THREADS={report['omp_num_threads']}); wall time {report['elapsed_s']:.0f} s "
             f"(package calls {report['package_s']:.0f} s, under the Triton interpreter)",
             f"- packages: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}",
             f"- data: TinyWorld, held-out evaluation seed offset {SEED}, one trajectory per family, {cfg['frames']} cache "
             f"frames (window {WINDOW} + sink {SINK}, full precision), all {cfg['layers']} layers x {cfg['heads']} heads x "
             f"{cfg['tokens_per_frame']} tokens x {cfg['head_dim']}; keys post-rotary (what the cache stores), values",
             f"- settings (both sides): {STAGES} PRQ stage, {CENTROIDS} centroids per span and head (K and V), "
             f"{ITERS} k-means iterations (tol {PACKAGE_TOL}), INT{BITS} residual, FP8-E4M3 scale per token and block of {BLOCK}",
             f"- draws: ours (b), (c) over {cfg['draws']} k-means init seeds (mean [min, max]); the package "
             f"{cfg['package_draws']} draw(s) (torch.manual_seed 0..); (b') uses the indices the package drew",
             f"- scope (the package took {report['package_s'] / max(report['package_calls'], 1):.0f} s per call "
             f"(one layer's K and V, {cfg['frames'] * cfg['tokens_per_frame']} tokens x {cfg['heads']} heads each) under "
             f"the interpreter, so the run is cut to ~10 min): every span length for {', '.join(cfg['span_families'])}, the first "
             f"(S = {cfg['spans'][0]}) for the other families; bfloat16 package runs for {', '.join(cfg['bf16_families'])}",
             "- the package gets all spans of a layer in one call (B = spans, H = 3 heads): its k-means stop test "
             "pools the call's rows, and below 10^4 tokens per call it needs zero changed ids either way, so one call "
             "per span (as its integrations make) gives the same result for the same init", "",
             "SQNR in dB = 10 log10(sum x^2 / sum (x - x^)^2) over all spans, heads, tokens, channels of a layer; x the "
             "recorded float32 K/V (the bf16 run too). (a) QVG's own code (`compress_kv_cache` "
             f"\"{QUANT_TYPE}\" + `uncompress_kv_cache`); (b) ours deferred (`fit_centroids` on all the span's tokens, "
             "`smooth`, residual on blocks of 64, `unsmooth`); (b') = (b) from the package's own init indices; (c) ours "
             "streaming (centroids from the span's first frame). Gap = (b) - (a, float32); criterion |gap| <= "
             f"{CRITERION_DB} dB.", ""]
    verdict = report["criterion_met"]
    lines += [f"**Criterion (b) within {CRITERION_DB} dB of (a, float32), K and V, every layer: "
              f"{'met' if verdict else 'NOT met'}** ({report['criterion_rows_met']} of {report['criterion_rows']} rows).", ""]
    for fam, by_s in report["qvg"].items():
        for S, rows in by_s.items():
            bf16 = any("qvg_bfloat16" in r["k"] for r in rows)
            lines += [f"## {fam}, spans of {S} frames ({rows[0]['spans']} spans x {int(S) * cfg['tokens_per_frame']} tokens "
                      f"per head)", "",
                      "| layer | tensor | ours (b) | ours, package's init (b') | ours stream (c) | QVG own f32 (a) |"
                      + (" QVG own bf16 (a) |" if bf16 else "") + " gap (b)-(a) | within | package k-means iters |",
                      "|---:|---|---:|---:|---:|---:|" + ("---:|" if bf16 else "") + "---:|---|---|"]
            for row in rows:
                for kind in "kv":
                    r = row[kind]
                    cells = [str(row["layer"]), kind.upper(), _span(r["ours_deferred"]), _span(r["ours_package_init"]),
                             _span(r["ours_stream"]), _span(r["qvg_float32"])]
                    if bf16:
                        cells.append(_span(r["qvg_bfloat16"]) if "qvg_bfloat16" in r else "")
                    nan = r.get("qvg_float32_nan", 0) + r.get("qvg_bfloat16_nan", 0)
                    cells += [f"{r['gap_db']:+.2f}", "yes" if r["within"] else "**no**",
                              ",".join(map(str, r["package_iters"])) + (f" ({nan} NaN)" if nan else "")]
                    lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    att = report["attribution"]
    lines += ["## Where the differences come from (mean over every family, span length, layer and tensor; dB)", "",
              "| difference | mean | min | max | rows |", "|---|---:|---:|---:|---:|"]
    for k, v in att.items():
        lines.append(f"| {ATTRIBUTION[k]} | {v['mean']:+.3f} | {v['min']:+.3f} | {v['max']:+.3f} | {v['n']} |")
    lines += ["", *report["explanation"], ""]
    if report.get("turbo"):
        t = report["turbo"]
        lines += [f"## TurboQuant: `turboquant` {t['version']} (third-party, pure PyTorch: ran on CPU) vs our turbo2.5",
                  "", f"{t['family']} rollout, all frames, every head. K: TurboQuantIP(bits=2) vs ours TQ_prod 2 bits; "
                  "V: TurboQuantMSE(bits=2) vs ours TQ_mse 2 bits. 'injected' = the package's objects given our rotation "
                  "(per layer and head), Lloyd-Max levels and QJL sketch (S R^T, the same projections as ours).", "",
                  "SQNR in dB; 'K slope' = least-squares slope of <q, k^> on <q, k> over 64 Gaussian queries per head "
                  "(1 = unbiased logits, the property TQ_prod is built for).", "",
                  "| layer | K ours | K package | K package, ours injected | K slope ours / package / injected "
                  "| V ours | V package | V package, ours injected |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in t["rows"]:
            sl = row["k_ip_slope"]
            lines.append(f"| {row['layer']} | {_f(row['k']['ours'])} | {_f(row['k']['package'])} | "
                         f"{_f(row['k']['package_ours_injected'])} | {sl['ours']:.3f} / {sl['package']:.3f} / "
                         f"{sl['package_ours_injected']:.3f} | {_f(row['v']['ours'])} | {_f(row['v']['package'])} | "
                         f"{_f(row['v']['package_ours_injected'])} |")
        lv = t["levels"]
        lines += ["", f"- 1-bit levels (K's TQ_mse stage): ours (Lloyd-Max of the Beta law, d={cfg['head_dim']}) "
                      f"{[round(x, 5) for x in lv['k_1bit']['ours']]}, package (+-sqrt(2/(pi d))) "
                      f"{[round(x, 5) for x in lv['k_1bit']['package']]}",
                  f"- 2-bit levels (V): ours (Lloyd-Max) {[round(x, 5) for x in lv['v_2bit']['ours']]}, package "
                  f"(conditional means of equal-mass cells, not Lloyd-Max) {[round(x, 5) for x in lv['v_2bit']['package']]}",
                  f"- QJL: {t['qjl_scale_note']}", *[f"- {x}" for x in t["explanation"]], ""]
    elif report.get("turbo_skipped"):
        lines += ["## TurboQuant", "", report["turbo_skipped"], ""]
    lines += ["## Shims (in this script; no package code copied; `calibrate/` never imports the packages)", ""]
    lines += [f"{i}. {s}" for i, s in enumerate(report["shims"], 1)]
    lines += ["", "Interpreter vs GPU, not shimmed: tl.dot on float32 is IEEE float32 here (a GPU's default is TF32); "
              "the centroid sums are float32 atomics in program order here (any order on a GPU). Both move only "
              "near-tie assignments and last-ulp sums.", ""]
    if report.get("golden"):
        g = report["golden"]
        lines += [f"Golden vectors: `{g['path']}` ({g['bytes']} bytes; package k-means iterations K {g['kmeans_iterations']['k']},"
                  f" V {g['kmeans_iterations']['v']}), checked by tests/test_peer_golden.py without the packages.", ""]
    return "\n".join(lines)


def explain(att: dict) -> list[str]:
    m = lambda k: att[k]["mean"]
    return [f"- (b) vs (a): {m('total'):+.3f} dB on average (range {att['total']['min']:+.3f} to {att['total']['max']:+.3f}).",
            f"- Formula deviations, (b') - (a) = {m('formula'):+.3f} dB: from the package's own init indices only our stated "
            "deviations remain: centroids stored in float16 (the package keeps them in its input dtype), each token "
            "re-assigned to its nearest stored centroid by `smooth` (the package keeps the ids of its last k-means "
            "assignment, made to the previous iteration's centroids, and subtracts the new means: after 2 iterations "
            "k-means has not converged), float32 sums in another order.",
            f"- k-means init RNG, (b) - (b') = {m('init_rng'):+.3f} dB: our init draws one index set per call from a fixed "
            "seed (shared by the rows), the package draws per row from the global RNG; with 2 iterations where k-means "
            "starts matters, so single draws spread as the [min, max] ranges show.",
            (f"- dtype, (a bf16) - (a f32) = {m('dtype'):+.3f} dB: bf16 input rounding, bf16 distances, centroids and "
             "residual in the package's bf16 path." if att["dtype"]["n"] else "- dtype: no bf16 run."),
            f"- schedule, (c) - (b) = {m('schedule'):+.3f} dB: the streaming runtime's centroids see only the span's "
            "first frame (16 tokens), not the whole span."]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=128, help="cache frames recorded per trajectory")
    parser.add_argument("--families", default="orbit,pan,static")
    parser.add_argument("--spans", default="8,16", help="span lengths S in frames (comma-separated)")
    parser.add_argument("--span-families", default="orbit",
                        help="families run at every span length; the others at the first only")
    parser.add_argument("--bf16-families", default="orbit", help="families also run through the package in bfloat16")
    parser.add_argument("--draws", type=int, default=8, help="k-means init seeds for ours (b), (c)")
    parser.add_argument("--package-draws", type=int, default=1, help="torch.manual_seed draws for the package")
    parser.add_argument("--out", default="artifacts/benchmarks")
    parser.add_argument("--write-golden", action="store_true", help=f"(re)write {GOLDEN.relative_to(GOLDEN.parents[2])}")
    parser.add_argument("--golden-only", action="store_true", help="write the golden vectors and stop")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("quant_videogen") is None or importlib.util.find_spec("triton") is None:
        print(MISSING, file=sys.stderr)
        return 2
    span_lengths = [int(s) for s in args.spans.split(",")]
    families = [f for f in args.families.split(",") if f]
    golden_frames = GOLDEN_FIRST_FRAME + 2 * GOLDEN_SPAN_FRAMES
    if args.frames < max(span_lengths) or args.draws < 1 or args.package_draws < 1:
        print("error: --frames must be >= the longest span, --draws and --package-draws >= 1", file=sys.stderr)
        return 2
    if (args.write_golden or args.golden_only) and args.frames < golden_frames:
        print(f"error: the golden vectors need --frames >= {golden_frames}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    pkg = QVGPackage()
    from benchmarks.kv_stats import load_world

    world = load_world("tinyworld")
    info = world.info
    recorded = {}
    need = [GOLDEN_FAMILY] if args.golden_only else list(
        dict.fromkeys(families + ([GOLDEN_FAMILY] if args.write_golden else [])))
    for fam in need:
        recorded[fam] = record(world, fam, args.frames)
        log.info("recorded %s: %d frames (%.0f s)", fam, args.frames, time.perf_counter() - start)
    golden = None
    if args.write_golden or args.golden_only:
        golden = write_golden(pkg, *recorded[GOLDEN_FAMILY], GOLDEN)
        if args.golden_only:
            return 0
    package_s, package_calls = 0.0, 0
    run = pkg.run

    def timed_run(*a, **kw):
        nonlocal package_s, package_calls
        out = run(*a, **kw)
        package_s += out["seconds"]
        package_calls += 1
        return out

    pkg.run = timed_run
    results: dict = {}
    for fam in families:
        K, V = recorded[fam]
        dtypes = [torch.float32] + ([torch.bfloat16] if fam in args.bf16_families.split(",") else [])
        lengths = span_lengths if fam in args.span_families.split(",") else span_lengths[:1]
        results[fam] = {}
        for S in lengths:
            results[fam][str(S)] = compare_qvg(pkg, K, V, S, dtypes, args.draws, args.package_draws)
            log.info("%s S=%d done (%.0f s)", fam, S, time.perf_counter() - start)
    report = {"format": FORMAT, "format_version": FORMAT_VERSION,
              "command": " ".join([COMMAND, *map(shlex.quote, argv)]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{cpu_model()} (shared with another job)",
              "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
              "versions": dict(pkg.versions), "package_path": pkg.path,
              "config": {"frames": args.frames, "families": families, "spans": span_lengths, "draws": args.draws,
                         "span_families": args.span_families.split(","),
                         "package_draws": args.package_draws, "bf16_families": args.bf16_families.split(","),
                         "layers": info.num_layers, "heads": info.num_kv_heads, "tokens_per_frame": info.tokens_per_frame,
                         "head_dim": info.head_dim, "quantize_config": QVG_CONFIG, "seed_offset": SEED},
              "qvg": results, "shims": list(SHIMS)}
    rows = [row[kind]["within"] for fam in results.values() for rs in fam.values() for row in rs for kind in "kv"]
    report["criterion_rows"], report["criterion_rows_met"] = len(rows), sum(rows)
    report["criterion_met"] = all(rows)
    report["attribution"] = attribution(report)
    report["explanation"] = explain(report["attribution"])
    tq = load_turboquant()
    if tq is None:
        report["turbo_skipped"] = "`turboquant` is not installed: `pip install --no-deps turboquant==0.2.0` to compare."
    else:
        fam = "orbit" if "orbit" in recorded else families[0]
        turbo = compare_turbo(tq, info, *recorded[fam])
        turbo["family"] = fam
        turbo["explanation"] = turbo_explanation(turbo)
        report["turbo"] = turbo
        report["shims"] += TURBO_SHIMS
        report["versions"]["turboquant"] = tq.VERSION
    if golden:
        report["golden"] = golden
    report["package_s"], report["package_calls"] = package_s, package_calls
    report["elapsed_s"] = time.perf_counter() - start
    out = Path(args.out)
    markdown = render_markdown(report)
    write_text_atomic(out / "peer_oracle.json", json.dumps(finite(report), indent=2, allow_nan=False, default=str) + "\n")
    write_text_atomic(out / "peer_oracle.md", markdown)
    print(markdown)
    return 0


def finite(x):
    """`x` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def turbo_explanation(t: dict) -> list[str]:
    m = lambda kind, col: _mean([r[kind][col] for r in t["rows"]])
    slope = lambda col: _mean([r["k_ip_slope"][col] for r in t["rows"]])
    return [f"V: injected - ours = {m('v', 'package_ours_injected') - m('v', 'ours'):+.4f} dB (same algorithm once our "
            "rotation and levels are in: left are our float16 norms vs its float32 and its +1e-10); as shipped - ours = "
            f"{m('v', 'package') - m('v', 'ours'):+.3f} dB (its 2-bit codebook is not Lloyd-Max; one seed-42 rotation "
            "for every layer and head).",
            f"K: injected - ours = {m('k', 'package_ours_injected') - m('k', 'ours'):+.4f} dB (float16 norm and residual "
            f"norm in ours); as shipped - ours = {m('k', 'package') - m('k', 'ours'):+.3f} dB: its QJL term is shrunk "
            "by 1/sqrt(d) (S scaled by 1/sqrt(d) but decoded with the paper's sqrt(pi/2)/d), which lowers the key "
            "error's variance but biases the logits toward the 1-bit MSE part's: slope "
            f"{slope('package'):.3f} vs ours {slope('ours'):.3f}. SQNR rewards it; the unbiased estimator the paper "
            "proves is lost. Settings cannot be matched as shipped: the codebooks and the sketch scale are hard-wired "
            "(no Lloyd-Max option, no per-head rotation), hence the injected column."]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    sys.exit(main())

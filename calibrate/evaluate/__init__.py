"""Evaluation: the numbers, figures and strips that show what 2-bit KV caches do to long rollouts.

* :mod:`~calibrate.evaluate.metrics`: pure metric functions on frame and attention tensors
  (PSNR/SSIM per frame and per window, flicker, drift, static flicker, revisit consistency,
  attention KL / top-frame agreement / output error, tail summaries, the short-clip blind spot).
* :mod:`~calibrate.evaluate.plots`: drift curves, per-window bars, per-layer heatmaps (PNG).
* :mod:`~calibrate.evaluate.strips`: reference | quantized | error strips (GIF, still PNG).
"""

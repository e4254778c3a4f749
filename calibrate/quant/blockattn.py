"""Softmax attention over keys that arrive block by block (the merge of flash-decoding).

A packed cache decodes its history a block at a time, so the whole history never exists in
full precision at once. The output of softmax attention over the union of blocks is kept as
three running quantities per query row (m the largest logit so far, l the sum of exp(logit - m),
acc the sum of exp(logit - m) * v):

    m' = max(m, max_j s_j)        l' = l e^(m - m') + sum_j e^(s_j - m')
    acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j          out = acc / l

which equals softmax(s) @ v over all blocks up to float rounding (the order of the sums
differs from one softmax over the concatenation). Queries are taken `query_chunk` rows at a
time so the logits of one block stay [B, H, query_chunk, N_block]. The first block added must
give every row a finite logit (the fresh frame's own keys do), so masked keys (logit -inf) in
later blocks never produce 0/0.

Shape legend: B batch, H heads, T query tokens, N keys of one block, D head_dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class OnlineSoftmax:
    """Running softmax attention of `q_BHTD` (logits q.k / sqrt(D) + bias) over blocks of keys."""

    def __init__(self, q_BHTD: Tensor, query_chunk: int | None = None, compute_dtype: torch.dtype | None = None,
                 key_block: int | None = None):
        self.dtype = compute_dtype or q_BHTD.dtype  # of the matmuls; logits and sums stay float32
        self.acc_dtype = torch.promote_types(q_BHTD.dtype, torch.float32)
        self.q = q_BHTD.to(self.dtype)
        self.scale = 1.0 / math.sqrt(q_BHTD.shape[-1])
        T = q_BHTD.shape[2]
        self.chunk = T if not query_chunk or query_chunk >= T else query_chunk
        self.key_block = key_block  # larger blocks are added in pieces of this many keys
        self.m = self.l = self.acc = None
        self.single: tuple[Tensor, Tensor] | None = None  # the logits and values of the only block so far

    def add(self, k_BHND: Tensor, v_BHND: Tensor, bias: Tensor | None = None) -> None:
        """One block of keys and values; `bias` broadcasts to [B, H, T, N] (added to the logits)."""
        N = k_BHND.shape[2]
        if self.key_block and N > self.key_block:
            for n0 in range(0, N, self.key_block):
                keys = slice(n0, n0 + self.key_block)
                b = bias if bias is None or bias.shape[-1] == 1 else bias[..., keys]
                self.add(k_BHND[:, :, keys], v_BHND[:, :, keys], b)
            return
        k, v = k_BHND.to(self.dtype), v_BHND.to(self.dtype)
        if self.chunk == self.q.shape[2] and self.m is None and self.single is None:
            s = (self.q @ k.transpose(-1, -2)).to(self.acc_dtype) * self.scale
            self.single = (s if bias is None else s + bias, v)  # one block: a plain softmax, if no other comes
            return
        if self.single is not None:
            s0, v0 = self.single
            self.single = None
            self._merge_logits(s0, v0, slice(None))
        for t0 in range(0, self.q.shape[2], self.chunk):
            rows = slice(t0, t0 + self.chunk)
            s = (self.q[:, :, rows] @ k.transpose(-1, -2)).to(self.acc_dtype) * self.scale
            if bias is not None:
                b = bias if bias.dim() < 3 or bias.shape[2] == 1 else bias[:, :, rows]
                s = s + b
            self._merge_logits(s, v, rows)

    def _merge_logits(self, s: Tensor, v: Tensor, rows: slice) -> None:
        if self.m is None:
            B, H, T, _ = self.q.shape
            self.m = torch.full((B, H, T, 1), -math.inf, dtype=self.acc_dtype, device=self.q.device)
            self.l = torch.zeros((B, H, T, 1), dtype=self.acc_dtype, device=self.q.device)
            self.acc = torch.zeros((B, H, T, v.shape[-1]), dtype=self.acc_dtype, device=self.q.device)
        m_old = self.m[:, :, rows]
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        p = s.sub_(m_new).exp_()  # the logits are not needed again: reuse their memory
        corr = (m_old - m_new).exp_()
        self.l[:, :, rows].mul_(corr).add_(p.sum(-1, keepdim=True))
        self.acc[:, :, rows].mul_(corr).add_((p.to(v.dtype) @ v).to(self.acc_dtype))
        self.m[:, :, rows] = m_new

    def result(self) -> Tensor:
        if self.single is not None:
            s, v = self.single
            return (s.softmax(dim=-1).to(v.dtype) @ v).to(self.acc_dtype)
        return self.acc.div_(self.l)  # in place: the accumulator becomes the output

"""float64 numpy oracles: the MoE experts computed one (token, slot) pair at a time, and top-k
routing written out from its definition."""

from __future__ import annotations

import math

import numpy as np


def _act(kind: str, gate, up, alpha=1.702, limit=7.0):
    if kind == "silu":
        return gate / (1 + np.exp(-gate)) * up
    if kind == "gelu":
        erf = np.vectorize(math.erf)
        return 0.5 * gate * (1 + erf(gate / math.sqrt(2))) * up
    if kind == "gelu_tanh":
        inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1 + np.tanh(inner)) * up
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return (up + 1) * gate / (1 + np.exp(-alpha * gate))


def experts(x, ids, weights, w1, w2, b1=None, b2=None, *, activation="silu",
            transposed=False, interleaved=False):  # fmt: skip
    """sum_s weights[t, s] * expert_{ids[t, s]}(x[t]) in float64; ids outside [0, E) add 0."""
    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    w1, w2 = np.asarray(w1, np.float64), np.asarray(w2, np.float64)
    num_experts = w1.shape[0]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if not 0 <= e < num_experts:
                continue
            first = w1[e].T if transposed else w1[e]  # [2I, H]
            h = first @ x[t] + (0 if b1 is None else np.asarray(b1[e], np.float64))
            gate, up = (h[0::2], h[1::2]) if interleaved else np.split(h, 2)
            a = _act(activation, gate, up)
            second = w2[e].T if transposed else w2[e]  # [H, I]
            y = second @ a + (0 if b2 is None else np.asarray(b2[e], np.float64))
            out[t] += weights[t, s] * y
    return out


def route(logits, top_k, *, scoring="softmax", renormalize=True, bias=None, groups=None,
          top_groups=None, scale=1.0):  # fmt: skip
    """(weights, ids) per token, from the definition (DeepSeek-V3's grouped top-k included)."""
    logits = np.asarray(logits, np.float64)
    tokens, num_experts = logits.shape
    weights = np.zeros((tokens, top_k))
    ids = np.zeros((tokens, top_k), np.int64)
    for t in range(tokens):
        row = logits[t]
        if scoring == "softmax":
            scores = np.exp(row - row.max())
            scores /= scores.sum()
        else:
            scores = 1 / (1 + np.exp(-row))
        choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
        if groups is not None:
            size = num_experts // groups
            group_score = [np.sort(choice[g * size : (g + 1) * size])[-2:].sum()
                           for g in range(groups)]  # fmt: skip
            keep = np.argsort(group_score)[::-1][:top_groups]
            mask = np.full(num_experts, -np.inf)
            for g in keep:
                mask[g * size : (g + 1) * size] = 0
            choice = choice + mask
        picked = np.argsort(-choice, kind="stable")[:top_k]
        w = scores[picked]
        if renormalize:
            w = w / (w.sum() + (1e-20 if scoring == "sigmoid" else 0))
        weights[t], ids[t] = w * scale, picked
    return weights, ids

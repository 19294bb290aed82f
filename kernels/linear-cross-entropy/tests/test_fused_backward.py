"""linear-cross-entropy's one-kernel backward with one, two and three token blocks, every option
at once: float32 gradients in the TPU interpreter (the aliased dh accumulator as Mosaic runs it)
and float64 ones (the generic interpreter, dh accumulated in its output block) vs a float64 torch
oracle; four matmul passes in a training step; never two backward token blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.bench import block_schedule

k = get_kernel("linear-cross-entropy")
api = k.KERNEL.jax

# 40 tokens, 300 vocabulary rows in blocks of 128 (three, the last ragged), hidden 32.
TOKENS, HIDDEN, VOCAB, BLOCK_VOCAB = 40, 32, 300, 128
OPTIONS = {
    "reduction": "none",
    "label_smoothing": 0.1,
    "z_loss": 1e-3,
    "softcap": 4.0,
    "logit_scale": 0.5,
    "ignore_index": 5,
}


def _inputs(hidden_dim=HIDDEN):
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((TOKENS, hidden_dim))
    weight = rng.standard_normal((VOCAB, hidden_dim)) / np.sqrt(hidden_dim) * 3
    bias = rng.standard_normal(VOCAB)
    labels = rng.integers(0, VOCAB, TOKENS)
    labels[rng.random(TOKENS) < 0.2] = OPTIONS["ignore_index"]
    cotangent = rng.standard_normal(TOKENS)
    return hidden, weight, bias, labels, cotangent


def _oracle_grads(hidden, weight, bias, labels, cotangent):
    h, w, b = (
        torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (hidden, weight, bias)
    )
    logits = torch.tanh((h @ w.T + b) * OPTIONS["logit_scale"] / OPTIONS["softcap"])
    logits = logits * OPTIONS["softcap"]
    target = torch.from_numpy(labels).long()
    loss = torch.nn.functional.cross_entropy(
        logits,
        target,
        ignore_index=OPTIONS["ignore_index"],
        reduction="none",
        label_smoothing=OPTIONS["label_smoothing"],
    )
    counted = target != OPTIONS["ignore_index"]
    loss = loss + OPTIONS["z_loss"] * torch.logsumexp(logits, -1) ** 2 * counted
    (loss * torch.from_numpy(cotangent)).sum().backward()
    return [t.grad.numpy() for t in (h, w, b)]


@pytest.mark.parametrize(
    "block_tokens, dtype, tol, chunks",
    [
        (16, jnp.float64, 1e-12, None),
        (TOKENS, jnp.float64, 1e-12, None),
        (32, jnp.float32, 2e-5, (16, 128, 128)),
    ],
    ids=[
        "f64 3 token blocks",
        "f64 1 token block",
        "f32 2 -> 3 token blocks, 2 vocabulary blocks, chunked tiles (TPU interpreter)",
    ],
)
def test_gradients_match_float64_oracle(block_tokens, dtype, tol, chunks, monkeypatch):
    """``chunks``: (token rows, hidden columns, vocabulary rows) of the kernels' inner loops, small
    enough that the blocks here take them (the forward's two row chunks per 32-token block, each
    in two vocabulary chunks of a 256-row block, the backward's two vocabulary chunks, each with
    two column chunks of a 256-wide hidden, all fori_loops), as the model-size blocks do."""
    hidden_dim, block_vocab = HIDDEN, BLOCK_VOCAB
    if chunks is not None:
        monkeypatch.setattr(api.pallas_tpu, "_ROW_CHUNK", chunks[0])
        monkeypatch.setattr(api.pallas_tpu, "_COLUMN_CHUNK", chunks[1])
        monkeypatch.setattr(api.pallas_tpu, "_VOCAB_CHUNK", chunks[2])
        hidden_dim, block_vocab = 2 * chunks[1], 2 * chunks[2]
    hidden, weight, bias, labels, cotangent = _inputs(hidden_dim)
    want = _oracle_grads(hidden, weight, bias, labels, cotangent)
    with jax.enable_x64(dtype == jnp.float64):

        def loss(h, w, b):
            per_token = api.linear_cross_entropy(
                h,
                w,
                jnp.asarray(labels, jnp.int32),
                b,
                implementation="pallas",
                block_tokens=block_tokens,
                block_vocab=block_vocab,
                **OPTIONS,
            )
            return jnp.sum(per_token * jnp.asarray(cotangent, dtype))

        got = jax.grad(loss, argnums=(0, 1, 2))(
            *(jnp.asarray(a, dtype) for a in (hidden, weight, bias))
        )
    for name, g, expected in zip(("dh", "dW", "db"), got, want, strict=True):
        assert g.dtype == dtype
        err = np.abs(np.asarray(g, np.float64) - expected).max() / np.abs(expected).max()
        assert err <= tol, f"{name}: relative max error {err:.3g}"


def test_a_training_step_runs_four_matmul_passes():
    """One logits pass forward, three backward (the logits again, dz @ W, dz^T @ h)."""
    hidden, weight, _, labels, _ = (
        jnp.asarray(a, jnp.float32) if a.dtype == np.float64 else a for a in _inputs()
    )

    def loss(h, w):
        return api.linear_cross_entropy(
            h,
            w,
            jnp.asarray(labels, jnp.int32),
            implementation="pallas",
            block_tokens=16,
            block_vocab=BLOCK_VOCAB,
        )

    calls = block_schedule.pallas_calls(jax.value_and_grad(loss, argnums=(0, 1)), hidden, weight)
    padded = 48 * 384 * HIDDEN  # 3 blocks of 16 tokens x 3 blocks of 128 rows, whole blocks
    flops = [block_schedule.matmul_flops(call) for call in calls]
    assert flops == [2 * padded, 3 * 2 * padded]


@pytest.mark.parametrize("dtype, multiple", [(jnp.float32, 8), (jnp.bfloat16, 16)])
def test_backward_never_runs_two_token_blocks(dtype, multiple):
    block = api.pallas_tpu.backward_token_block
    for tokens in range(1, 400):
        for block_tokens in (multiple, 2 * multiple, 128):
            chosen = block(tokens, block_tokens, dtype)
            assert -(-tokens // chosen) != 2, (tokens, block_tokens, chosen)
            assert chosen == tokens or chosen % multiple == 0, (tokens, block_tokens, chosen)

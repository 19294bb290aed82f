"""Input builders and error measures shared by the attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
GRAD_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@dataclass(frozen=True)
class Case:
    """One attention problem: shapes, dtype and which optional inputs to build."""

    batch: int = 1
    q_heads: int = 4
    kv_heads: int = 2
    q_len: int = 24
    kv_len: int = 24
    head_dim: int = 16
    dtype: str = "float32"
    kv_mask: bool = False
    segments: bool = False

    def arrays(self, seed: int = 0) -> dict:
        """q, k, v (and kv_mask / segment ids when asked), reproducible from ``seed``."""
        rng = np.random.default_rng(seed)
        dtype = jnp.dtype(self.dtype)

        def normal(*shape):
            return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

        arrays = {
            "query": normal(self.batch, self.q_heads, self.q_len, self.head_dim),
            "key": normal(self.batch, self.kv_heads, self.kv_len, self.head_dim),
            "value": normal(self.batch, self.kv_heads, self.kv_len, self.head_dim),
        }
        if self.kv_mask:
            arrays["kv_mask"] = jnp.asarray(rng.random((self.batch, self.kv_len)) > 0.3)
        if self.segments:
            arrays["q_segment_ids"] = jnp.asarray(
                np.sort(rng.integers(0, 3, (self.batch, self.q_len)), axis=1), jnp.int32
            )
            arrays["kv_segment_ids"] = jnp.asarray(
                np.sort(rng.integers(0, 3, (self.batch, self.kv_len)), axis=1), jnp.int32
            )
        return arrays

    def cotangents(self, seed: int = 1) -> tuple:
        rng = np.random.default_rng(seed)
        out = rng.standard_normal((self.batch, self.q_heads, self.q_len, self.head_dim))
        lse = rng.standard_normal((self.batch, self.q_heads, self.q_len))
        return jnp.asarray(out, self.dtype), jnp.asarray(lse, jnp.float32)


def max_abs_error(actual, expected) -> float:
    """Max |actual - expected| in f64; positions where both are the same infinity count as 0."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    same = actual == expected  # equal infinities
    with np.errstate(invalid="ignore"):
        difference = np.abs(actual - expected)
    return float(np.max(np.where(same, 0.0, difference), initial=0.0))


def assert_close(actual, expected, tolerance: float, what: str) -> None:
    assert not np.any(np.isnan(np.asarray(jnp.asarray(actual, jnp.float32)))), f"{what}: NaN"
    error = max_abs_error(actual, expected)
    assert error <= tolerance, f"{what}: max abs error {error:.3g} > {tolerance:g}"


def upcast(arrays: dict) -> dict:
    """Float arrays as f32 (the reference answer for low-precision inputs)."""
    return {
        name: value.astype(jnp.float32) if jnp.issubdtype(value.dtype, jnp.floating) else value
        for name, value in arrays.items()
    }


def outputs_and_grads(fn, arrays: dict, cotangents, **options):
    """(out, lse, dq, dk, dv) of ``fn`` (a ``*_with_lse`` function) in one jitted call."""

    @jax.jit
    def run(arrays, cotangents):
        rest = {n: v for n, v in arrays.items() if n not in ("query", "key", "value")}

        def forward(query, key, value):
            return fn(query, key, value, **rest, **options)

        (out, lse), pullback = jax.vjp(forward, arrays["query"], arrays["key"], arrays["value"])
        return (out, lse, *pullback(cotangents))

    return run(arrays, cotangents)


def loss_outputs_and_grads(
    attention, q, k, v, arrays: dict, options: dict, implementation, **blocks
):
    """(out, lse, dq, dk, dv) of ``dot_product_attention_with_lse`` under a fixed random output
    cotangent plus the finite log-sum-exps (fully masked rows have -inf), in one jitted call."""
    arrays = {n: jnp.asarray(a) for n, a in arrays.items()}
    out_shape = (*q.shape[:3], v.shape[-1])
    cotangent = jnp.asarray(np.random.default_rng(2).standard_normal(out_shape))

    def loss(q, k, v):
        out, lse = attention.jax.dot_product_attention_with_lse(
            q, k, v, **arrays, **options, implementation=implementation, **blocks
        )
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * cotangent.astype(out.dtype)) + jnp.sum(finite), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, lse, *grads


def assert_pallas_matches_float64(attention, q, k, v, arrays: dict, options: dict, what, **blocks):
    """The Pallas kernel (f32, ``blocks``) against the XLA reference on the same inputs in f64:
    out and lse within 2e-5, the three gradients within 1e-4."""
    got = loss_outputs_and_grads(attention, q, k, v, arrays, options, "pallas", **blocks)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v)]
        want = [
            np.asarray(x) for x in loss_outputs_and_grads(attention, *wide, arrays, options, "xla")
        ]
    for name, actual, expected, tol in zip(
        ("out", "lse", "dq", "dk", "dv"), got, want, (2e-5, 2e-5, 1e-4, 1e-4, 1e-4), strict=True
    ):
        assert_close(actual, expected, tol, f"{what} {name}")

"""Attention dropout under SPMD on 8 simulated CPU devices, one JSON line per check (run as a
script in a fresh process, as ``spmd_checks.py``, whose helpers it uses).

The mask hashes global (batch, query head) indices: each shard of a batch x heads split gets its
offsets from the boundary (``located`` factors), so the sharded call draws the unsharded call's
mask. Forward and gradients on Explicit and Auto meshes, and the torch backward's entry point.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from spmd_checks import auto_compare, compare, get_kernel, max_err, mesh, put, qkv, rand

SEED = jnp.int32(1234)
OPTIONS = dict(causal=True, dropout_rate=0.3, implementation="pallas", block_q=16, block_k=16)
SPEC = P("data", "model")


def _dropped(q, k, v, seed):
    return get_kernel("dot_product_attention").jax.dot_product_attention(
        q, k, v, dropout_seed=seed, **OPTIONS
    )


def _arrays():
    return [*qkv(2, 8, 4, seq=32, dim=16), SEED]


def explicit_batch_heads():
    result = compare(
        "attention dropout GQA 8/4, batch x heads over (2,4), Explicit",
        _dropped,
        _arrays(),
        [SPEC] * 3 + [P()],
        mesh((2, 4), ("data", "model")),
        (0, 1, 2),
        [SPEC],
    )
    q, k, v, seed = _arrays()
    undropped = _dropped(q, k, v, seed) - get_kernel(
        "dot_product_attention"
    ).jax.dot_product_attention(q, k, v, causal=True, implementation="pallas")
    result["dropped"] = float(jnp.max(jnp.abs(undropped)))  # the mask does drop
    result["ok"] = result["ok"] and result["dropped"] > 0.1
    return result


def auto_batch_heads():
    return auto_compare(
        "attention dropout GQA 8/4, batch x heads over (2,4), Auto",
        _dropped,
        _arrays(),
        [SPEC] * 3 + [P()],
        (0, 1, 2),
    )


def backward_batch_heads():
    """The backward entry point (the torch backward op's) regenerates the same global mask."""
    m = mesh((2, 4), ("data", "model"))
    api = get_kernel("dot_product_attention").jax
    q, k, v, seed = _arrays()
    out, lse = api.dot_product_attention_with_lse(q, k, v, dropout_seed=seed, **OPTIONS)
    d_out, d_lse = rand(14, out.shape), jnp.zeros_like(lse)
    # kv_mask, q/kv segment ids; sinks; q/kv positions, q/kv groups; dropout_seed; saved values
    args = [q, k, v, None, None, None, None, None, None, None, None, seed, out, lse, d_out, d_lse]
    backward = lambda *a: api.attention_backward(*a, **OPTIONS)
    expected = backward(*args)
    specs = [SPEC] * 3 + [None] * 8 + [P()] + [SPEC] * 4
    placed = [
        a if s is None else put(m, np.asarray(a), s) for a, s in zip(args, specs, strict=True)
    ]
    import jax

    got = jax.jit(backward)(*placed)
    err = max_err([g for g in got if g is not None], [e for e in expected if e is not None])
    return {
        "name": "attention_backward dropout, batch x heads over (2,4)",
        "ok": err <= 1e-5,
        "grad_err": err,
    }


CHECKS = (explicit_batch_heads, auto_batch_heads, backward_batch_heads)


def main() -> int:
    for fn in CHECKS:
        start = time.perf_counter()
        try:
            result = fn()
        except Exception:
            result = {"name": fn.__name__, "ok": False, "message": traceback.format_exc()[-3000:]}
        result["check"] = fn.__name__
        result["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sharded kernels on 8 simulated CPU devices: run as a script, prints one JSON line per check.

Run in a fresh process (the device count is fixed when JAX starts): ``python spmd_checks.py``.
Each check compares a kernel's sharded forward and gradients on an Explicit-axis mesh with the
same call on one device, and checks the output's sharding.
"""

from __future__ import annotations

import os

# 8 CPU devices, added to the flags checks_runner gives every checks script
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import functools
import importlib
import json
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kernel_hub import get_kernel
from kernel_hub.sharding import ShardingError, use_mesh

FORWARD_TOL, GRAD_TOL = 1e-6, 1e-5
CHECKS: list[Callable[[], dict]] = []


def check(fn):
    CHECKS.append(fn)
    return fn


def mesh(shape, names, kind=AxisType.Explicit):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def rand(seed, shape):
    """Standard normal f32 values drawn by NumPy: a ``jax.random`` draw compiles a program for
    each new shape (46 draws in five of these checks took 8.6 CPU-s)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def put(m, array, spec):
    return jax.device_put(array, NamedSharding(m, spec))


def max_err(a, b) -> float:
    """Largest |a - b| over every leaf, relative to the largest |b| of that leaf (values of
    order one read as absolute; a gradient summed over 256 columns is ~16)."""
    return max(
        (
            float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / max(1.0, np.max(np.abs(y))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        ),
        default=0.0,
    )


def with_grads(fn, args, diff):
    """(outputs, gradients of sum(outputs * fixed cotangents) w.r.t. args[diff]).

    One ``jax.vjp``: the forward is traced, lowered and compiled once and its outputs are the
    ones returned (a separate ``fn(*args)`` beside ``jax.grad`` put a second copy of the forward,
    interpret-mode kernels and all, in every compared program)."""

    def on_diff(*diff_args):
        full = list(args)
        for i, v in zip(diff, diff_args, strict=True):
            full[i] = v
        return fn(*full)

    if not diff:  # a forward-only op
        return fn(*args), ()
    out, pullback = jax.vjp(on_diff, *(args[i] for i in diff))
    cotangents = jax.tree.map(
        lambda o: jnp.cos(jnp.arange(o.size).reshape(o.shape)).astype(o.dtype), out
    )
    return out, pullback(cotangents)


@functools.lru_cache(maxsize=8)
def grads_program(fn, diff):
    """``with_grads(fn, args, diff)`` as one jitted program, made once per (fn, diff): checks
    that run the same function on the same shapes and shardings (the single-device reference of
    neighbouring checks, one sharded program fed other routing) reuse its compile, where a fresh
    ``jax.jit`` of a new lambda compiled the same program again. Only the last 8 are kept: each
    kept program holds its executables and their memory mappings (keeping all of them: 19,500
    mappings at the end of the run against 5,100, for the limit of 65,530 a process)."""
    return jax.jit(lambda *a: with_grads(fn, a, diff))


def compare(name, fn, args, specs, m, diff, expect_out):
    """Sharded vs single-device forward and gradients; the output specs; shard_map in jaxpr.

    Both sides are the same jitted program: one compile each, where an eager single-device run
    of the interpret-mode kernels' gradients dispatches (and compiles) op by op: 2-4x the CPU.
    """
    local = [np.asarray(a) for a in args]
    jitted = grads_program(fn, diff)
    ref_out, ref_grads = jitted(*[jnp.asarray(a) for a in local])
    placed = [put(m, a, s) for a, s in zip(local, specs, strict=True)]
    out, grads = jitted(*placed)
    out_specs = [tuple(o.sharding.spec) for o in jax.tree.leaves(out)]
    expect = [tuple(s) for s in expect_out or ()]
    pad = lambda s, n: s + (None,) * (n - len(s))
    outs = jax.tree.leaves(out)
    specs_ok = expect_out is None or all(
        pad(a, o.ndim) == pad(e, o.ndim) for a, e, o in zip(out_specs, expect, outs, strict=True)
    )
    jaxpr = str(jax.make_jaxpr(lambda *a: fn(*a))(*placed))
    fwd, grad = max_err(out, ref_out), max_err(grads, ref_grads)
    ok = fwd <= FORWARD_TOL and grad <= GRAD_TOL and specs_ok and "shard_map" in jaxpr
    return {
        "name": name,
        "ok": ok,
        "forward_err": fwd,
        "grad_err": grad,
        "out_specs": [str(s) for s in out_specs],
        "expected": [str(s) for s in expect],
        "grad_specs": [str(g.sharding.spec) for g in grads],
    }


def expect_error(name, fn, words):
    try:
        fn()
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        return {"name": name, "ok": all(w in message for w in words), "message": message[:400]}
    return {"name": name, "ok": False, "message": "no error raised"}


# --- rmsnorm ----------------------------------------------------------------------------------


def rmsnorm_fn():
    rms = get_kernel("rms_norm").jax.rms_norm
    return lambda x, w: rms(x, w, 1e-6, implementation="pallas")


@check
def rmsnorm_rows_8():
    m = mesh((8,), ("x",))
    x, w = rand(0, (16, 4, 128)), 1 + 0.1 * rand(1, (128,))
    return compare(
        "rmsnorm rows over (8,)", rmsnorm_fn(), [x, w], [P("x"), P()], m, (0, 1), [P("x")]
    )


@check
def rmsnorm_batch_seq_2x4():
    m = mesh((2, 4), ("data", "model"))
    x, w = rand(2, (4, 8, 128)), 1 + 0.1 * rand(3, (128,))
    return compare(
        "rmsnorm batch x seq over (2,4)",
        rmsnorm_fn(),
        [x, w],
        [P("data", "model"), P()],
        m,
        (0, 1),
        [P("data", "model")],
    )


@check
def rmsnorm_eager():
    """Outside jit too: concrete sharded arrays go through the boundary."""
    m = mesh((8,), ("x",))
    x, w = rand(6, (16, 128)), 1 + 0.1 * rand(7, (128,))
    out = rmsnorm_fn()(put(m, x, P("x")), put(m, w, P()))
    err = max_err(out, rmsnorm_fn()(x, w))
    spec = tuple(out.sharding.spec)
    return {
        "name": "rmsnorm eager on an Explicit mesh",
        "ok": err <= FORWARD_TOL and spec[:1] == ("x",),
        "forward_err": err,
        "out_spec": str(spec),
    }


@check
def rmsnorm_hidden_refused():
    m = mesh((8,), ("x",))
    x, w = put(m, rand(0, (8, 128)), P(None, "x")), put(m, jnp.ones(128), P("x"))
    return expect_error(
        "rmsnorm refuses a split hidden axis",
        lambda: rmsnorm_fn()(x, w),
        ["ShardingError", "hidden", "must stay whole", "all-gather"],
    )


@check
def pallas_without_boundary_fails():
    """The negative control: the same kernel without the rule fails on an Explicit mesh."""
    m = mesh((8,), ("x",))
    x, w = put(m, rand(0, (16, 128)), P("x")), put(m, jnp.ones(128), P())
    plain = get_kernel("rms_norm").jax.rms_norm.__wrapped__
    return expect_error(
        "pallas_call without the boundary fails",
        lambda: jax.jit(lambda a, b: plain(a, b, implementation="pallas"))(x, w),
        ["Manual"],
    )


@check
def rmsnorm_use_mesh_auto():
    m = mesh((2, 4), ("data", "model"), AxisType.Auto)
    x, w = rand(4, (8, 4, 128)), 1 + 0.1 * rand(5, (128,))
    ref = rmsnorm_fn()(x, w)
    with use_mesh(m, {"...": ("data", "model")}):
        fn = jax.jit(rmsnorm_fn())
        jaxpr = str(jax.make_jaxpr(rmsnorm_fn())(x, w))
        out = fn(put(m, x, P("data", "model")), put(m, w, P()))
    err = max_err(out, ref)
    return {
        "name": "rmsnorm in use_mesh on an Auto mesh",
        "ok": err <= FORWARD_TOL
        and "shard_map" in jaxpr
        and "in_specs=(P('data', 'model'" in jaxpr,
        "forward_err": err,
    }


# --- Auto meshes: plain jit, no use_mesh --------------------------------------------------------
# The traced arrays carry the mesh but no spec; the boundary places them by the mesh-axis
# conventions (data: batch/rows, model: heads) and the partitioner reshards the rest. Output
# shardings are the partitioner's choice, so only values and the shard_map are checked.


def auto_compare(name, fn, args, specs, diff):
    m = mesh((2, 4), ("data", "model"), AxisType.Auto)
    return compare(name, fn, args, specs, m, diff, None)


@check
def auto_rmsnorm():
    x, w = rand(20, (8, 4, 128)), 1 + 0.1 * rand(21, (128,))
    return auto_compare(
        "Auto mesh: rmsnorm rows over data x model",
        rmsnorm_fn(),
        [x, w],
        [P("data", "model"), P()],
        (0, 1),
    )


@check
def auto_layernorm():
    ln = get_kernel("layer_norm").jax
    x, w, b = rand(22, (8, 4, 128)), 1 + 0.1 * rand(23, (128,)), 0.1 * rand(24, (128,))
    checks = [
        auto_compare(
            "Auto mesh: layer_norm weight+bias",
            lambda x, w, b: ln.layer_norm(x, w, b, implementation="pallas"),
            [x, w, b],
            [P("data"), P(), P()],
            (0, 1, 2),
        ),
        auto_compare(
            "Auto mesh: layer_norm no bias",
            lambda x, w: ln.layer_norm_no_bias(x, w, implementation="pallas"),
            [x, w],
            [P(None, "model"), P()],
            (0, 1),
        ),
        auto_compare(
            "Auto mesh: layer_norm no affine",
            lambda x: ln.layer_norm_no_affine(x, implementation="pallas"),
            [x],
            [P("data", "model")],
            (0,),
        ),
    ]
    return {
        "name": "Auto mesh: layer_norm (3 forms)",
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
    }


@check
def auto_attention():
    plain, _ = attention_fns()
    spec = P("data", "model")
    return auto_compare(
        "Auto mesh: attention GQA 8/4 batch x heads",
        plain,
        list(qkv(2, 8, 4)),
        [spec] * 3,
        (0, 1, 2),
    )


@check
def auto_ragged_and_paged():
    api = get_kernel("ragged_attention").jax
    q, k, v = rand(30, (64, 8, 32)), rand(31, (64, 4, 32)), rand(32, (64, 4, 32))
    cu = jnp.array([0, 10, 40, 64], jnp.int32)
    heads = P(None, "model")
    ragged = auto_compare(
        "Auto mesh: ragged attention heads over model",
        lambda q, k, v, a, b: api.ragged_attention(q, k, v, a, b, implementation="pallas"),
        [q, k, v, cu, cu],
        [heads, heads, heads, P(), P()],
        (),
    )
    pages_k, pages_v = rand(33, (16, 8, 4, 32)), rand(34, (16, 8, 4, 32))
    table = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)[::-1]
    lens = jnp.array([5, 32, 17, 1], jnp.int32)
    paged = auto_compare(
        "Auto mesh: paged decode heads over model, sequences over data",
        lambda q, kp, vp, t, n: api.paged_attention(q, kp, vp, t, n, implementation="pallas"),
        [rand(35, (4, 8, 32)), pages_k, pages_v, table, lens],
        [P("data", "model"), P(None, None, "model"), P(None, None, "model"), P(), P()],
        (),
    )
    return {
        "name": "Auto mesh: ragged + paged",
        "ok": ragged["ok"] and paged["ok"],
        "checks": [ragged, paged],
    }


@check
def auto_8bit_kv_cache():
    """The serving ops on an 8-bit KV cache (int8 ragged keys, fp8 pages) with their f32 scales,
    one per token and kv head: the scales follow their heads over model, sequences over data
    (paged); TPU-shaped blocks, two per axis (ragged 32 queries x 128 keys, paged 2 pages)."""
    api = get_kernel("ragged_attention").jax
    keys = jnp.asarray(np.random.default_rng(40).integers(-127, 128, (2, 256, 4, 32), np.int8))
    scales = 0.01 + jnp.abs(rand(41, (2, 4, 256))) / 100
    cu_q, cu_k = jnp.array([0, 10, 40, 64], jnp.int32), jnp.array([0, 50, 180, 256], jnp.int32)
    heads = P(None, "model")
    ragged = auto_compare(
        "Auto mesh: ragged attention on int8 K/V, heads (and scales) over model",
        lambda q, k, v, a, b, ks, vs: api.ragged_attention(
            q, k, v, a, b, None, ks, vs, block_q=32, block_k=128, implementation="pallas"
        ),
        [rand(42, (64, 8, 32)), keys[0], keys[1], cu_q, cu_k, scales[0], scales[1]],
        [heads, heads, heads, P(), P(), P("model"), P("model")],
        (),
    )
    pages = rand(43, (2, 16, 32, 4, 32)).astype(jnp.float8_e4m3fn)
    page_scales = 0.01 + jnp.abs(rand(44, (2, 16, 4, 32))) / 100
    table = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)[::-1]
    on_heads = P(None, None, "model")
    paged = auto_compare(
        "Auto mesh: paged decode on fp8 pages, heads (and scales) over model, sequences over data",
        lambda q, kp, vp, t, n, ks, vs: api.paged_attention(
            q, kp, vp, t, n, None, ks, vs, pages_per_block=2, implementation="pallas"
        ),
        [
            rand(45, (4, 8, 32)),
            pages[0],
            pages[1],
            table,
            jnp.array([5, 128, 70, 1], jnp.int32),
            page_scales[0],
            page_scales[1],
        ],
        [P("data", "model"), on_heads, on_heads, P(), P(), heads, heads],
        (),
    )
    return all_of("Auto mesh: ragged + paged on an 8-bit cache", [ragged, paged])


def all_of(name, checks):
    return {"name": name, "ok": all(c["ok"] for c in checks), "checks": checks}


@check
def auto_gated_mlp():
    act = get_kernel("gated-mlp").jax.gated_activation
    g, u = rand(40, (8, 4, 256)), rand(41, (8, 4, 256))
    rows = P("data", "model")
    return all_of(
        "Auto mesh: gated activation, separate and fused, rows over data x model",
        [
            auto_compare(
                "Auto mesh: gated activation silu",
                lambda g, u: act(g, u, "silu", implementation="pallas"),
                [g, u],
                [rows, rows],
                (0, 1),
            ),
            auto_compare(
                "Auto mesh: gated activation fused gelu_tanh",
                lambda x: act(x, None, "gelu_tanh", implementation="pallas"),
                [jnp.concatenate([g, u], -1)],
                [rows],
                (0,),
            ),
        ],
    )


@check
def gated_mlp_intermediate_split_over_model():
    """Megatron's column-split gate and up: the intermediate features over ``model`` stay split
    through the kernel (Explicit: the arrays' own placement, output and gradients keep it;
    Auto: the conventions split ``intermediate`` over ``model``)."""
    act = get_kernel("gated-mlp").jax.gated_activation
    g, u = rand(45, (8, 4, 512)), rand(46, (8, 4, 512))
    tp = P("data", None, "model")
    return all_of(
        "gated activation, intermediate over model (TP)",
        [
            compare(
                "Explicit mesh: gated activation silu, intermediate over model",
                lambda g, u: act(g, u, "silu", implementation="pallas"),
                [g, u],
                [tp, tp],
                mesh((2, 4), ("data", "model")),
                (0, 1),
                [tp],
            ),
            auto_compare(
                "Auto mesh: gated activation gelu, intermediate over model",
                lambda g, u: act(g, u, "gelu", implementation="pallas"),
                [g, u],
                [tp, tp],
                (0, 1),
            ),
        ],
    )


@check
def auto_gated_rms_norm():
    norm = get_kernel("rmsnorm").gated.gated_rms_norm
    x, z, w = rand(42, (8, 4, 128)), rand(43, (8, 4, 128)), 1 + 0.1 * rand(44, (128,))
    rows = P("data", "model")
    return all_of(
        "Auto mesh: gated rms_norm, both orders, rows over data x model",
        [
            auto_compare(
                f"Auto mesh: gated rms_norm norm_before_gate={before}",
                lambda x, z, w, before=before: norm(
                    x, z, w, norm_before_gate=before, implementation="pallas"
                ),
                [x, z, w],
                [rows, rows, P()],
                (0, 1, 2),
            )
            for before in (True, False)
        ],
    )


def gdr_inputs(length, batch=2, key_heads=4, heads=8, dim=32):
    """q, k [B, T, HK, K], v [B, T, HV, V], g (log decay <= 0), beta in (0, 1), a state."""
    q, k = rand(45, (batch, length, key_heads, dim)), rand(46, (batch, length, key_heads, dim))
    v = rand(47, (batch, length, heads, dim))
    g = jnp.asarray(-0.1 * np.random.default_rng(48).random((batch, length, heads), np.float32))
    beta = jnp.asarray(np.random.default_rng(49).random((batch, length, heads), np.float32))
    return [q, k, v, g, beta, 0.1 * rand(50, (batch, heads, dim, dim))]


PACKED = jnp.array([0, 7, 23, 40], jnp.int32)
"""Offsets of 3 packed sequences of 40 tokens (chunks of 16 straddle their bounds)."""
# batch over data, heads (and their q/k heads) over model: 2 v heads and 1 q/k head a shard
GDR_SPECS = [P("data", None, "model")] * 5 + [P("data", "model")]


@check
def auto_gated_delta_rule():
    api = get_kernel("gated-delta-rule").jax
    return all_of(
        "Auto mesh: gated delta rule GVA 4/8, batch over data, heads over model",
        [
            auto_compare(
                "Auto mesh: chunk_gated_delta_rule, initial state, 2 chunks",
                lambda *a: api.chunk_gated_delta_rule(
                    *a, chunk_size=16, use_qk_l2norm=True, implementation="pallas"
                ),
                gdr_inputs(32),
                GDR_SPECS,
                (0, 1, 2, 3, 4, 5),
            ),
            auto_compare(
                "Auto mesh: recurrent_gated_delta_rule, 2 tokens",
                lambda *a: api.recurrent_gated_delta_rule(
                    *a, use_qk_l2norm=True, implementation="pallas"
                ),
                gdr_inputs(2),
                GDR_SPECS,
                (0, 1, 2, 3, 4, 5),
            ),
            auto_compare(  # batch of one: only the heads split
                "Auto mesh: chunk_gated_delta_rule, 3 sequences packed by cu_seqlens",
                lambda *a: api.chunk_gated_delta_rule(
                    *a, chunk_size=16, use_qk_l2norm=True, implementation="pallas"
                ),
                [*(x[:1] for x in gdr_inputs(40)[:5]), gdr_inputs(2, batch=3)[5], PACKED],
                [*[P(None, None, "model")] * 5, P(None, "model"), P()],
                (0, 1, 2, 3, 4, 5),
            ),
        ],
    )


@check
def auto_causal_conv1d():
    api = get_kernel("causal-conv1d").jax
    x, w, b = rand(51, (2, 32, 256)), rand(52, (256, 4)), rand(53, (256,))
    state = rand(54, (2, 3, 256))
    channels = P("data", None, "model")
    return all_of(
        "Auto mesh: causal conv1d and its update, batch over data, channels over model",
        [
            auto_compare(
                "Auto mesh: causal_conv1d silu, bias, initial state",
                lambda x, w, b, s: api.causal_conv1d(
                    x, w, b, s, activation="silu", implementation="pallas"
                ),
                [x, w, b, state],
                [channels, P("model"), P("model"), channels],
                (0, 1, 2, 3),
            ),
            auto_compare(
                "Auto mesh: causal_conv1d, 3 sequences packed by cu_seqlens",
                lambda x, w, b, cu: api.causal_conv1d(
                    x, w, b, None, cu, activation="silu", implementation="pallas"
                ),
                [rand(56, (1, 40, 256)), w, b, PACKED],
                [P(None, None, "model"), P("model"), P("model"), P()],
                (0, 1, 2),
            ),
            auto_compare(  # forward only: the Pallas update aliases its state (no JVP)
                "Auto mesh: causal_conv1d_update 2 tokens",
                lambda x, s, w, b: api.causal_conv1d_update(
                    x, s, w, b, activation="silu", implementation="pallas"
                ),
                [x[:, :2], rand(55, (2, 4, 256)), w, b],
                [channels, channels, P("model"), P("model")],
                (),
            ),
        ],
    )


@check
def auto_mamba2_scan():
    api = get_kernel("mamba2-scan").jax
    batch, length, heads, dim, groups, state = 2, 32, 8, 16, 4, 16
    x, dt = rand(56, (batch, length, heads, dim)), rand(57, (batch, length, heads))
    a = -jnp.exp(0.3 * rand(58, (heads,)))
    bc = [rand(59, (batch, length, groups, state)), rand(60, (batch, length, groups, state))]
    d, bias = rand(61, (heads,)), rand(62, (heads,))
    init = 0.1 * rand(63, (batch, heads, dim, state))
    token, per_head = P("data", None, "model"), P("model")
    seq_idx = jnp.array([[0] * 10 + [1] * 22, [0] * 32], jnp.int32)  # row 0: 2 sequences
    chunk = auto_compare(
        "Auto mesh: mamba_chunk_scan_combined, D, dt_bias, initial state, seq_idx, 2 chunks",
        lambda x, dt, a, b, c, d, bias, init, seq: api.mamba_chunk_scan_combined(
            x,
            dt,
            a,
            b,
            c,
            d,
            bias,
            init,
            seq,
            chunk_size=16,
            dt_softplus=True,
            implementation="pallas",
        ),
        [x, dt, a, *bc, d, bias, init, seq_idx],
        [token, token, per_head, token, token, per_head, per_head, P("data", "model"), P("data")],
        (0, 1, 2, 3, 4, 5, 6, 7),
    )
    step = P("data", "model")
    decode = auto_compare(  # forward only: the Pallas step aliases its state (no JVP)
        "Auto mesh: selective_state_update, D, z, dt_bias",
        lambda *a: api.selective_state_update(*a, dt_softplus=True, implementation="pallas"),
        [
            init,
            x[:, 0],
            dt[:, 0, :, None] + jnp.zeros((dim,)),
            jnp.broadcast_to(a[:, None, None], (heads, dim, state)),
            bc[0][:, 0],
            bc[1][:, 0],
            jnp.broadcast_to(d[:, None], (heads, dim)),
            rand(64, (batch, heads, dim)),
            jnp.broadcast_to(bias[:, None], (heads, dim)),
        ],
        [step, step, step, P("model"), step, step, P("model"), step, P("model")],
        (),
    )
    return all_of("Auto mesh: Mamba-2 scan and decode step, batch x heads", [chunk, decode])


@check
def auto_rotary():
    rope = get_kernel("rotary").jax.rotary_embedding
    q, k = rand(65, (2, 8, 16, 64)), rand(66, (2, 4, 16, 64))
    angles = jnp.arange(16)[:, None] * 0.1 * jnp.arange(1, 33)
    cos, sin = (jnp.tile(f(angles), (1, 2))[None] for f in (jnp.cos, jnp.sin))
    heads = P("data", "model")
    return all_of(
        "Auto mesh: rotary GQA 8/4, batch over data, heads over model",
        [
            auto_compare(
                "Auto mesh: rotary [B, H, S, D], tables shared by the batch",
                lambda q, k, c, s: rope(q, k, c, s, implementation="pallas"),
                [q, k, cos, sin],
                [heads, heads, P(), P()],
                (0, 1, 2, 3),
            ),
            auto_compare(
                "Auto mesh: rotary [B, S, H, D] interleaved, per-row tables",
                lambda q, k, c, s: rope(
                    q, k, c, s, unsqueeze_dim=2, interleaved=True, implementation="pallas"
                ),
                [
                    jnp.swapaxes(q, 1, 2),
                    jnp.swapaxes(k, 1, 2),
                    *(jnp.tile(t, (2, 1, 1)) for t in (cos, sin)),
                ],
                [P("data", None, "model"), P("data", None, "model"), P("data"), P("data")],
                (0, 1, 2, 3),
            ),
        ],
    )


# --- attention ----------------------------------------------------------------------------------


@functools.cache  # one pair of functions, so checks on the same shapes share their programs
def attention_fns():
    api = get_kernel("dot_product_attention").jax
    plain = lambda q, k, v: api.dot_product_attention(q, k, v, causal=True, implementation="pallas")
    lse = lambda q, k, v: api.dot_product_attention_with_lse(
        q, k, v, causal=True, implementation="pallas"
    )
    return plain, lse


def qkv(batch, heads, kv_heads, seq=64, dim=32):
    return (
        rand(10, (batch, heads, seq, dim)),
        rand(11, (batch, kv_heads, seq, dim)),
        rand(12, (batch, kv_heads, seq, dim)),
    )


@check
def attention_batch_heads_2x4():
    m = mesh((2, 4), ("data", "model"))
    plain, _ = attention_fns()
    spec = P("data", "model")
    return compare(
        "attention GQA 8/4, batch x heads over (2,4)",
        plain,
        list(qkv(2, 8, 4)),
        [spec] * 3,
        m,
        (0, 1, 2),
        [spec],
    )


@check
def attention_sinks_batch_split_2x4():
    """d_sinks sums over batch and queries: with batch split over data it must be summed there."""
    m = mesh((2, 4), ("data", "model"))
    api = get_kernel("dot_product_attention").jax
    fn = lambda q, k, v, s: api.dot_product_attention(
        q, k, v, causal=True, sinks=s, implementation="pallas"
    )
    spec = P("data", "model")
    return compare(
        "attention sinks GQA 8/4, batch x heads over (2,4)",
        fn,
        [*qkv(2, 8, 4), 3.0 * rand(13, (8,))],
        [spec] * 3 + [P("model")],
        m,
        (0, 1, 2, 3),
        [spec],
    )


@check
def attention_backward_sinks_batch_split_2x4():
    """The backward entry point (the torch backward op's) with batch split: its d_sinks is the
    sum over every batch shard, not one shard's partial sum."""
    m = mesh((2, 4), ("data", "model"))
    api = get_kernel("dot_product_attention").jax
    q, k, v = qkv(2, 8, 4)
    sinks = 3.0 * rand(13, (8,))
    out, lse = jax.jit(
        lambda q, k, v, s: api.dot_product_attention_with_lse(q, k, v, sinks=s, causal=True)
    )(q, k, v, sinks)
    d_out, d_lse = rand(14, out.shape), jnp.zeros_like(lse)
    # kv_mask, q/kv segment ids; sinks; q/kv positions, q/kv groups; dropout_seed; then the
    # saved values
    args = [q, k, v, None, None, None, sinks, None, None, None, None, None, out, lse, d_out, d_lse]
    backward = jax.jit(lambda *a: api.attention_backward(*a, causal=True, implementation="pallas"))
    expected = backward(*args)  # the sharded call's program on one device
    spec = P("data", "model")
    specs = [spec, spec, spec, None, None, None, P("model"), None, None, None, None, None]
    specs += [spec, spec, spec, spec]
    placed = [
        a if s is None else put(m, np.asarray(a), s) for a, s in zip(args, specs, strict=True)
    ]
    got = backward(*placed)
    err = max_err(got, expected)
    return {
        "name": "attention_backward sinks, batch x heads over (2,4)",
        "ok": err <= GRAD_TOL,
        "grad_err": err,
    }


def dense_mask_case(mask_shape, bias_shape):
    """GQA 8/4 with key padding, a [B|1, H|1, S, S] boolean mask and an additive bias."""
    q, k, v = qkv(2, 8, 4)
    keep = jnp.arange(64) < jnp.array([48, 64])[:, None]  # batch 0 pads its last 16 keys
    mask = jnp.broadcast_to(keep[:, None, None, :], (2, 8, 64, 64))
    mask = mask[: mask_shape[0], : mask_shape[1]]
    bias = 0.5 * rand(15, bias_shape)
    return q, k, v, mask, 3.0 * rand(13, (8,)), bias


def dense_specs(mask_shape, bias_shape):
    spec = P("data", "model")
    split = lambda shape: P(
        *[a if n > 1 else None for a, n in zip(("data", "model"), shape[:2], strict=True)]
    )
    return [spec, spec, spec, split(mask_shape), P("model"), split(bias_shape)]


@check
def dense_mask_fwd_bwd():
    """Dense-mask attention, forward (out, lse) and gradients through it, and the backward entry
    point (the torch backward op's): batch over data, heads over model, the bias broadcast over
    batch ([1, H, ...]: its gradient summed over data) or heads ([B, 1, ...]: over model); on an
    Explicit mesh and on an Auto mesh under plain jit."""
    dense_mask = importlib.import_module(get_kernel("attention").__name__ + ".dense_mask")

    fwd = lambda q, k, v, m, s, b: dense_mask.attention_with_dense_mask(
        q, k, v, m, s, b, implementation="pallas"
    )
    results = []
    cases = (
        ((2, 1), (1, 8, 64, 64), AxisType.Explicit),
        ((1, 1), (2, 1, 64, 64), AxisType.Auto),
    )
    for mask_shape, bias_shape, kind in cases:
        args = list(dense_mask_case(mask_shape, bias_shape))
        m = mesh((2, 4), ("data", "model"), kind)
        specs = dense_specs(mask_shape, bias_shape)
        results.append(
            compare(
                f"dense mask {mask_shape} bias {bias_shape[:2]} {kind}",
                fwd,
                args,
                specs,
                m,
                (0, 1, 2, 4, 5),
                None,
            )
        )
        out, lse = jax.jit(fwd)(*args)
        cot = [rand(16, out.shape), rand(17, lse.shape)]
        backward = jax.jit(
            lambda *a: dense_mask.attention_with_dense_mask_backward(*a, implementation="pallas")
        )
        full = [*args, out, lse, *cot]
        expected = backward(*full)
        spec = P("data", "model")
        placed = [
            put(m, np.asarray(a), sp)
            for a, sp in zip(full, [*specs, spec, spec, spec, spec], strict=True)
        ]
        got = backward(*placed)
        err = max_err(got, expected)
        results.append(
            {
                "name": f"backward entry {mask_shape} {bias_shape[:2]} {kind}",
                "ok": err <= GRAD_TOL,
                "grad_err": err,
            }
        )
    return {"name": "dense-mask attention", "ok": all(r["ok"] for r in results), "checks": results}


@check
def attention_lse_heads_8():
    m = mesh((8,), ("x",))
    _, lse = attention_fns()
    spec = P(None, "x")
    return compare(
        "attention_with_lse GQA 16/8, heads over (8,)",
        lse,
        list(qkv(1, 16, 8)),
        [spec] * 3,
        m,
        (0, 1, 2),
        [spec, spec],
    )


@check
def attention_kv_heads_follow_q():
    """kv heads left whole are split to match the query heads (no communication)."""
    m = mesh((2, 4), ("data", "model"))
    plain, _ = attention_fns()
    return compare(
        "attention, kv replicated while q heads split",
        plain,
        list(qkv(2, 8, 4)),
        [P("data", "model"), P("data"), P("data")],
        m,
        (0, 1, 2),
        [P("data", "model")],
    )


@check
def attention_seq_refused():
    m = mesh((8,), ("x",))
    plain, _ = attention_fns()
    q, k, v = (put(m, a, P(None, None, "x")) for a in qkv(1, 8, 4))
    return expect_error(
        "attention refuses a split sequence",
        lambda: plain(q, k, v),
        ["ShardingError", "q_len", "ring_attention"],
    )


@check
def attention_kv_heads_indivisible():
    m = mesh((8,), ("x",))
    plain, _ = attention_fns()
    q, k, v = qkv(1, 8, 4)
    q = put(m, q, P(None, "x"))
    return expect_error(
        "attention refuses kv heads that cannot follow",
        lambda: plain(q, k, v),
        ["ShardingError", "key dimension 1", "divisible by 8"],
    )


# --- moe-gemm -----------------------------------------------------------------------------------


def moe():
    return get_kernel("gmm").jax


def tiling():
    """One tiling for the sharded and the single-device call: the same sums in the same order."""
    return moe().Tiling(64, 64, 32)


SIZES = np.array([10, 0, 22, 32], np.int32)


@check
def gmm_k_n_2x4():
    m = mesh((2, 4), ("data", "model"))
    api = moe()
    fn = lambda a, b, s: api.gmm(a, b, s, implementation="pallas", tiling=tiling())
    lhs, rhs = rand(20, (64, 128)), rand(21, (4, 128, 256))
    return compare(
        "gmm, k (summed) x n over (2,4)",
        fn,
        [lhs, rhs, SIZES],
        [P(None, "data"), P(None, "data", "model"), P()],
        m,
        (0, 1),
        [P(None, "model")],
    )


@check
def gmm_transposed_n_8():
    m = mesh((8,), ("x",))
    api = moe()
    fn = lambda a, b, s: api.gmm(
        a, b, s, transpose_rhs=True, implementation="pallas", tiling=tiling()
    )
    lhs, rhs = rand(22, (64, 128)), rand(23, (4, 256, 128))
    return compare(
        "gmm transpose_rhs, n over (8,)",
        fn,
        [lhs, rhs, SIZES],
        [P(), P(None, "x"), P()],
        m,
        (0, 1),
        [P(None, "x")],
    )


@check
def tgmm_k_n_2x4():
    m = mesh((2, 4), ("data", "model"))
    api = moe()
    fn = lambda a, g, s: api.tgmm(a, g, s, implementation="pallas", tiling=tiling())
    lhs, grad = rand(24, (64, 128)), rand(25, (64, 256))
    return compare(
        "tgmm, k x n over (2,4)",
        fn,
        [lhs, grad, SIZES],
        [P(None, "data"), P(None, "model"), P()],
        m,
        (0, 1),
        [P(None, "data", "model")],
    )


@check
def gmm_experts_refused():
    m = mesh((4, 2), ("ep", "x"))
    api = moe()
    lhs, rhs = rand(20, (64, 128)), put(m, rand(21, (4, 128, 256)), P("ep"))
    return expect_error(
        "gmm refuses split experts",
        lambda: api.gmm(lhs, rhs, SIZES),
        ["ShardingError", "experts", "moe_ep"],
    )


def quantized_weight(seed, shape, fmt):
    """An int8 or fp8 expert weight [E, out, in] and its f32 scale (per channel / 128x128 block)."""
    experts, out, inner = shape
    values = rand(seed, shape) * 4
    if fmt == "int8":
        weight, scale_shape = jnp.round(values * 16).astype(jnp.int8), (experts, out)
    else:
        weight, scale_shape = values.astype(jnp.float8_e4m3fn), (experts, out // 128, inner // 128)
    return weight, jnp.abs(rand(seed + 1, scale_shape)) / 64 + 1e-3


@check
def gmm_quantized_k_n_2x4():
    """int8 and fp8 weights, k (summed) over data and n over model: the scales follow; the
    backward function (d lhs, summed over n) too."""
    m = mesh((2, 4), ("data", "model"))
    api = moe()
    results = []
    tiling = moe().Tiling(64, 128, 128)  # fp8: whole 128 x 128 scale blocks
    for fmt in ("int8", "fp8"):
        fn = lambda a, w, c, s: api.gmm_quantized(
            a, w, c, s, implementation="pallas", tiling=tiling
        )
        weight, scale = quantized_weight(26, (4, 512, 256), fmt)
        scale_spec = P(None, "model") if fmt == "int8" else P(None, "model", "data")
        results.append(
            compare(
                f"gmm_quantized {fmt}, k (summed) x n over (2,4)",
                fn,
                [rand(27, (64, 256)), weight, scale, SIZES],
                [P(None, "data"), P(None, "model", "data"), scale_spec, P()],
                m,
                (0,),
                [P(None, "model")],
            )
        )
        vjp = lambda a, w, c, s, d: api.gmm_quantized_vjp(a, w, c, s, d, implementation="pallas")
        results.append(
            compare(
                f"gmm_quantized_vjp {fmt}, k x n (summed) over (2,4)",
                vjp,
                [rand(27, (64, 256)), weight, scale, SIZES, rand(28, (64, 512))],
                [P(None, "data"), P(None, "model", "data"), scale_spec, P(), P(None, "model")],
                m,
                (),
                [P(None, "data")],
            )
        )
    return all_of("gmm_quantized and its vjp, k x n over (2,4)", results)


@check
def gmm_quantized_fp8_partial_blocks_refused():
    """out = 384 splits 2 ways but its 3 scale blocks do not (the scale cannot even be placed
    so; here it is replicated): refused, naming the scale, instead of shards of partial blocks."""
    m = mesh((4, 2), ("data", "model"))
    api = moe()
    weight, scale = quantized_weight(28, (4, 384, 256), "fp8")
    return expect_error(
        "gmm_quantized refuses fp8 shards of partial scale blocks",
        lambda: api.gmm_quantized(
            rand(29, (64, 256)),
            put(m, weight, P(None, "model")),
            put(m, scale, P()),
            SIZES,
        ),
        ["ShardingError", "scale dimension 1", "divisible by 2"],
    )


# --- expert parallelism --------------------------------------------------------------------------

HIGHEST = jax.lax.Precision.HIGHEST


def swiglu(h):
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


def dense_moe(x, index, weights, w_in, w_out):
    """The unsharded reference: every (token, slot) through its expert with plain einsums."""
    hidden = swiglu(jnp.einsum("th,tkhn->tkn", x, w_in[index], precision=HIGHEST))
    out = jnp.einsum("tkm,tkmh->tkh", hidden, w_out[index], precision=HIGHEST)
    return jnp.einsum("tkh,tk->th", out, weights, precision=HIGHEST)


def moe_inputs(tokens=64, hidden=128, inner=64, experts=16, top_k=2):
    x = rand(30, (tokens, hidden))
    logits = rand(31, (tokens, experts))
    weights, index = jax.lax.top_k(jax.nn.softmax(logits), top_k)
    w_in = rand(32, (experts, hidden, 2 * inner)) * hidden**-0.5
    w_out = rand(33, (experts, inner, hidden)) * inner**-0.5
    return [x, index.astype(jnp.int32), weights, w_in, w_out]


def compare_to_reference(name, fn, reference, args, specs, m, diff, expect_out):
    """Sharded ``fn`` vs single-device ``reference``: forward and gradients, output specs.

    The reference is jitted like the sharded side (one compile, where eagerly its gradient
    dispatched and compiled op by op)."""
    local = [jnp.asarray(np.asarray(a)) for a in args]
    ref_out, ref_grads = grads_program(reference, diff)(*local)
    placed = [put(m, np.asarray(a), s) for a, s in zip(args, specs, strict=True)]
    out, grads = grads_program(fn, diff)(*placed)
    fwd, grad = max_err(out, ref_out), max_err(grads, ref_grads)
    got = [
        tuple(o.sharding.spec)[: len(e)]
        for o, e in zip(jax.tree.leaves(out), expect_out, strict=True)
    ]
    specs_ok = got == [tuple(e) for e in expect_out]
    return {
        "name": name,
        "ok": fwd <= FORWARD_TOL and grad <= GRAD_TOL and specs_ok,
        "forward_err": fwd,
        "grad_err": grad,
        "out_specs": [str(g) for g in got],
    }


@functools.cache  # one function per transport, so checks on the same mesh share its program
def moe_ep_fn(transport="dense"):
    ep = get_kernel("gmm").expert_parallel
    return lambda *a: ep.moe_ep(*a, activation=swiglu, transport=transport, implementation="pallas")


@check
def moe_ep_16_experts_top2_8():
    m = mesh((8,), ("ep",))
    spec = P("ep")
    return compare_to_reference(
        "EP MoE E=16 top-2 over (8,) ep",
        moe_ep_fn(),
        dense_moe,
        moe_inputs(),
        [spec] * 5,
        m,
        (0, 2, 3, 4),
        [spec],
    )


@check
def moe_ep_data_x_ep_2x4():
    """Tokens and experts over ep (4); the data axis holds copies."""
    m = mesh((2, 4), ("data", "ep"))
    spec = P("ep")
    return compare_to_reference(
        "EP MoE E=16 top-2, ep of a (2,4) mesh",
        moe_ep_fn(),
        dense_moe,
        moe_inputs(),
        [spec] * 5,
        m,
        (0, 2, 3, 4),
        [spec],
    )


@check
def moe_ep_skewed_routing():
    """Every token on one shard's experts: the worst case the static buffers are sized for."""
    m = mesh((8,), ("ep",))
    args = moe_inputs()
    args[1] = jnp.stack([jnp.zeros(64, jnp.int32), jnp.ones(64, jnp.int32)], axis=1)
    return compare_to_reference(
        "EP MoE, all tokens routed to experts 0 and 1",
        moe_ep_fn(),
        dense_moe,
        args,
        [P("ep")] * 5,
        m,
        (0, 2, 3, 4),
        [P("ep")],
    )


# --- ring attention --------------------------------------------------------------------------


def ring_fn(causal):
    ring = get_kernel("dot_product_attention").ring
    return lambda q, k, v: ring.ring_attention_with_lse(
        q, k, v, causal=causal, implementation="pallas"
    )


def unsharded_attention(causal):
    api = get_kernel("dot_product_attention").jax
    return lambda q, k, v: api.dot_product_attention_with_lse(
        q, k, v, causal=causal, implementation="xla"
    )


def cp_mesh(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Explicit,) * len(names))


@check
def ring_causal_gqa_4():
    m = cp_mesh((4,), ("cp",))
    spec = P(None, None, "cp")
    return compare_to_reference(
        "ring attention, 4 shards, causal, GQA 4/2",
        ring_fn(True),
        unsharded_attention(True),
        list(qkv(1, 4, 2, seq=128)),
        [spec] * 3,
        m,
        (0, 1, 2),
        [spec, spec],
    )


def zigzag_case(
    shards,
    *,
    softcap=None,
    segments=False,
    kind=AxisType.Explicit,
    layout="zigzag",
    causal=True,
    window=None,
):
    """A ring (zig-zag causal unless told) vs unsharded attention. Both take the sequence in the
    layout's order (sharded over cp for the ring); the reference undoes the order, attends, and
    redoes it."""
    ring = get_kernel("dot_product_attention").ring
    api = get_kernel("dot_product_attention").jax
    seq = 32 * shards
    order = ring.zigzag_order(seq, shards) if layout == "zigzag" else np.arange(seq)
    undo = np.argsort(order)
    q, k, v = qkv(1, 4, 2, seq=seq)
    ids = (jnp.arange(seq) >= seq // 3).astype(jnp.int32)[None] + (jnp.arange(seq) >= seq // 2)
    options = dict(causal=causal, softcap=softcap, sliding_window=window)

    def sharded(q, k, v, ids):
        seg = (ids, ids) if segments else ()
        return ring.ring_attention_with_lse(
            q, k, v, *seg, layout=layout, implementation="pallas", **options
        )

    def reference(q, k, v, ids):
        q, k, v, ids = q[:, :, undo], k[:, :, undo], v[:, :, undo], ids[:, undo]
        seg = (ids, ids) if segments else (None, None)
        out, lse = api.dot_product_attention_with_lse(
            q, k, v, None, *seg, implementation="xla", **options
        )
        return out[:, :, order], lse[:, :, order]

    m = jax.sharding.Mesh(np.array(jax.devices()[:shards]), ("cp",), axis_types=(kind,))
    label = f"{layout} ring, {shards} shards, {'causal' if causal else 'bidirectional'}"
    label += (", softcap" if softcap else "") + (", segments" if segments else "")
    label += f", window {window}" if window else ""
    spec = P(None, None, "cp")
    args = [q[:, :, order], k[:, :, order], v[:, :, order], ids[:, order]]
    expect = [spec, spec] if kind == AxisType.Explicit else [(), ()]
    return compare_to_reference(
        f"{label}, {kind}",
        sharded,
        reference,
        args,
        [spec] * 3 + [P(None, "cp")],
        m,
        (0, 1, 2),
        expect,
    )


@check
def ring_zigzag_explicit_and_auto():
    # 4 shards each: the 8-shard ring is ring_sliding_window_4_and_8's Auto case (an 8-shard
    # ring compiles 8 steps each way, 29 CPU-s here against 12 for 4)
    checks = [
        zigzag_case(4),
        zigzag_case(4, softcap=20.0, segments=True, kind=AxisType.Auto),
    ]
    return {"name": "zig-zag ring attention", "ok": all(c["ok"] for c in checks), "checks": checks}


@check
def ring_sliding_window_4_and_8():
    """Windows across chunks (token positions into the kernel), steps outside them skipped."""
    checks = [
        zigzag_case(4, layout="contiguous", window=40),
        zigzag_case(4, window=24, segments=True),
        zigzag_case(8, window=50, softcap=20.0, kind=AxisType.Auto),
        zigzag_case(4, layout="contiguous", causal=False, window=30),
    ]
    return {
        "name": "ring attention, sliding window",
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
    }


@check
def ring_bidirectional_batch_2x4():
    m = mesh((2, 4), ("data", "cp"))
    spec = P("data", None, "cp")
    return compare_to_reference(
        "ring attention, batch x 4-shard cp, bidirectional, GQA 4/2",
        ring_fn(False),
        unsharded_attention(False),
        list(qkv(2, 4, 2, seq=128)),
        [spec] * 3,
        m,
        (0, 1, 2),
        [spec, spec],
    )


# --- linear cross-entropy, vocabulary-parallel ------------------------------------------------


def lce_inputs(tokens=64, hidden=32, vocab=256):
    """Labels with ignored tokens, a bias; the vocabulary divisible 8 ways."""
    labels = np.random.default_rng(33).integers(0, vocab, tokens, np.int32)
    labels[::7] = -100
    weight, bias = 0.3 * rand(31, (vocab, hidden)), rand(32, (vocab,))
    return [rand(30, (tokens, hidden)), weight, bias, jnp.asarray(labels)]


def lce_compare(name, options, specs, kind=AxisType.Explicit, implementations=("pallas",)):
    """The loss with the head's vocabulary split (on an Explicit mesh its weight gradient stays
    split), vs one device (XLA in chunks smaller than a shard's block)."""
    lce = get_kernel("linear_cross_entropy").jax
    m = mesh((2, 4), ("data", "model"), kind)
    out_spec = [P("data")] if options.get("reduction") == "none" else [P()]
    results = []
    for implementation in implementations:
        fn = functools.partial(
            lce_call,
            lce.linear_cross_entropy,
            implementation=implementation,
            block_vocab=32 if implementation == "xla" else None,
            **options,
        )
        expect = out_spec if kind == AxisType.Explicit else None
        result = compare(name, fn, lce_inputs(), specs, m, (0, 1, 2), expect)
        results.append({**result, "weight_grad_spec": result["grad_specs"][1]})  # d loss / d w
    ok = all(r["ok"] for r in results)
    if kind == AxisType.Explicit:
        ok = ok and all(r["weight_grad_spec"] == str(specs[1]) for r in results)
    return {"name": name, "ok": ok, "by_implementation": results}


def lce_call(loss, h, w, b, labels, **options):
    return loss(h, w, labels, b, **options)


VOCAB_SPECS = [P("data", None), P("model", None), P("model"), P("data")]


@check
def lce_vocab_parallel_options():
    options = {
        "reduction": "sum",
        "z_loss": 1e-3,
        "label_smoothing": 0.1,
        "softcap": 3.0,
        "logit_scale": 0.5,
    }
    return lce_compare(
        "linear CE: vocab over model, z-loss, smoothing, soft-cap",
        options,
        VOCAB_SPECS,
        implementations=("pallas", "xla"),
    )


@check
def lce_vocab_parallel_none():
    return lce_compare(
        "linear CE: vocab over model, reduction none",
        {"reduction": "none"},
        VOCAB_SPECS,
        implementations=("xla",),
    )


@check
def lce_vocab_over_both_axes():
    specs = [P(), P(("data", "model"), None), P(("data", "model")), P()]
    return lce_compare("linear CE: vocab 8-way over (data, model)", {"z_loss": 1e-4}, specs)


@check
def lce_vocab_parallel_auto():
    return lce_compare(
        "Auto mesh: linear CE, vocab over model and tokens over data by convention, mean",
        {"label_smoothing": 0.2},
        VOCAB_SPECS,
        kind=AxisType.Auto,
    )


@check
def lce_saved_backward_vocab_parallel():
    """The torch training path's backward (from the per-token op's saved log-sum-exp) with tokens
    over data and the head's vocabulary over model: dh, dW, db equal one device's, dW and db stay
    split; both implementations, every option."""
    lce = get_kernel("linear_cross_entropy").jax
    hidden, weight, bias, labels = lce_inputs()  # every 7th label ignored (-100)
    options = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 3.0, "logit_scale": 0.5}
    cotangent = jnp.linspace(0.5, 1.5, hidden.shape[0])

    def step(h, w, b, y, d, implementation):
        losses, lse = lce.linear_cross_entropy_per_token(
            h, w, y, b, implementation=implementation, **options
        )
        grads = lce.linear_cross_entropy_backward(
            h, w, y, b, losses, lse, d, 0.1 * d, implementation=implementation, **options
        )
        return losses, grads

    m = mesh((2, 4), ("data", "model"))
    specs = [P("data", None), P("model", None), P("model"), P("data"), P("data")]
    results = []
    for implementation in ("pallas", "xla"):
        run = jax.jit(functools.partial(step, implementation=implementation))
        arrays = (hidden, weight, bias, labels, cotangent)
        want = run(*arrays)
        got = run(*[put(m, np.asarray(a), s) for a, s in zip(arrays, specs, strict=True)])
        grad_specs = [str(g.sharding.spec) for g in got[1]]
        results.append(
            {
                "implementation": implementation,
                "forward_err": max_err(got[0], want[0]),
                "grad_err": max_err(got[1], want[1]),
                "grad_specs": grad_specs,
            }
        )
    ok = all(
        r["forward_err"] <= FORWARD_TOL
        and r["grad_err"] <= GRAD_TOL
        and r["grad_specs"][1:] == [str(P("model", None)), str(P("model"))]
        for r in results
    )
    return {"name": "linear CE: saved-statistics backward, vocab over model", "ok": ok,
            "by_implementation": results}  # fmt: skip


# --- torchax ----------------------------------------------------------------------------------


@check
def torchax_sharded_rms_norm():
    """torchax tensors holding sharded arrays run the op through the same rule, forward and
    backward; an unsharded call of the same shape afterwards is not served the sharded program."""
    import torch
    import torchax
    import torchax.tensor

    env = torchax.default_env()
    m = mesh((8,), ("x",))
    x, w = rand(40, (16, 128)), 1 + 0.1 * rand(41, (128,))
    ref_out, (ref_dx, ref_dw) = with_grads(rmsnorm_fn(), [x, w], (0, 1))
    op = get_kernel("rms_norm").rms_norm
    tx = torchax.tensor.Tensor(put(m, x, P("x")), env).requires_grad_()
    tw = torchax.tensor.Tensor(put(m, w, P()), env).requires_grad_()
    with env:
        out = op(tx, tw, 1e-6, "pallas")
        cot = torch.cos(torch.arange(out.numel(), dtype=torch.float32)).reshape(out.shape)
        (out * cot.to("jax")).sum().backward()
        plain = op(torchax.tensor.Tensor(x, env), torchax.tensor.Tensor(w, env), 1e-6, "pallas")
    errors = {
        "forward": max_err(out.jax(), ref_out),
        "dx": max_err(tx.grad.jax(), ref_dx),
        "dw": max_err(tw.grad.jax(), ref_dw),
        "unsharded": max_err(plain.jax(), ref_out),
    }
    spec = tuple(out.jax().sharding.spec)
    single = len(plain.jax().sharding.device_set) == 1
    return {
        "name": "torchax tensors with sharded arrays",
        "ok": spec[:1] == ("x",) and single and max(errors.values()) <= GRAD_TOL,
        "out_spec": str(spec),
        **errors,
    }


@check
def torchax_mixtral_experts_over_ep():
    """A tiny Mixtral on torchax with its expert weights split over ep (8 experts, 8 devices):
    the experts integration runs moe_ep and the logits match the stock model on CPU."""
    import torch
    import torchax
    import torchax.tensor
    from transformers import MixtralForCausalLM

    from kernel_hub.models.tiny import tiny_model

    stock = tiny_model(
        MixtralForCausalLM, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2
    )
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = stock(ids).logits.numpy()

    m = mesh((8,), ("ep",))
    env = torchax.default_env()
    moe = get_kernel("moe-gemm")
    stock.set_experts_implementation(moe.integrations.register())
    split = []
    with env, torch.no_grad():
        for name, param in stock.named_parameters():
            spec = P("ep") if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else P()
            array = put(m, jnp.asarray(param.detach().numpy()), spec)
            split += [name] if spec == P("ep") else []
            owner = stock.get_submodule(name.rpartition(".")[0])
            setattr(
                owner,
                name.rpartition(".")[2],
                torch.nn.Parameter(torchax.tensor.Tensor(array, env), requires_grad=False),
            )
        tokens = torchax.tensor.Tensor(put(m, jnp.asarray(ids.numpy(), jnp.int32), P()), env)
        got = np.asarray(stock(tokens).logits.jax())
    err = float(np.max(np.abs(got - expected)) / max(1.0, np.max(np.abs(expected))))
    return {
        "name": "torchax Mixtral, experts split over ep",
        "ok": err <= 1e-5 and len(split) == 4,
        "error": err,
        "split": split,
    }


# --- fused-moe expert parallelism (decode: tokens whole, experts over ep, psum) ------------------


def _fused_ep_case(m, quantization=None, implementation="pallas", axis="ep", run=None):
    """fused_experts_ep (or ``run(*args, **options)``) with the experts over ``axis`` of mesh
    ``m`` vs the unsharded fused_experts (XLA path), f32, with an empty expert and every routing
    slot of one token on one shard."""
    fused = get_kernel("fused-moe")
    tokens, hidden, inter, experts, top_k = 24, 128, 256, 16, 2
    rng = np.random.default_rng(40)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.choice([e for e in range(experts) if e != 5], top_k, replace=False)
                    for _ in range(tokens)]).astype(np.int32)  # fmt: skip
    ids[0] = [0, 1]
    weights = rng.random((tokens, top_k)).astype(np.float32)
    w1 = (rng.standard_normal((experts, 2 * inter, hidden)) / 11).astype(np.float32)
    w2 = (rng.standard_normal((experts, hidden, inter)) / 16).astype(np.float32)
    scales = [None, None]
    if quantization:
        (w1, s1), (w2, s2) = (fused.quant.quantize(jnp.asarray(w), quantization) for w in (w1, w2))
        w1, w2, scales = np.asarray(w1), np.asarray(w2), [np.asarray(s1), np.asarray(s2)]
    args = [x, ids, weights, w1, w2, None, None, *scales]
    expected = fused.jax.fused_experts(*args, quantization=quantization, implementation="xla")
    ep = P(axis)
    placed = [None if a is None else put(m, a, P() if i < 3 else ep) for i, a in enumerate(args)]
    run = run or fused.expert_parallel.fused_experts_ep
    jitted = jax.jit(
        lambda *a: run(
            *a, quantization=quantization, implementation=implementation,
            blocks=fused.jax.Blocks(8, 128) if implementation == "pallas" else None,
        )
    )  # fmt: skip
    got = jitted(*placed)
    err = max_err(got, expected) / max(1.0, float(jnp.max(jnp.abs(expected))))
    return {"ok": err <= 1e-5 and tuple(got.sharding.spec) in ((), (None,), (None, None)),
            "forward_err": err, "out_spec": str(got.sharding.spec)}  # fmt: skip


@check
def fused_experts_ep_16_experts_over_8():
    return {"name": "fused-moe EP E=16 over (8,) ep, Pallas", **_fused_ep_case(mesh((8,), ("ep",)))}


@check
def fused_experts_ep_int8_data_x_ep_2x4():
    m = mesh((2, 4), ("data", "ep"))
    return {
        "name": "fused-moe EP int8, ep of a (2,4) mesh, XLA",
        **_fused_ep_case(m, "int8", "xla"),
    }


@check
def fused_experts_splits_experts_by_use_mesh_rule():
    """On an Auto mesh, ``use_mesh``'s rule ``experts -> model`` makes ``fused_experts`` itself
    expert-parallel (its rule's ``combined`` experts factor; what model-bench's sharded decode
    runs): Pallas, forward."""
    m = mesh((2, 4), ("fsdp", "model"), AxisType.Auto)

    def run(*args, **options):
        with use_mesh(m, {"experts": "model"}):
            return get_kernel("fused-moe").jax.fused_experts(*args, **options)

    return {
        "name": "fused_experts, experts over model of an Auto (2,4) mesh by use_mesh, Pallas",
        **_fused_ep_case(m, axis="model", run=run),
    }


@check
def fused_experts_splits_experts_explicit_2x4():
    """``fused_experts`` with tokens split over ``data`` and weights split by expert over ``ep``
    (Explicit): each shard's experts on its tokens, one psum; forward and gradients (XLA)."""
    fused = get_kernel("fused-moe")
    tokens, hidden, inter, experts, top_k = 16, 128, 128, 8, 2
    rng = np.random.default_rng(41)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    args = [
        rand(1, (tokens, hidden)),
        jnp.asarray(ids.astype(np.int32)),
        jnp.asarray(rng.random((tokens, top_k)).astype(np.float32)),
        rand(2, (experts, 2 * inter, hidden)) / 11,
        rand(3, (experts, hidden, inter)) / 16,
    ]
    return compare(
        "fused_experts, tokens over data x experts over ep (2,4), Explicit, XLA",
        lambda *a: fused.jax.fused_experts(*a, implementation="xla"),
        args,
        [P("data"), P("data"), P("data"), P("ep"), P("ep")],
        mesh((2, 4), ("data", "ep")),
        (0, 2, 3, 4),
        [P("data")],
    )


@check
def fused_experts_ep_refuses_uneven_experts():
    fused = get_kernel("fused-moe")
    m = mesh((8,), ("ep",))
    x = put(m, np.zeros((8, 128), np.float32), P())
    ids = put(m, np.zeros((8, 1), np.int32), P())
    w = put(m, np.ones((8, 1), np.float32), P())
    w1 = put(m, np.zeros((12, 256, 128), np.float32), P())
    w2 = put(m, np.zeros((12, 128, 128), np.float32), P())
    return expect_error(
        "fused-moe EP refuses 12 experts over 8 shards",
        lambda: fused.expert_parallel.fused_experts_ep(x, ids, w, w1, w2),
        ["12 experts", "8 shards"],
    )


# Attention dropout: the mask hashes global (batch, query head) indices; each shard of a batch x
# heads split gets its offsets from the boundary (``located`` factors), so the sharded call draws
# the unsharded call's mask (forward and gradients, Explicit and Auto, the torch backward's entry).
DROPOUT_OPTIONS = dict(
    causal=True, dropout_rate=0.3, implementation="pallas", block_q=16, block_k=16
)
DROPOUT_SPEC = P("data", "model")


def _dropout_attention(q, k, v, seed):
    return get_kernel("dot_product_attention").jax.dot_product_attention(
        q, k, v, dropout_seed=seed, **DROPOUT_OPTIONS
    )


def _dropout_arrays():
    return [*qkv(2, 8, 4, seq=32, dim=16), jnp.int32(1234)]


@check
def dropout_explicit_batch_heads():
    result = compare(
        "attention dropout GQA 8/4, batch x heads over (2,4), Explicit",
        _dropout_attention,
        _dropout_arrays(),
        [DROPOUT_SPEC] * 3 + [P()],
        mesh((2, 4), ("data", "model")),
        (0, 1, 2),
        [DROPOUT_SPEC],
    )
    q, k, v, seed = _dropout_arrays()
    plain = get_kernel("dot_product_attention").jax.dot_product_attention
    undropped = jax.jit(
        lambda q, k, v, seed: (
            _dropout_attention(q, k, v, seed) - plain(q, k, v, causal=True, implementation="pallas")
        )
    )(q, k, v, seed)
    result["dropped"] = float(jnp.max(jnp.abs(undropped)))  # the mask does drop
    result["ok"] = result["ok"] and result["dropped"] > 0.1
    return result


@check
def dropout_auto_batch_heads():
    return auto_compare(
        "attention dropout GQA 8/4, batch x heads over (2,4), Auto",
        _dropout_attention,
        _dropout_arrays(),
        [DROPOUT_SPEC] * 3 + [P()],
        (0, 1, 2),
    )


@check
def dropout_backward_batch_heads():
    """The backward entry point (the torch backward op's) regenerates the same global mask."""
    m = mesh((2, 4), ("data", "model"))
    api = get_kernel("dot_product_attention").jax
    q, k, v, seed = _dropout_arrays()
    out, lse = jax.jit(
        lambda *a: api.dot_product_attention_with_lse(*a[:3], dropout_seed=a[3], **DROPOUT_OPTIONS)
    )(q, k, v, seed)
    d_out, d_lse = rand(14, out.shape), jnp.zeros_like(lse)
    # kv_mask, q/kv segment ids; sinks; q/kv positions, q/kv groups; dropout_seed; saved values
    args = [q, k, v, None, None, None, None, None, None, None, None, seed, out, lse, d_out, d_lse]
    backward = jax.jit(lambda *a: api.attention_backward(*a, **DROPOUT_OPTIONS))
    expected = backward(*args)  # the sharded call's program on one device
    specs = [DROPOUT_SPEC] * 3 + [None] * 8 + [P()] + [DROPOUT_SPEC] * 4
    placed = [
        a if s is None else put(m, np.asarray(a), s) for a, s in zip(args, specs, strict=True)
    ]
    got = backward(*placed)
    err = max_err([g for g in got if g is not None], [e for e in expected if e is not None])
    return {
        "name": "attention_backward dropout, batch x heads over (2,4)",
        "ok": err <= 1e-5,
        "grad_err": err,
    }


def main() -> int:
    only = set(sys.argv[1:])
    for fn in CHECKS:
        if only and fn.__name__ not in only:
            continue
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
    assert ShardingError  # imported for the checks' error types
    sys.exit(main())

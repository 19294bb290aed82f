"""Pallas fused linear + cross-entropy for TPU: the logits exist one [tokens, vocab] tile at a
time.

Forward, grid (token blocks, vocab blocks), vocab innermost: each step multiplies a token block of
the hidden states by a vocabulary block of the head weight (whole hidden dimension in VMEM, f32
accumulation), applies the logit form and folds the tile into an online log-sum-exp, the target's
logit and the sum of logits. Only those three per-token statistics reach HBM.

Backward, from the statistics' cotangents (``dz = g_lse * softmax + g_target * onehot + g_sum``):
one kernel, grid (vocab blocks, token blocks), tokens innermost, recomputes each tile once and
feeds both gradient products from it. The running ``dW`` (and bias gradient) block stays in VMEM
while the tokens stream past; ``dh = dz @ W`` is accumulated over the vocabulary blocks in an f32
[tokens, hidden] array in HBM (read, added to and written back once per vocabulary block; Pallas
TPU has no atomic adds, so one of the two gradients must travel). Three [tokens, vocab, hidden]
matmuls in the backward, one in the forward: four in all, the floor when only per-token
statistics are kept (the backward needs each logit again before it can form ``dz``).

Bytes: the backward's vocabulary block sets how often the hidden states and the f32 dh travel
(once per vocabulary block each: ``vocab / block_vocab x tokens x hidden x (2 + 4 + 4)`` bytes,
whatever the token block), and the forward's token block how often the head does. Both are as
large as VMEM allows: blocks indexed by the outer grid axis alone (the backward's W and dW blocks,
the forward's h block) are single-buffered (``pl.Buffered(1)``: one fetch or write-back per outer
step, waited for), the backward sweeps its weight block in vocabulary chunks (so its tiles are
[tokens, chunk], not [tokens, block_vocab]), and the per-token values travel as one [tokens, w]
array each way (a [tokens, w <= 128] block takes a 128-lane row per token whatever w is). On
v5e/v6e (128 MiB of VMEM) that is 3,072 vocabulary rows beside a 4,096-wide hidden.

Ragged edges (tokens or vocabulary not a multiple of the block) are masked in the kernels, so
the weight is never padded (a copy of a 152k x 4096 head would be 1.2 GiB).

Mosaic unrolls a kernel body into straight-line vector code, so a big block's tile costs compile
time and program size in proportion to its size. The forward therefore runs its token block in
``fori_loop`` chunks of rows (rows are independent) and, within each, its vocabulary block in
chunks of rows of W (the online statistics fold any split of the vocabulary), and the backward
its vocabulary block in chunks of rows of W (each logit needs only its token's saved
log-sum-exp) and, within each, its two gradient products in chunks of hidden columns (columns are
independent). The same products as one whole-block step, with the same blocks and DMAs: only the
loop body is compiled once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel_hub.kernel_api import tiling

from .reference import LogitForm, accumulation_dtype, transform

DEFAULT_BUDGET_BYTES = 40 << 20
"""What the default blocks may use off TPU (interpret mode: the blocks need only be legal)."""
_RESERVE_BYTES = 4 << 20
"""VMEM left to Mosaic's own scratch: the blocks may plan the generation's VMEM less this (124
MiB on v5e/v6e, 60 on v5p, 12 on v4), and the compiler limit is their estimate plus this."""
_BLOCKS = (
    *((256, rows) for rows in range(8192, 0, -512)),
    (128, 512),
    (128, 256),
    (64, 256),
    (64, 128),
)
"""Default backward (tokens, vocab) blocks, largest vocabulary first: the hidden states and the
f32 dh travel once per vocabulary block, whatever the token block (3,072 rows at H 4096 fill v5e
and v6e's VMEM with the resident weight and dW blocks). 256 tokens fill the v6e MXU's
contraction for dW."""
_FORWARD_TOKENS = (4096, 2048, 1024, 512, 256, 128, 64)
"""Default forward token blocks, largest first: the forward re-reads the head once per block."""


@dataclass(frozen=True)
class BlockConfig:
    """Tokens and vocabulary rows per grid step: multiples of the tile (8/16 tokens, 128
    vocabulary rows), or the whole axis. ``forward_block_tokens`` is the forward's token block
    (``block_tokens`` when None); the backward uses ``block_tokens``, both ``block_vocab``."""

    block_tokens: int
    block_vocab: int
    forward_block_tokens: int | None = None

    @property
    def forward_tokens(self) -> int:
        return self.forward_block_tokens or self.block_tokens


def forward_vmem_bytes(
    tokens_block: int, vocab_block: int, hidden: int, itemsize: int, acc_itemsize: int = 4
) -> int:
    """The forward's VMEM: the h block (single-buffered: it changes with the outer axis only),
    double-buffered W blocks, four f32 tiles of one row chunk by one vocabulary chunk, and three
    per-token blocks (the running statistics, the statistics out, the targets)."""
    rows = _chunk(tokens_block, _ROW_CHUNK)
    return (
        (tokens_block + 2 * vocab_block) * hidden * itemsize
        + 4 * rows * _chunk(vocab_block, _VOCAB_CHUNK) * acc_itemsize
        + 3 * _column_bytes(tokens_block, acc_itemsize)
    )


def backward_vmem_bytes(
    tokens_block: int, vocab_block: int, hidden: int, itemsize: int, acc_itemsize: int = 4
) -> int:
    """The backward's VMEM: double-buffered h blocks, the W block and the dW output block
    (single-buffered: they change with the outer axis only), the resident f32 dW block, the f32
    dh block in and out (double-buffered), four f32 tiles of one vocabulary chunk and two
    double-buffered per-token blocks (targets; log-sum-exp and cotangents)."""
    inputs = (2 * tokens_block + vocab_block) * hidden * itemsize
    dh = 4 * tokens_block * hidden * acc_itemsize
    dw = vocab_block * hidden * (acc_itemsize + itemsize)
    tiles = 4 * tokens_block * _chunk(vocab_block, _VOCAB_CHUNK) * acc_itemsize
    return inputs + dh + dw + tiles + 4 * _column_bytes(tokens_block, acc_itemsize)


def _column_bytes(tokens_block: int, acc_itemsize: int) -> int:
    """VMEM of a [tokens, width <= 128] block: each token's row takes a whole 128-lane row."""
    return tokens_block * 128 * acc_itemsize


def vmem_bytes(config: BlockConfig, hidden: int, itemsize: int, acc_itemsize: int = 4) -> int:
    """Largest VMEM footprint of the two kernels (double-buffered blocks + accumulators)."""
    return max(
        forward_vmem_bytes(
            config.forward_tokens, config.block_vocab, hidden, itemsize, acc_itemsize
        ),
        backward_vmem_bytes(
            config.block_tokens, config.block_vocab, hidden, itemsize, acc_itemsize
        ),
    )


def budget(generation: str | None) -> int:
    if generation is None:  # not on a TPU (interpret mode): the blocks need only be legal
        return DEFAULT_BUDGET_BYTES
    return tiling.vmem_budget(generation, reserve=_RESERVE_BYTES)


def default_config(
    tokens: int, vocab: int, hidden: int, dtype, generation: str | None = None
) -> BlockConfig:
    """The largest default blocks that fit the generation's VMEM budget (whole axes when
    smaller): the largest vocabulary block (with its token block) both kernels fit, then the
    largest forward token block with that vocabulary block."""
    itemsize = jnp.dtype(dtype).itemsize
    acc = accumulation_dtype(dtype).itemsize
    limit = budget(generation)
    bn, bv = _BLOCKS[-1]
    for bn, bv in _BLOCKS:  # both kernels at this pair (the forward's token block at its least)
        pair = BlockConfig(min(bn, tokens), min(bv, vocab))
        if vmem_bytes(pair, hidden, itemsize, acc) <= limit:
            break
    bn, bv = min(bn, tokens), min(bv, vocab)
    forward = next(
        (
            min(fbn, tokens)
            for fbn in _FORWARD_TOKENS
            if fbn >= bn
            and forward_vmem_bytes(min(fbn, tokens), bv, hidden, itemsize, acc) <= limit
        ),
        bn,
    )
    return BlockConfig(bn, bv, forward)


def config_problem(tokens: int, vocab: int, dtype, config: BlockConfig) -> str | None:
    """Why a block config is illegal for TPU tiling, or None."""
    bn, bv = config.block_tokens, config.block_vocab
    problems = [
        problem
        for problem in (
            tiling.row_block_problem(tokens, bn, dtype, name="block_tokens", axis="tokens"),
            tiling.row_block_problem(
                tokens, config.forward_tokens, dtype, name="forward_block_tokens", axis="tokens"
            ),
        )
        if problem is not None
    ]
    if not (bv == vocab or (bv > 0 and bv % 128 == 0)):
        problems.append(f"block_vocab={bv} must equal vocab ({vocab}) or be a multiple of 128")
    return "; ".join(problems) or None


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def _dot(a, b, contract_a: int, contract_b: int, acc):
    return jax.lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        preferred_element_type=acc,
        precision=_precision(a.dtype),
    )


@dataclass(frozen=True)
class _Shape:
    """Static facts every kernel body needs."""

    tokens: int
    vocab: int
    block_tokens: int
    block_vocab: int
    form: LogitForm
    has_bias: bool

    @property
    def ragged_tokens(self) -> bool:
        return self.tokens % self.block_tokens != 0

    @property
    def ragged_vocab(self) -> bool:
        return self.vocab % self.block_vocab != 0


def _rows_inside(ti, shape: _Shape):
    row = ti * shape.block_tokens + jax.lax.broadcasted_iota(jnp.int32, (shape.block_tokens, 1), 0)
    return row < shape.tokens


def _masked(block, inside):
    """Zero the rows of a block past the end of its array (they hold garbage, maybe NaN)."""
    return jnp.where(inside, block, jnp.zeros_like(block))


def _tile(h, w, bias, first, shape: _Shape, acc):
    """(z, columns, column inside vocab) of the tile of vocabulary rows ``first`` onwards (as many
    as ``w`` has); z is the transformed logits in ``acc``, ``bias`` that tile's bias or None."""
    logits = _dot(h, w, 1, 1, acc)
    if bias is not None:
        logits = logits + bias.astype(acc)
    columns = first + jax.lax.broadcasted_iota(jnp.int32, (1, w.shape[0]), 1)
    return transform(logits, shape.form), columns, columns < shape.vocab


def _weight_block(w_ref, first, shape: _Shape, rows=slice(None), columns=slice(None)):
    """``w_ref[rows, columns]``, the vocabulary rows from ``first`` on, zeroed past the vocab."""
    w = w_ref[rows, columns]
    if shape.ragged_vocab:
        row = first + jax.lax.broadcasted_iota(jnp.int32, (w.shape[0], 1), 0)
        w = _masked(w, row < shape.vocab)
    return w


def _hidden_block(h_ref, ti, shape: _Shape, columns=slice(None)):
    h = h_ref[:, columns]
    return _masked(h, _rows_inside(ti, shape)) if shape.ragged_tokens else h


_ROW_CHUNK = 256
"""Token rows of one forward chunk: a [chunk, vocab block] tile is what the loop body compiles."""
_COLUMN_CHUNK = 512
"""Hidden columns of one chunk of the backward's two gradient products."""
_VOCAB_CHUNK = 512
"""Vocabulary rows of one tile, forward and backward: the weight block is swept in such chunks
(the forward's online statistics fold the chunks in turn; in the backward each logit needs only
its row's saved log-sum-exp). A whole-block forward tile ([256, 3072] at H 4096 on v5e/v6e)
unrolled into four times the code (v5e, llama3-8b-head-2k: 3.2 MB, chunked 0.8 MB)."""


def _chunk(size: int, chunk: int) -> int:
    """The chunk ``_chunked`` takes: ``chunk`` when it splits ``size`` evenly, else ``size``."""
    return chunk if size > chunk and size % chunk == 0 else size


def _chunked(size: int, chunk: int, body) -> None:
    """``body(pl.ds(start, chunk))`` over ``size`` in a ``fori_loop`` (compiled once, not
    unrolled), or ``body(pl.ds(0, size))`` once when ``chunk`` does not split it evenly."""
    chunk = _chunk(size, chunk)
    if chunk == size:
        body(pl.ds(0, size))
        return

    def step(i, carry):
        body(pl.ds(pl.multiple_of(i * chunk, chunk), chunk))
        return carry

    jax.lax.fori_loop(0, size // chunk, step, None)


def _forward_kernel(*refs, shape: _Shape):
    if shape.has_bias:
        h_ref, w_ref, b_ref, t_ref, stats_ref, run_sc = refs
    else:
        h_ref, w_ref, t_ref, stats_ref, run_sc = refs
        b_ref = None
    vi = pl.program_id(1)
    acc = run_sc.dtype
    first = vi * shape.block_vocab
    # run_sc's columns: running max, running sum of exponentials, target logit, sum of logits.
    peak, sum_exp, target, total = (slice(i, i + 1) for i in range(4))

    @pl.when(vi == 0)
    def _init():
        run_sc[:, peak] = jnp.full((shape.block_tokens, 1), -jnp.inf, acc)
        run_sc[:, 1:] = jnp.zeros((shape.block_tokens, 3), acc)

    def tile(r, v):  # rows r of the token block against vocabulary rows v of the weight block
        bias = None if b_ref is None else b_ref[:, v]
        z, columns, inside = _tile(h_ref[r, :], w_ref[v, :], bias, first + v.start, shape, acc)
        z_in = jnp.where(inside, z, -jnp.inf)
        m_prev = run_sc[r, peak]
        m_new = jnp.maximum(m_prev, jnp.max(z_in, axis=1, keepdims=True))
        run_sc[r, sum_exp] = run_sc[r, sum_exp] * jnp.exp(m_prev - m_new) + jnp.sum(
            jnp.exp(z_in - m_new), axis=1, keepdims=True
        )
        run_sc[r, peak] = m_new
        picked = jnp.where(columns == t_ref[r, :], z, 0.0)
        run_sc[r, target] += jnp.sum(picked, axis=1, keepdims=True)
        run_sc[r, total] += jnp.sum(jnp.where(inside, z, 0.0), axis=1, keepdims=True)

    def rows(r):  # rows are independent; the statistics fold vocabulary chunks in online
        _chunked(shape.block_vocab, _VOCAB_CHUNK, lambda v: tile(r, v))

    _chunked(shape.block_tokens, _ROW_CHUNK, rows)

    @pl.when(vi == pl.num_programs(1) - 1)
    def _finish():  # stats' columns: log-sum-exp, target logit, sum of logits
        stats_ref[:, 0:1] = run_sc[:, peak] + jnp.log(run_sc[:, sum_exp])
        stats_ref[:, 1:3] = run_sc[:, 2:4]


def _dz(h, w, bias, t_ref, rows_ref, ti, first, shape: _Shape, acc):
    """Gradient of the loss with respect to the raw logits of one tile (zero outside)."""
    z, columns, inside = _tile(h, w, bias, first, shape, acc)
    rows = rows_ref[...]  # [bn, 4]: lse, and the cotangents of lse, target logit, sum of logits
    p = jnp.exp(z - rows[:, 0:1])
    dz = rows[:, 1:2] * p + jnp.where(columns == t_ref[...], rows[:, 2:3], 0.0) + rows[:, 3:4]
    form = shape.form
    if form.softcap is not None:
        capped = z / form.softcap
        dz = dz * (1.0 - capped * capped)
    if form.scale != 1.0:
        dz = dz * form.scale
    # Masked last: columns past the vocabulary and rows past the tokens hold garbage (maybe NaN).
    if shape.ragged_tokens:
        inside = inside & _rows_inside(ti, shape)
    return jnp.where(inside, dz, 0.0)


def _backward_kernel(*refs, shape: _Shape, in_place: bool):
    if shape.has_bias:
        (h_ref, w_ref, b_ref, t_ref, rows_ref, dh_in_ref) = refs[:6]
        dh_ref, dw_ref, db_ref, acc_sc, bias_sc = refs[6:]
    else:
        h_ref, w_ref, t_ref, rows_ref, dh_in_ref, dh_ref, dw_ref, acc_sc = refs
        b_ref = db_ref = bias_sc = None
    vi, ti = pl.program_id(0), pl.program_id(1)
    hidden_dim = h_ref.shape[1]

    @pl.when(ti == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, acc_sc.dtype)
        if shape.has_bias:
            bias_sc[...] = jnp.zeros(bias_sc.shape, bias_sc.dtype)

    if in_place:
        # One token block (the dh block never leaves VMEM), or the generic interpreter (which
        # loads output blocks from the output array): dh accumulates in its output block.
        @pl.when(vi == 0)
        def _first():
            dh_ref[...] = jnp.zeros(dh_ref.shape, dh_ref.dtype)

    else:  # dh_in aliases dh: the block as the previous vocabulary block left it

        def carry_in(c):
            dh_ref[:, c] = dh_in_ref[:, c]

        _chunked(hidden_dim, _COLUMN_CHUNK, carry_in)

    def vocab_rows(r):  # one chunk of the resident weight block: its logits, dz and products
        first = vi * shape.block_vocab + r.start
        bias = None if b_ref is None else b_ref[:, r]
        h = _hidden_block(h_ref, ti, shape)
        w = _weight_block(w_ref, first, shape, r)
        dz_acc = _dz(h, w, bias, t_ref, rows_ref, ti, first, shape, acc_sc.dtype)
        dz = dz_acc.astype(h.dtype)  # both products share the one recomputed tile
        if shape.has_bias:
            bias_sc[:, r] += jnp.sum(dz_acc, axis=0, keepdims=True)

        def columns(c):  # both products column by column of hidden: each column is independent
            acc_sc[r, c] += _dot(dz, _hidden_block(h_ref, ti, shape, c), 0, 0, acc_sc.dtype)
            w_c = _weight_block(w_ref, first, shape, r, c)
            dh_ref[:, c] += _dot(dz, w_c, 1, 0, dh_ref.dtype)

        _chunked(hidden_dim, _COLUMN_CHUNK, columns)

    _chunked(shape.block_vocab, _VOCAB_CHUNK, vocab_rows)

    @pl.when(ti == pl.num_programs(1) - 1)
    def _finish():
        dw_ref[...] = acc_sc[...].astype(dw_ref.dtype)
        if shape.has_bias:
            db_ref[...] = bias_sc[...].astype(db_ref.dtype)


def _params(semantics, need: int) -> pltpu.CompilerParams:
    """Mosaic's VMEM limit: the blocks' estimate plus the reserve ``budget`` keeps for Mosaic's
    own scratch (so at most the generation's VMEM when the blocks fit the budget)."""
    return pltpu.CompilerParams(
        dimension_semantics=semantics, vmem_limit_bytes=max(16 << 20, need + _RESERVE_BYTES)
    )


def _shape(hidden, weight, bias, block_tokens: int, block_vocab: int, form: LogitForm) -> _Shape:
    return _Shape(
        hidden.shape[0], weight.shape[0], block_tokens, block_vocab, form, bias is not None
    )


def _nbytes(array) -> int:
    return 0 if array is None else array.size * array.dtype.itemsize


def _reads(outer_blocks: int, inner_blocks: int) -> int:
    """How often an operand blocked along the inner grid axis is read: once per outer step, or
    once in all when the inner axis is one block (Pallas skips fetching an unchanged block)."""
    return outer_blocks if inner_blocks > 1 else 1


def _cost(shape: _Shape, hidden_dim: int, matmuls: int, transcendentals: int, bytes_accessed: int):
    """``matmuls`` [tokens, vocab, hidden] products over whole blocks (ragged edges run as whole
    blocks on the MXU); the elementwise work is not counted (a few ops per logit vs 2 * hidden)."""
    token_blocks = pl.cdiv(shape.tokens, shape.block_tokens)
    vocab_blocks = pl.cdiv(shape.vocab, shape.block_vocab)
    padded = token_blocks * shape.block_tokens * vocab_blocks * shape.block_vocab
    return pl.CostEstimate(
        flops=2 * matmuls * padded * hidden_dim,
        transcendentals=transcendentals * shape.tokens * shape.vocab,
        bytes_accessed=bytes_accessed,
    )


def _exps(form: LogitForm) -> int:
    """Transcendentals per logit of one pass: the exponential, and tanh when soft-capping."""
    return 1 + (form.softcap is not None)


def _operand_specs(shape: _Shape, hidden_dim: int, token_axis: int, vocab_axis: int):
    """BlockSpecs of h, W, bias, targets and per-token arrays for a grid whose token and vocab
    indices are at positions ``token_axis`` / ``vocab_axis``.

    A block indexed by the outer grid axis (0) stays put while the inner axis sweeps, so it is
    single-buffered (``pl.Buffered(1)``): one VMEM copy, not two, and one fetch (or write-back)
    per outer step that the pipeline waits for instead of overlapping."""

    def spec(block, axis: int, index):
        mode = pl.Buffered(1) if axis == 0 else None
        return pl.BlockSpec(block, lambda *ids: index(ids[axis]), pipeline_mode=mode)

    bn, bv = shape.block_tokens, shape.block_vocab
    h = spec((bn, hidden_dim), token_axis, lambda t: (t, 0))
    w = spec((bv, hidden_dim), vocab_axis, lambda v: (v, 0))
    b = spec((1, bv), vocab_axis, lambda v: (0, v))

    def per_token(width: int = 1):
        return spec((bn, width), token_axis, lambda t: (t, 0))

    return h, w, b, per_token


def forward(hidden, weight, bias, targets, form: LogitForm, config: BlockConfig, interpret: bool):
    """(lse, target logit, sum of logits), each [tokens] in the accumulation dtype."""
    tokens, hidden_dim = hidden.shape
    vocab = weight.shape[0]
    shape = _shape(hidden, weight, bias, config.forward_tokens, config.block_vocab, form)
    acc = accumulation_dtype(hidden.dtype)
    grid = (pl.cdiv(tokens, shape.block_tokens), pl.cdiv(vocab, shape.block_vocab))
    h, w, b, per_token = _operand_specs(shape, hidden_dim, 0, 1)
    operands = (hidden, weight, *(() if bias is None else (bias.reshape(1, vocab),)))
    need = forward_vmem_bytes(
        shape.block_tokens, shape.block_vocab, hidden_dim, hidden.dtype.itemsize, acc.itemsize
    )
    stats = pl.pallas_call(
        functools.partial(_forward_kernel, shape=shape),
        grid=grid,
        in_specs=[h, w, *([b] if bias is not None else []), per_token()],
        out_specs=per_token(3),
        out_shape=jax.ShapeDtypeStruct((tokens, 3), acc),
        scratch_shapes=[pltpu.VMEM((shape.block_tokens, 4), acc)],
        compiler_params=_params(("parallel", "arbitrary"), need),
        cost_estimate=_cost(
            shape,
            hidden_dim,
            matmuls=1,
            transcendentals=_exps(form),
            bytes_accessed=_nbytes(hidden)
            + _reads(*grid) * (_nbytes(weight) + _nbytes(bias))
            + _nbytes(targets)
            + 3 * tokens * acc.itemsize,
        ),
        interpret=interpret,
        name="linear_cross_entropy_forward",
    )(*operands, targets.reshape(tokens, 1))
    return stats[:, 0], stats[:, 1], stats[:, 2]


def backward_token_block(tokens: int, block_tokens: int, dtype) -> int:
    """The backward's token block: ``block_tokens``, unless that makes exactly two blocks.

    Each dh block is read back (prefetched) ``token_blocks - 1`` grid steps after the previous
    vocabulary block's write of it began, and the pipeline waits for an output copy one step
    after starting it: with two token blocks the read could overtake the write. Two blocks become
    three or more (a quarter of the tokens, rounded up to the sublane tile), else one.
    """
    if pl.cdiv(tokens, block_tokens) != 2:
        return block_tokens
    multiple = tiling.sublane_multiple(dtype)
    smaller = pl.cdiv(pl.cdiv(tokens, 4), multiple) * multiple
    return smaller if pl.cdiv(tokens, smaller) >= 3 else tokens


def backward(
    hidden, weight, bias, targets, lse, cotangents, form, config: BlockConfig, interpret: bool
):
    """(dh, dW, db or None) from the cotangents [tokens, 3] of (lse, target logit, sum).

    One pass over a (vocab blocks, token blocks) grid: three matmuls per tile (the logits again,
    dz @ W and dz^T @ h). dW and db stay in VMEM over the token sweep; dh is an f32 array in
    HBM that each vocabulary block reads and writes back (an input aliased to the output).
    """
    tokens, hidden_dim = hidden.shape
    vocab = weight.shape[0]
    block_tokens = backward_token_block(tokens, config.block_tokens, hidden.dtype)
    shape = _shape(hidden, weight, bias, block_tokens, config.block_vocab, form)
    acc = accumulation_dtype(hidden.dtype)
    token_blocks = pl.cdiv(tokens, shape.block_tokens)
    vocab_blocks = pl.cdiv(vocab, shape.block_vocab)
    with_bias = bias is not None
    # One [tokens, 4] array for the log-sum-exp and the cotangents: in HBM and VMEM a
    # [tokens, width <= 128] array takes a 128-lane row per token, whatever its width.
    side = (
        targets.reshape(tokens, 1),
        jnp.concatenate([lse.reshape(tokens, 1), cotangents], axis=1).astype(acc),
    )
    # Whole blocks (the TPU interpreter cannot alias a ragged output); sliced off below.
    dh_acc = jnp.zeros((token_blocks * shape.block_tokens, hidden_dim), acc)
    operands = (
        hidden,
        weight,
        *(() if bias is None else (bias.reshape(1, vocab),)),
        *side,
        dh_acc,
    )
    h, w, b, per_token = _operand_specs(shape, hidden_dim, 1, 0)
    out_shape = [dh_acc, jax.ShapeDtypeStruct(weight.shape, weight.dtype)]
    scratch = [pltpu.VMEM((shape.block_vocab, hidden_dim), acc)]
    if with_bias:
        out_shape.append(jax.ShapeDtypeStruct((1, vocab), bias.dtype))
        scratch.append(pltpu.VMEM((1, shape.block_vocab), acc))
    # Per-token operands, the hidden states and dh travel once per vocabulary block (once in
    # all when there is one token block); the head and its gradients once.
    per_sweep = _reads(vocab_blocks, token_blocks)
    # Off TPU, the TPU interpreter: it models the aliased dh as one HBM buffer and output blocks
    # that start unread, as Mosaic runs them. It has no float64, which takes the generic one.
    tpu_interpreter = interpret and acc != jnp.float64
    in_place = token_blocks == 1 or (interpret and not tpu_interpreter)
    weights = _nbytes(weight) + _nbytes(bias)
    need = backward_vmem_bytes(
        shape.block_tokens, shape.block_vocab, hidden_dim, hidden.dtype.itemsize, acc.itemsize
    )
    grads = pl.pallas_call(
        functools.partial(_backward_kernel, shape=shape, in_place=in_place),
        grid=(vocab_blocks, token_blocks),
        in_specs=[h, w, *([b] if with_bias else []), per_token(), per_token(4), h],  # dh as h
        out_specs=[h, w, b][: len(out_shape)],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_shape],
        scratch_shapes=scratch,
        input_output_aliases={len(operands) - 1: 0},
        compiler_params=_params(("arbitrary", "arbitrary"), need),
        cost_estimate=_cost(
            shape,
            hidden_dim,
            matmuls=3,
            transcendentals=_exps(form),
            bytes_accessed=2 * weights  # read, and dW (db) written
            + per_sweep * (_nbytes(hidden) + sum(_nbytes(a) for a in side) + 2 * _nbytes(dh_acc)),
        ),
        interpret=pltpu.InterpretParams() if tpu_interpreter else interpret,
        name="linear_cross_entropy_backward",
    )(*operands)
    dbias = grads[2].reshape(vocab) if with_bias else None
    return grads[0][:tokens].astype(hidden.dtype), grads[1], dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def token_statistics(hidden, weight, bias, targets, form: LogitForm, config, interpret: bool):
    """``reference.token_statistics`` blockwise, with a backward that recomputes the tiles."""
    return forward(hidden, weight, bias, targets, form, config, interpret)


def _statistics_fwd(hidden, weight, bias, targets, form, config, interpret):
    stats = forward(hidden, weight, bias, targets, form, config, interpret)
    return stats, (hidden, weight, bias, targets, stats[0])


def _statistics_bwd(form, config, interpret, residuals, cotangents):
    hidden, weight, bias, targets, lse = residuals
    g = jnp.stack([c.astype(lse.dtype) for c in cotangents], axis=1)
    dh, dw, db = backward(hidden, weight, bias, targets, lse, g, form, config, interpret)
    return dh, dw, db, None


token_statistics.defvjp(_statistics_fwd, _statistics_bwd)

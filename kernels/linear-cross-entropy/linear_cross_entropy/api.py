"""Public JAX API: ``linear_cross_entropy`` (the loss) and ``token_statistics`` (its logits part,
dispatched through an implementation table: pallas, xla), with input checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernel_hub.kernel_api import (
    FLOATS_AND_F64,
    Einsum,
    SavedBackward,
    ShardingRule,
    check_dtype,
    check_int32_values,
    check_rank,
    dtype_name,
    float64_problem,
    jax_default_device,
    jax_platform,
    op,
    pallas_and_xla,
    require,
    sharded,
    tpu_generation,
)

from . import pallas_tpu, reference, sharding, xla_chunked
from .reference import REDUCTIONS, LogitForm

OP = "linear_cross_entropy"
PLAIN = LogitForm()
_INTEGERS = ("int32", "int64", "uint32", "int16", "int8", "uint8")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_inputs(
    hidden,
    weight,
    labels,
    bias=None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> None:
    """Shape, dtype and option rules shared by the JAX function and the torch op."""
    require(
        reduction in REDUCTIONS,
        f"{OP}: reduction={reduction!r}; valid: {', '.join(REDUCTIONS)}",
    )
    require(
        isinstance(ignore_index, int) and not isinstance(ignore_index, bool),
        f"{OP}: ignore_index={ignore_index!r}; it must be an int (Transformers uses -100)",
    )
    require(
        _number(label_smoothing) and 0.0 <= label_smoothing <= 1.0,
        f"{OP}: label_smoothing={label_smoothing!r}; it must be a number in [0, 1]",
    )
    require(
        _number(logit_scale) and logit_scale > 0,
        f"{OP}: logit_scale={logit_scale!r}; it must be a positive number",
    )
    require(
        softcap is None or (_number(softcap) and softcap > 0),
        f"{OP}: softcap={softcap!r}; it must be None or a positive number",
    )
    require(
        _number(z_loss) and z_loss >= 0,
        f"{OP}: z_loss={z_loss!r}; it must be a number >= 0",
    )
    check_rank(OP, "hidden", hidden, 2)
    check_rank(OP, "weight", weight, 2)
    check_rank(OP, "labels", labels, 1)
    check_dtype(OP, "hidden", hidden, FLOATS_AND_F64)
    check_dtype(OP, "weight", weight, FLOATS_AND_F64)
    check_dtype(OP, "labels", labels, _INTEGERS)
    require(
        hidden.dtype == weight.dtype,
        f"{OP}: hidden is {dtype_name(hidden.dtype)} but weight is {dtype_name(weight.dtype)}; "
        "they must match "
        "(cast hidden to the head's dtype, as nn.Linear requires)",
    )
    require(
        weight.shape[1] == hidden.shape[1],
        f"{OP}: weight has shape {tuple(weight.shape)} but hidden's size is {hidden.shape[1]}; "
        f"weight must be [vocab, {hidden.shape[1]}]",
    )
    require(
        labels.shape[0] == hidden.shape[0],
        f"{OP}: labels has {labels.shape[0]} entries for {hidden.shape[0]} tokens; one label per "
        "token (shift the labels before calling)",
    )
    if bias is not None:
        check_rank(OP, "bias", bias, 1)
        check_dtype(OP, "bias", bias, FLOATS_AND_F64)
        require(
            bias.shape[0] == weight.shape[0],
            f"{OP}: bias has shape {tuple(bias.shape)}; it must be ({weight.shape[0]},)",
        )


def _generation() -> str | None:
    return tpu_generation(jax_default_device()) if jax_platform() == "tpu" else None


def _config(hidden, weight, block_tokens, block_vocab) -> pallas_tpu.BlockConfig:
    default = pallas_tpu.default_config(
        hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.dtype, _generation()
    )
    if block_tokens or block_vocab:  # an explicit block: the forward takes the same token block
        return pallas_tpu.BlockConfig(
            block_tokens or default.block_tokens, block_vocab or default.block_vocab
        )
    return default


def _pallas(hidden, weight, bias, targets, *, form, block_tokens, block_vocab):
    config = _config(hidden, weight, block_tokens, block_vocab)
    interpret = jax_platform() == "cpu"
    return pallas_tpu.token_statistics(hidden, weight, bias, targets, form, config, interpret)


def _pallas_problem(hidden, weight, bias, targets, *, form, block_tokens, block_vocab):
    if problem := float64_problem(hidden):
        return problem
    config = _config(hidden, weight, block_tokens, block_vocab)
    problem = pallas_tpu.config_problem(hidden.shape[0], weight.shape[0], hidden.dtype, config)
    generation = _generation()
    need = pallas_tpu.vmem_bytes(config, hidden.shape[1], hidden.dtype.itemsize)
    if problem is None and generation is not None and need > pallas_tpu.budget(generation):
        problem = (
            f"blocks {config.block_tokens} x {config.block_vocab} with the whole hidden size "
            f"({hidden.shape[1]}) need {need >> 20} MiB of VMEM, over {generation}'s "
            f"{pallas_tpu.budget(generation) >> 20} MiB budget"
        )
    return problem


def _xla(hidden, weight, bias, targets, *, form, block_tokens, block_vocab):
    return xla_chunked.token_statistics(
        hidden, weight, bias, targets, form, block_vocab or xla_chunked.CHUNK
    )


TABLE = pallas_and_xla("token_statistics", _pallas, _xla, _pallas_problem)


# Sharding: tokens split freely (data parallel, the ``batch`` factor), the LM head
# vocabulary-parallel (``vocab``, ``combined``): each shard computes its block's log-sum-exp,
# target logit (only the shard owning the label picks one) and logit sum, and
# ``sharding.combine_vocab_shards`` merges them exactly. Only [tokens] vectors cross chips, never
# the weight; the backward is the shard_map's transpose (hidden's gradient summed over the
# vocabulary shards, the head's local).
@sharded(
    ShardingRule.parse(
        "token_statistics",
        "batch hidden, vocab hidden, vocab, batch -> batch, batch, batch",
        whole=("hidden",),
        combined=("vocab",),
    )
)
def token_statistics(
    hidden: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    targets: jax.Array,
    *,
    form: LogitForm = PLAIN,
    implementation: str | None = None,
    block_tokens: int | None = None,
    block_vocab: int | None = None,
    split_axes: dict[str, tuple[str, ...]] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: (log-sum-exp, target logit, sum of logits) of ``form(hidden @ weight.T + bias)``.

    ``targets`` [tokens] int32; -1 picks nothing. Differentiable in hidden, weight and bias.
    ``split_axes`` (set by the sharding boundary, see ``sharding``): inside a shard_map, weight
    and bias are this shard's block of a vocabulary split over ``split_axes["vocab"]``.
    """
    axes = sharding.vocab_axes(split_axes)
    if axes:
        targets = sharding.local_targets(targets, weight.shape[0], axes)
    stats = TABLE(
        hidden,
        weight,
        bias,
        targets,
        form=form,
        block_tokens=block_tokens,
        block_vocab=block_vocab,
        implementation=implementation,
    )
    return sharding.combine_vocab_shards(*stats, axes) if axes else stats


def _loss_rule(reduction: str = "mean", **_) -> Einsum:
    """The loss: per-token results keep the token split; a sum or mean over split tokens is
    combined by the function (a mean is the total over the count, both summed over shards)."""
    per_token = reduction == "none"
    return Einsum(
        "batch hidden, vocab hidden, batch, vocab -> " + ("batch" if per_token else ""),
        whole=("hidden",),
        combined=("vocab",) if per_token else ("vocab", "batch"),
    )


def check_label_values(labels, weight, ignore_index: int = -100) -> None:
    """On every call where the labels can be read (``host_values``): each in [0, vocab) or
    ``ignore_index``, as torch's cross_entropy requires (the kernels would give a NaN loss, or
    wrap an int64 label into another id)."""
    vocab = weight.shape[0]
    values = check_int32_values(OP, "labels", labels)
    if values is None:
        return
    bad = values[(values != ignore_index) & ((values < 0) | (values >= vocab))]
    if bad.size:
        require(
            False,
            f"{OP}: labels holds {int(bad[0])}; each label must be in [0, {vocab}) (the "
            f"vocabulary of weight) or ignore_index ({ignore_index})",
        )


def _targets_and_form(labels, ignore_index: int, logit_scale: float, softcap: float | None):
    """(labels as int32, the kernels' targets: ``NO_TARGET`` where ignored, the logit form)."""
    labels = labels.astype(jnp.int32)
    targets = jnp.where(labels == ignore_index, reference.NO_TARGET, labels)
    return (
        labels,
        targets,
        LogitForm(float(logit_scale), None if softcap is None else float(softcap)),
    )


def _loss_and_lse(
    hidden, weight, labels, bias, *, ignore_index, reduction, label_smoothing, logit_scale,
    softcap, z_loss, implementation, block_tokens, block_vocab, split_axes,
):  # fmt: skip
    """(the loss, the log-sum-exp of each token's logits over the whole vocabulary)."""
    labels, targets, form = _targets_and_form(labels, ignore_index, logit_scale, softcap)
    lse, target, total = token_statistics(
        hidden,
        weight,
        bias,
        targets,
        form=form,
        implementation=implementation,
        block_tokens=block_tokens,
        block_vocab=block_vocab,
        split_axes=split_axes,
    )
    vocab_axes = sharding.vocab_axes(split_axes)
    vocab_shards = jax.lax.axis_size(vocab_axes) if vocab_axes else 1
    loss = reference.loss_from_statistics(
        lse,
        target,
        total,
        labels,
        weight.shape[0] * vocab_shards,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        token_axes=sharding.token_axes(split_axes),
    )
    return loss, lse


_OP_OPTIONS = {
    "check": check_inputs,
    "check_values": check_label_values,
    "differentiable": ("hidden", "weight", "bias"),
    "jax_only": ("block_tokens", "block_vocab", "split_axes"),
    "autocast": ("hidden", "weight", "bias"),
}


@op(sharding=_loss_rule, **_OP_OPTIONS)
def linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    bias: jax.Array | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    implementation: str | None = None,
    block_tokens: int | None = None,
    block_vocab: int | None = None,
    split_axes: dict[str, tuple[str, ...]] | None = None,
) -> jax.Array:
    """Cross-entropy of ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)``
    against ``labels`` without materialising the logits; hidden [N, H], weight [V, H], labels [N].

    Semantics of ``torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=,
    reduction=, label_smoothing=)``, plus ``z_loss * logsumexp**2`` per counted token. The
    result (a scalar, or [N] for ``reduction="none"``) is f32 (f64 for f64 inputs); logits are
    accumulated in f32 for bf16 inputs. ``implementation`` forces "pallas" or "xla" (a scan over
    vocabulary chunks, ``xla_chunked``); ``block_tokens`` / ``block_vocab`` override the Pallas
    blocks (``block_vocab``: the XLA chunk too). Sharded inputs run vocabulary- and
    token-parallel (``split_axes`` is the boundary's). The torch op takes neither the blocks nor
    ``split_axes``; its backward differentiates this function (the forward kernel runs again), so
    the kernel's torch ``linear_cross_entropy`` calls ``linear_cross_entropy_per_token`` when it
    takes a gradient.
    """
    return _loss_and_lse(
        hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, logit_scale=logit_scale, softcap=softcap, z_loss=z_loss,
        implementation=implementation, block_tokens=block_tokens, block_vocab=block_vocab,
        split_axes=split_axes,
    )[0]  # fmt: skip


# The backward from the saved log-sum-exp. Tokens and vocabulary split freely: a shard
# recomputes its block's logits against the whole-vocabulary log-sum-exp (so its softmax is the
# global one) and picks only the labels it owns (``columns``: the vocabulary ids, split with the
# head, tell a shard where its block starts); dh sums over vocabulary shards and dW over token
# shards (results lacking a split factor are summed at the boundary).
@sharded(
    ShardingRule.parse(
        "statistics_backward",
        "batch hidden, vocab hidden, vocab, vocab, batch, batch, batch, batch, batch "
        "-> batch hidden, vocab hidden, vocab",
        whole=("hidden",),
    )
)
def statistics_backward(
    hidden: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    columns: jax.Array,
    targets: jax.Array,
    lse: jax.Array,
    d_lse: jax.Array,
    d_target: jax.Array,
    d_total: jax.Array,
    *,
    vocab: int,
    form: LogitForm = PLAIN,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(dh, dW, db) of ``token_statistics`` from its saved whole-vocabulary log-sum-exp and the
    cotangents of its three outputs; ``columns`` is ``arange(vocab)`` (the whole vocabulary's
    size). The Pallas implementation recomputes each logits tile once (its one backward kernel,
    no forward); the XLA one differentiates its forward."""
    local = targets - columns[0]
    owned = (targets >= 0) & (local >= 0) & (local < weight.shape[0])
    targets = jnp.where(owned, local, reference.NO_TARGET)
    blocks = {"form": form, "block_tokens": None, "block_vocab": None}
    chosen = TABLE.select(hidden, weight, bias, targets, implementation=implementation, **blocks)
    if chosen.name == "pallas":
        config = _config(hidden, weight, None, None)
        cotangents = jnp.stack([d_lse, d_target, d_total], axis=1)
        return pallas_tpu.backward(
            hidden, weight, bias, targets, lse, cotangents, form, config, jax_platform() == "cpu"
        )

    def forward(h, w, b):
        return chosen.fn(h, w, b, targets, **blocks)

    (local_lse, _, _), pullback = jax.vjp(forward, hidden, weight, bias)
    if weight.shape[0] != vocab:  # a shard's log-sum-exp enters the whole one as exp(its - whole)
        d_lse = d_lse * jnp.exp(local_lse - lse)
    return pullback((d_lse, d_target, d_total))


def linear_cross_entropy_backward(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    bias: jax.Array | None,
    losses: jax.Array,
    lse: jax.Array,
    d_losses: jax.Array,
    d_lse: jax.Array,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(dh, dW, db) of ``linear_cross_entropy_per_token`` from its saved outputs: the statistics'
    cotangents from the O(N) loss (which is affine in the target logit and the logit sum, so
    their values do not enter), then ``statistics_backward``. No forward kernel runs."""
    labels, targets, form = _targets_and_form(labels, ignore_index, logit_scale, softcap)

    def loss_of(lse, target, total):
        return reference.loss_from_statistics(
            lse,
            target,
            total,
            labels,
            weight.shape[0],
            ignore_index=ignore_index,
            reduction="none",
            label_smoothing=float(label_smoothing),
            z_loss=float(z_loss),
        )

    _, pullback = jax.vjp(loss_of, lse, jnp.zeros_like(lse), jnp.zeros_like(lse))
    g_lse, g_target, g_total = pullback(d_losses.astype(lse.dtype))
    vocab = weight.shape[0]
    return statistics_backward(
        hidden,
        weight,
        bias,
        jnp.arange(vocab, dtype=jnp.int32),
        targets,
        lse,
        g_lse + d_lse.astype(lse.dtype),
        g_target,
        g_total,
        vocab=vocab,
        form=form,
        implementation=implementation,
    )


@op(
    name="linear_cross_entropy_per_token",
    sharding=Einsum(
        "batch hidden, vocab hidden, batch, vocab -> batch, batch",
        whole=("hidden",),
        combined=("vocab",),
    ),
    # the backward starts from the saved log-sum-exp instead of running the forward again
    jax_backward=SavedBackward(
        linear_cross_entropy_backward, ("losses", "lse", "d_losses", "d_lse")
    ),
    **_OP_OPTIONS,
)
def linear_cross_entropy_per_token(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    bias: jax.Array | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    implementation: str | None = None,
    block_tokens: int | None = None,
    block_vocab: int | None = None,
    split_axes: dict[str, tuple[str, ...]] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(``linear_cross_entropy(..., reduction="none")``, the log-sum-exp of each token's logits
    over the whole vocabulary), each [N], f32 (f64 for f64 inputs). Differentiable in both; the
    torch op's backward (``linear_cross_entropy_backward``) starts from the saved log-sum-exp, so
    a torch training step runs the forward kernel once, as a JAX one does. The torch
    ``linear_cross_entropy`` reduces its losses (a sum or mean over split tokens is then the
    partitioner's, not the function's)."""
    return _loss_and_lse(
        hidden, weight, labels, bias, ignore_index=ignore_index, reduction="none",
        label_smoothing=label_smoothing, logit_scale=logit_scale, softcap=softcap, z_loss=z_loss,
        implementation=implementation, block_tokens=block_tokens, block_vocab=block_vocab,
        split_axes=split_axes,
    )  # fmt: skip

"""Transformers integration: an ``AttentionInterface`` function that runs this kernel.

``register(name)`` installs ``attention_forward`` under ``name`` in ``AttentionInterface`` and
``transformers_masks.mask_interface`` under the same name in ``AttentionMaskInterface``; without
the mask entry Transformers passes ``attention_mask=None`` and padding would be silently ignored.
Then ``attn_implementation=name`` (or ``model.set_attn_implementation(name)``) selects it.

Masks ``attention_forward`` takes:

* a ``MaskDescription`` (what the registered mask function returns for every mask Transformers
  composes from its own factories: padding, packing, windows, chunks, image-token blocks, cache
  offsets): its rule and O(S) arrays go to the flash kernel, no dense mask is ever built;
* ``None``: plain causal (or bidirectional) attention over all keys, exactly as SDPA reads it:
  for a prefill into a larger static cache the keys past ``q_len`` are empty slots and are cut.
* a 4-D boolean (or additive float) mask (a model's own, or a mask function the description
  cannot express): one whose visible-key sets are nested across queries (Mllama's
  cross-attention mask) runs the flash kernel with positions (``describe_nested``); else
  ``dense_mask`` turns it into key padding + the layer's causal/window rule, or
  packed segments, checked on device to reproduce the mask exactly; a mask it cannot express
  runs on the reference implementation and a warning says why.

Attention dropout (``dropout`` > 0: Transformers passes the module's rate in training, 0 in eval)
runs in the kernel with a seed drawn from torch's default generator (``torch_api.dropout_seed``):
``torch.manual_seed`` reproduces the masks. A dense 4-D mask or a position bias has no kernel
path with dropout; such calls run torch's SDPA with its own dropout, and a warning says so.

Every keyword is honoured or refused (``keywords``): GPT-OSS's sinks (``s_aux``) run in the
kernel, T5's ``position_bias`` through the dense path (reference implementation, with its
gradient), MLA's value head dim natively. ``module_problem(module)`` tells ``kernelize`` which
modules pass a feature the kernel does not implement, before any call.
"""

from __future__ import annotations

import logging

import torch

from kernel_hub.kernel_api import KernelInputError

from . import keywords
from .torch_api import (
    attention_with_dense_mask,
    attention_with_lse,
    dot_product_attention,
    dropout_seed,
)
from .transformers_masks import (
    MaskDescription,
    describe_nested,
    mask_interface,
    trace_mask_factories,
)

log = logging.getLogger(__name__)

DEFAULT_NAME = "kernel_hub_attention"

# What kernelize() checks before switching a model (as Hugging Face kernels' layer flags):
# attention_forward traces into one torch.compile graph and has a backward.
can_torch_compile = True
has_backward = True


def _is_causal(module: torch.nn.Module, is_causal: bool | None) -> bool:
    return bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)


def _kernel_window(sliding_window: int | None, causal: bool) -> int | None:
    """Transformers' window to ours: causal keeps q - k < w (same); bidirectional keeps
    |q - k| <= w, which is our |q - k| < w + 1."""
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise KernelInputError(
            f"attention: sliding_window={sliding_window!r}; it must be an integer >= 1 or None"
        )
    return sliding_window if causal else sliding_window + 1


def _dropout_attention(
    query, key, value, attention_mask, dropout, scaling, causal, softcap, sinks, position_bias
):
    """Dropout under a dense mask or a position bias (no kernel path: the dense-mask op takes no
    dropout) runs torch's SDPA, as Transformers' SDPA integration would (a position bias joins
    the additive mask)."""
    for name, given in (("softcap", softcap), ("s_aux (attention sinks)", sinks)):
        if given is not None:
            raise KernelInputError(
                f"attention: dropout > 0 together with {name} under a dense mask or a position "
                f"bias is not supported by kernel-hub attention (its dense-mask path has no "
                f"dropout and torch SDPA no {name}); use attn_implementation='eager' for this "
                f"configuration"
            )
    log.warning(
        "attention: dropout=%s > 0 with a dense mask or a position bias runs torch SDPA (the "
        "kernel's dropout needs a mask it describes)",
        dropout,
    )
    q_len, kv_len = query.shape[2], key.shape[2]
    if position_bias is not None:
        attention_mask = _biased_mask(attention_mask, position_bias, causal, q_len, kv_len)
    return torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal and attention_mask is None and q_len == kv_len,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def _dropout(rate: float, query: torch.Tensor) -> dict:
    """The kernel's dropout options for ``rate`` (none at 0: eval, or a model without dropout)."""
    if rate <= 0.0:
        return {}
    return {"dropout_rate": float(rate), "dropout_seed": dropout_seed(query.device)}


def _visibility(attention_mask, causal: bool, window, q_len: int, kv_len: int, device):
    """The mask to combine a bias with: the given one, or the causal (end-aligned) / window /
    full rule that ``attention_mask=None`` stands for (``window`` in the kernel's convention)."""
    if attention_mask is not None:
        return attention_mask
    distance = (
        torch.arange(q_len, device=device)[:, None]
        + (kv_len - q_len)
        - torch.arange(kv_len, device=device)[None, :]
    )
    allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if window is not None:
        allowed &= distance.abs() < window
    return allowed[None, None]


def _biased_mask(attention_mask, position_bias, causal, q_len, kv_len):
    """One additive mask holding the bias where keys are visible (for torch SDPA)."""
    visible = _visibility(attention_mask, causal, None, q_len, kv_len, position_bias.device)
    if visible.dtype != torch.bool:
        return position_bias + visible
    return position_bias.masked_fill(~visible, torch.finfo(position_bias.dtype).min)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers' AttentionInterface contract: q [B, Hq, S, D], k [B, Hkv, Skv, D],
    v [B, Hkv, Skv, Dv] -> (out [B, S, Hq, Dv], None). Attention weights are never returned.

    ``s_aux`` [Hq] are attention sinks (GPT-OSS), ``position_bias`` [B|1, Hq, S, Skv] an additive
    bias (T5); both get gradients. Other keywords: see ``keywords`` (harmless ones are ignored,
    anything else that is not None is refused).
    """
    keywords.check_call(kwargs, attention_mask)
    if kwargs.get("output_attentions", False):
        log.warning("attention: output_attentions=True is not supported; returning None weights")
    if isinstance(attention_mask, MaskDescription):
        return _described_attention(
            query,
            key,
            value,
            attention_mask,
            dropout,
            scaling,
            softcap,
            s_aux,
            position_bias,
            module,
        )
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise KernelInputError(
            f"attention: attention_mask of type {type(attention_mask).__name__} is not supported; "
            f"expected a MaskDescription, a 4-D tensor or None (register() installs the mask "
            f"function that builds it)"
        )
    causal = _is_causal(module, is_causal)
    window = _kernel_window(sliding_window, causal)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and causal and 1 < q_len < kv_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
        kv_len = q_len
    options = dict(causal=causal, sliding_window=window, softcap=softcap, scale=scaling)
    dense = attention_mask is not None or position_bias is not None
    if dropout > 0.0 and not dense:
        out = dot_product_attention(
            query, key, value, sinks=s_aux, **options, **_dropout(dropout, query)
        )
    elif dropout > 0.0:
        out = _dropout_attention(
            query,
            key,
            value,
            attention_mask,
            dropout,
            scaling,
            causal,
            softcap,
            s_aux,
            position_bias,
        )
    elif position_bias is not None:
        visible = _visibility(attention_mask, causal, window, q_len, kv_len, query.device)
        out, _ = attention_with_dense_mask(
            query, key, value, visible, sinks=s_aux, bias=position_bias, **options
        )
    elif attention_mask is None:
        out = dot_product_attention(query, key, value, sinks=s_aux, **options)
    elif attention_mask.shape[-2:] == (q_len, kv_len) and (
        nested := describe_nested(attention_mask)
    ):
        return _described_attention(
            query, key, value, nested, 0.0, scaling, softcap, s_aux, None, module
        )
    else:
        out, _ = attention_with_dense_mask(
            query, key, value, attention_mask, sinks=s_aux, **options
        )
    return out.transpose(1, 2).contiguous(), None


def _described_attention(
    query,
    key,
    value,
    mask: MaskDescription,
    dropout,
    scaling,
    softcap,
    sinks,
    position_bias,
    module: torch.nn.Module,
):
    """Attention under a ``MaskDescription``: its rule replaces the module's (as a mask replaces
    ``is_causal`` and ``sliding_window`` under SDPA). An additive bias has no kernel path; it gets
    the description's dense mask (its path is dense anyway), and so does dropout beside it."""
    expected = (mask.q_len, mask.kv_len)
    if (query.shape[2], key.shape[2]) != expected:
        raise KernelInputError(
            f"attention: the mask describes {mask.q_len} queries and {mask.kv_len} keys, but "
            f"query has {query.shape[2]} and key {key.shape[2]}"
        )
    options = dict(
        causal=mask.causal, sliding_window=mask.sliding_window, softcap=softcap, scale=scaling
    )
    if dropout > 0.0 and position_bias is not None:
        out = _dropout_attention(
            query, key, value, mask.dense(), dropout, scaling, False, softcap, sinks, position_bias
        )
    elif position_bias is not None:
        out, _ = attention_with_dense_mask(
            query, key, value, mask.dense(), sinks=sinks, bias=position_bias, **options
        )
    else:
        arguments = (query, key, value, mask.kv_valid, mask.q_segment_ids, mask.kv_segment_ids)
        options.update(
            sinks=sinks,
            q_positions=mask.q_positions,
            kv_positions=mask.kv_positions,
            q_groups=mask.q_groups,
            kv_groups=mask.kv_groups,
            window_bounds_groups=mask.window_bounds_groups,
            **_dropout(dropout, query),
        )
        # only key padding or explicit positions can leave a query row without a key
        may_be_empty = mask.kv_valid is not None or mask.q_positions is not None
        eager = getattr(module, STOCK_IMPLEMENTATION, None) == "eager"
        if not (eager and may_be_empty):
            return dot_product_attention(*arguments, **options).transpose(1, 2).contiguous(), None
        out, lse = attention_with_lse(*arguments, **options)
        if not (torch.compiler.is_compiling() or _traced(lse)):
            out = _eager_empty_rows(query, key, value, out, lse, scaling, softcap)
        else:
            out = _traced_eager_empty_rows(query, key, value, out, lse, scaling, softcap, module)
    return out.transpose(1, 2).contiguous(), None


STOCK_IMPLEMENTATION = "_kernel_hub_stock_attention"
"""Attribute ``module_problem`` sets on an attention module: the implementation it ran before
kernelize. On the module, not in a side table, so a copy of a kernelized model (``deepcopy``)
keeps the convention; read only by this kernel's attention function."""


def _traced(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torchax tensor holding a JAX tracer: inside torchax's jit (how
    TorchTPU and model-bench trace a torch model) no value can be read on the host, yet
    ``torch.compiler.is_compiling()`` is False there."""
    array = getattr(tensor, "_elem", None)
    if array is None:
        return False
    import jax  # only reached for torchax tensors, whose arrays are JAX's

    return isinstance(array, jax.core.Tracer)


def _eager_empty_rows(query, key, value, out, lse, scaling, softcap):
    """Transformers' eager attention on query rows that see no key (left padding under a causal
    mask): every score plus the dtype's minimum rounds to the minimum, so the softmax is uniform
    over all keys and the row averages every value; its backward is the softmax's at that
    uniform point (``softmax(s - s.detach())`` has both). The kernel gives zeros there (SDPA's
    convention). Computed on those rows only, O(rows x Sk); a host read finds them."""
    empty = torch.isneginf(lse)
    if not bool(empty.any()):
        return out
    b, h, q = empty.nonzero(as_tuple=True)
    kv_head = h // (query.shape[1] // key.shape[1])
    rows = query[b, h, q].unsqueeze(1)  # [R, 1, D]
    keys, values = key[b, kv_head], value[b, kv_head]  # [R, Sk, D], [R, Sk, Dv]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (rows @ keys.transpose(1, 2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = torch.softmax(scores - scores.detach(), dim=-1).to(values.dtype)
    return out.index_put((b, h, q), (weights @ values).squeeze(1).to(out.dtype))


def _traced_eager_empty_rows(query, key, value, out, lse, scaling, softcap, module):
    """``_eager_empty_rows`` without a host read, for torch.compile and torchax's jit: eager's row
    (every key weighted 1/n) is the mean of the values, and its backward, the softmax's at that
    uniform point, is linear in the scores: the gradient of ``q @ K^T (V - mean V) * scale / n`` (V
    held constant there) plus the mean's. Every row gets it, O(Sq x D x Dv) per head, and a
    ``where`` keeps it on rows that see no key. A soft-cap makes that backward depend on each score,
    so with one only the value is served: training is refused (``module_problem`` leaves such
    modules alone under a compiled training kernelize); in eval mode those rows' gradient holds the
    mean's part only (they are padding positions)."""
    gradient = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if softcap is not None and gradient and module.training:
        raise KernelInputError(
            f"attention: {type(module).__name__} ran eager attention, whose fully masked query "
            "rows average every value; with soft-capping kernel-hub follows that backward only "
            "after a host read, which a traced step (torch.compile, torchax's jit) cannot make. "
            "Kernelize with mode='training+torch_compile' (which leaves this attention alone) "
            "or train without tracing the step"
        )
    groups = query.shape[1] // key.shape[1]
    mean = value.mean(-2, keepdim=True)  # [B, Hkv, 1, Dv]
    rows = mean.repeat_interleave(groups, 1)  # eager's value, soft-cap or not
    if gradient and softcap is None:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        moments = key.transpose(-1, -2) @ (value - mean).detach() * (scale / key.shape[2])
        linear = query @ moments.repeat_interleave(groups, 1).to(query.dtype)  # [B, Hq, Sq, Dv]
        rows = rows + (linear - linear.detach())
    empty = torch.isneginf(lse)[..., None]  # [B, Hq, Sq, 1]
    return torch.where(empty, rows.to(out.dtype), out)


def module_problem(
    module: torch.nn.Module, training: bool = True, compiling: bool = False
) -> str | None:
    """Hook for ``kernelize``: why a module's attention cannot run on this kernel, or None. It
    also notes the implementation the module ran (fully masked rows follow its convention)."""
    config = getattr(module, "config", None)
    stock = getattr(config, "_attn_implementation", None)
    setattr(module, STOCK_IMPLEMENTATION, stock)
    if training and compiling and stock == "eager" and keywords.soft_caps(module):
        return (
            f"{type(module).__name__} runs eager attention with soft-capping, whose fully masked "
            "query rows (left padding) average every value, and a training loss can read them "
            "(the last padding position predicts the first token); with a soft-cap kernel-hub "
            "finds those rows with a host read that torch.compile cannot trace"
        )
    return keywords.module_problem(module)


def register(name: str = DEFAULT_NAME) -> str:
    """Make ``attn_implementation=name`` run ``attention_forward`` with kernel-hub's masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)
    trace_mask_factories()
    return name

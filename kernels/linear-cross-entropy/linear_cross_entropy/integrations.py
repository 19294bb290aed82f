"""Transformers integration: a causal LM's loss (``ForCausalLMLoss``) from its hidden states.

kernel-hub's ``CausalLMLossInterface`` (``kernel_hub.layers.integrations.causal_lm_loss``) makes
a Transformers ``*ForCausalLM`` skip its logits in training and calls ``causal_lm_loss`` here with
the decoder's last hidden states and the LM head. It keeps ``ForCausalLMLoss``'s semantics: the
label shift (or the caller's ``shift_labels``), ``ignore_index``, mean over counted tokens, or the
sum divided by ``num_items_in_batch`` when given; the loss is float32, as there.
"""

from __future__ import annotations

import torch

from .torch_api import linear_cross_entropy

DEFAULT_NAME = "kernel_hub_linear_cross_entropy"
# What kernelize() checks before switching a model in a given mode (tested: fullgraph compile
# and training gradients).
can_torch_compile = True
has_backward = True
module_problem = None  # kernel-hub's CausalLMLossInterface probes the model before switching


def register(name: str = DEFAULT_NAME) -> str:
    """The name kernelize reports for this loss (nothing to register with Transformers)."""
    return name


def causal_lm_loss(
    hidden_states: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ForCausalLMLoss(softcap(logit_scale * head(hidden_states)), labels, ...)`` without the
    logits; hidden_states [..., H] (every position), labels [...] unshifted."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels,
        head.bias,
        ignore_index,
        reduction,
        0.0,
        logit_scale,
        softcap,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss

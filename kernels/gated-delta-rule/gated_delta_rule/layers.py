"""``GatedDeltaNet``: replaces the ``forward`` of the Qwen3-Next and Qwen3.5 linear-attention
mixers (``Qwen3NextGatedDeltaNet``: one fused q/k/v/z projection; ``Qwen3_5GatedDeltaNet``,
``Qwen3_5MoeGatedDeltaNet``: separate projections) with the same computation, the delta rule
running through this kernel's ops (chunked for prefill and training, recurrent for one-token
cached decode).

Projections and the gated norm (a module: kernelize swaps it separately) are the host module's.
The short convolution is ``causal_conv1d_fn`` / ``causal_conv1d_update`` looked up on the module
first (``function_slots``: kernelize fills them there from the causal-conv1d kernel), else the
model module's own functions. Packed sequences (``cu_seq_lens_q``) are
refused: the stock mixer hands them to a fallback that ignores them, so its convolution mixes the
sequences. Other keyword arguments the stock mixer ignores are ignored here too.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import api

chunk_gated_delta_rule = api.chunk_gated_delta_rule.torch
recurrent_gated_delta_rule = api.recurrent_gated_delta_rule.torch

PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
CONV_SLOTS = ("causal_conv1d_fn", "causal_conv1d_update")
MODULE_FUNCTIONS = ("apply_mask_to_padding_states", *CONV_SLOTS)
MODULE_STATE = ("conv1d", "dt_bias", "A_log", "norm", "out_proj", "key_dim", "value_dim")
PROJECTIONS = (
    ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"),  # Qwen3-Next
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5
)


def _project(module, hidden_states):
    """(mixed q/k/v [B, channels, T], z [B, T, HV, V], b, a) as the host's forward computes them."""
    if hasattr(module, "in_proj_qkvz"):
        query, key, value, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
        )
        query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
        return torch.cat((query, key, value), dim=-1).transpose(1, 2), z, b, a
    batch, seq_len = hidden_states.shape[:2]
    z = module.in_proj_z(hidden_states).reshape(batch, seq_len, -1, module.head_v_dim)
    mixed = module.in_proj_qkv(hidden_states).transpose(1, 2)
    return mixed, z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)


class GatedDeltaNet(torch.nn.Module):
    """Qwen3-Next's and Qwen3.5's gated-delta-net mixer with the delta rule on kernel-hub's ops."""

    has_backward = True
    can_torch_compile = False  # the cache's state bookkeeping is Python

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        packing = [name for name in PACKING_KWARGS if kwargs.get(name) is not None]
        if packing:
            raise NotImplementedError(
                f"GatedDeltaNet: packed sequences ({', '.join(packing)}) are not supported: the "
                "stock mixer's convolution ignores the packing; pad the batch instead"
            )
        stock = sys.modules[type(self).__module__]
        hidden_states = stock.apply_mask_to_padding_states(hidden_states, attention_mask)
        seq_len = hidden_states.shape[1]
        if cache is not None:
            conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
            recurrent_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
        else:
            conv_state, recurrent_state = None, None

        conv_fn, conv_update = (self.__dict__.get(n) or getattr(stock, n) for n in CONV_SLOTS)
        mixed_qkv, z, b, a = _project(self, hidden_states)
        weight = self.conv1d.weight.squeeze(1)
        if conv_state is not None and seq_len == 1 and not cache.is_recording_past(self.layer_idx):
            mixed_qkv = conv_update(
                mixed_qkv, conv_state, weight, self.conv1d.bias, self.activation
            )
        else:
            if cache is not None:
                mixed_qkv = cache.update_conv_state(
                    mixed_qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size
                )
            mixed_qkv = conv_fn(mixed_qkv, weight, self.conv1d.bias, activation=self.activation)
            if cache is not None:
                mixed_qkv = mixed_qkv[:, :, -seq_len:]
        mixed_qkv = mixed_qkv.transpose(1, 2)
        query, key, value = torch.split(
            mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1
        )
        batch = query.shape[0]
        query = query.reshape(batch, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch, seq_len, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        if recurrent_state is not None and seq_len == 1:
            core, last_state = recurrent_gated_delta_rule(
                query, key, value, g, beta, initial_state=recurrent_state, use_qk_l2norm=True
            )
        else:
            core, last_state = chunk_gated_delta_rule(
                query,
                key,
                value,
                g,
                beta,
                initial_state=recurrent_state,
                chunk_size=64,
                use_qk_l2norm=True,
            )
        if cache is not None:
            cache.update_recurrent_state(last_state, self.layer_idx)

        z_shape = z.shape
        core = self.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
        core = core.reshape(z_shape).reshape(batch, seq_len, -1)
        return self.out_proj(core)

    forward.function_slots = CONV_SLOTS  # read by kernelize: it fills these on the module


def _mixer_problem(module: torch.nn.Module) -> str | None:
    """Why ``GatedDeltaNet.forward`` cannot stand in for this module's, or None."""
    stock = sys.modules.get(type(module).__module__)
    missing = [n for n in MODULE_FUNCTIONS if not callable(getattr(stock, n, None))]
    if missing:
        return f"its module defines no {', '.join(missing)}"
    missing = [n for n in MODULE_STATE if not hasattr(module, n)]
    if missing:
        return f"it has no {', '.join(missing)}"
    if not any(all(hasattr(module, n) for n in names) for names in PROJECTIONS):
        known = " or ".join("/".join(names) for names in PROJECTIONS)
        return f"its projections are none of the known layouts ({known})"
    if module.num_v_heads % module.num_k_heads:
        return f"{module.num_v_heads} value heads are not a multiple of {module.num_k_heads}"
    if getattr(module, "activation", None) not in ("silu", "swish"):
        return f"activation is {module.activation!r}; the conv path is written for silu"
    return None


MODULE_CHECKS = {"GatedDeltaNet": _mixer_problem}

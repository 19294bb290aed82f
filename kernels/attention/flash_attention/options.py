"""The attention options: one frozen dataclass every attention function takes.

The public JAX functions' keyword parameters (``api``, ``dense_mask``; ``kernel_api.takes_options``)
and so the torch ops' schemas (``kernel_api.op``) are derived from ``AttentionSpec``, and the
kernels receive it resolved (``AttentionSpec.resolved``): an option is
declared here, last, and used where the math needs it; nothing else lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kernel_hub.kernel_api import check_score_options, resolved_scores

from . import dropout

OP = "dot_product_attention"

TORCH_1_0 = ("causal", "sliding_window", "softcap", "scale", "implementation", "block_q", "block_k")
"""The options of the 1.0 torch schemas, which sit right after the 1.0 tensor arguments; every
option added since follows the last tensor argument (so 1.0 positional calls keep their meaning)."""


@dataclass(frozen=True)
class AttentionSpec:
    """Which pairs attend and how scores are formed (see ``masking``), and how it is computed.

    ``sliding_window`` w keeps keys with 0 <= position - key < w (|..| < w when not causal);
    ``softcap`` c maps scores s to c * tanh(s / c); ``scale`` defaults to 1/sqrt(head_dim)
    (``resolved`` fills it in); ``implementation`` forces "pallas", "tokamax" or "xla";
    ``block_q``/``block_k`` override the Pallas blocks (powers of two).
    """

    causal: bool = False
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    implementation: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    window_bounds_groups: bool = False
    """Group pairs must also be inside the window: ``(causal | group) & window`` (Gemma 3's
    sliding layers) rather than ``(causal & window) | group``."""
    dropout_rate: float = 0.0
    """Attention dropout: each probability is dropped with this chance (the mask is
    ``dropout``'s hash of the call's ``dropout_seed`` and the indices) and the kept ones are scaled
    by 1 / (1 - rate); in [0, 1)."""

    def __post_init__(self) -> None:
        check_score_options(self, OP)
        dropout.check_rate(self.dropout_rate, OP)

    def resolved(self, head_dim: int) -> AttentionSpec:
        """These options with the default scale 1/sqrt(head_dim) filled in (numbers as floats)."""
        return replace(
            self,
            **resolved_scores(self, head_dim),
            window_bounds_groups=bool(self.window_bounds_groups),
            dropout_rate=float(self.dropout_rate),
        )

"""The ragged/paged attention options: one frozen dataclass both functions take.

The public JAX functions' keyword parameters (``api``; ``kernel_api.takes_options``), and so the
raw torch ops' schemas (``kernel_api.op``) and the torch entry points' keywords (``torch_api``),
are derived from ``RaggedSpec``, and the kernels receive it resolved (``RaggedSpec.resolved``):
an option is declared here, last, and used where the math needs it; nothing else lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kernel_hub.kernel_api import check_score_options, resolved_scores

KERNEL = "ragged-attention"
RAGGED_UNUSED = ("pages_per_block",)
"""Fields ``ragged_attention`` does not take."""
PAGED_UNUSED = ("causal", "block_q", "block_k")
"""Fields ``paged_attention`` does not take (decode is causal; its blocks are pages)."""


@dataclass(frozen=True)
class RaggedSpec:
    """Which pairs attend (see ``masking``), how scores are formed, and how it is computed.

    ``sliding_window`` w keeps keys with 0 <= position - key < w; ``softcap`` c maps scores s to
    c * tanh(s / c); ``scale`` defaults to 1/sqrt(head_dim) (``resolved`` fills it in);
    ``implementation`` forces "pallas" or "xla"; ``block_q`` (packed query rows) / ``block_k``
    override the ragged kernel's blocks, ``pages_per_block`` the paged kernel's.
    """

    causal: bool = True
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    implementation: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    pages_per_block: int | None = None

    def __post_init__(self) -> None:
        check_score_options(self, KERNEL)

    def resolved(self, head_dim: int) -> RaggedSpec:
        """These options with the default scale 1/sqrt(head_dim) filled in (numbers as floats)."""
        return replace(self, **resolved_scores(self, head_dim))

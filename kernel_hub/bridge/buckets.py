"""Row buckets: pad a row dimension up to a few sizes so varying lengths share one compilation.

A kernel opts in per op with ``RowBuckets``: the leading dimensions (all but the last
``feature_dims``) of the named tensor arguments are flattened into one row axis and padded up to a
bucket size; the listed outputs are sliced back to the real rows. Varying lengths and batch shapes
then compile once per bucket, not once per shape.

This is only valid for ops whose rows are independent (norms, per-token activations). Padded input
rows are copies of the last real row, so they compute nothing a real row would not (no new NaN or
inf), and their cotangents are zero, so they add nothing to the gradients of other arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


def power_of_two(rows: int) -> int:
    """The smallest power of two >= ``rows`` (0 stays 0): at most 2x padding, log2 buckets."""
    return 1 << (rows - 1).bit_length() if rows > 0 else 0


@dataclass(frozen=True)
class RowBuckets:
    """Which tensors of an op share a bucketable row axis.

    ``inputs``: tensor argument names whose leading dims are the rows (they must agree).
    ``outputs``: indices of outputs whose leading dims are the same rows.
    ``feature_dims``: trailing dims that are not rows (1 for ``[..., hidden]``).
    ``bucket``: rows -> padded rows; must return a value >= rows.
    """

    inputs: tuple[str, ...]
    outputs: tuple[int, ...] = (0,)
    feature_dims: int = 1
    bucket: Callable[[int], int] = power_of_two

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("RowBuckets needs at least one input name")
        if self.feature_dims < 0:
            raise ValueError(f"feature_dims must be >= 0, got {self.feature_dims}")

    def layout(self, tensors: Mapping[str, Any]) -> RowLayout | None:
        """How to pad this call's tensors, or None when there is nothing to pad or reshape.

        Calls whose named inputs disagree on their leading shape are not bucketed (they still run,
        with their own compilation).
        """
        leads = {
            tuple(tensors[name].shape[: tensors[name].dim() - self.feature_dims])
            for name in self.inputs
            if tensors[name] is not None and tensors[name].dim() >= self.feature_dims
        }
        if len(leads) != 1:
            return None
        (lead,) = leads
        rows = math.prod(lead)
        padded = self.bucket(rows) if rows else 0  # no row to repeat
        if padded < rows:
            raise ValueError(f"bucket function returned {padded} rows for {rows}; must be >= rows")
        if padded == rows and len(lead) == 1:  # already [bucket, *features]
            return None
        return RowLayout(lead, rows, padded)


@dataclass(frozen=True)
class RowLayout:
    """One call's row geometry: the original leading shape, its row count and the bucket size."""

    lead: tuple[int, ...]
    rows: int
    padded: int

    def pad(self, tensor: Any, *, zeros: bool = False) -> Any:
        """``[*lead, *features]`` -> ``[padded, *features]``; filler rows repeat the last row, or
        are zeros (for cotangents)."""
        # view() when it can: half of reshape()'s cost on a small tensor (one dispatch, not two)
        features = tensor.shape[len(self.lead) :]
        if tensor.is_contiguous():
            flat = tensor.view(self.rows, *features)
        else:
            flat = tensor.reshape(self.rows, *features)
        extra = self.padded - self.rows
        if extra == 0:
            return flat
        if zeros:
            filler = flat.new_zeros((extra, *flat.shape[1:]))
        else:
            filler = flat[-1:].expand(extra, *flat.shape[1:])
        return torch.cat([flat, filler])

    def unpad(self, tensor: Any) -> Any:
        """``[padded, *features]`` -> ``[*lead, *features]`` (a view of the real rows)."""
        if self.padded != self.rows:
            tensor = tensor[: self.rows]
        return tensor.view(*self.lead, *tensor.shape[1:])

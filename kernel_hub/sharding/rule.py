"""A declarative sharding rule: which array dimensions of an op may be split over mesh axes.

A rule names every dimension of every operand and result with a *factor*, einsum style, e.g.
``"... hidden, hidden -> ... hidden"`` for RMSNorm. ``...`` stands for any number of leading
dimensions (the same count wherever it appears), each one a free factor. Each factor is

* free (default): it may be split; the operands and results holding it are split the same way;
* ``whole``: it must stay unsplit (e.g. the normalised axis, a sequence a kernel scans whole);
  ``handled_by`` may name the layer that does shard it (ring attention, expert parallelism);
* ``reduced``: it appears in no result; when split, each shard computes a partial result and the
  shards' results are summed (``psum``). Einsum-style, the same holds per result: a result that
  lacks a split factor other results keep (the sinks' gradient, summed over batch) is summed
  over that factor's axes;
* grouped with another (``together``): both split over the same mesh axes, e.g. query heads and
  kv heads under grouped-query attention, so each shard keeps whole head groups.

One rule is the single source of the ``jax.shard_map`` specs (``boundary``) and the DTensor
strategy (``dtensor``) of an op.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import KernelHubError

ELLIPSIS = "..."


class ShardingError(KernelHubError, ValueError):
    """Inputs sharded in a way an op's rule cannot serve; names the factor, operand and axis."""


def _parse_side(op: str, text: str) -> tuple[tuple[str, ...], ...]:
    side = []
    for part in text.split(","):
        names = tuple(part.split())
        if names.count(ELLIPSIS) > 1 or (ELLIPSIS in names and names[0] != ELLIPSIS):
            raise ShardingError(f"{op}: '...' may appear once, first, in {part.strip()!r}")
        side.append(names)
    return tuple(side)


@dataclass(frozen=True)
class ShardingRule:
    """The sharding rule of one op; build it with ``ShardingRule.parse``."""

    op: str
    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    whole: frozenset[str] = frozenset()
    reduced: frozenset[str] = frozenset()
    together: tuple[tuple[str, str], ...] = ()
    handled_by: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(
        cls,
        op: str,
        text: str,
        *,
        whole: Sequence[str] = (),
        reduced: Sequence[str] = (),
        together: Sequence[tuple[str, str]] = (),
        handled_by: Mapping[str, str] | None = None,
    ) -> ShardingRule:
        """``text`` is ``"operand factors, ... -> result factors, ..."``."""
        if text.count("->") != 1:
            raise ShardingError(f"{op}: a sharding rule reads 'operands -> results', got {text!r}")
        left, right = text.split("->")
        rule = cls(
            op,
            _parse_side(op, left),
            _parse_side(op, right),
            frozenset(whole),
            frozenset(reduced),
            tuple(tuple(pair) for pair in together),
            dict(handled_by or {}),
        )
        rule._validate()
        return rule

    @property
    def factors(self) -> frozenset[str]:
        return frozenset(f for dims in self.operands for f in dims if f != ELLIPSIS)

    def _validate(self) -> None:
        known = self.factors
        in_results = {f for dims in self.results for f in dims}
        declared = set(self.whole) | set(self.reduced) | {f for p in self.together for f in p}
        unknown = (declared | (in_results - {ELLIPSIS})) - known
        if unknown:
            raise ShardingError(f"{self.op}: factors {sorted(unknown)} are in no operand")
        grouped = {f for pair in self.together if set(pair) & in_results for f in pair}
        for factor in known - in_results - set(self.whole) - set(self.reduced) - grouped:
            raise ShardingError(
                f"{self.op}: factor {factor!r} is in no result; declare it whole or reduced"
            )
        clash = set(self.reduced) & in_results
        if clash:
            raise ShardingError(f"{self.op}: reduced factors {sorted(clash)} appear in results")

    def partner(self, factor: str) -> str | None:
        """The factor split together with ``factor``, if any."""
        for a, b in self.together:
            if factor in (a, b):
                return b if factor == a else a
        return None

    def __str__(self) -> str:
        side = lambda dims: ", ".join(" ".join(d) for d in dims)
        return f"{side(self.operands)} -> {side(self.results)}"

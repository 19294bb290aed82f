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
* ``combined``: it may be split, and the op's function combines its shards' partial results
  itself (a log-sum-exp over vocabulary shards is no sum): under a split the boundary calls it
  with ``split_axes={factor: mesh axes}`` for its collectives. DTensor strategies never split it
  (each rank would need those collectives); such an operand is replicated there;
* ``located``: free, and the function needs its shard's place along it (a hash of global indices,
  such as attention dropout's mask): under a split the boundary calls it with
  ``split_axes={factor: mesh axes}``, whose ``axis_index`` gives the shard's offset. DTensor
  strategies never split it (no rank knows its offset there);
* grouped with another (``together``): both split over the same mesh axes, e.g. query heads and
  kv heads under grouped-query attention, so each shard keeps whole head groups.

A dimension written ``factor?`` may instead have size 1 and broadcast (a [1, 1, Sq, Sk] mask
against [B, H, ...] queries): an operand's size-1 dimension stays unsplit (each shard reads all of
it), and a result's size-1 dimension (the gradient of such an operand) is summed over the axes
that split the factor.

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


BROADCAST = "?"
Dim = tuple[int, int]
"""(array index, dimension index counted from the end: -1 is the last)."""


def _parse_side(op: str, text: str) -> tuple[tuple[tuple[str, ...], ...], frozenset[Dim]]:
    """The factor names of each array and the (array, dimension from the end) that broadcast."""
    side, broadcast = [], set()
    for index, part in enumerate(text.split(",")):
        names = tuple(part.split())
        if names.count(ELLIPSIS) > 1 or (ELLIPSIS in names and names[0] != ELLIPSIS):
            raise ShardingError(f"{op}: '...' may appear once, first, in {part.strip()!r}")
        broadcast |= {
            (index, position - len(names))
            for position, name in enumerate(names)
            if name.endswith(BROADCAST)
        }
        side.append(tuple(name.removesuffix(BROADCAST) for name in names))
    return tuple(side), frozenset(broadcast)


@dataclass(frozen=True)
class ShardingRule:
    """The sharding rule of one op; build it with ``ShardingRule.parse``."""

    op: str
    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    whole: frozenset[str] = frozenset()
    reduced: frozenset[str] = frozenset()
    combined: frozenset[str] = frozenset()
    located: frozenset[str] = frozenset()
    together: tuple[tuple[str, str], ...] = ()
    handled_by: Mapping[str, str] = field(default_factory=dict)
    broadcast_operands: frozenset[Dim] = frozenset()
    broadcast_results: frozenset[Dim] = frozenset()

    @classmethod
    def parse(
        cls,
        op: str,
        text: str,
        *,
        whole: Sequence[str] = (),
        reduced: Sequence[str] = (),
        combined: Sequence[str] = (),
        located: Sequence[str] = (),
        together: Sequence[tuple[str, str]] = (),
        handled_by: Mapping[str, str] | None = None,
    ) -> ShardingRule:
        """``text`` is ``"operand factors, ... -> result factors, ..."``."""
        if text.count("->") != 1:
            raise ShardingError(f"{op}: a sharding rule reads 'operands -> results', got {text!r}")
        left, right = text.split("->")
        (operands, broadcast_operands), (results, broadcast_results) = (
            _parse_side(op, left),
            _parse_side(op, right),
        )
        rule = cls(
            op,
            operands,
            results,
            frozenset(whole),
            frozenset(reduced),
            frozenset(combined),
            frozenset(located),
            tuple(tuple(pair) for pair in together),
            dict(handled_by or {}),
            broadcast_operands,
            broadcast_results,
        )
        rule._validate()
        return rule

    @property
    def factors(self) -> frozenset[str]:
        return frozenset(f for dims in self.operands for f in dims if f != ELLIPSIS)

    def _validate(self) -> None:
        known = self.factors
        in_results = {f for dims in self.results for f in dims}
        declared = set(self.whole) | set(self.reduced) | set(self.combined) | set(self.located)
        declared |= {f for pair in self.together for f in pair}
        unknown = (declared | (in_results - {ELLIPSIS})) - known
        if unknown:
            raise ShardingError(f"{self.op}: factors {sorted(unknown)} are in no operand")
        grouped = {f for pair in self.together if set(pair) & in_results for f in pair}
        declared_absent = set(self.whole) | set(self.reduced) | set(self.combined)
        for factor in known - in_results - declared_absent - grouped:
            raise ShardingError(
                f"{self.op}: factor {factor!r} is in no result; declare it whole, reduced or "
                "combined"
            )
        for kind, factors in (("reduced", self.reduced), ("combined", self.combined)):
            clash = set(factors) & in_results
            if clash:
                raise ShardingError(f"{self.op}: {kind} factors {sorted(clash)} appear in results")

    def partner(self, factor: str) -> str | None:
        """The factor split together with ``factor``, if any."""
        for a, b in self.together:
            if factor in (a, b):
                return b if factor == a else a
        return None

    def broadcasts(self, result: bool, index: int, dim: int, rank: int) -> bool:
        """Whether dimension ``dim`` of a rank-``rank`` operand (or result) may broadcast."""
        dims = self.broadcast_results if result else self.broadcast_operands
        return (index, dim - rank) in dims

    def __str__(self) -> str:
        def side(arrays, broadcast):
            return ", ".join(
                " ".join(
                    f + BROADCAST * ((i, p - len(dims)) in broadcast) for p, f in enumerate(dims)
                )
                for i, dims in enumerate(arrays)
            )

        operands = side(self.operands, self.broadcast_operands)
        return f"{operands} -> {side(self.results, self.broadcast_results)}"


@dataclass(frozen=True)
class Einsum:
    """A rule as ``ShardingRule.parse`` reads it, less the op's name: the op it is declared on
    (``kernel_api.op``) names it, and parses it then:
    ``Einsum("... hidden, hidden -> ... hidden", whole=("hidden",))``."""

    text: str
    whole: Sequence[str] = ()
    reduced: Sequence[str] = ()
    combined: Sequence[str] = ()
    located: Sequence[str] = ()
    together: Sequence[tuple[str, str]] = ()
    handled_by: Mapping[str, str] | None = None

    def rule(self, op: str) -> ShardingRule:
        return ShardingRule.parse(
            op,
            self.text,
            whole=self.whole,
            reduced=self.reduced,
            combined=self.combined,
            located=self.located,
            together=self.together,
            handled_by=self.handled_by,
        )

"""Transformers' masks as O(S) descriptions the kernel evaluates per block, never [B, 1, Sq, Sk].

Transformers 5 builds every mask from ``mask_function(batch, head, q_idx, kv_idx)`` closures made
by a few factories in ``masking_utils`` (causal, sliding windows, chunks, padding, packed
sequences, bidirectional blocks of image tokens), combined with ``and_masks``/``or_masks``. The
mask function ``mask_interface`` registers in ``AttentionMaskInterface`` reads that closure tree
(each factory's inner function is recognised by its code's file and qualified name, its
parameters by the names of its closure cells; nothing is evaluated per pair) and returns a
``MaskDescription``: the layer's
rule plus per-token arrays (key padding, segment ids, positions, groups). The description is the
mask function, rewritten, so the result is exact by construction:

* causal / ``sliding_window_overlay(w)`` (``kv > q - w``): the kernel's causal window ``w``;
* ``sliding_window_bidirectional_overlay(w)`` (``|q - kv| <= w``, ModernBERT): window ``w + 1``;
* ``chunked_overlay(c, left_padding)`` (Llama 4): segment ids ``(index - left_padding) // c``;
* ``packed_sequence_mask_function`` + ``remap_positions_for_packed_sequence``: segment ids; the
  remap changes nothing inside a segment (positions there step by one, as indices do), except
  for chunk ids, computed from the positions;
* ``blockwise_overlay(block_sequence_ids)`` OR-ed to the rule (Gemma 3, PaliGemma image tokens):
  groups; a window AND-ed after the OR bounds the groups too (``window_bounds_groups``);
* the 2-D padding mask: key padding; queries at ``q_offset`` and keys at ``kv_offset`` that are
  not end-aligned (a static cache): explicit positions.

Anything else (a model's own lambda, a vmap-only mask) is not described: ``mask_interface``
returns Transformers' dense SDPA mask and logs why (not while compiling: logging would break the
graph), and the dense-mask op runs it.

Under ``torch.compile`` dynamo cannot read a closure it built (``__closure__`` of a nested
function is not traceable), so ``trace_mask_factories`` registers each factory a graph substitute
(``torch.compiler.substitute_in_graph``) that returns a ``TracedMaskFunction``: the factory's own
closure (built by the factory's own code, so it computes what the factory's result computes) plus
the factory's kind and arguments, which dynamo reads as attributes. The walk is the same; the
rule becomes constants of the graph (guarded through the config values it came from) and the
padding, packing and group tensors stay graph inputs, so another padding pattern reuses the graph
with its own values.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import masking_utils as mu

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaskDescription:
    """What ``attention_forward`` needs instead of a dense mask. Arrays are [B, Sq] / [B, Sk]
    (int32, or bool for ``kv_valid``) or None; the rule is in the kernel's convention."""

    q_len: int
    kv_len: int
    causal: bool
    sliding_window: int | None = None
    window_bounds_groups: bool = False
    kv_valid: torch.Tensor | None = None
    q_segment_ids: torch.Tensor | None = None
    kv_segment_ids: torch.Tensor | None = None
    q_positions: torch.Tensor | None = None
    kv_positions: torch.Tensor | None = None
    q_groups: torch.Tensor | None = None
    kv_groups: torch.Tensor | None = None

    ndim = 4
    """Transformers reads ``attention_mask.ndim`` before it hands a prepared mask on."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense mask's shape, for model code that reads ``attention_mask.shape``."""
        batch = next((x.shape[0] for x in self.arrays() if x is not None), 1)
        return (batch, 1, self.q_len, self.kv_len)

    def dense(self) -> torch.Tensor:
        """The [B, 1, Sq, Sk] boolean mask described (``masking``'s rule), for the paths that
        are dense anyway: torch SDPA with dropout, an additive position bias."""
        batch = self.shape[0]
        device = next((x.device for x in self.arrays() if x is not None), None)
        if self.q_positions is not None:
            q_position, k_position = self.q_positions, self.kv_positions
        else:
            q_position = torch.arange(self.q_len, device=device)[None] + self.kv_len - self.q_len
            k_position = torch.arange(self.kv_len, device=device)[None]
        distance = q_position[:, :, None] - k_position[:, None, :]
        window = torch.ones_like(distance, dtype=torch.bool)
        if self.sliding_window is not None:
            limit = distance if self.causal else distance.abs()
            window = limit < self.sliding_window
        allowed = window & (distance >= 0) if self.causal else window
        if self.q_groups is not None:
            q_group, k_group = self.q_groups[:, :, None], self.kv_groups[:, None, :]
            together = (q_group == k_group) & (q_group >= 0)
            allowed = allowed | (together & window if self.window_bounds_groups else together)
        if self.q_segment_ids is not None:
            allowed = allowed & (self.q_segment_ids[:, :, None] == self.kv_segment_ids[:, None])
        if self.kv_valid is not None:
            allowed = allowed & self.kv_valid[:, None, :]
        return allowed.expand(batch, -1, -1)[:, None]

    def arrays(self) -> tuple[torch.Tensor | None, ...]:
        return (
            self.kv_valid,
            self.q_segment_ids,
            self.kv_segment_ids,
            self.q_positions,
            self.kv_positions,
            self.q_groups,
            self.kv_groups,
        )


class Unsupported(Exception):
    """A mask function this module cannot describe; the message says which part."""


def _leaf(*_):
    return True


_FACTORIES: tuple[tuple[Callable, str, tuple], ...] = (
    (mu.and_masks, "and", (_leaf,)),
    (mu.or_masks, "or", (_leaf,)),
    (mu.sliding_window_overlay, "window", (1,)),
    (mu.sliding_window_bidirectional_overlay, "window_inclusive", (1,)),
    (mu.chunked_overlay, "chunk", (1, None)),
    (mu.blockwise_overlay, "blocks", (None,)),
    (mu.padding_mask_function, "padding", (None,)),
    (mu.packed_sequence_mask_function, "packed", (None,)),
    (mu.remap_positions_for_packed_sequence, "remap", (_leaf, None)),
)
"""Every factory ``masking_utils`` composes masks from, its kind, and arguments to build one."""


def _key(code) -> tuple[str, str]:
    """Strings, not the code object: torch.compile guards on what the lookup reads."""
    return code.co_filename, code.co_qualname


_CODES: dict[tuple[str, str], str] = {
    _key(mu.causal_mask_function.__code__): "causal",
    _key(mu.bidirectional_mask_function.__code__): "all",
    **{_key(factory(*args).__code__): kind for factory, kind, args in _FACTORIES},
}
"""(file, qualified name) of each mask function's code -> kind."""


class TracedMaskFunction:
    """What a mask factory returns while dynamo traces (``trace_mask_factories``): the factory's
    own closure, called as it is, with the kind and the factory's arguments readable."""

    def __init__(self, mask_kind: str, mask_cells: dict[str, Any], function: Callable) -> None:
        self.mask_kind, self.mask_cells, self.function = mask_kind, mask_cells, function

    def __call__(self, batch_idx, head_idx, q_idx, kv_idx):
        return self.function(batch_idx, head_idx, q_idx, kv_idx)


def _substitute(factory: Callable, kind: str) -> None:
    """Register the graph substitute of one factory. It calls a copy of the factory (the
    factory itself would be substituted again) and names the arguments as the closure does."""
    copy = types.FunctionType(
        factory.__code__, factory.__globals__, factory.__name__, factory.__defaults__
    )
    parameters = inspect.signature(factory).parameters.values()
    names = tuple(p.name for p in parameters)
    packed = any(p.kind is p.VAR_POSITIONAL for p in parameters)  # and_masks(*mask_functions)

    def traced(*args):
        cells = {names[0]: args} if packed else dict(zip(names, args, strict=True))
        return TracedMaskFunction(kind, cells, copy(*args))

    torch.compiler.substitute_in_graph(factory, skip_signature_check=True)(traced)


_traced = False
"""Whether ``trace_mask_factories`` ran (substitutes are registered once per process). Without
them a compiled call gets the dense mask: the walk stops at the first closure dynamo built."""


def trace_mask_factories() -> None:
    """Make mask functions built under ``torch.compile`` readable by the walk (once per
    process; the substitutes return what the factories return, for every model). A second
    copy of this module finds them registered and reads the first copy's objects (the walk
    reads them by attribute, not by class)."""
    global _traced
    if _traced:
        return
    for factory, kind, _ in _FACTORIES:
        try:
            _substitute(factory, kind)
        except ValueError as exc:  # registered by another copy of this kernel
            log.debug("attention: %s", exc)
    _traced = True


def _cells(fn) -> dict[str, Any]:
    if not isinstance(fn, types.FunctionType):
        return fn.mask_cells
    try:
        closure = fn.__closure__ or ()
    except AttributeError:  # a closure dynamo built (no graph substitute made it readable)
        raise Unsupported(f"{fn.__qualname__} was built while compiling") from None
    return {
        name: cell.cell_contents
        for name, cell in zip(fn.__code__.co_freevars, closure, strict=True)
    }


@dataclass
class _Terms:
    """The mask function flattened: AND of ``terms``, one of which may be an OR of a rule and
    blockwise groups (kept in ``rule_or_groups``)."""

    causal: bool = False
    all_allowed: bool = False
    window: int | None = None  # kv > q - w, outside any OR
    window_inclusive: int | None = None  # |q - kv| <= w
    inner_window: int | None = None  # a window inside the OR with the groups
    chunk: tuple[int, torch.Tensor] | None = None
    padding: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    remap: torch.Tensor | None = None
    groups: torch.Tensor | None = None


def _kind(fn) -> str:
    if not isinstance(fn, types.FunctionType):
        kind = getattr(fn, "mask_kind", None)
    else:
        kind = _CODES.get(_key(fn.__code__))
    if kind is None:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise Unsupported(f"mask function {name} is not one of masking_utils' factories")
    return kind


def _and_terms(fn, terms: _Terms, inside_or: bool = False) -> None:
    kind = _kind(fn)
    cells = _cells(fn)
    if kind == "and":
        for part in cells["mask_functions"]:
            _and_terms(part, terms, inside_or)
    elif kind == "or":
        if inside_or:
            raise Unsupported("nested or_masks")
        _or_terms(cells["mask_functions"], terms)
    elif kind == "remap":
        if terms.remap is not None:
            raise Unsupported("positions remapped twice")
        terms.remap = cells["position_ids"]
        _and_terms(cells["mask_function"], terms, inside_or)
    elif kind == "causal":
        terms.causal = True
    elif kind == "all":
        terms.all_allowed = True
    elif kind == "window":
        setattr(terms, "inner_window" if inside_or else "window", int(cells["sliding_window"]))
    elif kind == "window_inclusive" and not inside_or:
        terms.window_inclusive = int(cells["sliding_window"])
    elif kind == "chunk" and not inside_or:
        terms.chunk = (int(cells["chunk_size"]), cells["left_padding"])
    elif kind == "padding" and not inside_or:
        terms.padding = cells["padding_mask"]
    elif kind == "packed" and not inside_or:
        terms.packed = cells["packed_sequence_mask"]
    else:
        raise Unsupported(f"{kind} inside or_masks")


def _or_terms(parts, terms: _Terms) -> None:
    """OR of one rule (causal, optionally windowed) and blockwise groups."""
    rule = [p for p in parts if _kind(p) != "blocks"]
    blocks = [p for p in parts if _kind(p) == "blocks"]
    if len(blocks) != 1 or len(rule) != 1:
        raise Unsupported("or_masks other than (rule | one blockwise_overlay)")
    if terms.groups is not None:
        raise Unsupported("two blockwise overlays")
    terms.groups = _cells(blocks[0])["block_sequence_ids"]
    inner = _Terms()
    _and_terms(rule[0], inner, inside_or=True)
    terms.causal |= inner.causal
    terms.all_allowed |= inner.all_allowed and not inner.causal
    terms.inner_window = inner.inner_window


def _flatten(mask_function) -> _Terms:
    terms = _Terms()
    _and_terms(mask_function, terms)
    if terms.remap is not None and terms.packed is None:
        raise Unsupported("positions remapped without the packed-sequence mask")
    return terms


def _rule(terms: _Terms) -> tuple[bool, int | None, bool]:
    """(causal, kernel window, window_bounds_groups) of the flattened terms."""
    if terms.all_allowed and not terms.causal and terms.groups is not None:
        terms.groups = None  # everything is allowed already
    windows = [w for w in (terms.window, terms.inner_window) if w is not None]
    if terms.window_inclusive is not None:
        if terms.causal or windows:
            raise Unsupported("an inclusive two-way window together with a causal rule")
        return False, terms.window_inclusive + 1, terms.groups is not None
    if not windows:
        return terms.causal, None, False
    if not terms.causal:
        raise Unsupported("a one-sided window (kv > q - w) without the causal rule")
    if len(windows) == 2 and windows[0] != windows[1]:
        raise Unsupported("two different windows")
    bounds_groups = terms.groups is not None and terms.window is not None
    return True, windows[0], bounds_groups


def _indices(offset, length: int, device) -> torch.Tensor:
    return torch.arange(length, device=device) + offset


def _take(values: torch.Tensor, index: torch.Tensor, batch: int) -> torch.Tensor:
    """values [B or 1, L] at index [S] -> int32 [B, S]."""
    return values.expand(batch, -1)[:, index].to(torch.int32)


def _floor_div(x: torch.Tensor, divisor: int) -> torch.Tensor:
    return torch.div(x, divisor, rounding_mode="floor")


def _renumber(pairs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One int32 id per position for tuples of non-decreasing ids [B, S] (a new id wherever any
    of them changes)."""
    changed = torch.zeros_like(pairs[0], dtype=torch.bool)
    for ids in pairs:
        changed[:, 1:] |= ids[:, 1:] != ids[:, :-1]
    return changed.to(torch.int32).cumsum(-1, dtype=torch.int32)


def describe(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor,
    kv_offset: int,
    mask_function,
    attention_mask: torch.Tensor | None,
    device,
) -> MaskDescription:
    """The description of ``sdpa_mask``'s arguments (raises ``Unsupported``)."""
    terms = _flatten(mask_function)
    causal, window, bounds_groups = _rule(terms)
    q_index = _indices(q_offset, q_length, device)
    kv_index = _indices(kv_offset, kv_length, device)
    batch = batch_size

    kv_valid = None
    for padding in (mu.prepare_padding_mask(attention_mask, kv_length, kv_offset), terms.padding):
        if padding is not None:
            padding = padding.to(device=device, dtype=torch.bool)
            valid = padding.expand(batch, -1)[:, kv_index]
            kv_valid = valid if kv_valid is None else kv_valid & valid

    q_ids = kv_ids = None
    if terms.chunk is not None:
        size, left_padding = terms.chunk
        left = left_padding.to(device).reshape(-1, 1)
        if terms.remap is not None:
            positions = terms.remap.expand(batch, -1).to(device)
            q_ids = kv_ids = _floor_div(positions - left, size)
        else:
            q_ids = _floor_div(q_index[None] - left, size).expand(batch, -1)
            kv_ids = _floor_div(kv_index[None] - left, size).expand(batch, -1)
    if terms.packed is not None:
        if q_length != kv_length or not isinstance(q_offset, int) or q_offset or kv_offset:
            raise Unsupported("packed sequences with a cache")
        packed = terms.packed.to(device).expand(batch, -1)
        q_ids = kv_ids = packed if q_ids is None else _renumber((packed, q_ids))
    if q_ids is not None:
        q_ids, kv_ids = q_ids.to(torch.int32).contiguous(), kv_ids.to(torch.int32).contiguous()

    q_groups = kv_groups = None
    if terms.groups is not None:
        if terms.chunk is not None:
            raise Unsupported("chunked attention with bidirectional blocks")
        groups = terms.groups.to(device)
        q_groups, kv_groups = _take(groups, q_index, batch), _take(groups, kv_index, batch)

    q_positions = kv_positions = None
    aligned = isinstance(q_offset, int) and q_offset + q_length == kv_offset + kv_length
    if (causal or window is not None) and not aligned:
        q_positions = q_index.to(torch.int32)[None].expand(batch, -1).contiguous()
        kv_positions = kv_index.to(torch.int32)[None].expand(batch, -1).contiguous()

    return MaskDescription(
        q_len=q_length,
        kv_len=kv_length,
        causal=causal,
        sliding_window=window,
        window_bounds_groups=bounds_groups,
        kv_valid=kv_valid,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_groups=q_groups,
        kv_groups=kv_groups,
    )


@functools.cache
def _log_dense(reason: str) -> None:
    log.warning("attention: Transformers' dense mask is used because %s", reason)


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=mu.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
) -> MaskDescription | torch.Tensor | None:
    """``AttentionMaskInterface`` entry: a ``MaskDescription``, or (for a mask function it cannot
    describe) ``sdpa_mask``'s dense mask, with a once-per-reason warning. A description that
    comes back (``generate`` prepares masks before the model's forward builds them again) is
    returned as it is, as Transformers returns a prepared 4-D mask."""
    if isinstance(attention_mask, MaskDescription):
        if (attention_mask.q_len, attention_mask.kv_len) != (q_length, kv_length):
            raise ValueError(
                f"a prepared MaskDescription for {attention_mask.q_len} queries and "
                f"{attention_mask.kv_len} keys was given where {q_length} and {kv_length} are "
                f"needed; pass the 2-D padding mask instead"
            )
        return attention_mask
    try:
        return describe(
            batch_size,
            q_length,
            kv_length,
            q_offset,
            kv_offset,
            mask_function,
            attention_mask,
            device,
        )
    except Unsupported as exc:
        if not torch.compiler.is_compiling():
            _log_dense(str(exc))
    return mu.sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        device=device,
        **kwargs,
    )


def describe_nested(mask: torch.Tensor) -> MaskDescription | None:
    """A model's own [B, 1, Sq, Sk] mask whose visible-key sets are nested across queries, as
    positions, or None. Mllama's cross-attention mask is one: a text token sees every tile of
    the images up to its own, and a token before any image sees all keys (Mllama unmasks such
    rows). A query's position is how many keys it sees, a key's the fewest any query that sees
    it sees: then ``key position <= query position`` is the mask if the sets are nested, which
    is checked, in O(Sq x Sk) on the mask the model built (no O(S^2) op in attention).

    Additive masks must hold only 0 and the dtype's minimum; every query must see a key (a fully
    masked row's convention differs between eager and SDPA). Not while compiling: the check
    reads its result on the host."""
    if mask.dim() != 4 or mask.shape[1] != 1 or torch.compiler.is_compiling():
        return None
    if mask.dtype == torch.bool:
        visible = mask[:, 0]
    else:
        visible = mask[:, 0] == 0
        if not (visible | (mask[:, 0] == torch.finfo(mask.dtype).min)).all():
            return None
    seen = visible.sum(-1, dtype=torch.int32)  # [B, Sq]
    if not (seen > 0).all():
        return None
    q_len, kv_len = visible.shape[1:]
    levels = torch.where(visible, seen[:, :, None], kv_len + 1).amin(1)  # [B, Sk]
    if not torch.equal(levels[:, None, :] <= seen[:, :, None], visible):
        return None
    return MaskDescription(
        q_len, kv_len, causal=True, q_positions=seen, kv_positions=levels.to(torch.int32)
    )

"""Group metadata for the Pallas kernels: which (row tile, group) pair each grid step visits.

Group sizes are data, so the grid cannot depend on them. Rows are sorted by group, so the groups
cut the ``cdiv(m, tm)`` row tiles at no more than ``E - 1`` places: ``cdiv(m, tm) + E - 1`` visits
always suffice. Each visit names a row tile, a group and the rows ``[start, end)`` of that group
inside the tile; the kernels mask the other rows. Visits past the last useful one repeat the last
tile and group with an empty row range, so their blocks are already in VMEM and nothing is copied.
All of this is computed by XLA from ``group_sizes`` and handed to the kernel as scalar prefetch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupBounds(NamedTuple):
    """First row and one-past-last row of every group."""

    starts: jax.Array
    ends: jax.Array


class Schedule(NamedTuple):
    """Per-visit metadata, each an int32 array of ``num_visits`` entries."""

    tiles: jax.Array
    groups: jax.Array
    row_starts: jax.Array
    row_ends: jax.Array


def group_bounds(group_sizes: jax.Array, rows: int) -> GroupBounds:
    """Row ranges of the groups: negative sizes count as 0, rows past ``rows`` are dropped."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return GroupBounds(starts, ends)


def sanitized_sizes(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Group sizes that every implementation reads the same way (see ``group_bounds``)."""
    bounds = group_bounds(group_sizes, rows)
    return bounds.ends - bounds.starts


def num_visits(rows: int, num_groups: int, tile_rows: int) -> int:
    """Grid length over row tiles: enough for any split of ``rows`` into ``num_groups`` groups."""
    return cdiv(rows, tile_rows) + num_groups - 1


def cdiv(a, b: int):
    """Ceiling division for Python ints and non-negative integer arrays."""
    return (a + b - 1) // b


def _visits_per_group(bounds: GroupBounds, tile_rows: int, empty_visits: int):
    """First tile and number of visits of each group; empty groups get ``empty_visits`` visits."""
    nonempty = bounds.ends > bounds.starts
    first_tile = bounds.starts // tile_rows
    last_tile = (bounds.ends - 1) // tile_rows
    counts = jnp.where(nonempty, last_tile - first_tile + 1, empty_visits)
    return first_tile, counts


def _locate(counts: jax.Array, visits: int):
    """For each visit index: its group (by running count), its index within the group, and the
    number of visits all groups use together."""
    ends = jnp.cumsum(counts)
    v = jnp.arange(visits, dtype=jnp.int32)
    group = jnp.searchsorted(ends, v, side="right").astype(jnp.int32)
    group = jnp.minimum(group, counts.shape[0] - 1)
    within = v - (ends[group] - counts[group])
    return v, group, within, ends[-1]


def _row_range(bounds: GroupBounds, group, tile, tile_rows: int, active):
    start = jnp.maximum(bounds.starts[group], tile * tile_rows)
    end = jnp.minimum(bounds.ends[group], (tile + 1) * tile_rows)
    return jnp.where(active, start, 0), jnp.where(active, end, 0)


def gmm_schedule(group_sizes: jax.Array, rows: int, tile_rows: int) -> Schedule:
    """Visits for ``gmm``: ordered by row tile, so each output tile's visits are consecutive.

    Row tiles no group reaches (``sum(group_sizes) < rows``) get one visit with an empty range,
    which writes zeros.
    """
    num_tiles = cdiv(rows, tile_rows)
    visits = num_visits(rows, group_sizes.shape[0], tile_rows)
    bounds = group_bounds(group_sizes, rows)
    first_tile, counts = _visits_per_group(bounds, tile_rows, empty_visits=0)
    v, group, within, used = _locate(counts, visits)
    covered_tiles = cdiv(bounds.ends[-1], tile_rows)
    in_group = v < used
    group_tile = first_tile[group] + within
    # After the group visits: one visit per uncovered tile, then padding on the last tile.
    tail_tile = jnp.minimum(covered_tiles + v - used, num_tiles - 1)
    tiles = jnp.where(in_group, group_tile, tail_tile)
    last_group = _last_nonempty_group(bounds)
    groups = jnp.where(in_group, group, last_group)
    row_starts, row_ends = _row_range(bounds, group, tiles, tile_rows, in_group)
    return Schedule(tiles, groups, row_starts, row_ends)


def tgmm_schedule(group_sizes: jax.Array, rows: int, tile_rows: int) -> Schedule:
    """Visits for ``tgmm``: ordered by group, so each group's output block is visited in a run.

    Empty groups get one visit with an empty range, which writes their zero gradient.
    """
    num_tiles = cdiv(rows, tile_rows)
    visits = num_visits(rows, group_sizes.shape[0], tile_rows)
    bounds = group_bounds(group_sizes, rows)
    first_tile, counts = _visits_per_group(bounds, tile_rows, empty_visits=1)
    v, group, within, used = _locate(counts, visits)
    real = v < used
    nonempty = bounds.ends[group] > bounds.starts[group]
    # Padding visits repeat the last real visit (group E-1, its last tile).
    within = jnp.where(real, within, counts[group] - 1)
    tiles = jnp.minimum(first_tile[group] + within, num_tiles - 1)
    row_starts, row_ends = _row_range(bounds, group, tiles, tile_rows, real & nonempty)
    return Schedule(tiles, group, row_starts, row_ends)


def _last_nonempty_group(bounds: GroupBounds) -> jax.Array:
    index = jnp.arange(bounds.starts.shape[0], dtype=jnp.int32)
    return jnp.max(jnp.where(bounds.ends > bounds.starts, index, 0))

"""``Mamba2ScanMixer``: runs the host Mamba-2 mixer's own forward (Mamba2, Bamba, Nemotron-H,
Falcon-H1, GraniteMoeHybrid, Zamba2) with its two scan slots filled by this kernel's ops:
``mamba2_chunk_scan`` (Transformers' name for the ``mamba_chunk_scan_combined`` hub slot) and
``mamba2_selective_state_update`` (``selective_state_update``).

How: the stock forward is cloned once per class with those two module globals replaced (the
decorators around it, Transformers' deprecated-argument renaming and accelerate's hooks, are
cloned with it), so projections, the convolution, the cache bookkeeping, the gated norm and the
model-specific multipliers stay the model's own code, and nothing global is patched.

The slots take the calls Transformers' wrapped fallbacks take and do what they do: keyword
arguments the fallback does not name are dropped (as its wrapper drops them), packed sequences
(``seq_idx``, ``cu_seqlens``) are refused as the fallback refuses them (the mixer's convolution
would mix the sequences anyway), the decode step writes the new state over the cache tensor in
place, and the chunked scan returns float32. A ``z`` gate in the chunked call is refused (the
fallback ignores it, mamba-ssm applies it; no 5.24 model passes one). ``mamba2_split_conv1d_scan_
combined`` (the fused training path) stays the fallback, which returns None, so training runs the
unfused path through the chunked slot, as stock does.

The convolution slots (``causal_conv1d_fn`` / ``causal_conv1d_update``) are the module's own when
kernelize filled them there (``function_slots``, from the causal-conv1d kernel, as for
``GatedDeltaNet``), else the model module's: other models of the class keep theirs.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import types

import torch

from . import api

mamba_chunk_scan_combined = api.mamba_chunk_scan_combined.torch
selective_state_update = api.selective_state_update.torch

CHUNK_SLOT = "mamba2_chunk_scan"
DECODE_SLOT = "mamba2_selective_state_update"
PACKING = ("seq_idx", "cu_seqlens")


def _refuse_packing(slot: str, kwargs: dict) -> None:
    packing = [name for name in PACKING if kwargs.get(name) is not None]
    if packing:
        raise ValueError(
            f"{slot}: packed sequences ({', '.join(packing)}) are refused, as Transformers' own "
            "fallback refuses them: the mixer's convolution would mix the sequences; pad instead"
        )


def chunk_scan_slot(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    z: torch.Tensor | None = None,
    **kwargs,
):
    """Transformers' ``mamba2_chunk_scan`` call on ``mamba_chunk_scan_combined``."""
    _refuse_packing(CHUNK_SLOT, kwargs)
    if z is not None:
        raise NotImplementedError(
            f"{CHUNK_SLOT}: a z gate is refused: Transformers' fallback ignores it and mamba-ssm "
            "applies it, so there is no stock result to match"
        )
    low, high = (float(v) for v in dt_limit)
    y, final = mamba_chunk_scan_combined(
        hidden_states,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        initial_states,
        None,
        int(chunk_size),
        bool(dt_softplus),
        low,
        None if math.isinf(high) else high,
    )
    return (y, final) if return_final_states else y


def state_update_slot(
    state: torch.Tensor,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    z: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Transformers' ``mamba2_selective_state_update`` call on ``selective_state_update``; the
    new state is copied over ``state`` (the cache tensor), as the fallback does."""
    _refuse_packing(DECODE_SLOT, kwargs)
    y, new_state = selective_state_update(
        state, hidden_states, dt, A, B, C, D, z, dt_bias, bool(dt_softplus)
    )
    state.copy_(new_state)
    return y


SLOTS = {CHUNK_SLOT: chunk_scan_slot, DECODE_SLOT: state_update_slot}
CONV_SLOT, CONV_UPDATE_SLOT = CONV_SLOTS = ("causal_conv1d_fn", "causal_conv1d_update")


@functools.cache
def _conv_slot(fn):
    """``fn`` (a filled ``causal_conv1d_fn``) taking the Mamba mixers' call, which passes the
    mixer's ``**kwargs`` on: packing refused, the other keywords dropped (the fallback drops
    them)."""

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        _refuse_packing(CONV_SLOT, kwargs)
        return fn(hidden_states, weight, bias, activation=activation)

    return causal_conv1d_fn


def _filled_conv(module: torch.nn.Module) -> tuple[tuple[str, object], ...]:
    """The convolution slots kernelize filled on ``module``, as (global name, function) pairs;
    none when it filled none (the model module's functions then run)."""
    conv, update = (module.__dict__.get(name) for name in CONV_SLOTS)
    if not (callable(conv) and callable(update)):
        return ()
    return ((CONV_SLOT, _conv_slot(conv)), (CONV_UPDATE_SLOT, update))


def _with_globals(fn, replacements: dict):
    """``fn`` (and the decorator wrappers around it, down its ``__wrapped__`` chain) rebuilt so the
    innermost function reads ``replacements`` instead of its module's globals of those names."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        namespace = {**fn.__globals__, **replacements}
        clone = types.FunctionType(
            fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__
        )
        clone.__kwdefaults__ = fn.__kwdefaults__
        return functools.wraps(fn)(clone)
    new_inner = _with_globals(inner, replacements)
    cells = fn.__closure__ or ()
    holding = [i for i, cell in enumerate(cells) if cell.cell_contents is inner]
    if len(holding) != 1:
        raise TypeError(f"{fn.__qualname__}: cannot find the wrapped function in its closure")
    closure = tuple(
        types.CellType(new_inner) if i == holding[0] else cell for i, cell in enumerate(cells)
    )
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone = functools.wraps(fn)(clone)
    clone.__wrapped__ = new_inner
    return clone


@functools.cache
def filled_forward(cls: type, conv: tuple[tuple[str, object], ...] = ()):
    """``cls.forward`` with the scan slots filled, and the convolution slots ``conv`` (built once
    per class and convolution functions)."""
    return _with_globals(cls.forward, {**SLOTS, **dict(conv)})


class Mamba2ScanMixer(torch.nn.Module):
    """A Transformers Mamba-2 mixer's own forward, its scan on kernel-hub's ops."""

    has_backward = True  # the chunked op's backward is exact (XLA); decode is inference only
    can_torch_compile = False  # the cache's state bookkeeping is Python, as in GatedDeltaNet

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        return filled_forward(type(self), _filled_conv(self))(
            self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
        )

    forward.function_slots = CONV_SLOTS  # read by kernelize: it fills these on the module


def _innermost(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _mixer_problem(module: torch.nn.Module) -> str | None:
    """Why ``Mamba2ScanMixer`` cannot serve this module, or None."""
    stock = sys.modules.get(type(module).__module__)
    missing = [name for name in SLOTS if not callable(getattr(stock, name, None))]
    if missing:
        return f"its module defines no {', '.join(missing)}"
    names = set(_innermost(type(module).forward).__code__.co_names)
    if not names & set(SLOTS):
        return f"its forward calls neither {' nor '.join(SLOTS)}"
    try:
        filled_forward(type(module))
    except TypeError as exc:
        return f"its forward cannot be rebuilt with the slots filled: {exc}"
    signature = inspect.signature(_innermost(type(module).forward))
    if list(signature.parameters)[:4] != ["self", "hidden_states", "cache", "attention_mask"]:
        return f"its forward takes {signature}, not (hidden_states, cache, attention_mask, ...)"
    return None


MODULE_CHECKS = {"Mamba2ScanMixer": _mixer_problem}

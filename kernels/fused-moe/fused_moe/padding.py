"""Expert weights padded once to the TPU's lane width (torch side), so no call relayouts them.

A TPU array whose minor dimension is not a multiple of 128 gets a compact layout (e.g. GPT-OSS's
``down_proj`` [E, I, 2880] is stored ``{0,2,1}``, experts on lanes); the kernel reads row-major
blocks, so XLA copied the whole weight on every call. ``prepare`` zero-pads H (and I where I is a
minor axis) to a multiple of 128 once, and keeps the module's parameters as views of the padded
storage: their shapes and values stay the stock ones (the stock forward, ``state_dict`` and
in-place loads work as before; memory grows by the padding only). Each call pads the activations
(``[T, H]``, small) and slices the output; padded rows and columns are zero, so results are
exact (a padded intermediate column gives act(0, 0) = 0 for every gated activation).

Applies to float and int8 weights in plain torch storage. Left as they are: fp8 and w8a8 (their
H and I are multiples of 128 already), mxfp4 (packed bytes and scales need another layout), and
weights a view cannot share storage with (tensor subclasses). A call that needs gradients reads
the parameters themselves (the padded storage is outside autograd).
"""

from __future__ import annotations

import torch

from . import quantized
from .blocks import lane_padded

PADDED = "_kernel_hub_padded"
"""Module attribute: {"extra": padded H - H, "tensors": the padded tensors by name}."""
_PADDABLE = (None, "int8")


def sizes(module: torch.nn.Module) -> tuple[int, int, int, int]:
    """(H, padded H, I, padded I) of an experts module (``blocks.lane_padded``)."""
    transposed = getattr(module, "is_transposed", False)
    gate_up = module.gate_up_proj
    hidden = gate_up.shape[1] if transposed else gate_up.shape[2]
    inter = (gate_up.shape[2] if transposed else gate_up.shape[1]) // 2
    interleaved = not getattr(module, "is_concatenated", True)
    padded = lane_padded(hidden, inter, transposed=transposed, interleaved=interleaved)
    return hidden, padded[0], inter, padded[1]


def _pad_axis(t: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[axis] = size
    out = t.new_zeros(shape)
    out.narrow(axis, 0, t.shape[axis]).copy_(t)
    return out


def _view_of(padded: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The leading ``shape`` block of ``padded`` (a view on its storage)."""
    view = padded
    for axis, size in enumerate(shape):
        view = view.narrow(axis, 0, size)
    return view


def _padded_tensors(module: torch.nn.Module, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """Zero-padded copies of the module's expert tensors, by attribute name."""
    transposed = getattr(module, "is_transposed", False)
    gate_axis, down_axis = (1, 2) if transposed else (2, 1)
    names = ["gate_up_proj", "down_proj"]
    if getattr(module, "has_bias", False):
        names += ["gate_up_proj_bias", "down_proj_bias"]
    if quantized.kind(module) == "int8":
        names += ["gate_up_proj_scale", "down_proj_scale"]
    out = {}
    for name in names:
        t = getattr(module, name).detach()
        if name.startswith("gate_up"):  # 2I on axis 2 / 1 (weight) or 1 (bias, scale)
            i_axis = (2 if transposed else 1) if name == "gate_up_proj" else 1
            t = _pad_axis(t, i_axis, 2 * inter)  # zero (gate, up) pairs at the end
            if name == "gate_up_proj":
                t = _pad_axis(t, gate_axis, hidden)
        elif name == "down_proj":
            t = _pad_axis(_pad_axis(t, down_axis, hidden), 3 - down_axis, inter)
        else:  # down bias / scale [E, H]
            t = _pad_axis(t, 1, hidden)
        out[name] = t
    return out


def prepare(module: torch.nn.Module) -> bool:
    """Pad the module's expert tensors once (see the module docstring); True if it did. Run at
    kernelize time, never inside a compiled forward."""
    module.__dict__.pop(PADDED, None)
    if quantized.kind(module) not in _PADDABLE:
        return False
    hidden, padded_hidden, inter, padded_inter = sizes(module)
    if (hidden, inter) == (padded_hidden, padded_inter):
        return False
    params = [getattr(module, p) for p in ("gate_up_proj", "down_proj")]
    if any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in params):
        return False
    tensors = _padded_tensors(module, padded_hidden, padded_inter)
    for name, padded in tensors.items():
        old = getattr(module, name)
        view = _view_of(padded, old.shape)
        if isinstance(old, torch.nn.Parameter):
            setattr(module, name, torch.nn.Parameter(view, requires_grad=old.requires_grad))
        else:
            setattr(module, name, view)
    setattr(module, PADDED, {"extra": padded_hidden - hidden, "tensors": tensors})
    return True


def _current(module: torch.nn.Module, prepared: dict) -> bool:
    """Whether the parameters still live on the padded storage (a ``.to()`` or a replaced
    parameter moves them off it). Not checkable while compiling: kernelize prepared them."""
    if torch.compiler.is_compiling():
        return True
    return all(
        getattr(module, name).data_ptr() == t.data_ptr() for name, t in prepared["tensors"].items()
    )


def kernel_tensors(module: torch.nn.Module) -> tuple[tuple, int]:
    """(the tensors the kernel reads, as ``quantized.expert_tensors``, and how many zero columns
    the activations need: padded H - H, 0 when they are the module's own tensors)."""
    tensors = quantized.expert_tensors(module)
    prepared = getattr(module, PADDED, None)
    if prepared is None or (torch.is_grad_enabled() and tensors[0].requires_grad):
        return tensors, 0
    if not _current(module, prepared) and not prepare(module):
        return quantized.expert_tensors(module), 0
    prepared = getattr(module, PADDED)
    padded = prepared["tensors"]
    names = ["gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"]
    names += ["gate_up_proj_scale", "down_proj_scale"]
    picked = tuple(None if t is None else padded[n] for n, t in zip(names, tensors, strict=True))
    return picked, prepared["extra"]

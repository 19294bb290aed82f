"""Expert weights padded once to the TPU's lane width (torch side), so no call relayouts them.

A TPU array whose minor dimension is not a multiple of 128 gets a compact layout (e.g. GPT-OSS's
``down_proj`` [E, I, 2880] is stored ``{0,2,1}``, experts on lanes); the kernel reads row-major
blocks, so XLA copied the whole weight on every call. ``prepare`` zero-pads H (and I where I is a
minor axis: ``blocks.lane_padded``) once, and keeps the module's parameters as views of the
padded storage: their shapes and values stay the stock ones (the stock forward, ``state_dict``
and in-place loads work as before; memory grows by the padding only). Each call pads the
activations (``[T, H]``, small) and slices the output; padded rows and columns are zero, so
results are exact (a padded intermediate column gives act(0, 0) = 0 for every gated activation).

Float, int8 and mxfp4 weights in plain torch storage. mxfp4 pads H and I to 128 bytes (256
values; GPT-OSS: 2880 -> 3072, which also gives the kernel intermediate blocks that divide I)
and its scale groups to 128 (zero bytes decode to 0; groups past the bytes are never read).
Left as they are: fp8 and w8a8 (H and I are multiples of 128 already), and weights a view
cannot share storage with (tensor subclasses). A call that needs gradients reads the
parameters themselves (the padded storage is outside autograd).
"""

from __future__ import annotations

import torch

from . import quantized
from .blocks import LANES, lane_padded
from .quant import MX_GROUP

PADDED = "_kernel_hub_padded"
"""Module attribute: {"extra": padded H - H, "tensors": the padded tensors by name}."""
_PADDABLE = (None, "int8", "mxfp4")


def sizes(module: torch.nn.Module) -> tuple[int, int, int, int]:
    """(H, padded H, I, padded I) of an experts module (``blocks.lane_padded``)."""
    transposed = getattr(module, "is_transposed", False)
    packing = 2 if quantized.kind(module) == "mxfp4" else 1
    gate_up = module.gate_up_proj
    hidden = gate_up.shape[1] if transposed else gate_up.shape[2] * packing
    inter = (gate_up.shape[2] if transposed else gate_up.shape[1]) // 2
    interleaved = not getattr(module, "is_concatenated", True)
    padded = lane_padded(hidden, inter, transposed=transposed, interleaved=interleaved,
                         packing=packing)  # fmt: skip
    return hidden, padded[0], inter, padded[1]


def _shapes(module: torch.nn.Module, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """Padded shape of each expert tensor the kernel reads, by attribute name. Every padding
    is a trailing block (interleaved gate/up pairs at the end), so the stock tensor is the
    leading block of the padded one."""
    kind = quantized.kind(module)
    experts = module.gate_up_proj.shape[0]
    packing = 2 if kind == "mxfp4" else 1
    if getattr(module, "is_transposed", False):
        shapes = {
            "gate_up_proj": (experts, hidden, 2 * inter),
            "down_proj": (experts, inter, hidden),
        }
    else:
        shapes = {
            "gate_up_proj": (experts, 2 * inter, hidden // packing),
            "down_proj": (experts, hidden, inter // packing),
        }
    if getattr(module, "has_bias", False):
        shapes |= {"gate_up_proj_bias": (experts, 2 * inter), "down_proj_bias": (experts, hidden)}
    if kind == "int8":
        shapes |= {"gate_up_proj_scale": (experts, 2 * inter), "down_proj_scale": (experts, hidden)}
    if kind == "mxfp4":  # scale groups padded to whole lanes too (unread past the bytes)
        groups = lambda n: -(-n // MX_GROUP // LANES) * LANES
        shapes |= {
            "gate_up_proj_scales": (experts, 2 * inter, groups(hidden)),
            "down_proj_scales": (experts, hidden, groups(inter)),
        }
    return shapes


def _padded(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = t.new_zeros(shape)
    _view_of(out, t.shape).copy_(t)
    return out


def _view_of(padded: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The leading ``shape`` block of ``padded`` (a view on its storage)."""
    view = padded
    for axis, size in enumerate(shape):
        view = view.narrow(axis, 0, size)
    return view


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
    shapes = _shapes(module, padded_hidden, padded_inter)
    tensors = {n: _padded(getattr(module, n).detach(), shape) for n, shape in shapes.items()}
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
    parameter moves them off it). Not checkable while compiling (dynamo cannot trace storage
    pointers): a compiled model whose weights are replaced must be kernelized again."""
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
    kind = quantized.kind(module)
    names += [quantized.scale_name(kind, p) if kind else "" for p in ("gate_up_proj", "down_proj")]
    picked = tuple(None if t is None else padded[n] for n, t in zip(names, tensors, strict=True))
    return picked, prepared["extra"]

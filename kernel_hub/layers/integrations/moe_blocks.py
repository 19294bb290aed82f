"""MoE blocks whose experts are not behind Transformers' ``ExpertsInterface`` (Llama 4's
``Llama4TextMoe``): switched per module to a MoE kernel's experts function where a probe shows
the block computes the one form served here.

The form (``InputScaledMoE``): the router returns ``(scores [T, E], logits [T, E])`` with scores
zero outside ``topk(logits, router.top_k)``; each expert runs on the input scaled by its score
(not its output: Llama 4 applies the sigmoid router score before the experts); the experts are
``down_e(up * act_fn(gate))`` with ``gate, up = (x @ gate_up_proj[e]).chunk(2, -1)`` on
``[E, in, out]`` weights; the block returns ``(shared_expert(x) + sum of the experts' outputs,
logits)``. The switched forward calls the module's own router and shared expert (the routing
math is the stock's own), takes each token's top-k experts from the logits as the router does,
and runs the scaled rows through the kernel's ``experts_forward`` (moe-gemm for training,
fused-moe for inference) with combine weights of 1.

Which form a block computes is decided by values, never by class name: the block's class
forward runs on a twin (instances of the module's own block, router and experts classes,
created without their ``__init__``, holding small f64 weights, a stand-in activation ``sin`` so
a misplaced activation shows, and a stand-in shared expert), for top-1 and top-2 routing, and
must match the switched forward run with a plain torch experts function. Near misses (the score
on the experts' output, a dense softmax router, no shared expert or one on the scaled input, gate
and up swapped) are refused with the reason.

The experts module is handed to the kernel's function with the layout flags Transformers'
``use_experts_implementation`` would set (``is_transposed``: ``[E, in, out]`` weights, gate then
up, no bias, ``_apply_gate``: ``up * act_fn(gate)``), set on the instance while the block is
switched and removed by ``unkernelize``; the kernel's ``module_problem`` then decides whether it
runs them exactly (e.g. fused-moe serves silu, gelu and tanh-gelu gates only).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

from .recording import recording_adapter

FORM = (
    "(shared_expert(x) + sum over the router's top-k experts e of "
    "down_e(up * act_fn(gate))(score_e * x), router_logits); gate, up = (score_e * x @ "
    "gate_up_proj[e]).chunk(2, -1), scores zero outside topk(router_logits, router.top_k)"
)
_STATE = "_kernel_hub_moe_block"
EXPERTS_FLAGS = {
    "has_gate": True,
    "is_transposed": True,
    "is_concatenated": True,
    "has_bias": False,
    "has_post_expert_norm": False,
}
"""The experts layout of the form, as ``use_experts_implementation`` names it (set on the
experts instance while switched, with ``_apply_gate``)."""
_FLAG_NAMES = (*EXPERTS_FLAGS, "_apply_gate")
_PROBE_SIZES = {"hidden": 8, "inter": 6, "experts": 4}


def _apply_gate(experts: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return up * experts.act_fn(gate)


def _install_flags(experts: torch.nn.Module) -> None:
    experts.__dict__.update(EXPERTS_FLAGS)
    experts.__dict__["_apply_gate"] = types.MethodType(_apply_gate, experts)


def _remove_flags(experts: torch.nn.Module) -> None:
    for name in _FLAG_NAMES:
        experts.__dict__.pop(name, None)


ExpertsFunction = Callable[
    [torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def moe_forward(
    block: torch.nn.Module, hidden_states: torch.Tensor, experts_function: ExpertsFunction
) -> tuple[torch.Tensor, torch.Tensor]:
    """The form, with the experts run by ``experts_function`` (an ``ExpertsInterface``
    function: experts, rows [N, H], expert ids [N, 1], combine weights [N, 1] -> [N, H])."""
    x = hidden_states.reshape(-1, block.hidden_dim)
    scores, logits = block.router(x)
    top_k = block.router.top_k
    index = torch.topk(logits, top_k, dim=1).indices
    rows = (x.unsqueeze(1) * scores.gather(1, index).unsqueeze(-1)).reshape(-1, x.shape[-1])
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    routed = experts_function(block.experts, rows, index.reshape(-1, 1), ones)
    out = block.shared_expert(x) + routed.reshape(x.shape[0], top_k, -1).sum(dim=1)
    return out, logits


def reference_experts(
    experts: torch.nn.Module, rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The experts of the form in plain torch, one row at a time (the probe's oracle)."""
    out = []
    for row, (expert,), (weight,) in zip(rows, index.tolist(), weights, strict=True):
        activated = _apply_gate(experts, row @ experts.gate_up_proj[expert])
        out.append(activated @ experts.down_proj[expert] * weight)
    return torch.stack(out) if out else rows.new_zeros(rows.shape)


def _switched_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    return moe_forward(self, hidden_states, self.__dict__[_STATE])


class _Sin(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x)


def _twin(cls: type, **state: Any) -> torch.nn.Module:
    """An instance of ``cls`` created without its ``__init__``, holding only ``state``."""
    twin = cls.__new__(cls)
    torch.nn.Module.__init__(twin)
    for name, value in state.items():
        if value is None:
            twin.register_parameter(name, None)
        else:
            setattr(twin, name, value)
    return twin


def _probe_block(classes: tuple[type, type, type], top_k: int, seed: int) -> torch.nn.Module:
    block_cls, router_cls, experts_cls = classes
    generator = torch.Generator().manual_seed(seed)
    h, i, e = (_PROBE_SIZES[n] for n in ("hidden", "inter", "experts"))

    def weight(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64))

    router = _twin(
        router_cls,
        weight=weight(e, h),
        bias=None,
        in_features=h,
        out_features=e,
        num_experts=e,
        top_k=top_k,
    )
    experts = _twin(
        experts_cls,
        gate_up_proj=weight(e, h, 2 * i),
        down_proj=weight(e, i, h),
        num_experts=e,
        hidden_size=h,
        intermediate_size=i,
        expert_dim=i,
        act_fn=_Sin(),
    )
    with torch.random.fork_rng(devices=[]):  # kernelize leaves the global RNG alone
        shared = torch.nn.Linear(h, h, bias=False, dtype=torch.float64)
    shared.weight = weight(h, h)
    return _twin(
        block_cls,
        hidden_dim=h,
        num_experts=e,
        top_k=top_k,
        router=router,
        experts=experts,
        shared_expert=shared,
    )


@dataclass(frozen=True)
class MoEBlockRecognition:
    served: bool
    reason: str | None = None


@functools.cache
def recognise_moe_block(
    block_cls: type, router_cls: type, experts_cls: type
) -> MoEBlockRecognition:
    """Whether a block of these classes computes the form (module docstring), on f64 twins."""
    x = torch.randn(2, 3, _PROBE_SIZES["hidden"], generator=torch.Generator().manual_seed(1))
    x = x.to(torch.float64)
    for top_k in (1, 2):
        block = _probe_block((block_cls, router_cls, experts_cls), top_k, seed=top_k)
        try:
            with torch.no_grad():
                stock = block_cls.forward(block, x)
                expected = moe_forward(block, x, reference_experts)
        except Exception as exc:  # other state, structure or arguments: not the form
            return MoEBlockRecognition(
                False,
                f"its forward is not the input-scaled MoE form ({FORM}): on a probe holding "
                f"router, experts and shared_expert: {type(exc).__name__}: {exc}",
            )
        if not _close(stock, expected):
            return MoEBlockRecognition(
                False,
                f"its forward is not the input-scaled MoE form ({FORM}): on a top-{top_k} "
                "probe its result differs (e.g. the router score on the experts' output, a "
                "dense router, another shared expert or gate/up order)",
            )
    return MoEBlockRecognition(True)


def _close(stock: Any, expected: tuple[torch.Tensor, torch.Tensor]) -> bool:
    if not (isinstance(stock, tuple) and len(stock) == 2):
        return False
    out, logits = stock
    return (
        isinstance(out, torch.Tensor)
        and out.shape == expected[0].shape
        and torch.allclose(out, expected[0], rtol=1e-10, atol=1e-10)
        and isinstance(logits, torch.Tensor)
        and torch.equal(logits, expected[1])
    )


def _classes(module: torch.nn.Module) -> tuple[type, type, type]:
    return type(module), type(module.router), type(module.experts)


def _layout_problem(block: torch.nn.Module) -> str | None:
    """Why this instance's state does not fit the form's layout, or None."""
    experts, router = block.experts, block.router
    gate_up, down = (getattr(experts, n, None) for n in ("gate_up_proj", "down_proj"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (gate_up, down)):
        return "its experts hold no 3-D gate_up_proj and down_proj"
    n, hidden, width = gate_up.shape
    if width % 2 or tuple(down.shape) != (n, width // 2, hidden):
        return (
            f"its experts' gate_up_proj {tuple(gate_up.shape)} and down_proj "
            f"{tuple(down.shape)} are not [E, H, 2I] and [E, I, H]"
        )
    if getattr(block, "hidden_dim", None) != hidden:
        return f"its hidden_dim {getattr(block, 'hidden_dim', None)} is not the experts' H {hidden}"
    top_k = getattr(router, "top_k", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= n:
        return f"its router's top_k is {top_k!r}, not an int in [1, {n}]"
    if "forward" in block.__dict__ and not _ours(block):
        return "its forward is already replaced on the instance"
    return None


def _is_candidate(module: torch.nn.Module) -> bool:
    """A Transformers block holding a router and experts that do not dispatch through
    ``ExpertsInterface`` (those are switched by it)."""
    if not type(module).__module__.startswith("transformers."):
        return False
    router, experts = (getattr(module, n, None) for n in ("router", "experts"))
    if not isinstance(router, torch.nn.Module) or not isinstance(experts, torch.nn.Module):
        return False
    forward = getattr(type(experts), "forward", None)
    while forward is not None:
        code = getattr(forward, "__code__", None)
        if code is not None and "experts_interface" in code.co_names + code.co_freevars:
            return False
        forward = getattr(forward, "__wrapped__", None)
    return True


@dataclass
class _Installed:
    label: str
    blocks: list[torch.nn.Module]


class InputScaledMoEInterface:
    """kernelize's switch of input-scaled MoE blocks, shaped like its ``ModelInterface``s: the
    MoE kernel's ``integrations`` provides ``register() -> name`` and ``experts_forward``;
    ``switch`` installs the per-block forwards; ``restore`` removes them."""

    name: str = "InputScaledMoE"
    kind: str = "experts"
    op: str = "moe-gemm"
    inference_op: str = "fused-moe"

    def dispatches(self, module: torch.nn.Module) -> bool:
        return _is_candidate(module) and _block_problem(module) is None

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        """Candidate blocks not of the form (or whose state does not fit it), with the reason:
        no kernel is tried for them."""
        return [
            (name, module, problem)
            for name, module in model.named_modules()
            if _is_candidate(module) and (problem := _block_problem(module))
        ]

    def integration(self, kernel: types.ModuleType) -> Any:
        adapter = recording_adapter(kernel, "experts_forward", _FUNCTIONS)
        if adapter is None or adapter.module_problem is None:
            return adapter
        return replace(adapter, module_problem=functools.partial(_experts_problem, adapter))

    def model_problem(self, model: torch.nn.Module, modules: list) -> str | None:
        return None  # blocks not of the form are unreached, never dispatched

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        state = model.__dict__.get(_STATE)
        in_place = state is not None and all(_ours(b) for b in state.blocks)
        return {"": state.label if in_place else None}

    def switch(self, model: torch.nn.Module, name: Any) -> str:
        function = _FUNCTIONS.get(name)
        if function is None:
            raise KernelHubError(f"integrations.register() returned {name!r}, not an experts name")
        blocks = [m for m in model.modules() if self.dispatches(m)]
        for block in blocks:
            _install_flags(block.experts)
            block.__dict__[_STATE] = function
            block.__dict__["forward"] = types.MethodType(_switched_forward, block)
        label = f"{name} (router score on the experts' input, shared expert)"
        model.__dict__[_STATE] = _Installed(label, blocks)
        return label

    def restore(self, model: torch.nn.Module, previous: dict[str, Any]) -> None:
        self.discard(model)

    def discard(self, model: torch.nn.Module) -> None:
        """Drop the forwards and flags still in place (a forward other code replaced since
        stays)."""
        state = model.__dict__.pop(_STATE, None)
        for block in state.blocks if state is not None else ():
            if _ours(block):
                del block.__dict__["forward"]
            block.__dict__.pop(_STATE, None)
            _remove_flags(block.experts)


def _ours(block: torch.nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _switched_forward and forward.__self__ is block


def _block_problem(block: torch.nn.Module) -> str | None:
    """Why a candidate block is not served by any kernel: not of the form, or its state does not
    fit it."""
    return recognise_moe_block(*_classes(block)).reason or _layout_problem(block)


def _experts_problem(adapter: Any, block: torch.nn.Module) -> str | None:
    """The kernel's own check of the block's experts, seen with the form's layout flags (set
    for the check only; ``switch`` sets them for good)."""
    experts = block.experts
    _install_flags(experts)
    try:
        return adapter.module_problem(experts)
    finally:
        _remove_flags(experts)


_FUNCTIONS: dict[str, ExpertsFunction] = {}
"""Registered name -> the kernel's ``experts_forward``."""

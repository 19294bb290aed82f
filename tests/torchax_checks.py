"""A tiny model on torchax's "jax" device with kernel-hub's layers; prints a JSON report.

Run in its own process by test_torchax.py, once for all models (the models share their small
JAX programs: the same sizes, so the second one reuses what the first compiled): importing torchax
renames torch's PrivateUse1 device and breaks torch.compile for the rest of a process. JAX runs on
the CPU here, so the Pallas kernels run in interpret mode (each kernel's CPU order is set to try
Pallas first).

Each model's report holds measured differences against the stock CPU model and what was seen
inside the kernel ops while that model ran; test_torchax.py holds the thresholds and what each
model should show.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
import torch
import torch.nn.functional as F

from kernel_hub import get_kernel, kernelize
from kernel_hub.models.tiny import VOCAB_SIZE, build_tiny_model

PALLAS_CALL_NAME = re.compile(r"pallas_call\[.*?\bname=(\w+)", re.S)
# Parameter kinds counted in the report (substring of the parameter name), so a test can see
# that the gradients compared include every norm, router and expert weight.
PARAM_KINDS = {"norm": "norm", "router": ".mlp.gate.", "experts": ".mlp.experts."}


def numpy_of(tensor) -> np.ndarray:
    """Host copy for comparisons, outside any kernel op."""
    return np.asarray(tensor.jax()) if hasattr(tensor, "jax") else tensor.detach().numpy()


def max_abs(a, b) -> float:
    return float(np.abs(numpy_of(a).astype(np.float64) - numpy_of(b)).max())


def is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


# --- Torch autograd through single ops on "jax" tensors, against plain torch on the CPU. ---


def _group_rows(group_sizes: torch.Tensor) -> list[slice]:
    bounds = itertools.accumulate(group_sizes.tolist(), initial=0)
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def reference_gmm(lhs, rhs, group_sizes):
    """Rows of each group times that group's weights; rows past the groups give zeros."""
    groups = _group_rows(group_sizes)
    tail = lhs.new_zeros(lhs.shape[0] - groups[-1].stop, rhs.shape[2])
    return torch.cat([*(lhs[rows] @ rhs[g] for g, rows in enumerate(groups)), tail])


def reference_tgmm(lhs, grad, group_sizes):
    """Each group's ``lhs[rows].T @ grad[rows]``."""
    return torch.stack([lhs[rows].T @ grad[rows] for rows in _group_rows(group_sizes)])


@dataclass(frozen=True)
class OpProbe:
    """One op called on "jax" tensors with torch autograd, and its plain-torch reference."""

    kernel: str
    """Registry op of the kernel that holds the torch op."""
    inputs: Callable[[], dict[str, torch.Tensor]]
    differentiable: tuple[str, ...]
    reference: Callable[..., torch.Tensor]
    static: dict


# Group sizes leave empty groups and rows past the last group (their output is zeros).
GROUP_SIZES = torch.tensor([4, 0, 5], dtype=torch.int32)
OP_PROBES = {
    "rms_norm": OpProbe(
        "rmsnorm",
        lambda: {"x": torch.randn(4, 64), "weight": torch.randn(64)},
        ("x", "weight"),
        lambda x, weight, eps: F.rms_norm(x, (x.shape[-1],), weight, eps),
        {"eps": 1e-6},
    ),
    "gmm": OpProbe(
        "moe-gemm",
        lambda: {
            "lhs": torch.randn(10, 16),
            "rhs": torch.randn(3, 16, 8),
            "group_sizes": GROUP_SIZES,
        },
        ("lhs", "rhs"),
        reference_gmm,
        {},
    ),
    "tgmm": OpProbe(
        "moe-gemm",
        lambda: {
            "lhs": torch.randn(10, 16),
            "grad": torch.randn(10, 8),
            "group_sizes": GROUP_SIZES,
        },
        ("lhs", "grad"),
        reference_tgmm,
        {},
    ),
}


def probe_errors(name: str, probe: OpProbe, kernel, torchax) -> dict[str, float]:
    """Max abs differences of the output and of each gradient of ``sum(out**2)``."""
    inputs = probe.inputs()
    on_jax = {n: t.to("jax") for n, t in inputs.items()}
    for n in probe.differentiable:
        on_jax[n].requires_grad_()
    out = getattr(kernel, name)(**on_jax, **probe.static)
    (out * out).sum().backward()
    with torchax.disable_temporarily():
        on_cpu = {n: t.clone().requires_grad_(n in probe.differentiable) for n, t in inputs.items()}
        expected = probe.reference(**on_cpu, **probe.static)
        (expected * expected).sum().backward()
    grads = {f"d{n}": max_abs(on_jax[n].grad, on_cpu[n].grad) for n in probe.differentiable}
    return {"out": max_abs(out, expected), **grads}


# --- The models. ---


@dataclass(frozen=True)
class ModelCase:
    """What a model needs: the layers swapped by hand and the ops probed on their own."""

    swaps: dict[str, tuple[str, str]]
    """Class-name suffix -> (registry op, layer name in that kernel's ``layers``)."""
    probes: tuple[str, ...]
    """Names in OP_PROBES."""


RMSNORM_SWAP = {"RMSNorm": ("rmsnorm", "RMSNorm")}
MODELS = {
    "llama": ModelCase(RMSNORM_SWAP, ("rms_norm",)),
    "mixtral": ModelCase(
        {**RMSNORM_SWAP, "Experts": ("moe-gemm", "MoEExperts")}, ("rms_norm", "gmm", "tgmm")
    ),
}


class OpWatch:
    """Watches the torchax runtime from inside kernel ops.

    Host copies and reads are caught four ways. The JAX function must receive the very arrays
    inside the input tensors and the output tensors must wrap the very arrays it returned (any
    host round trip makes new arrays). It must be a jitted function: inside, its arguments are
    tracers, so the kernel cannot read a value on the host at all (a group size, say). The host
    paths of torchax (``j2t_copy``/``t2j_copy``, behind ``.torch()``; a tensor's
    ``.numpy()``/``.tolist()``) and of JAX arrays (``item()``, and ``tolist()``, ``int()``,
    ``bool()``, ``jax.device_get`` through ``_value``) are counted while an op runs. JAX's
    device-to-host transfer guard is set to "disallow"; it fires on accelerators only, and it is
    what would catch ``np.asarray`` of a JAX array, which on the CPU backend reads the buffer
    directly (zero-copy) without passing through any of the above.

    Calls are counted per op and role (forward, backward) from the key the executor passes to
    the runtime.
    """

    def __init__(self, runtime, torchax) -> None:
        self.calls: dict[str, dict[str, int]] = {}
        self.host_copies = 0
        self.copied_inputs = 0
        self.copied_outputs = 0
        self.not_jitted = 0
        self.inside = False
        self._dispatch, self._call = runtime.dispatch, runtime.call
        runtime.dispatch, runtime.call = self.dispatch, self.call
        self.tensor_type = torchax.tensor.Tensor
        array_type = type(jax.numpy.zeros(()))
        host_paths = [
            (torchax.tensor.Environment, ("j2t_copy", "t2j_copy")),
            (self.tensor_type, ("numpy", "tolist")),
            (array_type, ("item",)),
        ]
        for owner, names in host_paths:
            for name in names:
                setattr(owner, name, self._counting(getattr(owner, name)))
        array_type._value = property(self._counting(array_type._value.fget))

    def reset(self) -> None:
        """Forget what earlier models' ops showed: each report holds its own model's."""
        self.calls = {}
        self.host_copies = self.copied_inputs = self.copied_outputs = self.not_jitted = 0

    def _counting(self, function):
        def counted(*args, **kwargs):
            if self.inside:
                self.host_copies += 1
            return function(*args, **kwargs)

        return counted

    def dispatch(self, implementation, args, kwargs):
        self.inside = True
        try:
            with jax.transfer_guard_device_to_host("disallow"):
                return self._dispatch(implementation, args, kwargs)
        finally:
            self.inside = False

    def call(self, jax_fn, tensors, *, key=None):
        qualname, role = key[:2]
        roles = self.calls.setdefault(qualname.rpartition("::")[2], {})
        roles[role] = roles.get(role, 0) + 1
        self.not_jitted += not hasattr(jax_fn, "lower")
        received, returned = [], []

        def spy(*arrays):
            received.extend(jax.tree.leaves(arrays))
            outputs = jax_fn(*arrays)
            returned.extend(jax.tree.leaves(outputs))
            return outputs

        result = self._call(spy, tensors, key=key)
        for tensor in jax.tree.leaves(list(tensors), is_leaf=is_tensor):
            # A View's array is computed on device from its base; only plain tensors hold one.
            if isinstance(tensor, self.tensor_type) and not any(
                tensor.jax() is array for array in received
            ):
                self.copied_inputs += 1
        wrapped = [t.jax() for t in jax.tree.leaves(result, is_leaf=is_tensor)]
        if len(wrapped) != len(returned):
            self.copied_outputs += max(len(wrapped), len(returned))
        else:
            self.copied_outputs += sum(w is not r for w, r in zip(wrapped, returned, strict=True))
        return result


class Logits(torch.nn.Module):
    """The model as a function of token ids alone (JAX traces arrays, not config flags)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def swap_layers(model, swaps, kernels) -> dict[str, int]:
    """Replace matching modules' forward by the kernel layer's, by hand (as kernelize() will)."""
    swapped = {}
    for module in model.modules():
        for suffix, (op, layer) in swaps.items():
            if type(module).__name__.endswith(suffix):
                layer_class = getattr(kernels[op].layers, layer)
                module.forward = types.MethodType(layer_class.forward, module)
                swapped[layer] = swapped.get(layer, 0) + 1
    return swapped


class RecordingSelection:
    """Records which implementation a kernel's implementation table picks."""

    def __init__(self, table) -> None:
        self.op = table.op
        self.chosen: set[str] = set()
        self._select = table.select
        table.select = self.select

    def select(self, *args, **kwargs):
        implementation = self._select(*args, **kwargs)
        self.chosen.add(implementation.name)
        return implementation


def main(model_names: list[str]) -> None:
    cases = [MODELS[name] for name in model_names]
    # Kernels load before torchax exists: their ops are registered on torchax's import.
    ops = {op for case in cases for op, _ in case.swaps.values()}
    ops |= {OP_PROBES[p].kernel for case in cases for p in case.probes}
    kernels = {op: get_kernel(op) for op in sorted(ops)}
    tables = [table for kernel in kernels.values() for table in kernel.KERNEL.implementation_tables]
    selections = [RecordingSelection(table) for table in tables]

    import torchax

    from kernel_hub.bridge.runtimes import torchax as torchax_runtime

    watch = OpWatch(torchax_runtime.RUNTIME, torchax)
    reports = {}
    for name in model_names:
        watch.reset()
        for selection in selections:
            selection.chosen.clear()
        reports[name] = check(name, kernels, tables, selections, watch)
    print(json.dumps(reports))


def check(model_name: str, kernels, tables, selections, watch: OpWatch) -> dict:
    """One model's report; ``watch`` and ``selections`` start empty."""
    case = MODELS[model_name]
    stock = build_tiny_model(model_name)
    ours = copy.deepcopy(stock)
    kernelized = copy.deepcopy(stock)
    swapped = swap_layers(ours, case.swaps, kernels)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB_SIZE, (2, 9))
    labels = torch.randint(0, VOCAB_SIZE, (2, 9))

    import torchax
    import torchax.interop

    env = torchax.default_env()
    torchax.enable_globally()
    ours.to("jax")
    kernelized.to("jax")
    kernelize_report = kernelize(kernelized, mode="inference")
    for table in tables:  # after kernelize, which re-applies the registry's order
        table.set_order("cpu", ("pallas", *(n for n in table.names if n != "pallas")))
    ids_jax, labels_jax = ids.to("jax"), labels.to("jax")

    def loss_of(logits, targets):
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))

    # Eager forward: every swapped layer is kernel-hub op calls on torchax tensors.
    logits = ours(ids_jax).logits
    with torchax.disable_temporarily():
        stock_logits = stock(ids).logits
        stock_loss = loss_of(stock_logits, labels)
        stock_loss.backward()
    stock_params = dict(stock.named_parameters())

    kernelized_logits = kernelized(ids_jax).logits

    # Torch autograd through each op on "jax" tensors: the forward op, then the backward op.
    op_errors = {
        name: probe_errors(name, OP_PROBES[name], kernels[OP_PROBES[name].kernel], torchax)
        for name in case.probes
    }

    # A sliced input reaches the op as a torchax View.
    wide = torch.randn(4, 96)
    weight = torch.randn(64)
    view = wide.to("jax")[:, :64]
    view_out = kernels["rmsnorm"].rms_norm(view, weight.to("jax"), 1e-6)
    with torchax.disable_temporarily():
        view_ref = F.rms_norm(wide[:, :64], (64,), weight, 1e-6)

    # Training step the torchax way: JAX autodiff over the model as one JAX function, eagerly
    # and under jax.jit; the kernels' custom_vjp supply their gradients.
    jittable = torchax.interop.JittableModule(Logits(ours))
    jit_logits = jittable(ids_jax)
    params = {name.removeprefix("model."): p.jax() for name, p in jittable.params.items()}

    def jax_loss(params, ids, labels):
        params = {f"model.{name}": value for name, value in params.items()}
        torch_params, torch_ids, torch_labels = env.j2t_iso((params, ids, labels))
        with env:
            out = jittable.functional_call("forward", torch_params, jittable.buffers, torch_ids)
            return env.t2j_iso(loss_of(out, torch_labels))

    value_and_grad = jax.value_and_grad(jax_loss)
    arguments = (params, ids_jax.jax(), labels_jax.jax())
    loss, grads = value_and_grad(*arguments)
    jit_loss, jit_grads = jax.jit(value_and_grad)(*arguments)
    jaxpr = str(jax.make_jaxpr(value_and_grad)(*arguments))

    def grad_error(grads) -> float:
        return max(
            float(np.abs(np.asarray(grads[n]) - stock_params[n].grad.numpy()).max()) for n in params
        )

    # Greedy generation, as in docs/running-on-tpu.md (before the SGD step changes the stock model).
    ours.eval()
    stock.eval()
    prompt = ids[:1, :5]
    generated = ours.generate(prompt.to("jax"), max_new_tokens=4, do_sample=False)
    with torchax.disable_temporarily():
        stock_generated = stock.generate(prompt, max_new_tokens=4, do_sample=False)

    # One SGD step on both models.
    lr = 0.5
    stepped = {n: np.asarray(params[n] - lr * grads[n]) for n in params}
    with torch.no_grad():
        for param in stock.parameters():
            param.sub_(lr * param.grad)
    step_error = max(
        float(np.abs(stepped[n] - stock_params[n].detach().numpy()).max()) for n in params
    )

    report = {
        "torchax_version": torchax.__version__,
        "model": model_name,
        "swapped_layers": swapped,
        "logits_type": type(logits).__name__,
        "logits_max_abs": max_abs(logits, stock_logits),
        "jit_logits_max_abs": max_abs(jit_logits, stock_logits),
        "kernelize_device": kernelize_report.device,
        "kernelize_swapped": kernelize_report.counts(),
        "kernelized_logits_max_abs": max_abs(kernelized_logits, stock_logits),
        "op_autograd_max_abs": op_errors,
        "view_input_type": type(view).__name__,
        "view_out_max_abs": max_abs(view_out, view_ref),
        "loss_abs": abs(float(loss) - float(stock_loss)),
        "jit_loss_abs": abs(float(jit_loss) - float(stock_loss)),
        "grad_max_abs": grad_error(grads),
        "jit_grad_max_abs": grad_error(jit_grads),
        "params_with_grad": len(params),
        "params_with_grad_by_kind": {
            kind: sum(part in n for n in params) for kind, part in PARAM_KINDS.items()
        },
        # A parameter whose stock gradient is zero (an expert no token reached) would compare
        # trivially equal.
        "params_with_zero_stock_grad": sorted(
            n for n in params if not np.abs(stock_params[n].grad.numpy()).max() > 0
        ),
        "step_max_abs": step_error,
        "kernels_in_training_step": sorted(set(PALLAS_CALL_NAME.findall(jaxpr))),
        "generated_tokens": numpy_of(generated).tolist(),
        "stock_generated_tokens": stock_generated.tolist(),
        "op_calls": watch.calls,
        "host_copies_inside_ops": watch.host_copies,
        "inputs_not_passed_as_is": watch.copied_inputs,
        "outputs_not_wrapped_as_is": watch.copied_outputs,
        "kernel_functions_not_jitted": watch.not_jitted,
        # the ops the model ran (a kernel's other tables, e.g. rmsnorm's gated_rms_norm, idle)
        "implementations": {s.op: sorted(s.chosen) for s in selections if s.chosen},
    }
    torchax.disable_globally()  # the next model starts from a process without torchax modes
    return report


if __name__ == "__main__":
    main(sys.argv[1:])

"""Hugging Face ``kernels`` layer mappings that load kernel-hub builds.

``kernels`` (0.17) swaps the forward of layers Transformers marks with
``use_kernel_forward_from_hub(NAME)`` for a layer of a hub build, chosen per device type by a
mapping ``{NAME: {device: LayerRepository(...)}}``. kernel-hub's hub builds carry the layout it
reads (``build/torch-cpu``, ``build/torch-tpu`` with ``backend: tpu``, branches ``vN``), so the
mapping below lets ``kernels.kernelize(model, device="tpu" | "cpu")`` (or Transformers'
``use_kernels=True`` with ``kernel_config``, where Transformers accepts the installed
``kernels``) load them, and ``hub_attention`` loads the attention build:

    with kernels.use_kernel_mapping(hub_layer_mapping()):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    model.set_attn_implementation(hub_attention("kernel-hub/attention"))

With the pinned pair (transformers 5.24.0 accepts only ``kernels>=0.18.2,<0.19``; 0.17.2 is
installed) Transformers marks nothing and refuses ``use_kernels=True`` and
``attn_implementation="org/repo"``; ``hub_layer_mapping`` warns so, and the layers must be
marked with ``kernels``' own functions first (docs/running-on-tpu.md). Transformers 5.24 marks
no experts class with ``use_kernel_forward_from_hub`` under any ``kernels`` (they dispatch
through ``ExpertsInterface``), so the mapping's ``MoEExperts`` reaches them only when marked.

What a user gives up against ``kernel_hub.kernelize``: ``kernels`` checks neither kernel-hub's
signatures nor the pinned publisher keys (0.17 verifies no file digest on load either; a lock
file pins commits only). What it checks instead is whether the Hub marks the repo's organisation
as a trusted kernel publisher, else ``trust_remote_code``; so the build is trusted as the hub
serves it, and a mirror or a compromised hub goes unnoticed. It also swaps by layer name
alone, without kernel-hub's bit-exact probe of each class's form (an ``RMSNorm``-named class that
rounds after the weight, as GPT-OSS/OLMo2 do, gets the Llama form: equal in f32, a rounding
apart in bf16; a ``rotary_pos_emb`` function that casts back or upcasts, as OLMo, ModernBERT and
Hunyuan-VL do, gets Llama's form likewise, and GPT-OSS's half-width form is refused at call
time). Importing this module imports ``kernels``; nothing else in kernel-hub does.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import warnings
from pathlib import Path
from typing import Any

from kernel_hub.declaration import KernelDeclaration
from kernel_hub.errors import KernelHubError
from kernel_hub.registry.registry import load_registry

DEVICES = ("tpu", "cpu")
"""Device types ``kernels`` selects kernel-hub's variants for: torch-tpu (TorchTPU), torch-cpu."""

FUNCTION_SLOTS = {"rotary_pos_emb": ("rotary", "ApplyRotaryPosEmb")}
"""Transformers' function slots (``use_kernel_forward_from_hub`` on a function, e.g. Llama's
``apply_rotary_pos_emb``) -> (registry op, the layer of its build that serves the slot). A
function slot is a layer to ``kernels`` 0.17 (``FuncRepository`` is deprecated there); kernel-hub's
own kernelize fills these slots without a layer, so the registry does not list them."""


def _major(specifier: Any) -> int:
    """The major version a ``>=X.Y,<Z`` range starts at: ``kernels`` fetches branch ``vX``."""
    lower = [s.version for s in specifier if s.operator in (">=", "==", "~=")]
    if not lower:
        raise KernelHubError(f"version range {specifier} has no lower bound to take a major from")
    return int(lower[0].split(".")[0])


def transformers_marks_nothing() -> str | None:
    """Why ``kernels.kernelize`` swaps no layer of a Transformers model with the installed pair,
    or None: Transformers' ``use_kernel_forward_from_hub`` marks layers only when the installed
    ``kernels`` is in the range that Transformers accepts, and is an inert stub otherwise."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        return None
    low, high = import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION
    return (
        f"transformers {importlib.metadata.version('transformers')} marks its layers for Hugging "
        f"Face kernels only with kernels>={low},<{high}; with kernels "
        f"{importlib.metadata.version('kernels')} its use_kernel_forward_from_hub does nothing, "
        "so kernels.kernelize swaps no layer of a Transformers model with this mapping and says "
        "nothing; from_pretrained(use_kernels=True) raises ValueError and "
        'attn_implementation="org/repo" raises ImportError. kernel_hub.kernelize(model) swaps '
        "them without the kernels package; or mark each class first with "
        "kernels.replace_kernel_forward_from_hub(cls, layer_name) and load attention with "
        "kernel_hub.layers.integrations.hf_kernels.hub_attention(repo)"
    )


def hub_layer_mapping(
    registry: str | Path | None = None,
    devices: tuple[str, ...] = DEVICES,
    trust_remote_code: bool | list[str] = False,
) -> dict[str, dict[str, Any]]:
    """``{layer name: {device: LayerRepository}}`` for every layer of every registry op with a hub
    repo, and for the function slots its ops serve (``FUNCTION_SLOTS``), at the major version its
    range starts at (``kernels`` resolves it to branch ``vN``).

    ``trust_remote_code`` goes to each ``LayerRepository``: ``kernels`` imports code only from
    organisations the Hub marks as trusted kernel publishers (it asks the Hub, which a mirror or a
    ``kernel-hub serve`` store cannot answer), or from the repos listed here.

    Warns when the installed Transformers and ``kernels`` do not work together
    (``transformers_marks_nothing``): the mapping would then swap nothing, silently."""
    from kernels import LayerRepository

    inert = transformers_marks_nothing()
    if inert is not None:
        warnings.warn(inert, UserWarning, stacklevel=2)

    unknown = set(devices) - set(DEVICES)
    if unknown:
        raise KernelHubError(
            f"devices {sorted(unknown)}: kernel-hub builds serve {', '.join(DEVICES)}"
        )
    slots_of = {op: (slot, layer) for slot, (op, layer) in FUNCTION_SLOTS.items()}
    mapping: dict[str, dict[str, Any]] = {}
    for entry in load_registry(registry):
        if entry.repo is None:
            continue
        slots = [(layer, layer) for layer in entry.layers]
        slots += [slots_of[entry.name]] if entry.name in slots_of else []
        for slot, layer in slots:
            mapping[slot] = {
                device: LayerRepository(
                    repo_id=entry.repo,
                    layer_name=layer,
                    version=_major(entry.version),
                    trust_remote_code=trust_remote_code,
                )
                for device in devices
            }
    return mapping


def hub_attention(
    repo: str = "kernel-hub/attention",
    version: int = 1,
    trust_remote_code: bool = False,
) -> str:
    """Load kernel-hub's attention build through ``kernels.get_kernel`` and register its
    Transformers ``AttentionInterface`` function (with its mask function); returns the name to
    pass as ``attn_implementation`` / ``model.set_attn_implementation(name)``.

    The route for a Transformers that refuses the installed ``kernels`` (5.24 with 0.17:
    ``attn_implementation="org/repo"`` raises ``ImportError`` in
    ``load_and_register_attn_kernel``); it works with a compatible pair too. The name is the repo
    with ``/`` spelled ``--``: an ``org/repo`` name would send Transformers to its own hub loader.
    ``trust_remote_code`` as for ``kernels.get_kernel``."""
    import kernels

    if "/" not in repo:
        raise KernelHubError(f"attention repo {repo!r}: expected an 'org/name' hub repo id")
    kernel = kernels.get_kernel(repo, version=version, trust_remote_code=trust_remote_code)
    label = f"{repo} v{version}"
    declared = vars(kernel).get("KERNEL")
    if not isinstance(declared, KernelDeclaration):
        raise KernelHubError(f"{label} declares no KERNEL: it is not a kernel-hub build")
    adapter = declared.adapter("transformers", label)
    if adapter is None:
        raise KernelHubError(
            f"{label} has no Transformers integration: it is not an attention build"
        )
    return adapter.register(repo.replace("/", "--"))

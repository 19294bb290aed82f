"""Training a kernelized model with ``transformers.Trainer``: ``KernelizeCallback``.

    trainer = Trainer(model=model, args=TrainingArguments(bf16=True, ...),
                      callbacks=[KernelizeCallback()])
    trainer.train()

Trainer moves the model to ``args.device`` in its ``__init__`` and only later, in ``train()``,
wraps it (Accelerate's mixed-precision forward on the top-level model) and compiles it
(``torch_compile=True``). ``on_init_end`` runs between the two, which is where kernelize must run:
on the device the kernels will see, before the compiled graph is traced. The mode is TRAINING,
plus TORCH_COMPILE when ``args.torch_compile`` is set (``torch_compile_backend`` and
``torch_compile_mode`` set it too); gradient checkpointing needs nothing more, since the swapped
forwards are pure and recompute identically. Kernel-hub's swaps are per-module forwards and
interface switches, so they survive ``train()``/``eval()`` and ``evaluate()``.

bf16/fp16 mixed precision: autocast does not reach custom ops, so kernel-hub's layers and
integrations follow what the stock op does under autocast themselves (attention runs in the
autocast dtype like SDPA; norms keep their input dtype as on the CPU); the weights stay f32.

Do not also set ``use_kernels=True`` on the model: Hugging Face ``kernels`` reverts forwards on
every mode switch. The callback refuses such a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from kernel_hub.errors import KernelHubError

from ..kernelize import kernelize
from ..modes import Mode
from ..report import KernelizeReport


def training_mode(args: TrainingArguments) -> Mode:
    """TRAINING, with TORCH_COMPILE when the Trainer will ``torch.compile`` the model."""
    return Mode.TRAINING | Mode.TORCH_COMPILE if args.torch_compile else Mode.TRAINING


class KernelizeCallback(TrainerCallback):
    """Kernelizes the Trainer's model after its device move, before it is wrapped or compiled.

    ``registry`` is passed to ``kernelize``; the report is kept in ``self.report`` (and logged).
    """

    def __init__(self, *, registry: str | Path | None = None):
        self.registry = registry
        self.report: KernelizeReport | None = None

    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any):
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            raise KernelHubError(
                f"KernelizeCallback: the Trainer passed model={type(model).__name__}, "
                "not a torch.nn.Module; give Trainer the model itself"
            )
        if getattr(model, "use_kernels", False):
            raise KernelHubError(
                "KernelizeCallback: the model has use_kernels=True (Hugging Face kernels), which "
                "re-applies its own forwards on every train()/eval() switch and would undo "
                "kernel-hub's; load the model without use_kernels"
            )
        self.report = kernelize(
            model, mode=training_mode(args), device=args.device, registry=self.registry
        )
        return control

"""Transformers causal LMs: the training loss from the hidden states, the logits never built.

A ``*ForCausalLM`` forward computes ``logits = lm_head(hidden)`` (``[tokens, vocab]``, gigabytes
at a 128k vocabulary) and hands them to ``ForCausalLMLoss``; a loss slot that receives logits is
too late to save that memory. So ``kernelize`` gives the model instance a forward that, in
training with ``labels`` (and the default ``logits_to_keep=0``),

1. runs the stock forward with ``labels=None`` and ``logits_to_keep`` an empty index, so the head
   projects no position, while a forward hook on the decoder keeps its ``last_hidden_state``;
2. computes the loss with the ``linear-cross-entropy`` kernel's ``causal_lm_loss`` from those
   hidden states and the head (label shift, ``shift_labels``, ``ignore_index`` and
   ``num_items_in_batch`` as ``ForCausalLMLoss``), plus ``router_aux_loss_coef * aux_loss`` where
   the stock forward adds the router's load-balancing loss (MoE models asked for router logits;
   the stock forward computes ``aux_loss`` without labels too, so step 1 returns it);
3. returns the stock output with that loss and **``logits=None``** (the logits are skipped:
   that is the point). Evaluation (``model.eval()``), calls without labels and calls with another
   ``logits_to_keep`` run the stock forward unchanged and return logits.

Exact or says no: before installing, the class's forward runs on a probe copy of the model whose
children are recorders (a child's plain attributes, such as Falcon-H1's ``lm_head_multiplier``,
read through; its output gives ``None`` for fields other decoders add, such as Gemma 4's
``shared_kv_states``), and must (a) call one child once and feed its ``last_hidden_state``
unchanged to the head, (b) post-process the logits only in a way the kernel implements (nothing,
Gemma 2/3/4's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``, Falcon-H1's ``lm_head_multiplier``), checked on values, (c) pass those
logits, the labels, the vocabulary size and the loss keywords to ``self.loss_function`` and
return its result as ``loss``, plus nothing or ``router_aux_loss_coef * aux_loss`` (checked on
values with the router logits asked for, where the forward or config takes
``output_router_logits``), and (d) project no position for an empty ``logits_to_keep``. The
model's ``loss_function`` must be Transformers' ``ForCausalLMLoss`` and its head a plain
``nn.Linear``. Anything else leaves the model alone with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kernel_hub.errors import KernelHubError

from .recording import recording_adapter

_STATE = "_kernel_hub_causal_lm_loss"
"""Instance attribute of a switched model: its ``_Installed``."""
_LOSS_KEYWORDS = ("num_items_in_batch", "ignore_index", "shift_labels")
"""The keywords of ``ForCausalLMLoss`` that change its result (its ``**kwargs`` are ignored)."""


class Refused(KernelHubError):
    """Why a causal LM keeps its stock loss."""


@dataclass(frozen=True)
class LogitForm:
    """Post-processing of the head's output: ``softcap * tanh(scale * logits / softcap)``."""

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def describe(self) -> str:
        parts = [f"logit_scale={self.scale:g}"] if self.scale != 1.0 else []
        parts += [f"softcap={self.softcap:g}"] if self.softcap is not None else []
        return ", ".join(parts) or "plain logits"


def candidate_forms(config: Any) -> list[LogitForm]:
    """Forms the kernel implements that this config could ask for (the probe picks one)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scales = [1.0]
    if isinstance(getattr(config, "logit_scale", None), (int, float)):
        scales.append(float(config.logit_scale))
    if isinstance(getattr(config, "logits_scaling", None), (int, float)) and config.logits_scaling:
        scales.append(1.0 / float(config.logits_scaling))
    if isinstance(getattr(config, "lm_head_multiplier", None), (int, float)):
        scales.append(float(config.lm_head_multiplier))
    caps: list[float | None] = [None]
    if isinstance(softcap, (int, float)) and softcap > 0:
        caps.append(float(softcap))
    return [LogitForm(s, c) for s in scales for c in caps]


def is_causal_lm(module: torch.nn.Module) -> bool:
    """A Transformers ``*ForCausalLM`` model (the candidates of this interface)."""
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel) and type(module).__name__.endswith("ForCausalLM")


# ------------------------------------------------------------------------------------------
# The probe.


class _Decoder(torch.nn.Module):
    """Stands in for a child of the probed model: records calls, returns fixed hidden states
    (and router logits); reads through to the child's plain attributes (numbers, flags, text)."""

    def __init__(self, child: torch.nn.Module, output: Any):
        super().__init__()
        object.__setattr__(self, "_child", child)
        object.__setattr__(self, "_output", output)
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._output

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        value = getattr(self.__dict__["_child"], name)
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise AttributeError(
                f"the probe's stand-in for {type(self._child).__name__} offers its plain "
                f"attributes only, not {name!r} ({type(value).__name__})"
            )
        return value


def _decoder_output(hidden: torch.Tensor, router_logits: tuple | None) -> Any:
    """The stand-in decoder's output: ``last_hidden_state`` and ``router_logits``; ``None`` for
    any other field a model's decoder output has (Gemma 4's ``shared_kv_states``)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class _Output(BaseModelOutputWithPast):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    out = _Output(last_hidden_state=hidden)
    out.router_logits = router_logits
    return out


class _Head(torch.nn.Linear):
    """The probe's LM head: a small Linear that keeps what it was given."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return super().forward(x)


_PROBE_LOSS = 1.25
"""What the probe's ``loss_function`` returns (a fresh tensor per call)."""
_PROBE_AUX_COEF = 0.375
"""The probe copy's ``router_aux_loss_coef``, so a forward adding ``coef * aux_loss`` shows it."""


class _LossRecorder:
    def __init__(self):
        self.calls: list[inspect.BoundArguments] = []

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        bound = inspect.signature(ForCausalLMLoss).bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append(bound)
        return torch.tensor(_PROBE_LOSS)


def head_of(model: torch.nn.Module) -> tuple[str, torch.nn.Linear]:
    """(child name, module) of the model's LM head, or ``Refused``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise Refused(f"{type(model).__name__} has no output embeddings (LM head)")
    name = next((n for n, m in model.named_children() if m is head), None)
    if name is None:
        raise Refused("its LM head is not a direct child of the model")
    if type(head) is not torch.nn.Linear:
        raise Refused(f"its LM head is {type(head).__name__}, not a plain torch.nn.Linear")
    if "forward" in head.__dict__:
        raise Refused("its LM head's forward is replaced on the instance")
    return name, head


@dataclass
class _ProbeRun:
    out: Any
    children: dict[str, _Decoder]
    head: _Head
    loss: _LossRecorder


class _Prober:
    """Runs the class's forward on probe copies of ``model`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.head_name, self.real_head = head_of(model)
        generator = torch.Generator().manual_seed(0)
        self.hidden = torch.randn(2, 3, 4, generator=generator)
        self.labels = torch.randint(0, 8, (2, 3), generator=generator)
        self.head_weight = torch.randn(8, 4, generator=generator)
        self.head_bias = torch.randn(8, generator=generator)
        experts = getattr(model, "num_experts", None)
        self.router_logits = (
            (torch.randn(6, experts, generator=generator),)
            if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0
            else None
        )

    def run(self, **kwargs: Any) -> _ProbeRun:
        cls, model = type(self.model), self.model
        copy = object.__new__(cls)
        copy.__dict__.update(model.__dict__)
        output = _decoder_output(self.hidden, self.router_logits)
        children = {
            n: _Decoder(child, output) for n, child in model.named_children() if n != self.head_name
        }
        with torch.random.fork_rng(devices=[]):  # kernelize leaves the global RNG alone
            head = _Head(4, 8, bias=self.real_head.bias is not None)
        with torch.no_grad():
            head.weight.copy_(self.head_weight)
            if head.bias is not None:
                head.bias.copy_(self.head_bias)
        head.inputs = []
        copy.__dict__["_modules"] = OrderedDict({**children, self.head_name: head})
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            copy.__dict__[hooks] = OrderedDict()
        copy.__dict__.pop("forward", None)
        if "router_aux_loss_coef" in model.__dict__:
            copy.__dict__["router_aux_loss_coef"] = _PROBE_AUX_COEF
        recorder = _LossRecorder()
        copy.__dict__["_loss_function"] = recorder
        copy.__dict__["training"] = True
        try:
            with torch.no_grad():
                out = cls.forward(copy, input_ids=self.labels, return_dict=True, **kwargs)
        except Exception as exc:  # the forward needs more than the probe offers
            raise Refused(
                f"{cls.__name__}.forward does not run on the probe: {type(exc).__name__}: {exc}"
            ) from None
        return _ProbeRun(out, children, head, recorder)

    def fused_route(self, **kwargs: Any) -> _ProbeRun:
        """The run ``fused_forward`` makes: no labels, no position projected."""
        run = self.run(labels=None, logits_to_keep=_no_positions(self.hidden.device), **kwargs)
        if len(run.head.inputs) != 1 or run.head.inputs[0].numel() != 0 or run.loss.calls:
            raise Refused("its forward still projects positions with an empty logits_to_keep")
        return run

    def aux_policies(self, labeled: _ProbeRun, fused: _ProbeRun) -> set[bool]:
        """The policies this pair of runs agrees with: True, the labelled run's loss is the loss
        function's result plus ``router_aux_loss_coef * aux_loss`` of the fused route (the result
        alone where that route has no ``aux_loss``); False, the result alone."""
        loss = getattr(labeled.out, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return set()
        base = torch.tensor(_PROBE_LOSS)
        aux = getattr(fused.out, "aux_loss", None)
        forms = {False: base, True: base}
        if isinstance(aux, torch.Tensor):
            forms[True] = (
                base + _PROBE_AUX_COEF * aux.float()
                if "router_aux_loss_coef" in self.model.__dict__
                else None
            )
        return {
            policy
            for policy, want in forms.items()
            if want is not None and torch.allclose(loss.float(), want, rtol=1e-6, atol=1e-7)
        }


def probe(model: torch.nn.Module) -> tuple[str, LogitForm, bool | None]:
    """(decoder child name, logit form, router aux policy) of a causal LM whose forward the
    interface can serve, or ``Refused`` with the reason (see the module docstring). The policy:
    True, the forward adds ``router_aux_loss_coef * aux_loss`` to the loss; False, it returns an
    ``aux_loss`` but does not add it; None, no probe run returned an ``aux_loss``."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    cls = type(model)
    loss_function = model.loss_function
    if loss_function is not ForCausalLMLoss:
        name = getattr(loss_function, "__qualname__", type(loss_function).__name__)
        raise Refused(
            f"its loss_function is {name}, not Transformers' ForCausalLMLoss (custom class "
            "weights, losses or reductions are not implemented by the kernel)"
        )
    prober = _Prober(model)
    hidden, labels = prober.hidden, prober.labels
    loss_keywords = {"num_items_in_batch": torch.tensor(5), "ignore_index": -7}
    labeled = prober.run(labels=labels, **loss_keywords)
    called = [n for n, child in labeled.children.items() if child.calls]
    if len(called) != 1 or labeled.children[called[0]].calls != 1:
        raise Refused(f"its forward calls children {called}, not one decoder once")
    if len(labeled.head.inputs) != 1 or not torch.equal(labeled.head.inputs[0], hidden):
        raise Refused("its LM head does not get the decoder's last_hidden_state unchanged")
    raw = torch.nn.functional.linear(hidden, labeled.head.weight, labeled.head.bias)
    logits = getattr(labeled.out, "logits", None)
    form = next(
        (
            f
            for f in candidate_forms(model.config)
            if isinstance(logits, torch.Tensor)
            and logits.shape == raw.shape
            and torch.allclose(logits, f.apply(raw), rtol=1e-6, atol=1e-6)
        ),
        None,
    )
    if form is None:
        forms = "; ".join(f.describe() for f in candidate_forms(model.config))
        raise Refused(
            f"its logits are post-processed in a way the kernel does not implement (it "
            f"implements, for this config: {forms})"
        )
    if len(labeled.loss.calls) != 1:
        raise Refused(f"its forward calls loss_function {len(labeled.loss.calls)} times, not once")
    call = labeled.loss.calls[0].arguments
    extra = dict(call.get("kwargs", {}))
    if not (
        call["logits"] is logits
        and call["labels"] is labels
        and call["vocab_size"] == getattr(model.config.get_text_config(), "vocab_size", None)
        and call["num_items_in_batch"] is loss_keywords["num_items_in_batch"]
        and call["ignore_index"] == loss_keywords["ignore_index"]
        and call["shift_labels"] is None
        and not extra
    ):
        raise Refused(
            "its forward does not pass (logits, labels, vocab_size, loss keywords) to "
            "loss_function unchanged"
        )
    runs = [(labeled, prober.fused_route())]
    if "output_router_logits" in inspect.signature(cls.forward).parameters or hasattr(
        model.config.get_text_config(), "output_router_logits"
    ):  # a MoE model: its aux loss asked for (elsewhere a call returning one runs stock)
        routed = {"output_router_logits": True}
        runs.append((prober.run(labels=labels, **routed), prober.fused_route(**routed)))
    policies = {True, False}
    for with_labels, fused in runs:
        policies &= prober.aux_policies(with_labels, fused)
    if not policies:
        raise Refused(
            "its loss is not the loss_function's result (plus router_aux_loss_coef * aux_loss "
            "where it routes): it adds or changes something the fused loss does not compute"
        )
    adds = policies == {True}
    seen = any(isinstance(getattr(f.out, "aux_loss", None), torch.Tensor) for _, f in runs)
    return called[0], form, adds if seen else None


def _no_positions(device: torch.device) -> torch.Tensor:
    """A ``logits_to_keep`` selecting no position: the head then projects nothing."""
    return torch.empty(0, dtype=torch.long, device=device)


# ------------------------------------------------------------------------------------------
# The installed forward.


class _Capture:
    """Holds the decoder's last hidden states between the hook and the loss."""

    def __init__(self):
        self.active = False
        self.hidden: torch.Tensor | None = None

    def hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.active:
            self.hidden = output.last_hidden_state


@dataclass
class _Installed:
    label: str
    """What ``current`` reports: the registered name and the logit form."""
    loss: Any
    """The kernel's ``causal_lm_loss``."""
    form: LogitForm
    aux: bool | None
    """The router aux policy ``probe`` found: add ``router_aux_loss_coef * aux_loss`` (True),
    leave it out (False), or none seen (None: a call that returns one runs the stock forward)."""
    head: str
    capture: _Capture
    hook: Any
    labels_index: int
    keep_index: int


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if index < len(args) else kwargs.get(name, default)


def _with(args: tuple, kwargs: dict, index: int, name: str, value: Any) -> tuple[tuple, dict]:
    if index < len(args):
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


def fused_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The switched model's forward (see the module docstring)."""
    state: _Installed = self.__dict__[_STATE]
    stock = type(self).forward
    labels = _argument(args, kwargs, state.labels_index, "labels", None)
    keep = _argument(args, kwargs, state.keep_index, "logits_to_keep", 0)
    if labels is None or not self.training or not (isinstance(keep, int) and keep == 0):
        return stock(self, *args, **kwargs)
    given = args, kwargs
    args, kwargs = _with(args, kwargs, state.labels_index, "labels", None)
    args, kwargs = _with(
        args, kwargs, state.keep_index, "logits_to_keep", _no_positions(labels.device)
    )
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    state.capture.active = True
    try:
        out = stock(self, *args, return_dict=True, **kwargs)
        hidden = state.capture.hidden
    finally:
        state.capture.active = False
        state.capture.hidden = None
    aux = getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor) and state.aux is None:  # a route the probe did not see
        return stock(self, *given[0], **given[1])
    loss = state.loss(
        hidden,
        getattr(self, state.head),
        labels,
        logit_scale=state.form.scale,
        softcap=state.form.softcap,
        **{k: kwargs[k] for k in _LOSS_KEYWORDS if k in kwargs},
    )
    if isinstance(aux, torch.Tensor) and state.aux:
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    out = type(out)(**{**fields, "loss": loss, "logits": None})
    return out if return_dict else out.to_tuple()


def _with_stock_signature(cls: type) -> Any:
    """``fused_forward`` showing the stock forward's signature: the Trainer drops dataset
    columns the forward's signature does not name."""

    @functools.wraps(cls.forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return fused_forward(self, *args, **kwargs)

    return forward


def _parameter_index(cls: type, name: str) -> int:
    """Position of ``name`` among ``cls.forward``'s arguments after self (or ``Refused``)."""
    params = list(inspect.signature(cls.forward).parameters)[1:]
    if name not in params:
        raise Refused(f"{cls.__name__}.forward has no {name!r} parameter")
    return params.index(name)


@dataclass(frozen=True)
class CausalLMLossInterface:
    """kernelize's switch of a causal LM's loss, shaped like its ``ModelInterface``s: the op's
    ``integrations`` provides ``register() -> name`` and ``causal_lm_loss``; ``switch`` probes
    and installs ``fused_forward`` on the instance, ``restore`` removes it."""

    name: str = "ForCausalLMLoss"
    kind: str = "causal LM loss"
    op: str = "linear-cross-entropy"
    training_only: bool = True
    """kernelize skips this interface outside training mode (the forward acts only there)."""

    def dispatches(self, module: torch.nn.Module) -> bool:
        return is_causal_lm(module)

    def unreached(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        return []

    def integration(self, kernel: types.ModuleType) -> Any:
        return recording_adapter(kernel, "causal_lm_loss", _LOSSES)

    def model_problem(self, model: torch.nn.Module, modules: list) -> str | None:
        if [n for n, _ in modules] != [""]:
            return "the causal LM is a submodule; kernelize the causal LM itself"
        return None

    def current(self, model: torch.nn.Module) -> dict[str, Any]:
        state = model.__dict__.get(_STATE)
        return {"": state.label if state is not None and "forward" in model.__dict__ else None}

    def switch(self, model: torch.nn.Module, name: Any) -> str:
        loss = _LOSSES.get(name)
        if loss is None:
            raise KernelHubError(f"integrations.register() returned {name!r}, not a loss name")
        if "forward" in model.__dict__:
            raise Refused("its forward is already replaced on the instance")
        decoder, form, aux = probe(model)
        head, _ = head_of(model)
        capture = _Capture()
        router = "; router aux loss added as stock" if aux else ""
        state = _Installed(
            label=f"{name} ({form.describe()}{router}; logits skipped in training with labels)",
            loss=loss,
            form=form,
            aux=aux,
            head=head,
            capture=capture,
            hook=getattr(model, decoder).register_forward_hook(capture.hook),
            labels_index=_parameter_index(type(model), "labels"),
            keep_index=_parameter_index(type(model), "logits_to_keep"),
        )
        model.__dict__[_STATE] = state
        model.__dict__["forward"] = types.MethodType(_with_stock_signature(type(model)), model)
        return state.label

    def restore(self, model: torch.nn.Module, previous: dict[str, Any]) -> None:
        state = model.__dict__.pop(_STATE, None)
        if state is not None:
            state.hook.remove()
            model.__dict__.pop("forward", None)


_LOSSES: dict[str, Any] = {}
"""Registered name -> the kernel's ``causal_lm_loss``."""

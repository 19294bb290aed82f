"""MoE blocks outside ``ExpertsInterface`` (Llama 4's ``Llama4TextMoe``: sigmoid top-k router
score on the experts' input, shared expert): recognised by the probe, near misses refused, and a
switched block matching stock forward and backward on moe-gemm (training) and fused-moe
(inference); unkernelize leaves nothing behind."""

from __future__ import annotations

import pytest
import torch
from transformers import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import (
    Llama4Router,
    Llama4TextExperts,
    Llama4TextMoe,
)

from kernel_hub import get_kernel, kernelize, unkernelize
from kernel_hub.layers.integrations import moe_blocks


def _fake(name: str, base: type, **methods) -> type:
    """A subclass that looks like Transformers' own (the interface only considers those)."""
    return type(name, (base,), {**methods, "__module__": "transformers.models.fake"})


def _score_on_output(self, hidden_states):  # Mixtral's combine: the score weights the output
    x = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(x)
    routed = self.experts(x.repeat(scores.shape[1], 1)).reshape(scores.shape[1], *x.shape)
    return self.shared_expert(x) + (routed * scores.t()[..., None]).sum(0), logits


def _shared_on_scaled_input(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(x)
    routed_in = x.repeat(scores.shape[1], 1) * scores.t().reshape(-1, 1)
    routed = self.experts(routed_in).reshape(scores.shape[1], *x.shape).sum(0)
    return self.shared_expert(routed_in[: x.shape[0]]) + routed, logits


def _no_shared_expert(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(x)
    routed_in = x.repeat(scores.shape[1], 1) * scores.t().reshape(-1, 1)
    return self.experts(routed_in).reshape(scores.shape[1], *x.shape).sum(0), logits


def _dense_softmax(self, hidden_states):  # every expert gets a non-zero score
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    return torch.softmax(logits, dim=-1), logits


def _gate_up_swapped(self, hidden_states):
    hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    up, gate = torch.bmm(hidden_states, self.gate_up_proj).chunk(2, dim=-1)
    return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, self.hidden_size)


NEAR_MISSES = {
    "score on the output": (_fake("M", Llama4TextMoe, forward=_score_on_output), None, None),
    "shared on scaled input": (
        _fake("M", Llama4TextMoe, forward=_shared_on_scaled_input),
        None,
        None,
    ),
    "no shared expert": (_fake("M", Llama4TextMoe, forward=_no_shared_expert), None, None),
    "dense softmax router": (None, _fake("R", Llama4Router, forward=_dense_softmax), None),
    "gate and up swapped": (None, None, _fake("E", Llama4TextExperts, forward=_gate_up_swapped)),
}


def test_llama4_block_is_recognised() -> None:
    recognition = moe_blocks.recognise_moe_block(Llama4TextMoe, Llama4Router, Llama4TextExperts)
    assert recognition.served, recognition.reason


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_are_refused(name: str) -> None:
    block, router, experts = NEAR_MISSES[name]
    recognition = moe_blocks.recognise_moe_block(
        block or Llama4TextMoe, router or Llama4Router, experts or Llama4TextExperts
    )
    assert not recognition.served and "not the input-scaled MoE form" in recognition.reason


class _Holder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out, logits = self.inner(x)
        return out, logits


def _block(top_k: int, **fields) -> _Holder:
    config = Llama4TextConfig(
        hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=top_k,
        **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Llama4TextMoe(config)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, 0.0, 0.2)
    return _Holder(block)


def _run(model: _Holder, x: torch.Tensor, grads: bool):
    xi = x.clone().requires_grad_(grads)
    out, logits = model(xi)
    if not grads:
        return (out.detach(), logits.detach()), []
    (out.pow(2).sum() + logits.sum()).backward()
    found = [xi.grad] + [p.grad for p in model.parameters()]
    model.zero_grad()
    return (out.detach(), logits.detach()), found


@pytest.mark.parametrize(
    ("mode", "top_k", "kernel"), [("training", 1, "moe-gemm"), ("inference", 2, "fused-moe")]
)
def test_switched_block_matches_stock(mode: str, top_k: int, kernel: str) -> None:
    """In f64, so any difference beyond summation order shows (top-2 training: the tiny Llama 4
    of the flagship coverage test)."""
    model = _block(top_k).to(torch.float64)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    training = mode == "training"
    stock, stock_grads = _run(model, x, training)
    report = kernelize(model, mode=mode)
    (entry,) = [e for e in report.entries if e.target == "InputScaledMoE"]
    assert entry.swapped_to and entry.swapped_to.startswith(kernel), str(report)
    got, got_grads = _run(model, x, training)
    torch.testing.assert_close(got, stock, rtol=1e-12, atol=1e-12)
    assert len(got_grads) == len(stock_grads)
    for mine, theirs in zip(got_grads, stock_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    unkernelize(model)
    block = model.inner
    assert "forward" not in block.__dict__
    assert not set(moe_blocks.EXPERTS_FLAGS) & set(block.experts.__dict__)


def test_activation_fused_moe_lacks_falls_back_to_moe_gemm() -> None:
    """fused-moe's gates are silu / gelu / tanh-gelu: relu experts pass it over (with the reason)
    for moe-gemm, which calls the module's own gate."""
    model = _block(1, hidden_act="relu")
    report = kernelize(model, mode="inference")
    (entry,) = [e for e in report.entries if e.target == "InputScaledMoE"]
    assert entry.swapped_to.startswith("moe-gemm"), entry
    assert "fused-moe left it" in entry.swapped_to and "matches none" in entry.swapped_to


def test_switched_block_compiles_fullgraph_and_matches_stock() -> None:
    """The switched forward traces with no graph break (moe-gemm in training+torch_compile, top-2
    of 4 experts), and the compiled block gives stock's outputs and gradients (f64)."""
    model = _block(2).to(torch.float64)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    stock, stock_grads = _run(model, x, True)
    report = kernelize(model, mode="training+torch_compile")
    (entry,) = [e for e in report.entries if e.target == "InputScaledMoE"]
    assert entry.swapped_to and entry.swapped_to.startswith("moe-gemm"), str(report)
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend, fullgraph=True)
    got, got_grads = _run(compiled, x, True)
    kernel = get_kernel("moe-gemm")
    ops = [getattr(kernel, n).qualname.replace("::", ".") for n in kernel.manifest.ops]
    assert len(graphs) == 1 and any(f"torch.ops.{op}" in graphs[0].code for op in ops), ops
    torch.testing.assert_close(got, stock, rtol=1e-12, atol=1e-12)
    assert len(got_grads) == len(stock_grads)
    for mine, theirs in zip(got_grads, stock_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)

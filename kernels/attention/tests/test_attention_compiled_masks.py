"""Masks under ``torch.compile(fullgraph=True, backend="aot_eager")``: tiny Llama and Gemma 2
(window 4, soft-cap) get the mask description, not Transformers' dense
mask: the flash op runs, the dense-mask op never does, and logits and gradients match the stock
model uncompiled (f32). The same compiled model then takes another padding pattern, no padding,
and a packed batch (``position_ids`` restarts). An eager model (fully masked rows average every
value) trains compiled with eager's loss."""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_hub.errors import KernelInputError  # noqa: E402
from kernel_hub.models import tiny  # noqa: E402

LENGTH = 12


@pytest.fixture(scope="module")
def kernel_name(attention):
    return attention.KERNEL.integration("transformers").register()


@pytest.fixture
def op_calls(attention, monkeypatch):
    """Counts the integration's calls of the flash and the dense-mask op (dynamo traces the
    counting wrappers, so a compiled graph counts each op it holds once per trace)."""
    integrations = attention.KERNEL.integration("transformers")
    calls = {"flash": 0, "dense": 0, "segments": 0}
    for key, name in (
        ("flash", "attention_with_lse"),
        ("flash", "dot_product_attention"),
        ("dense", "attention_with_dense_mask"),
    ):
        op = getattr(integrations, name)

        def counting(*args, _op=op, _key=key, **kwargs):
            calls[_key] += 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(integrations, name, counting)
    described = integrations._described_attention

    def counting_segments(query, key, value, mask, *args, **kwargs):
        calls["segments"] += mask.q_segment_ids is not None
        return described(query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(integrations, "_described_attention", counting_segments)
    return calls


def _padded(left: int, right: int) -> dict:
    ids = torch.randint(8, tiny.VOCAB_SIZE, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :left] = 0
    mask[1, LENGTH - right :] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


def _packed() -> dict:
    """Two rows, each three sequences back to back, as position_ids restarts (no 2-D mask)."""
    ids = torch.randint(8, tiny.VOCAB_SIZE, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    lengths = ((5, 4, 3), (2, 7, 3))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return {
        "input_ids": ids,
        "position_ids": positions,
        "use_cache": False,
    }  # a cache hides packing


def _step(forward, model, inputs: dict):
    """Logits at real tokens and every gradient of a fixed projection of them."""
    model.zero_grad()
    logits = forward(**inputs).logits
    real = inputs.get("attention_mask", torch.ones(logits.shape[:2])).bool()
    logits = logits[real]
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_close(what: str, got, want, tolerance: float = 1e-5) -> None:
    (got_logits, got_grads), (want_logits, want_grads) = got, want
    error = (got_logits - want_logits).abs().max().item()
    assert error <= tolerance, f"{what}: logits max abs error {error:.3g}"
    assert got_grads.keys() == want_grads.keys(), what
    for parameter, expected in want_grads.items():
        scale = expected.abs().max().clamp_min(1.0)  # absolute below 1, relative above
        error = ((got_grads[parameter] - expected).abs().max() / scale).item()
        assert error <= tolerance, f"{what} {parameter}: gradient error {error:.3g}"


def _gemma2() -> torch.nn.Module:
    return tiny.tiny_model(transformers.Gemma2ForCausalLM, sliding_window=4)


MODELS = {"llama": lambda: tiny.build_tiny_model("llama"), "gemma2": _gemma2}
"""Gemma 2 has a full and a sliding layer (Mistral's window mask is the same factory tree)."""
BATCHES = {
    "left and right padding": _padded(3, 2),
    "other padding": _padded(1, 5),
    "no padding": _padded(0, 0),
    "packed": _packed(),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_model_gets_the_description_not_a_dense_mask(
    attention, kernel_name, op_calls, name
):
    model = MODELS[name]().train()
    stock = model.config._attn_implementation
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for batch, inputs in BATCHES.items():
        model.set_attn_implementation(stock)
        want = _step(model, model, inputs)
        model.set_attn_implementation(kernel_name)
        got = _step(compiled, model, inputs)
        assert op_calls["flash"] and op_calls["dense"] == 0, f"{name} {batch}: {op_calls}"
        _assert_close(f"{name} {batch}", got, want)
    assert op_calls["segments"], "the packed batch reached no layer as segments"


def test_traced_eager_rows_equal_the_host_read_form(attention):
    """Eager's fully masked rows without a host read: values and gradients as the form that
    gathers those rows (softmax of ``s - s.detach()``), grouped heads, some rows empty."""
    integrations = attention.KERNEL.integration("transformers")
    module = torch.nn.Identity()
    generator = torch.Generator().manual_seed(0)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, requires_grad=True)

    q, k, v, out = normal(2, 4, 6, 8), normal(2, 2, 5, 8), normal(2, 2, 5, 3), normal(2, 4, 6, 3)
    lse = torch.randn(2, 4, 6, generator=generator)
    lse[0, :, :3] = lse[1, 1, 4] = -torch.inf
    cotangent = torch.randn(out.shape, generator=generator)
    results = []
    for rows in (
        lambda: integrations._eager_empty_rows(q, k, v, out, lse, 0.3, None),
        lambda: integrations._traced_eager_empty_rows(q, k, v, out, lse, 0.3, None, module),
    ):
        value = rows()
        results.append((value, torch.autograd.grad((value * cotangent).sum(), (q, k, v, out))))
    (want, want_grads), (got, got_grads) = results
    assert (got - want).abs().max() <= 1e-6
    for name, g, w in zip("qkvo", got_grads, want_grads, strict=True):
        assert (g - w).abs().max() <= 1e-5, f"d{name}"
    # With a soft-cap the value is still eager's; training with gradients is refused.
    with pytest.raises(KernelInputError, match="soft-capping"):
        integrations._traced_eager_empty_rows(q, k, v, out, lse, 0.3, 5.0, module)
    want = integrations._eager_empty_rows(q, k, v, out, lse, 0.3, 5.0)
    for training, context in ((True, torch.no_grad), (False, contextlib.nullcontext)):
        with context():
            got = integrations._traced_eager_empty_rows(
                q, k, v, out, lse, 0.3, 5.0, module.train(training)
            )
        assert (got - want).abs().max() <= 1e-6, training


@pytest.mark.slow
def test_compiled_training_of_an_eager_model_follows_eager_rows(attention):
    """Tiny Llama on eager attention, left padded, labels everywhere (the last padding position
    predicts the first token, so the loss reads a fully masked row): a
    ``training+torch_compile`` kernelize swaps its attention, and the compiled loss and
    gradients are eager's."""
    from kernel_hub.layers.kernelize import kernelize

    model = tiny.build_tiny_model("llama")
    model.set_attn_implementation("eager")
    inputs = _padded(3, 0)
    inputs["labels"] = inputs["input_ids"]

    def loss_and_grads(forward):
        model.zero_grad()
        loss = forward(**inputs).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want = loss_and_grads(model)
    report = kernelize(model, device="cpu", mode="training+torch_compile")
    entries = [e for e in report.entries if e.target == "AttentionInterface"]
    assert entries and all(e.swapped for e in entries), entries
    torch._dynamo.reset()
    got = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    _assert_close("eager llama loss", (got[0][None], got[1]), (want[0][None], want[1]))

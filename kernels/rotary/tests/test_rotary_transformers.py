"""The rotary_pos_emb slot: which Transformers functions the probe accepts (and the near misses it
refuses, with the reason), tiny models in training with labels on a padded batch giving the stock
loss and gradients with every training swap on, per-instance and reversible swaps, and a
fullgraph compile."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import transformers

from kernel_hub import get_kernel
from kernel_hub.layers.integrations import rotary_slot
from kernel_hub.layers.integrations.rotary_slot import RotaryCall, RotaryForm, RotarySlotInterface
from kernel_hub.layers.kernelize import kernelize, unkernelize
from kernel_hub.loading.mappings import kernel_mapping

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),
    # Phi-3's function rotates cos.shape[-1] features and passes the rest: partial rotary
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "partial_rotary_factor": 0.5}),
}
HALF = RotaryForm(interleaved=False, upcast=False, cast_back=False)


def _function(model: str, slot: str = rotary_slot.SLOT):
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    return getattr(module, slot)


INTERLEAVE = rotary_slot.INTERLEAVE_SLOT


@pytest.mark.parametrize(
    ("model", "form"),
    [
        ("llama", HALF),
        ("phi3", HALF),  # partial rotary inside the function
        ("gpt_neox", HALF),
        ("olmo", RotaryForm(False, False, True)),
        ("modernbert", RotaryForm(False, True, True)),
        ("cohere", RotaryForm(True, True, True)),  # its rotate_half rotates pairs
    ],
)
def test_transformers_functions_are_recognised_as_their_form(model, form):
    assert rotary_slot.recognise_rotary(_function(model)).form == form


@pytest.mark.parametrize(
    ("model", "call"),
    [
        ("gpt_oss", RotaryCall(half_width=True)),  # one cos value per frequency
        ("gemma4", RotaryCall(single=True)),  # apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)
    ],
)
def test_other_calling_conventions_are_recognised(model, call):
    recognition = rotary_slot.recognise_rotary(_function(model))
    assert (recognition.form, recognition.call) == (HALF, call)


def one_tensor_other_half(x, cos, sin, unsqueeze_dim=1):
    """A near miss of Gemma 4's form: one tensor per call, rotated by -90 degrees."""
    return other_half_rotary(x, x, cos, sin, unsqueeze_dim)[0]


def half_width_other_sign(q, k, cos, sin, unsqueeze_dim=1):
    """A near miss of GPT-OSS's form: half-width cos/sin, the sine's sign flipped."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((first * cos + second * sin, second * cos - first * sin), dim=-1)

    return rotate(q), rotate(k)


@pytest.mark.parametrize("fn", [one_tensor_other_half, half_width_other_sign])
def test_near_misses_of_the_other_conventions_are_refused(fn):
    recognition = rotary_slot.recognise_rotary(fn)
    assert recognition.form is None and "none of the rotary forms" in recognition.reason


@pytest.mark.parametrize(
    ("model", "position_ids"),
    [("deepseek_v3", True), ("glm_moe_dsa", True), ("mistral_large4", False)],
)
def test_interleaved_functions_are_recognised(model, position_ids):
    recognition = rotary_slot.recognise_interleaved(_function(model, INTERLEAVE))
    assert (recognition.form, recognition.call) == (
        HALF,
        RotaryCall(pairs=True, position_ids=position_ids),
    )


def _interleaved(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, variant):
    """DeepSeek-V3's apply_rotary_pos_emb_interleave with one detail changed by ``variant``."""
    half = cos.shape[-1] // 2
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos, sin = (
        (cos[..., half:], sin[..., half:])
        if variant == "second half"
        else (
            cos[..., :half],
            sin[..., :half],
        )
    )

    def rotate(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        parts = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        if variant == "other way":
            parts = (x1 * cos + x2 * sin, x2 * cos - x1 * sin)
        if variant == "pairs out":  # the result left in interleaved pairs
            return torch.stack(parts, dim=-1).flatten(-2)
        return torch.cat(parts, dim=-1)

    return rotate(q), rotate(k)


@pytest.mark.parametrize("variant", ["second half", "other way", "pairs out", "stock"])
def test_interleaved_near_misses_are_refused(variant):
    def fn(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return _interleaved(q, k, cos, sin, position_ids, unsqueeze_dim, variant=variant)

    recognition = rotary_slot.recognise_interleaved(fn)
    if variant == "stock":  # the harness is served: each near miss differs in one detail
        assert recognition.form == HALF
        return
    assert recognition.form is None and "none of the rotary forms" in recognition.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("model", "slot"),
    [("gpt_oss", rotary_slot.SLOT), ("gemma4", rotary_slot.SLOT), ("deepseek_v3", INTERLEAVE)],
)
def test_slot_functions_of_the_other_conventions_match_stock_with_gradients(model, slot, dtype):
    stock = _function(model, slot)
    recognise = rotary_slot.recognise_interleaved if slot == INTERLEAVE else None
    recognition = (recognise or rotary_slot.recognise_rotary)(stock)
    apply_rotary = get_kernel("rotary").KERNEL.integration("transformers").apply_rotary
    calls = []

    def kernel_apply(*args, **kwargs):
        calls.append(args)
        return apply_rotary(*args, **kwargs)

    slot = rotary_slot.slot_function(stock, kernel_apply, recognition.form, recognition.call)
    generator = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, 5, 4, 16, generator=generator),
        torch.randn(2, 5, 2, 16, generator=generator),
    )
    width = 8 if recognition.call.half_width else 16
    cos, sin = (
        torch.randn(2, 5, width, generator=generator),
        torch.randn(2, 5, width, generator=generator),
    )

    def run(fn, dtype=dtype):
        tensors = [t.to(dtype) for t in (q, k)] + [cos.to(dtype), sin.to(dtype)]
        qi, ki = (t.clone().requires_grad_() for t in tensors[:2])
        if recognition.call.single:
            out = (fn(qi, tensors[2], tensors[3], unsqueeze_dim=2), fn(ki, *tensors[2:], 2))
        else:
            out = fn(qi, ki, *tensors[2:], unsqueeze_dim=2)
        sum(o.double().pow(2).sum() for o in out).backward()
        return [o.detach() for o in out] + [qi.grad, ki.grad]

    want, got = run(stock), run(slot)
    # every rotation ran on the kernel (q and k in one call, or one call each), none on stock
    assert len(calls) == (2 if recognition.call.single else 1)
    if dtype == torch.float32:
        for mine, theirs in zip(got, want, strict=True):
            assert mine.dtype == theirs.dtype
            torch.testing.assert_close(mine, theirs)
        return
    # bf16: the gradients' sums of two products cancel, so the kernel's and stock's roundings
    # differ by whole ulps there; each is judged against f64, the kernel within twice stock's error
    exact = run(stock, torch.float64)
    for mine, theirs, truth in zip(got, want, exact, strict=True):
        assert mine.dtype == theirs.dtype

        def error(t, truth=truth):
            return float((t.double() - truth).abs().max() / truth.abs().max())

        assert error(mine) <= 2 * error(theirs), (error(mine), error(theirs))


def _complex_function(model: str):
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    return module.apply_rotary_emb


@pytest.mark.parametrize(("model", "dim"), [("llama4", 2), ("deepseek_v2", 1)])
def test_complex_rotary_functions_are_recognised_in_their_layout(model, dim):
    assert rotary_slot.recognise_complex_rotary(_complex_function(model)).unsqueeze_dim == dim


def _pairs(x):
    return torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))


def complex_conjugate(xq, xk, freqs_cis):
    """Rotates the other way."""
    f = freqs_cis.conj()[:, :, None, :]
    return tuple(torch.view_as_real(_pairs(x) * f).flatten(3).type_as(x) for x in (xq, xk))


def complex_halves(xq, xk, freqs_cis):
    """Pairs the two halves (rotate-half) instead of neighbours."""
    f = freqs_cis[:, :, None, :]

    def rotate(x):
        first, second = x.float().chunk(2, dim=-1)
        out = torch.complex(first, second) * f
        return torch.cat((out.real, out.imag), dim=-1).type_as(x)

    return rotate(xq), rotate(xk)


def complex_not_cast_back(xq, xk, freqs_cis):
    f = freqs_cis[:, :, None, :]
    return tuple(torch.view_as_real(_pairs(x) * f).flatten(3) for x in (xq, xk))


def complex_unit_magnitude(xq, xk, freqs_cis):
    """Drops freqs_cis's magnitude (Llama 4's rope scaling lives in it)."""
    f = torch.polar(torch.ones_like(freqs_cis.real), freqs_cis.angle())[:, :, None, :]
    return tuple(torch.view_as_real(_pairs(x) * f).flatten(3).type_as(x) for x in (xq, xk))


@pytest.mark.parametrize(
    "fn", [complex_conjugate, complex_halves, complex_not_cast_back, complex_unit_magnitude]
)
def test_complex_rotary_near_misses_are_refused(fn):
    recognition = rotary_slot.recognise_complex_rotary(fn)
    assert recognition.unsqueeze_dim is None and "within f32 rounding" in recognition.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_slot_function_matches_stock_with_gradients(dtype):
    """Llama 4's apply_rotary_emb: within one ulp of stock (torch's complex product rounds in
    another order), the gradients within float tolerance; every call ran on the kernel."""
    stock = _complex_function("llama4")
    apply_rotary = get_kernel("rotary").KERNEL.integration("transformers").apply_rotary
    calls = []

    def kernel_apply(*args, **kwargs):
        calls.append(args)
        return apply_rotary(*args, **kwargs)

    slot = rotary_slot.complex_slot_function(stock, kernel_apply, 2)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, h, 16, generator=generator).to(dtype) for h in (4, 2))
    freqs = torch.polar(0.5 + torch.rand(2, 5, 8, generator=generator), torch.randn(2, 5, 8))

    def run(fn):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = fn(qi, ki, freqs)
        sum(o.float().pow(2).sum() for o in out).backward()
        return [o.detach() for o in out] + [qi.grad, ki.grad]

    want, got = run(stock), run(slot)
    assert len(calls) == 1
    ulp = torch.finfo(dtype).eps
    for mine, theirs in zip(got, want, strict=True):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multidimensional_rope_runs_each_part_on_the_kernel(dtype):
    """Gemma 4's vision apply_multidimensional_rope splits x, cos and sin per position axis and
    calls the module's apply_rotary_pos_emb on each part: that call is the slot (the copy kernelize
    gives the vision attention calls the kernel there), results and gradients as stock's."""
    from transformers.models.gemma4 import modeling_gemma4

    stock = modeling_gemma4.apply_multidimensional_rope
    recognition = rotary_slot.recognise_rotary(modeling_gemma4.apply_rotary_pos_emb)
    apply_rotary = get_kernel("rotary").KERNEL.integration("transformers").apply_rotary
    calls = []

    def kernel_apply(*args, **kwargs):
        calls.append(args)
        return apply_rotary(*args, **kwargs)

    slot = rotary_slot.slot_function(
        modeling_gemma4.apply_rotary_pos_emb, kernel_apply, recognition.form, recognition.call
    )
    copy_ = rotary_slot._nested(stock, slot)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 16, generator=generator).to(dtype)
    cos, sin = (torch.randn(2, 6, 16, generator=generator).to(dtype) for _ in range(2))
    position_ids = torch.zeros(2, 6, 2, dtype=torch.long)

    def run(fn):
        xi = x.clone().requires_grad_()
        out = fn(xi, cos, sin, position_ids)
        out.float().pow(2).sum().backward()
        return out.detach(), xi.grad

    want, got = run(stock), run(copy_)
    assert len(calls) == 2  # one per position axis
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for mine, theirs in zip(got, want, strict=True):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, **tolerance)
    assert modeling_gemma4.apply_multidimensional_rope is stock  # the model's module untouched


def test_gemma4_vision_tower_runs_its_rotary_on_the_kernel(tmp_path, monkeypatch):
    """kernel-hub models feeds Gemma 4 text only: its vision tower, kernelized (rotary only),
    on 16 patches; every part of q and k rotated by the kernel, output as stock's."""
    from kernel_hub.models import architectures as archs
    from kernel_hub.testing import registry_with_ops

    (arch,) = [a for a in archs.architectures() if a.model_type == "gemma4"]
    tower = archs.build(arch).model.vision_tower
    patch = tower.config.patch_size
    pixels = torch.randn(1, 16, 3 * patch * patch, generator=torch.Generator().manual_seed(0))
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1)[None]
    with torch.no_grad():
        want = tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
    integration = get_kernel("rotary").KERNEL.integration("transformers")
    calls = []
    apply_rotary = integration.apply_rotary
    monkeypatch.setattr(
        integration, "apply_rotary", lambda *a, **k: calls.append(a) or apply_rotary(*a, **k)
    )
    report = kernelize(tower, mode="inference", registry=registry_with_ops(tmp_path, "rotary"))
    swapped = [e.swapped_to for e in report.entries if e.swapped]
    assert len(swapped) == 2 and "through apply_multidimensional_rope" in swapped[0], str(report)
    with torch.no_grad():
        got = tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
    layers = tower.config.num_hidden_layers
    assert len(calls) == layers * 2 * 2  # q and k, two position axes each
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_deepseek_v3_interleaved_rotary_runs_on_the_kernel_in_training(tmp_path, monkeypatch):
    """DeepSeek-V3 with rope_interleave (its default), only the rotary kernel in the registry:
    every layer's q and k rotated by the kernel, the loss and every gradient as stock's."""
    from kernel_hub.models import architectures as archs
    from kernel_hub.testing import registry_with_ops

    (arch,) = [a for a in archs.architectures(("decoder",)) if a.model_type == "deepseek_v3"]
    model = archs.build(arch, {"num_key_value_heads": 4}).train()  # MLA: as many kv heads
    assert model.config.rope_interleave
    stock = copy.deepcopy(model)
    integration = get_kernel("rotary").KERNEL.integration("transformers")
    calls = []
    apply_rotary = integration.apply_rotary
    monkeypatch.setattr(
        integration, "apply_rotary", lambda *a, **k: calls.append(a) or apply_rotary(*a, **k)
    )
    report = kernelize(model, mode="training", registry=registry_with_ops(tmp_path, "rotary"))
    entries = rotary_entries(report)
    assert entries and all(e.swapped for e in entries), str(report)
    assert "interleaved pairs de-interleaved before the kernel" in entries[0].swapped_to
    inputs = archs.batch(arch, model)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    got = step(model, lambda: model(**inputs, labels=labels).loss)
    assert len(calls) == model.config.num_hidden_layers
    assert_matches(got, step(stock, lambda: stock(**inputs, labels=labels).loss))


def test_flagship_models_of_the_other_conventions_match_stock_in_training(tmp_path):
    """Only the rotary kernel in the registry: GPT-OSS (half-width cos/sin), Gemma 4 text (one
    tensor per call) and Llama 4 text (complex freqs_cis) swapped, training outputs and every
    gradient as stock's."""
    from kernel_hub.models.coverage import EXACT, run_coverage
    from kernel_hub.testing import registry_with_ops

    registry = registry_with_ops(tmp_path, "rotary")
    results = run_coverage(
        "training", model_types=["gpt_oss", "gemma4_text", "llama4_text"], registry=registry
    )
    for result in results:
        assert result.status == EXACT and result.swapped == {"rotary_pos_emb": 2}, result


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("glm", "its result is none of the rotary forms"),  # cos re-interleaved
        ("glmasr", "is not a slot signature"),  # a position_ids parameter
    ],
)
def test_other_transformers_functions_are_refused_with_the_reason(model, reason):
    recognition = rotary_slot.recognise_rotary(_function(model))
    assert recognition.form is None and reason in recognition.reason


def other_half_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """A near miss: rotates by -90 degrees, (x2, -x1), where Llama's rotate_half is (-x2, x1)."""

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((x[..., half:], -x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def test_a_rotary_that_rotates_the_other_half_is_refused():
    recognition = rotary_slot.recognise_rotary(other_half_rotary)
    assert recognition.form is None
    assert "probe 0" in recognition.reason and "none of the rotary forms" in recognition.reason


def tiny(name: str) -> torch.nn.Module:
    config_name, model_name, extra = MODELS[name]
    config = getattr(transformers, config_name)(**TINY, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).train()


def batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def step(model, forward=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = forward() if forward is not None else model(**batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_matches(got, want, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        err = float((got[1][name] - grad).abs().max() / grad.abs().max().clamp_min(1e-12))
        assert err <= rtol, f"{name}: relative max error {err:.3g}"


def rotary_entries(report):
    return [e for e in report.entries if e.target == "rotary_pos_emb"]


# Gemma 2 keeps stock attention: with left padding the attention kernel alone differs from
# stock eager attention on this model (closing notes of #24), which would hide the rotary's share.
STOCK_ATTENTION = {"gemma2": {"attention": "off"}}


@pytest.mark.parametrize("name", list(MODELS))
def test_training_loss_and_every_gradient_match_stock_with_every_swap(name):
    model = tiny(name)
    stock = copy.deepcopy(model)
    with kernel_mapping(STOCK_ATTENTION.get(name, {})):
        report = kernelize(model, device="cpu")
    entries = rotary_entries(report)
    assert len(entries) == TINY["num_hidden_layers"] and all(e.swapped for e in entries)
    assert "rotate-half in promote(q, cos)" in entries[0].swapped_to
    swapped = {e.target for e in report.entries if e.swapped}
    assert {"ForCausalLMLoss", "GatedMLP" if name != "phi3" else "FusedGatedMLP"} <= swapped
    assert_matches(step(model), step(stock))


def test_the_kernel_runs_per_instance_and_unkernelize_restores(monkeypatch):
    adapter = get_kernel("rotary").KERNEL.integration("transformers")
    calls = []
    original = adapter.rotary_embedding
    monkeypatch.setattr(adapter, "rotary_embedding", lambda *a: calls.append(a) or original(*a))
    model = tiny("llama")
    other = copy.deepcopy(model)  # the same class, not kernelized: stays stock
    kernelize(model, device="cpu")
    attention = model.model.layers[0].self_attn
    assert "forward" in attention.__dict__
    model(**batch())
    assert len(calls) == TINY["num_hidden_layers"]
    other(**batch())
    assert len(calls) == TINY["num_hidden_layers"]
    assert "rotary_pos_emb" in unkernelize(model)
    assert "forward" not in attention.__dict__
    model(**batch())
    assert len(calls) == TINY["num_hidden_layers"]


def test_a_swap_undone_by_other_code_is_reported_and_left_alone():
    model = tiny("llama")
    kernelize(model, device="cpu")
    attention = model.model.layers[1].self_attn
    del attention.__dict__["forward"]  # e.g. another library resetting forwards
    from kernel_hub.layers.kernelize import kernelize_report

    entries = rotary_entries(kernelize_report(model))
    assert not any(e.swapped for e in entries) and "undone" in entries[0].reason
    unkernelize(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_model_whose_function_rotates_the_other_half_is_left_alone_with_the_reason(
    monkeypatch,
):
    model = tiny("llama")
    cls = type(model.model.layers[0].self_attn)
    stock = rotary_slot.stock_function(cls)
    monkeypatch.setitem(stock.__globals__, "apply_rotary_pos_emb", other_half_rotary)
    entries = rotary_entries(kernelize(model, device="cpu"))
    assert entries and not any(e.swapped for e in entries)
    assert "LlamaAttention's apply_rotary_pos_emb: on probe 0" in entries[0].reason
    assert "forward" not in model.model.layers[0].self_attn.__dict__


def test_attention_applying_another_rotary_is_reported_not_switched():
    class VisionAttention(torch.nn.Module):
        def forward(self, x, cos, sin):
            return apply_rotary_pos_emb_vision(x, cos, sin)  # noqa: F821 (never run)

    VisionAttention.__module__ = "transformers.models.fake.modeling_fake"
    model = torch.nn.Sequential(VisionAttention())
    [(name, _, reason)] = RotarySlotInterface().unreached(model)
    assert name == "0" and "apply_rotary_pos_emb_vision" in reason


def test_mrope_model_calls_the_plain_slot_and_matches_stock():
    """Qwen2-VL builds its mRoPE sections into cos and sin; its slot function is Llama's."""
    config = transformers.Qwen2VLTextConfig(
        **TINY,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLTextModel(config).eval()
    stock = copy.deepcopy(model)
    entries = rotary_entries(kernelize(model, device="cpu", mode="inference"))
    assert entries and all(e.swapped for e in entries)
    ids = batch()["input_ids"]
    position_ids = torch.arange(24).expand(3, 2, 24)  # (temporal, height, width) positions
    got = model(input_ids=ids, position_ids=position_ids).last_hidden_state
    want = stock(input_ids=ids, position_ids=position_ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fullgraph_compile_with_every_training_swap_matches_stock():
    model = tiny("qwen3")
    stock = copy.deepcopy(model)
    report = kernelize(model, device="cpu", mode="training+torch_compile")
    assert all(e.swapped for e in rotary_entries(report))
    compiled = torch.compile(lambda **kw: model(**kw).loss, backend="aot_eager", fullgraph=True)
    assert_matches(step(model, lambda: compiled(**batch())), step(stock))

"""Expert weights padded once to 128 lanes (``padding.prepare``): the module keeps the stock
parameters (views of the padded storage), the kernel reads the padded tensors, results stay
exact, and weights replaced after kernelize are followed."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_models import MODELS, TOKENS, build, experts_modules  # noqa: E402

import kernel_hub as kh  # noqa: E402
from kernel_hub import get_kernel  # noqa: E402
from kernel_hub.models.tiny import tiny_config  # noqa: E402

fused = get_kernel("fused-moe")
padding = fused.padding
TOLERANCE = 1e-5


def _routed(module, tokens=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = padding.sizes(module)[0]
    x = torch.randn(tokens, hidden, generator=g)
    experts = module.gate_up_proj.shape[0]
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, 2, generator=g)


def _gpt_oss_unaligned_intermediate():
    """GPT-OSS with 2I = 96: its [E, H, 2I] gate/up has an unaligned minor axis (I padded)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = tiny_config(GptOssConfig, intermediate_size=48, num_local_experts=4,
                         num_experts_per_tok=2, head_dim=16, sliding_window=8,
                         **TOKENS)  # fmt: skip
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("name", [*MODELS, "gpt_oss_i48"])
def test_prepare_pads_once_and_keeps_the_stock_module(name):
    model = _gpt_oss_unaligned_intermediate() if name == "gpt_oss_i48" else build(name)
    module = experts_modules(model)[0]
    x, ids, w = _routed(module)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = module(x, ids, w)
    kh.kernelize(model, mode="inference")
    padded = getattr(module, padding.PADDED)["tensors"]
    hidden, padded_hidden, inter, padded_inter = padding.sizes(module)
    assert padded_hidden % 128 == 0 and padded_hidden > hidden
    transposed = module.is_transposed
    assert padded["down_proj"].shape[2 if transposed else 1] == padded_hidden
    assert padded["gate_up_proj"].shape[2 if transposed else 1] == 2 * padded_inter
    if name == "gpt_oss_i48":
        assert (inter, padded_inter) == (48, 64)
    for pname, t in padded.items():  # the module's tensors are views of the padded storage
        assert getattr(module, pname).data_ptr() == t.data_ptr()
    after = model.state_dict()
    for k, v in before.items():
        assert after[k].shape == v.shape and torch.equal(after[k], v), k
    with torch.no_grad():
        got = fused.integrations.experts_forward(module, x, ids, w)
    assert (got - expected).abs().max().item() <= TOLERANCE
    kh.unkernelize(model)
    with torch.no_grad():  # the stock forward on the views
        assert torch.equal(module(x, ids, w), expected)


def test_replaced_weights_are_followed_and_repadded():
    model = build("gpt_oss")
    module = experts_modules(model)[0]
    kh.kernelize(model, mode="inference")
    x, ids, w = _routed(module, seed=3)
    old = getattr(module, padding.PADDED)["tensors"]["down_proj"]
    new = torch.randn_like(module.down_proj) * 0.1
    module.down_proj = torch.nn.Parameter(new)
    with torch.no_grad():
        got = fused.integrations.experts_forward(module, x, ids, w)
    kh.unkernelize(model)
    with torch.no_grad():
        expected = module(x, ids, w)
    assert getattr(module, padding.PADDED)["tensors"]["down_proj"] is not old
    assert module.down_proj.data_ptr() == padding.kernel_tensors(module)[0][1].data_ptr()
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_int8_and_mxfp4_weights_are_padded():
    model = build("mixtral")
    kh.quantize_experts(model, "int8")
    module = experts_modules(model)[0]
    assert fused.integrations.module_problem(module) is None
    padded = getattr(module, padding.PADDED)["tensors"]
    assert padded["gate_up_proj"].dtype == torch.int8
    assert padded["gate_up_proj"].shape[2] % 128 == 0
    assert padded["down_proj_scale"].shape[1] % 128 == 0
    model = build("gpt_oss")
    kh.kernelize(model, mode="inference")
    module = experts_modules(model)[0]
    kh.quantize_experts(model, "mxfp4")  # the float padding is replaced by the bytes' padding
    assert fused.integrations.module_problem(module) is None
    padded = getattr(module, padding.PADDED)["tensors"]
    assert {t.dtype for t in padded.values() if t.ndim == 3} == {torch.uint8}
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_scales", "down_proj_scales"):
        assert padded[name].shape[2] % 128 == 0, name
        assert getattr(module, name).data_ptr() == padded[name].data_ptr()
    kh.unkernelize(model)

"""``kernel-hub model-bench`` end to end on two small cells (a training step and a paged decode
step): a narrow Llama, stock and kernelized, traced through torchax and compiled deviceless for
v6e.

torchax renames torch's PrivateUse1 device for the rest of a process, so the command's cells run
in a subprocess (one for all of them: model_bench_cells.py); the real-size cells are in
docs/model-bench.md.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from model_bench_cells import ran, run_cells, selected, set_args

from kernel_hub.cli import main
from kernel_hub.models.presets import PRESETS

pytestmark = pytest.mark.tpu_compile

# Narrow but tile-aligned (head_dim 128, 2 query heads per KV head), vocab a multiple of the
# linear-cross-entropy block; 3 layers in the model, 2 compiled.
SMALL_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 3,
    "tie_word_embeddings": False,
}
TRAIN_KERNELS = {
    "flash_attention",
    "rms_norm",
    "rotary",
    "gated_activation",
    "linear_cross_entropy",
}


def cell_args(*args: str, model_type: str = "llama", fields: dict = SMALL_LLAMA) -> list[str]:
    """The command's arguments for a cell on a small model (the Llama by default)."""
    return ["model-bench", f"--model-type={model_type}", *set_args(fields), *args, "--tpu=v6e"]


def needs_torchax_and_libtpu() -> None:
    if importlib.util.find_spec("torchax") is None or importlib.util.find_spec("libtpu") is None:
        pytest.skip("model-bench needs torchax and libtpu (the torchax and tpu extras)")


def cells() -> dict[str, dict]:
    """Every cell of this module by name (model_bench_cells.py: the command's arguments, or a
    script and its arguments); a test takes a cell through the fixture of that name (``scaled``:
    the cell ``scaled_<model_type>`` of the test's model type)."""
    decode = ["--mode=decode", f"--batch={DECODE_BATCH}", f"--context={DECODE_CONTEXT}"]
    static = [
        *("--mode=decode", "--cache=static"),
        *(f"--batch={STATIC_BATCH}", f"--context={STATIC_CONTEXT}"),
    ]
    scaled = {
        f"scaled_{model_type}": cell_args(
            f"--mode={SCALING_MODES[model_type]}",
            "--seq=256",
            model_type=model_type,
            fields=fields,
        )
        for model_type, fields in TINY_STRUCTURES.items()
    }
    commands = {
        "train": cell_args("--mode=train", "--seq=128"),
        "decode": cell_args(*decode, "--cache=paged"),
        "decode_fp8": cell_args(
            *decode, "--cache=paged", "--weights=fp8", "--kv-cache-dtype=float8_e4m3fn"
        ),
        **scaled,
        "moe_train": cell_args("--mode=train", "--seq=128", model_type="gpt_oss", fields=MOE_TRAIN),
        "eager_static_decode": cell_args(
            *static, model_type="gpt_oss", fields=TINY_STRUCTURES["gpt_oss"]
        ),
        "hybrid_static_decode": cell_args(*static, model_type="qwen3_next", fields=TINY_QWEN3_NEXT),
    }
    small_decode = [json.dumps(SMALL_LLAMA), str(DECODE_BATCH), str(DECODE_CONTEXT)]
    scripts = {
        "trace_paged_decode": (_TRACE_PAGED_DECODE, small_decode),
        "trace_8bit_decode": (_TRACE_8BIT_DECODE, small_decode),
        "hybrid_decode_numerics": (
            _HYBRID_DECODE_NUMERICS,
            [json.dumps({**TINY_QWEN3_NEXT, "num_hidden_layers": 2})],  # 1 linear + 1 full
        ),
    }
    return {
        **{name: {"argv": argv} for name, argv in commands.items()},
        **{name: {"code": code, "argv": argv} for name, (code, argv) in scripts.items()},
    }


def _cells_of(item: pytest.Item) -> set[str]:
    names = set(item.fixturenames) & set(cells())
    if "scaled" in item.fixturenames:
        names.add(f"scaled_{item.callspec.params['model_type']}")
    return names


@pytest.fixture(scope="module")
def bench_cells(request, tmp_path_factory) -> dict[str, dict]:
    """The cells of this module's selected tests, run in one subprocess (model_bench_cells.py:
    the imports and first traces once, not once a cell)."""
    needs_torchax_and_libtpu()
    wanted = selected(request, _cells_of)
    chosen = {name: cell for name, cell in cells().items() if name in wanted}
    return run_cells(chosen, tmp_path_factory.mktemp("cells"))


@pytest.fixture
def train(bench_cells):
    return ran(bench_cells, "train")


# Two pages of 256 tokens per sequence, more than one block per axis for the paged kernel.
DECODE_BATCH, DECODE_CONTEXT = 4, 512
# The static-cache decode cells (gpt-oss's eager attention, Qwen3-Next's hybrid).
STATIC_BATCH, STATIC_CONTEXT = 2, 256


@pytest.fixture
def decode(bench_cells):
    return ran(bench_cells, "decode")


def test_both_variants_at_full_depth(train):
    _, rows = train
    assert [r["variant"] for r in rows] == ["stock", "kernelized"]
    for row in rows:
        assert (row["model"], row["mode"], row["tpu"]) == ("llama", "train", "v6e")
        assert (row["compiled_layers"], row["full_layers"]) == (2, 3)
        assert row["flops"] > 0 and row["bytes_accessed"] > 0 and row["roofline_ms"] > 0
        # three layers hold more than the two compiled
        assert row["peak_hbm_bytes"] > row["compiled"]["peak_hbm_bytes"]
        assert row["measured_ms"] is None  # no TPU here
    # same weights, same gradients: the arguments and outputs are the same size
    stock, kernelized = (r["compiled"] for r in rows)
    assert stock["argument_bytes"] == kernelized["argument_bytes"]
    assert stock["output_bytes"] == kernelized["output_bytes"]


def test_the_kernelized_program_holds_the_training_kernels(train):
    stock, kernelized = train[1]
    assert stock["kernels"] == [] and stock["replaced"] == {}
    for family in TRAIN_KERNELS:
        assert any(name.startswith(family) for name in kernelized["kernels"]), family
    assert kernelized["replaced"]["ForCausalLMLoss"] == "linear-cross-entropy x1"
    assert kernelized["replaced"]["GatedMLP"] == "gated-mlp x2"
    assert any("declared CostEstimate" in note for note in kernelized["notes"])


def test_the_table_names_both_variants(train):
    table, _ = train
    assert "stock" in table and "kernelized" in table
    assert "replaced RMSNorm -> rmsnorm x5" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-3-8b", "--layers=1"], "--layers must be >= 2"),
        (["llama-3-8b", "--layers=40"], "more than the model's 32 layers"),
        (["llama-9"], "unknown model preset 'llama-9'"),
        ([], "exactly one of PRESET"),
        (["--model-type=llama", "--set=tie_word_embeddings=maybe"], "cannot build a 'llama'"),
        (
            ["--model-type=gemma3_text", "--set=num_hidden_layers=6"],
            "the model has 1 full_attention layers; scaling compiles up to 2 of each type",
        ),
    ],
)
def test_bad_input_is_refused_before_any_compile(args, message, capsys):
    # in this process: each is refused before torchax is imported or anything compiles
    assert main(["model-bench", *args, "--mode=train", "--tpu=v6e"]) == 2
    assert message in capsys.readouterr().err


def _weight_bytes(layers: int, weights: str = "bf16", *, lane_padding: bool = False) -> int:
    """Bytes of the small Llama's parameters, its linear layers held in ``weights`` (scales
    included); ``lane_padding``: only what the fp8 block scales' rows would take at 128 lanes
    a row (the most their TPU layout adds: a row holds 2 to 4 scales here)."""
    from kernel_hub.models.model_bench import _build, spec_for_model_type
    from kernel_hub.models.quantized_bench import hold_quantized

    spec = spec_for_model_type("llama", mode="decode", tpu="v6e", overrides=SMALL_LLAMA)
    model = _build(spec, spec.layer_types()[:layers])
    if weights != "bf16":
        hold_quantized(model, weights)
    if lane_padding:
        scales = [p for name, p in model.named_parameters() if name.endswith("weight_scale_inv")]
        return sum(p.shape[0] * 128 * 4 - p.numel() * 4 for p in scales)
    return sum(p.numel() * p.element_size() for p in model.parameters())


# The small Llama's decode hand count: 3 layers, one KV head of 128, B x C tokens read + B new
# tokens written; the inputs: ids, positions, cu_seq_lens q and k, write indices (int32), then
# each path's own (stock: read index and CB's mask; kernelized: the block table).
KV_TOKEN_BF16 = 2 * 3 * 1 * 128 * 2
STOCK_INPUTS = 4 * DECODE_BATCH * DECODE_CONTEXT + 2 * DECODE_BATCH**2 * DECODE_CONTEXT
KERNELIZED_INPUTS = 4 * DECODE_BATCH * (DECODE_CONTEXT // 256)


def _decode_floor(weights: str, kv_token: int, path_inputs: int) -> int:
    b = DECODE_BATCH
    kv = b * DECODE_CONTEXT * kv_token + b * kv_token
    logits = b * SMALL_LLAMA["vocab_size"] * 2
    batch_inputs = 4 * (b + b + 2 * (b + 1) + b)
    return _weight_bytes(3, weights) + kv + logits + batch_inputs + path_inputs


def test_a_paged_decode_step_runs_the_paged_kernel_over_the_donated_cache(decode):
    table, (stock, kernelized) = decode
    assert [stock["variant"], kernelized["variant"]] == ["stock", "kernelized"]
    assert stock["kernels"] == [] and "paged_attention" in kernelized["kernels"]
    assert "ragged-attention x2" in kernelized["replaced"]["ContinuousBatching"]
    assert "paged KV cache of 512 tokens" in table
    for row in (stock, kernelized):
        assert row["mode"] == "decode" and row["compiled"]["alias_bytes"] > 0  # cache in place
        assert row["peak_hbm_bytes"] > row["compiled"]["peak_hbm_bytes"]


def test_the_decode_hand_count_is_weights_live_kv_new_tokens_and_logits(decode):
    _, (stock, kernelized) = decode
    # above it only the rotary buffer and the TPU layout padding of the small integer inputs
    # (under the new tokens' K/V: leaving those out, or counting the paged buffer's spare pages,
    # would break the bounds)
    for row, inputs in ((stock, STOCK_INPUTS), (kernelized, KERNELIZED_INPUTS)):
        floor = _decode_floor("bf16", KV_TOKEN_BF16, inputs)
        assert 0 <= row["min_bytes"] - floor < DECODE_BATCH * KV_TOKEN_BF16, row["variant"]


# Traces (no compile) the paged decode step of both variants at the small cell; per variant:
# whether the cache it returns is its input unchanged, and every equation's primitive whose output
# is at least a quarter of the cache buffer (a layer's K or V pages are a sixth of it here).
_TRACE_PAGED_DECODE = """
import json, math, sys
from jax._src import core
from kernel_hub.models import model_bench as mb

spec = mb.spec_for_model_type("llama", overrides=json.loads(sys.argv[1]), mode="decode",
                              batch=int(sys.argv[2]), context=int(sys.argv[3]), tpu="v6e")
def large(jaxpr, size):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if math.prod(getattr(var.aval, "shape", ())) * 4 >= size:
                yield eqn.primitive.name
        for sub in core.jaxprs_in_params(eqn.params):
            yield from large(sub, size)
found = {}
for variant in mb.VARIANTS:
    model = mb._build(spec, spec.layer_types()[:2])
    if variant == "kernelized":
        mb._kernelize(model, "decode")
    step = mb.trace_step(model, spec)
    jaxpr = step.traced.jaxpr.jaxpr
    cache = jaxpr.invars[len(step.arguments[0]) + len(step.arguments[1])]
    size = math.prod(cache.aval.shape)
    found[variant] = {"unchanged": jaxpr.outvars[-1] is cache, "large": list(large(jaxpr, size))}
print(json.dumps(found))
"""


@pytest.fixture
def trace_paged_decode(bench_cells):
    return ran(bench_cells, "trace_paged_decode")


def test_the_paged_decode_program_writes_the_cache_and_copies_no_buffer(trace_paged_decode):
    """Kernelized: the returned cache is the input with the new tokens scattered in (K and V of
    each compiled layer), and nothing else the size of the buffer (no per-layer view of it
    copied in front of the kernel). Stock under torchax: Transformers writes through per-layer
    views, which torchax's ``Tensor.view`` copies, so its step returns the cache unchanged."""
    found = json.loads(trace_paged_decode[0].strip().splitlines()[-1])
    assert found["kernelized"] == {"unchanged": False, "large": ["scatter"] * 4}
    assert found["stock"]["unchanged"], "stock's write reaches the cache under torchax now"


# The layer structure of the presets whose layers differ, at tiny width (head_dim 128, 2 query
# heads per KV head, 4 experts): Gemma 3's 5 sliding : 1 full attention, gpt-oss's alternating
# sliding/full attention with MoE and sinks (Qwen3-Next's hybrid: its static decode below).
_TINY = {"vocab_size": 1024, "hidden_size": 256, "num_attention_heads": 2, "head_dim": 128}
_TINY_KV = {**_TINY, "num_key_value_heads": 1}
TINY_STRUCTURES = {
    "gemma3_text": {
        **_TINY_KV,
        "intermediate_size": 512,
        "query_pre_attn_scalar": 128,
        "sliding_window": 128,
        "num_hidden_layers": 12,
    },
    "gpt_oss": {
        **_TINY_KV,
        "intermediate_size": 256,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "num_hidden_layers": 4,
    },
}
TYPE_COUNTS = {
    "gemma3_text": "10 sliding_attention, 2 full_attention",
    "gpt_oss": "2 sliding_attention, 2 full_attention",
}


# The scaling is the same code in every mode; gemma3's cell trains (its kernelized training step
# holds no more HBM than stock's; its prefill at this size holds more), gpt-oss's prefills (its
# training step, MoE backward and sinks, compiles below in a one-type model: 4 programs, not 6).
SCALING_MODES = {"gemma3_text": "train", "gpt_oss": "prefill"}


@pytest.fixture
def scaled(bench_cells, model_type):
    return ran(bench_cells, f"scaled_{model_type}")


@pytest.mark.parametrize("model_type", sorted(TINY_STRUCTURES))
def test_models_with_differing_layers_scale_by_layer_type(model_type, scaled):
    fields = TINY_STRUCTURES[model_type]
    mode = SCALING_MODES[model_type]
    _, rows = scaled
    stock, kernelized = rows
    assert (stock["variant"], kernelized["variant"]) == ("stock", "kernelized")
    for row in rows:
        assert row["mode"] == mode
        assert row["full_layers"] == fields["num_hidden_layers"] and row["compiled_layers"] == 3
        assert (
            f"scaled by layer type to {row['full_layers']} layers ({TYPE_COUNTS[model_type]})"
            in (row["notes"][0])
        )
    assert stock["kernels"] == [] and "flash_attention_forward" in kernelized["kernels"]
    assert kernelized["peak_hbm_bytes"] <= stock["peak_hbm_bytes"]


# gpt-oss's MoE training cell: full-attention layers only (one layer type: 4 programs, not 6) at
# 128 tokens: the command took 42 CPU-s against 62 at 256 (libtpu's training compiles), and the
# flash kernels take the whole sequence in one block at either length (query blocks of 512 packed
# rows), so 256 crossed no more block edges.
MOE_TRAIN = {
    **TINY_STRUCTURES["gpt_oss"],
    "num_hidden_layers": 2,
    "layer_types": ["full_attention", "full_attention"],
}


@pytest.fixture
def moe_train(bench_cells):
    return ran(bench_cells, "moe_train")


def test_a_moe_model_with_attention_sinks_trains_on_the_backward_kernels(moe_train):
    """gpt-oss's training step (the one MoE training cell): its clamped SwiGLU experts run the
    moe-gemm kernels forward and backward, its attention with sinks the flash kernels' backward."""
    _, rows = moe_train
    stock, kernelized = rows
    assert [r["mode"] for r in rows] == ["train", "train"]
    assert stock["kernels"] == [] and stock["replaced"] == {}
    backward = {
        "moe_gmm",
        "moe_tgmm",
        "flash_attention_backward_dq",
        "flash_attention_backward_dkv",
    }
    assert backward <= set(kernelized["kernels"])
    assert kernelized["replaced"]["ExpertsInterface"] == "moe-gemm x2"
    assert kernelized["peak_hbm_bytes"] <= stock["peak_hbm_bytes"]


@pytest.fixture
def eager_static_decode(bench_cells):
    return ran(bench_cells, "eager_static_decode")


def test_an_eager_attention_model_decodes_over_a_static_cache_under_torchax_jit(
    eager_static_decode,
):
    """gpt-oss runs Transformers' eager attention; over a static cache its mask has key padding,
    so kernelize serves eager's rows that see no key. torchax's jit is not torch.compile, so that
    must take the traced form there (the host read met a tracer: ConcretizationTypeError)."""
    _, rows = eager_static_decode
    assert [r["variant"] for r in rows] == ["stock", "kernelized"]
    assert "flash_attention_forward" in rows[1]["kernels"]


# Qwen3-Next's hybrid at tiny width: linear attention and full attention alternating (4 layers,
# 2 of each type; head dims 128, 2 value heads per q/k head in the gated delta net), 4 experts.
TINY_QWEN3_NEXT = {
    **_TINY_KV,
    "intermediate_size": 512,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "num_hidden_layers": 4,
}


def _linear_state_bytes(batch: int) -> int:
    """One gated-delta-net layer's decode states: the bf16 conv state over q, k and v channels
    and the f32 recurrent state per value head, by hand from TINY_QWEN3_NEXT."""
    f = TINY_QWEN3_NEXT
    channels = 2 * f["linear_num_key_heads"] * f["linear_key_head_dim"] + (
        f["linear_num_value_heads"] * f["linear_value_head_dim"]
    )
    conv = batch * channels * f["linear_conv_kernel_dim"] * 2
    heads = f["linear_num_value_heads"]
    return conv + batch * heads * f["linear_key_head_dim"] * f["linear_value_head_dim"] * 4


@pytest.fixture
def hybrid_static_decode(bench_cells):
    return ran(bench_cells, "hybrid_static_decode")


def test_a_hybrid_model_decodes_over_a_static_cache_on_its_decode_kernels(hybrid_static_decode):
    """The linear-attention layers' conv and recurrent states are donated cache arguments beside
    the attention layers' K/V (the largest compiled program: 1 linear + 2 full attention layers);
    kernelized, the step runs the decode kernels on them; the hand count reads and writes them."""
    batch, context = STATIC_BATCH, STATIC_CONTEXT
    _, rows = hybrid_static_decode
    stock, kernelized = rows
    assert stock["kernels"] == []
    assert {"causal_conv1d_update", "recurrent_gated_delta_rule"} <= set(kernelized["kernels"])
    assert {"GatedDeltaNet", "CausalConv1dSlots"} <= set(kernelized["replaced"])
    token_kv = 2 * TINY_QWEN3_NEXT["num_key_value_heads"] * TINY_QWEN3_NEXT["head_dim"] * 2
    states = _linear_state_bytes(batch)
    for row in rows:
        assert any("an f32 recurrent state" in note for note in row["notes"])
        assert row["compiled"]["alias_bytes"] == 2 * batch * context * token_kv + states
        # new K/V of the two attention layers; the states rewritten whole
        assert row["compiled"]["min_bytes_correction"] == 2 * batch * token_kv + states


def test_static_decode_binds_gated_delta_net_states_and_refuses_other_mixers():
    """Shapes from the mixer (Qwen3-Next's); OLMo-hybrid's gated delta net reads the same kind
    of cache, but model-bench has not checked its states, so its static decode is refused."""
    from kernel_hub.errors import KernelInputError
    from kernel_hub.models import model_bench as mb
    from kernel_hub.models.decode_bench import _linear_states

    kinds = ["linear_attention", "full_attention"]
    spec = mb.spec_for_model_type("qwen3_next", overrides=TINY_QWEN3_NEXT, mode="decode", tpu="v6e")
    conv, recurrent = _linear_states(mb._build(spec, kinds), 0, batch=3)
    assert conv[0] == recurrent[0] == 3
    assert 3 * math.prod(conv[1:]) * 2 + 3 * math.prod(recurrent[1:]) * 4 == _linear_state_bytes(3)
    assert conv[2] == TINY_QWEN3_NEXT["linear_conv_kernel_dim"]
    olmo = mb.spec_for_model_type("olmo_hybrid", mode="decode", cache="static", tpu="v6e")
    with pytest.raises(KernelInputError, match="whose mixer is not one model-bench binds"):
        _linear_states(mb._build(olmo, kinds), 0, batch=1)


# Eager Transformers on CPU (f32) prefills a static cache and decodes one token; model-bench's
# static decode step, stock and kernelized, runs on jax's CPU from the prefilled cache (K/V and
# the linear layers' states); prints, per variant and cache part, the largest difference from
# Transformers' next logits and updated cache, and how far that part moved in the step.
_HYBRID_DECODE_NUMERICS = """
import json, sys
import jax, jax.numpy as jnp, torch
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache
from kernel_hub.models import model_bench as mb
from kernel_hub.models.decode_bench import DecodeShape, decode_step

config = AutoConfig.for_model("qwen3_next", **json.loads(sys.argv[1]))
batch, prompt_len = 2, 7
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
model.set_experts_implementation(mb.STOCK_EXPERTS)
prompt = torch.randint(0, config.vocab_size, (batch, prompt_len))
new = torch.randint(0, config.vocab_size, (batch, 1))
cache = StaticCache(config=config, max_cache_len=prompt_len + 1)

def held(cache):
    array = lambda t: jnp.asarray(t.detach().numpy())
    linear = [layer for layer in cache.layers if hasattr(layer, "conv_states")]
    attention = [layer for layer in cache.layers if not hasattr(layer, "conv_states")]
    return {"keys": [array(l.keys) for l in attention],
            "values": [array(l.values) for l in attention],
            "conv_states": [array(l.conv_states[0]) for l in linear],
            "recurrent_states": [array(l.recurrent_states[0]) for l in linear]}

with torch.no_grad():
    model(prompt, cache=cache, use_cache=True)
    before = held(cache)
    logits = jnp.asarray(model(new, cache=cache, use_cache=True).logits.numpy())
    after = held(cache)
params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
buffers = {n: jnp.asarray(b.detach().numpy()) for n, b in model.named_buffers()}
found = {}
for variant in mb.VARIANTS:
    if variant == "kernelized":
        mb._kernelize(model, "decode")
    step = decode_step(model, DecodeShape(batch, prompt_len + 1, "static"),
                       lambda shape, dtype, heads_dim=None: jax.ShapeDtypeStruct(shape, dtype))
    ids = jnp.asarray(new.numpy(), jnp.int32)
    got_logits, got = jax.jit(step.function)(params, buffers, before, ids, jnp.int32(prompt_len))
    errors = {}
    for part in after:
        errors[part] = [
            max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got[part], after[part])),
            min(float(jnp.max(jnp.abs(b - w))) for b, w in zip(before[part], after[part])),
        ]
    found[variant] = {"logits": float(jnp.max(jnp.abs(got_logits - logits))), "cache": errors}
print(json.dumps(found))
"""


@pytest.fixture
def hybrid_decode_numerics(bench_cells):
    return ran(bench_cells, "hybrid_decode_numerics")


def test_the_hybrid_static_decode_step_returns_transformers_next_logits_and_states(
    hybrid_decode_numerics,
):
    """From a cache Transformers prefilled, both variants' steps give Transformers' next-token
    logits and return the cache Transformers' decode leaves: K/V and the linear layers' conv and
    recurrent states updated (each moved in the step), not the states they were given."""
    found = json.loads(hybrid_decode_numerics[0].strip().splitlines()[-1])
    for variant, errors in found.items():
        assert errors["logits"] < 1e-4, variant
        parts = errors["cache"]
        assert set(parts) == {"keys", "values", "conv_states", "recurrent_states"}
        for part, (error, moved) in parts.items():
            assert moved > 1e-3, (variant, part, moved)
            assert error < 1e-4, (variant, part, error)


@pytest.mark.parametrize(
    "name", sorted(n for n, p in PRESETS.items() if p.library == "transformers")
)  # the Diffusers one: tests/test_model_bench_presets.py
def test_every_preset_builds_at_real_width_on_meta(name):
    from kernel_hub.models.model_bench import _build, spec_for_preset

    spec = spec_for_preset(name, mode="train", tpu="v6e")
    model = _build(spec, spec.layer_types()[:2])
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.config.hidden_size == PRESETS[name].config["hidden_size"]
    assert len(model.model.layers) == 2


def test_a_step_that_overflows_the_chip_is_a_clear_error(monkeypatch):
    """libtpu refuses to compile a step whose temporaries exceed the chip's HBM (llama-3-8b's
    stock training step at 8k tokens on v5e: 18.22 GiB against 15.75); model-bench says which
    variant, how many layers and by how much, instead of a traceback."""
    from kernel_hub.errors import KernelInputError
    from kernel_hub.models import model_bench as bench

    refusal = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (18.22G) exceeds available HBM (15.75G)."
    )

    def failing(message):
        def compile_step(model, spec, figure_cache):
            raise RuntimeError(message)

        return compile_step

    monkeypatch.setattr(bench, "_build", lambda spec, kinds: None)  # no model needed
    monkeypatch.setattr(bench, "compile_step", failing(refusal))
    spec = bench.spec_for_model_type("llama", mode="train", tpu="v5e", overrides=SMALL_LLAMA)
    with pytest.raises(KernelInputError, match=r"stock --mode train on v5e.*1 decoder layers") as e:
        bench.bench_variant(spec, "stock")
    assert "HBM (18.22 GiB > 15.75 GiB)" in str(e.value) and "--topology" in str(e.value)
    monkeypatch.setattr(bench, "compile_step", failing("INTERNAL: something else"))
    with pytest.raises(RuntimeError, match="something else"):  # other failures pass unchanged
        bench.bench_variant(spec, "stock")


def test_a_variant_that_does_not_fit_is_a_row_beside_the_other(monkeypatch, tmp_path, capsys):
    """Stock refused for lack of HBM (llama-3-8b's training step on v5e), kernelized compiled:
    the command reports both, the refused one without figures (table, JSON null, plot label),
    and exits 0; with neither compiled it is an error naming both refusals."""
    from kernel_hub.bench.model_figures import ProgramFigures
    from kernel_hub.models import model_bench as bench

    refusal = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (18.22G) exceeds available HBM (15.75G)."
    )
    refused = {"stock"}

    def compile_step(model, spec, figure_cache):
        if model["variant"] in refused:
            raise RuntimeError(refusal)
        layers = model["layers"]
        figures = ProgramFigures(100.0 * layers, 1.0, 10.0 * layers, 0.0, 50.0 * layers, 7.0)
        return bench.CompiledStep(figures, ["rms_norm_forward"], False, None, (), {}, 1, None)

    def kernelize(model, mode):
        model["variant"] = "kernelized"
        return {"RMSNorm": "rmsnorm x1"}

    monkeypatch.setattr(
        bench, "_build", lambda spec, kinds: {"variant": "stock", "layers": len(kinds)}
    )
    monkeypatch.setattr(bench, "_kernelize", kernelize)
    monkeypatch.setattr(bench, "compile_step", compile_step)
    settings = set_args(SMALL_LLAMA)
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    command = ["model-bench", "--model-type=llama", *settings, "--mode=train", "--tpu=v5e"]
    monkeypatch.setenv("COLUMNS", "300")  # the table unwrapped
    assert main([*command, f"--json={out}", f"--plot={plot}"]) == 0
    table = capsys.readouterr().out
    assert "does not fit one chip's HBM: 18.22 GiB > 15.75 GiB" in table
    stock, kernelized = json.loads(out.read_text())
    assert stock["variant"] == "stock" and stock["hbm_overflow"] == "18.22 GiB > 15.75 GiB"
    for key in ("peak_hbm_bytes", "bytes_accessed", "flops", "roofline_ms", "min_bytes"):
        assert stock[key] is None and kernelized[key] > 0
    assert stock["compiled_layers"] == 1 and "1 decoder layers does not fit" in stock["notes"][0]
    assert kernelized["hbm_overflow"] is None and kernelized["kernels"] == ["rms_norm_forward"]
    assert kernelized["peak_hbm_bytes"] == 100.0 * 3 + 1.0 + 10.0 * 3  # scaled to 3 layers
    assert plot.read_bytes().startswith(b"\x89PNG")
    refused.add("kernelized")
    assert main(command) == 2
    error = capsys.readouterr().err
    assert "llama stock --mode train" in error and "llama kernelized --mode train" in error


# Quantized decode: the kernelized variant holds fp8 linear weights (QuantizedLinear, as
# quantize_linear keeps them) and an fp8 paged cache; stock the same model dequantized, in bf16.
KV_TOKEN_8BIT = 2 * 3 * 1 * (128 + 4)  # 8-bit K and V with one f32 scale per token and kv head


@pytest.fixture
def decode_fp8(bench_cells):
    return ran(bench_cells, "decode_fp8")


def test_fp8_weights_and_an_fp8_paged_cache_run_their_kernels_in_fewer_bytes(decode_fp8):
    _, (stock, kernelized) = decode_fp8
    assert stock["kernels"] == [] and stock["replaced"] == {}
    assert {"quantized_matmul_fp8", "paged_attention"} <= set(kernelized["kernels"])
    # q, k, v, o, gate, up, down of 2 compiled layers; the LM head stays bf16
    assert kernelized["replaced"]["QuantizedLinear"] == "quantized-matmul x14"
    assert any("stock holds the dequantized (bf16) weights" in n for n in stock["notes"])
    assert any("left bf16: lm_head" in n for n in kernelized["notes"])
    assert kernelized["bytes_accessed"] < stock["bytes_accessed"]
    assert kernelized["min_bytes"] < stock["min_bytes"]


def test_the_quantized_decode_hand_count_holds_8bit_weights_and_cache(decode_fp8):
    _, (stock, kernelized) = decode_fp8
    for row, weights, token, inputs in (
        (stock, "bf16", KV_TOKEN_BF16, STOCK_INPUTS),
        (kernelized, "fp8", KV_TOKEN_8BIT, KERNELIZED_INPUTS),
    ):
        # above the floor: as for bf16, and the block scales' layout padding
        slack = DECODE_BATCH * token + _weight_bytes(3, weights, lane_padding=True)
        floor = _decode_floor(weights, token, inputs)
        assert 0 <= row["min_bytes"] - floor < slack, row["variant"]


# Traces (no compile) the kernelized decode step with an 8-bit cache, paged (fp8) and static
# (int8); per cache: the dtypes of the cache argument's leaves, and how many of them the step
# returns unchanged.
_TRACE_8BIT_DECODE = """
import json, sys
import jax
from kernel_hub.models import model_bench as mb

found = {}
for cache, dtype in (("paged", "float8_e4m3fn"), ("static", "int8")):
    spec = mb.spec_for_model_type("llama", overrides=json.loads(sys.argv[1]), mode="decode",
                                  batch=int(sys.argv[2]), context=int(sys.argv[3]), tpu="v6e",
                                  cache=cache, kv_cache_dtype=dtype)
    model = mb._build(spec, spec.layer_types()[:2])
    mb._kernelize(model, "decode")
    step = mb.trace_step(model, spec)
    jaxpr = step.traced.jaxpr.jaxpr
    n = len(step.arguments[0]) + len(step.arguments[1])
    leaves = len(jax.tree.leaves(step.arguments[2]))
    ins, outs = jaxpr.invars[n : n + leaves], jaxpr.outvars[-leaves:]
    found[cache] = {"dtypes": sorted({str(v.aval.dtype) for v in ins}),
                    "unchanged": sum(o is i for o, i in zip(outs, ins, strict=True))}
print(json.dumps(found))
"""


@pytest.fixture
def trace_8bit_decode(bench_cells):
    return ran(bench_cells, "trace_8bit_decode")


def test_the_8bit_decode_programs_write_their_pages_and_scales(trace_8bit_decode):
    """The serving attention writes the new tokens into the 8-bit pages in their own dtype (a
    write through a byte view, ragged-attention before 1.3.2, does not trace under torchax,
    which has no dtype-reinterpreting view), and their scales; every page and scale tensor of
    the donated cache comes back written."""
    found = json.loads(trace_8bit_decode[0].strip().splitlines()[-1])
    assert found == {
        "paged": {"dtypes": ["float32", "float8_e4m3fn"], "unchanged": 0},
        "static": {"dtypes": ["float32", "int8"], "unchanged": 0},
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-3-8b", "--mode=train", "--weights=fp8"], "--weights fp8 with --mode train"),
        (
            ["gemma-3-12b", "--mode=decode", "--cache=static", "--kv-cache-dtype=int8"],
            "8-bit serving caches hold full-attention layers only; this model has "
            "sliding_attention layers",
        ),
        (
            ["llama-3-8b", "--mode=decode", "--weights=int4", "--topology=2x2", "--cache=static"],
            "--weights int4 on a --topology: not built",
        ),
    ],
)
def test_unsupported_quantized_cells_are_refused_before_any_compile(args, message, capsys):
    assert main(["model-bench", *args, "--tpu=v6e"]) == 2
    assert message in capsys.readouterr().err


def test_only_a_training_step_scales_its_temporaries(monkeypatch):
    """A training row multiplies the per-layer growth of temporaries (saved activations); a
    forward-only row keeps the largest compiled program's (1 and 2 of 3 layers here)."""
    from kernel_hub.bench.model_figures import ProgramFigures
    from kernel_hub.models import model_bench as bench

    def compile_step(model, spec, figure_cache):
        figures = ProgramFigures(100.0 * model, 1.0, 10.0 * model + 5.0, 0.0, 0.0, 0.0)
        return bench.CompiledStep(figures, [], False, None, (), {}, 1, None)

    monkeypatch.setattr(bench, "_build", lambda spec, kinds: len(kinds))
    monkeypatch.setattr(bench, "compile_step", compile_step)
    peaks = {}
    for mode in ("train", "prefill"):
        spec = bench.spec_for_model_type("llama", mode=mode, tpu="v6e", overrides=SMALL_LLAMA)
        peaks[mode] = bench.bench_variant(spec, "stock").peak_hbm_bytes
    assert peaks == {"train": 300.0 + 1.0 + 35.0, "prefill": 300.0 + 1.0 + 25.0}

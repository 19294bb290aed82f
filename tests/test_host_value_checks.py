"""Index values a kernel would misread are refused where they can be read without a device round
trip (``kernel_hub.checks.host_values``): ids wider than int32, duplicate expert ids, labels
outside the vocabulary, decreasing sequence numbers, packed offsets that leave tokens out. Each
of these ran before, and gave a wrong answer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernel_hub import get_kernel
from kernel_hub.checks import check_offset_values, host_values
from kernel_hub.errors import KernelInputError

WIDE = 2**32 + 1  # an int64 id that int32 would read as 1


def test_host_values_reads_only_what_is_already_on_the_host():
    assert host_values(np.arange(3)).tolist() == [0, 1, 2]
    assert host_values(jnp.arange(3)).tolist() == [0, 1, 2]
    assert host_values(torch.arange(3)).tolist() == [0, 1, 2]
    assert host_values(jax.ShapeDtypeStruct((3,), jnp.int32)) is None
    assert host_values(torch.empty(3, device="meta")) is None
    seen = []
    jax.jit(lambda x: seen.append(host_values(x)) or x)(jnp.arange(3))
    assert seen == [None]  # a tracer is never read


def test_traced_offsets_are_not_checked_and_readable_ones_are():
    jax.jit(lambda cu: check_offset_values("op", "cu", cu, 20) or cu)(jnp.asarray([0, 25]))
    with pytest.raises(KernelInputError, match=r"cu is \[0, 25\]; it must start at 0, end at 20"):
        check_offset_values("op", "cu", np.asarray([0, 25]), 20)


def _fused_moe_args(ids):
    tokens, top_k = ids.shape
    x = torch.randn(tokens, 128)
    w_gate_up, w_down = torch.zeros(4, 256, 128), torch.zeros(4, 128, 128)
    return x, ids, torch.ones(tokens, top_k), w_gate_up, w_down


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([[0, 1], [2, 2]], r"token 1 routes to expert 2 twice in top_k_index"),
        ([[0, 1], [1, WIDE]], rf"top_k_index holds {WIDE}, outside int32"),
    ],
)
def test_fused_moe_refuses_ids_it_would_misroute(ids, message):
    fused = get_kernel("fused-moe")
    args = _fused_moe_args(torch.tensor(ids, dtype=torch.int64))
    with pytest.raises(KernelInputError, match=message):
        fused.fused_experts(*args)
    with pytest.raises(KernelInputError, match=message):
        fused.jax.fused_experts(*(np.asarray(a) for a in args))


def test_fused_moe_sentinel_ids_may_repeat():
    """Ids outside [0, E) contribute nothing, so padding may repeat them."""
    fused = get_kernel("fused-moe")
    out = fused.fused_experts(*_fused_moe_args(torch.tensor([[0, -1], [-1, -1], [4, 4]])))
    assert out.shape == (3, 128)


@pytest.mark.parametrize(
    ("label", "message"),
    [
        (32, r"labels holds 32; each label must be in \[0, 32\) .* or ignore_index \(-100\)"),
        (-5, r"labels holds -5; each label must be in \[0, 32\)"),
        (WIDE, rf"labels holds {WIDE}, outside int32"),
    ],
)
def test_linear_cross_entropy_refuses_labels_outside_the_vocabulary(label, message):
    lce = get_kernel("linear-cross-entropy")
    hidden, weight = torch.randn(4, 16), torch.randn(32, 16)
    labels = torch.tensor([0, -100, label, 3], dtype=torch.int64)
    with pytest.raises(KernelInputError, match=message):
        lce.linear_cross_entropy(hidden, weight, labels)


def test_attention_refuses_ids_it_would_misread():
    attention = get_kernel("attention")
    q = k = v = torch.randn(1, 1, 8, 16)
    wide = torch.zeros(1, 8, dtype=torch.int64)
    wide[0, 4:] = 2**32  # read as int32 this is segment 0 again: the two segments would merge
    with pytest.raises(KernelInputError, match=r"q_segment_ids holds 4294967296, outside int32"):
        attention.attention_with_lse(q, k, v, q_segment_ids=wide, kv_segment_ids=wide)
    positions = torch.arange(8)[None] + 2**31 - 4  # they would wrap past int32's end
    with pytest.raises(KernelInputError, match=r"q_positions holds 2147483651, outside int32"):
        attention.attention_with_lse(q, k, v, q_positions=positions, kv_positions=positions)
    reserved = torch.full((1, 8), -(2**31), dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"q_segment_ids holds -2147483648, the id kv_mask"):
        attention.attention_with_lse(
            q, k, v, kv_mask=torch.ones(1, 8, dtype=torch.bool), q_segment_ids=reserved,
            kv_segment_ids=torch.zeros(1, 8, dtype=torch.int32),
        )  # fmt: skip


def test_mamba2_scan_refuses_sequence_numbers_that_decrease():
    mamba = get_kernel("mamba2-scan")
    batch, length, heads, width, state = 1, 12, 2, 8, 4
    x = torch.randn(batch, length, heads, width)
    dt, a = torch.rand(batch, length, heads), -torch.rand(heads)
    b = c = torch.randn(batch, length, 1, state)
    seq_idx = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"seq_idx decreases in row 0 \(1 then 0 at 8\)"):
        mamba.mamba_chunk_scan_combined(x, dt, a, b, c, seq_idx=seq_idx, chunk_size=16)


@pytest.mark.parametrize("offsets", [[0, 5, 12], [0, 12, 5, 20], [3, 10, 20], [0, 10, 25]])
def test_packed_sequences_refuse_offsets_that_do_not_cover_the_tokens(offsets):
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    message = rf"cu_seqlens is \[{', '.join(map(str, offsets))}\]; it must start at 0, end at 20"
    conv = get_kernel("causal-conv1d")
    with pytest.raises(KernelInputError, match=message):
        conv.causal_conv1d(torch.randn(1, 20, 8), torch.randn(8, 4), cu_seqlens=cu_seqlens)
    rule = get_kernel("gated-delta-rule")
    q = k = torch.randn(1, 20, 1, 8)
    v, g, beta = torch.randn(1, 20, 1, 8), -torch.rand(1, 20, 1), torch.rand(1, 20, 1)
    with pytest.raises(KernelInputError, match=message):
        rule.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)


def test_values_are_checked_on_every_call_not_once_per_signature():
    """A torch op's eager calls validate a signature once; value checks run on every call: a
    later call with the same shapes and a bad value is refused too."""
    lce = get_kernel("linear-cross-entropy")
    hidden, weight = torch.randn(4, 16), torch.randn(32, 16)
    lce.linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(KernelInputError, match=r"labels holds 32; each label must be in"):
        lce.linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 32, 3]))
    moe = get_kernel("moe-gemm")
    lhs, rhs = torch.randn(8, 128), torch.randn(2, 128, 128)
    moe.gmm(lhs, rhs, torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(KernelInputError, match=r"group_sizes sum to 12 but lhs has 8 rows"):
        moe.gmm(lhs, rhs, torch.tensor([4, 8], dtype=torch.int32))

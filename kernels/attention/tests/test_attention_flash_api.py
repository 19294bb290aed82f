"""flash-attn's entry points (``flash_attn_api``, what Transformers' hub attention calls): every
argument against a float64 reference, forward and gradients, f32 and bf16, and the refusals."""

from __future__ import annotations

import pytest
import torch

from kernel_hub.kernel_api import KernelInputError

H, HKV, D = 4, 2, 16


def _reference(q, k, v, *, causal, window, softcap, scale, sinks=None):
    """[S, H, D] attention of one sequence in float64; queries aligned to the end of the keys."""
    q, k, v = (x.double().transpose(0, 1) for x in (q, k, v))
    k, v = (x.repeat_interleave(H // HKV, 0) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else D**-0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    position = torch.arange(q.shape[1])[:, None] + k.shape[1] - q.shape[1]
    distance = position - torch.arange(k.shape[1])[None]
    allowed = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        allowed &= distance >= 0
    if window is not None:
        allowed &= (distance < window) if causal else (distance.abs() < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q.shape[1], 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ v).transpose(0, 1)


def _inputs(lengths_q, lengths_k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(total, heads):
        return torch.randn(total, heads, D, generator=g).to(dtype).requires_grad_()

    return make(sum(lengths_q), H), make(sum(lengths_k), HKV), make(sum(lengths_k), HKV)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _check(out, expected, inputs, dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), expected, **tol)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, inputs, cotangent.to(out.dtype))
    want = torch.autograd.grad(expected, inputs, cotangent.double())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), **tol)


OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-window": dict(causal=True, window_size=(2, 2)),
    "causal-window-right-0": dict(causal=True, window_size=(2, 0)),
    "window-bidirectional": dict(window_size=(2, 2)),
    "softcap-scale": dict(causal=True, softcap=3.0, softmax_scale=0.5),
}


def _reference_options(options):
    left = options.get("window_size", (-1, -1))[0]
    return dict(
        causal=options.get("causal", False),
        window=None if left == -1 else left + 1,
        softcap=options.get("softcap", 0.0),
        scale=options.get("softmax_scale"),
    )


CASES = [(name, torch.float32) for name in sorted(OPTIONS)] + [
    (name, torch.bfloat16) for name in ("causal-window", "softcap-scale")
]


@pytest.mark.parametrize(("name", "dtype"), CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_varlen_matches_reference_per_sequence(attention, name, dtype) -> None:
    """Three packed sequences, prefill-shaped (q = k lengths) and chunk-shaped (fewer queries,
    aligned to the end of their keys, as with a KV cache)."""
    options = OPTIONS[name]
    for lengths_q, lengths_k in (([3, 7, 5], [3, 7, 5]), ([1, 4, 2], [6, 4, 9])):
        q, k, v = _inputs(lengths_q, lengths_k, dtype)
        out = attention.flash_attn_varlen_func(
            q, k, v, _cu(lengths_q), _cu(lengths_k), max(lengths_q), max(lengths_k), **options
        )
        parts, (cq, ck) = [], (_cu(lengths_q), _cu(lengths_k))
        for b in range(len(lengths_q)):
            rows_q, rows_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            parts.append(_reference(q[rows_q], k[rows_k], v[rows_k], **_reference_options(options)))
        _check(out, torch.cat(parts), (q, k, v), dtype)


@pytest.mark.parametrize("name", ["plain", "causal-window", "softcap-scale"])
def test_dense_call_matches_reference(attention, name) -> None:
    options = OPTIONS[name]
    q, k, v = (x.detach().view(2, -1, *x.shape[1:]).requires_grad_() for x in _inputs([6], [8]))
    out = attention.flash_attn_func(q, k, v, **options)
    expected = torch.stack(
        [_reference(q[b], k[b], v[b], **_reference_options(options)) for b in range(2)]
    )
    _check(out, expected, (q, k, v), torch.float32)


def test_s_aux_is_served_as_attention_sinks(attention) -> None:
    q, k, v = _inputs([5, 3], [5, 3], torch.float32)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(2)).requires_grad_()
    cu = _cu([5, 3])
    out = attention.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, s_aux=sinks)
    expected = torch.cat(
        [
            _reference(
                q[r], k[r], v[r], causal=True, window=None, softcap=0, scale=None, sinks=sinks
            )
            for r in (slice(0, 5), slice(5, 8))
        ]
    )
    _check(out, expected, (q, k, v, sinks), torch.float32)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(dropout_p=0.1), "dropout_p=0.1; attention dropout is not served"),
        (dict(alibi_slopes=torch.ones(H)), "alibi_slopes is not served"),
        (dict(return_attn_probs=True), "return_attn_probs=True is not served"),
        (dict(window_size=(2, 0)), r"window_size=\(2, 0\) without causal; only symmetric"),
        (dict(window_size=(-2, -1)), r"window_size=\(-2, -1\); each side is -1"),
        (dict(softcap=-1.0), r"softcap=-1.0; 0.0 \(none\) or a number > 0"),
        (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), "block_table .* is not served"),
    ],
)
def test_unserved_arguments_are_refused(attention, options, message) -> None:
    q, k, v = _inputs([4], [4], torch.float32)
    cu = _cu([4])
    with pytest.raises(KernelInputError, match=message):
        attention.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, **options)
    if "block_table" not in options:
        with pytest.raises(KernelInputError, match=message):
            attention.flash_attn_func(q[None], k[None], v[None], **options)


def test_bad_layouts_are_refused(attention) -> None:
    q, k, v = _inputs([4], [4], torch.float32)
    cu = _cu([4])
    with pytest.raises(KernelInputError, match=r"q has shape \(4, 4, 16\); expected \[batch, seq"):
        attention.flash_attn_func(q, k, v)
    with pytest.raises(KernelInputError, match=r"cu_seqlens_k has shape \(2, 1\)"):
        attention.flash_attn_varlen_func(q, k, v, cu, cu[:, None], 4, 4)
    with pytest.raises(KernelInputError, match="must describe the same number of sequences"):
        attention.flash_attn_varlen_func(q, k, v, cu, _cu([2, 2]), 4, 4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'seqused_k'"):
        attention.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, seqused_k=torch.tensor([4]))


BAD_OFFSETS = {
    "overrun": [0, 3, 6],  # ends past the 5 tokens
    "short": [0, 2, 4],  # leaves a token out
    "decreasing": [0, 4, 2, 5],
    "not-from-0": [1, 3, 5],
}


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_bad_offsets_are_refused(attention, case, side) -> None:
    """Offsets that would mix or drop tokens are refused before the kernel runs."""
    q, k, v = _inputs([5], [5], torch.float32)
    bad = torch.tensor(BAD_OFFSETS[case], dtype=torch.int32)
    good = _cu([2, 3]) if len(bad) == 3 else _cu([1, 3, 1])
    cu_q, cu_k = (bad, good) if side == "q" else (good, bad)
    message = rf"cu_seqlens_{side}=\[.*start at 0, never decrease and end at the 5 tokens"
    with pytest.raises(KernelInputError, match=message):
        attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3)


def test_bad_offsets_inside_a_compiled_graph_raise(attention) -> None:
    """Under torch.compile the offsets are graph values: an assertion in the graph fails the call
    (no host read, no silent result)."""
    q, k, v = _inputs([5], [5], torch.float32)

    def call(cu_k):
        return attention.flash_attn_varlen_func(q, k, v, _cu([2, 3]), cu_k, 3, 3)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="end at the 5 tokens"):
        compiled(torch.tensor([0, 3, 6], dtype=torch.int32))


def test_queries_without_keys_give_zeros_as_in_flash_attn(attention) -> None:
    """More queries than keys under causal masking: bottom-right alignment leaves the first
    queries no key; flash-attn returns zeros there (and no NaN reaches a gradient)."""
    q, k, v = _inputs([5], [3], torch.float32)
    out = attention.flash_attn_varlen_func(q, k, v, _cu([5]), _cu([3]), 5, 3, causal=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    expected = _reference(q[2:], k, v, causal=True, window=None, softcap=0, scale=None)
    _check(out[2:], expected, (q, k, v), torch.float32)

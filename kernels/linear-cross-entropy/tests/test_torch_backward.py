"""The torch training path of linear-cross-entropy: ``linear_cross_entropy`` with a gradient runs
``linear_cross_entropy_per_token``, whose backward starts from the saved log-sum-exp. Its loss and
gradients equal the op that differentiates the whole loss (``loss_only``) for every option, and a
forward + backward traces the forward kernel once, not twice."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernel_hub import get_kernel

k = get_kernel("linear-cross-entropy")
api = k.KERNEL.jax

# 40 tokens, 300 vocabulary rows, hidden 32 (the torch op takes the default blocks; the kernels'
# multi-block schedules are tested at the JAX level, test_fused_backward.py).
TOKENS, HIDDEN, VOCAB = 40, 32, 300
OPTIONS = [
    {},
    {"reduction": "none", "label_smoothing": 0.1, "softcap": 4.0, "logit_scale": 0.5},
    {"z_loss": 1e-3, "label_smoothing": 0.2, "ignore_index": 3, "reduction": "sum"},
]
"""Every option, each reduction (the kernel programs are the same for all: the options reach the
backward through the O(N) loss part and the logit form)."""
EVERY_OPTION = {
    "reduction": "sum",
    "label_smoothing": 0.1,
    "z_loss": 0.0123,  # a value no other test uses: both torch programs are traced afresh
    "softcap": 4.0,
    "logit_scale": 0.5,
    "ignore_index": 3,
}


def tensors(bias: bool, ignore_index: int = -100):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3).requires_grad_()
    b = torch.randn(VOCAB, generator=generator).requires_grad_() if bias else None
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[::6] = ignore_index
    return hidden, weight, labels, b


def loss_and_grads(loss_fn, hidden, weight, labels, b, options):
    leaves = [t for t in (hidden, weight, b) if t is not None]
    for t in leaves:
        t.grad = None
    loss = loss_fn(hidden, weight, labels, b, **options)
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (loss * weights).sum().backward()
    return [loss.detach(), *(t.grad for t in leaves)]


def assert_same(got, want):
    for name, g, w in zip(("loss", "dh", "dW", "db"), got, want, strict=False):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_saved_statistics_backward_equals_the_differentiated_loss(options):
    inputs = tensors(bias=bool(options), ignore_index=options.get("ignore_index", -100))
    options = {**options, "implementation": "xla"}
    want = loss_and_grads(k.loss_only, *inputs, options)
    assert_same(loss_and_grads(k.linear_cross_entropy, *inputs, options), want)


def test_num_items_in_batch_through_the_causal_lm_loss():
    """Transformers' sum / num_items_in_batch, as the integration calls it."""
    integrations = k.KERNEL.integration("transformers")
    hidden, weight, labels, _ = tensors(bias=False)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight = torch.nn.Parameter(weight.detach().clone())
    got = integrations.causal_lm_loss(hidden[None], head, labels[None], num_items_in_batch=17)
    got.backward()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[1:]
    want = k.loss_only(hidden.detach().requires_grad_(), weight, shifted, None, -100, "sum") / 17
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert head.weight.grad is not None and hidden.grad is not None


def test_a_torch_training_step_runs_the_forward_kernel_once(monkeypatch):
    """Pallas, every option: the same loss and gradients as the loss-only op, and the kernels
    counted as the programs torch runs are traced (``EVERY_OPTION`` holds a value no other test
    uses): the per-token op's forward program holds the forward kernel, its backward program only
    the backward kernel; the loss-only op's backward runs the forward again (the count can
    fail)."""
    counts = {"forward": 0, "backward": 0}
    for name in counts:
        kernel = getattr(api.pallas_tpu, name)

        def counted(*args, _kernel=kernel, _name=name):
            counts[_name] += 1
            return _kernel(*args)

        monkeypatch.setattr(api.pallas_tpu, name, counted)
    inputs = tensors(bias=True, ignore_index=EVERY_OPTION["ignore_index"])
    options = {**EVERY_OPTION, "implementation": "pallas"}
    got = loss_and_grads(k.linear_cross_entropy, *inputs, options)
    assert counts == {"forward": 1, "backward": 1}
    counts.update(forward=0, backward=0)
    assert_same(got, loss_and_grads(k.loss_only, *inputs, options))
    assert counts == {"forward": 2, "backward": 1}


def test_without_a_gradient_the_loss_only_op_runs():
    hidden, weight, labels, _ = tensors(bias=False)
    with torch.no_grad():
        loss = k.linear_cross_entropy(hidden, weight, labels)
    assert loss.shape == () and loss.grad_fn is None


def test_the_loss_takes_the_ops_parameters():
    assert list(inspect.signature(k.linear_cross_entropy).parameters) == list(
        inspect.signature(k.loss_only).parameters
    )


def test_a_bad_reduction_is_refused_in_training_too():
    from kernel_hub.errors import KernelInputError

    hidden, weight, labels, _ = tensors(bias=False)
    with pytest.raises(KernelInputError, match="reduction='avg'; valid: mean, sum, none"):
        k.linear_cross_entropy(hidden, weight, labels, reduction="avg")


def test_the_torch_programs_hold_four_matmul_passes():
    """The two programs torch runs, as traced: the per-token op's forward holds the forward
    kernel (one N x V x H pass), its backward only the backward kernel (three)."""
    import jax
    import jax.numpy as jnp

    from kernel_hub.bench import block_schedule

    hidden, weight, labels = (
        jnp.zeros((TOKENS, HIDDEN)),
        jnp.zeros((VOCAB, HIDDEN)),
        jnp.zeros(TOKENS, jnp.int32),
    )
    stats = jnp.zeros(TOKENS)

    def forward(h, w, y):
        return api.linear_cross_entropy_per_token(h, w, y, implementation="pallas")

    def backward(h, w, y, losses, lse, d):
        return api.linear_cross_entropy_backward(
            h, w, y, None, losses, lse, d, d, implementation="pallas"
        )

    one_pass = 2 * TOKENS * VOCAB * HIDDEN  # the default blocks are the whole axes here
    programs = (
        (forward, (hidden, weight, labels)),
        (backward, (hidden, weight, labels, stats, stats, stats)),
    )
    found = [
        [
            (str(call.params["name"]), block_schedule.matmul_flops(call))
            for call in block_schedule.pallas_calls(jax.jit(fn), *args)
        ]
        for fn, args in programs
    ]
    assert found == [
        [("linear_cross_entropy_forward", one_pass)],
        [("linear_cross_entropy_backward", 3 * one_pass)],
    ]

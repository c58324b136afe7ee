"""Autograd: backward, .grad, no_grad, and gradients against finite differences."""

import numpy as np
import pytest

import loom


def f(x, w, b):
    h = loom.ops.tanh(x @ w + b)
    return loom.ops.mean(loom.ops.softmax(h, -1) * h)


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    x = loom.from_numpy(rng.standard_normal((3, 4)))
    w = loom.from_numpy(rng.standard_normal((4, 5))).requires_grad_()
    b = loom.from_numpy(rng.standard_normal(5)).requires_grad_()
    f(x, w, b).backward()
    for p in (w, b):
        grad = p.grad.numpy().copy()
        values = p.numpy()  # the parameter's own memory
        eps = 1e-6
        for i in np.ndindex(values.shape):
            old = values[i]
            values[i] = old + eps
            with loom.no_grad():
                up = f(x, w, b).item()
            values[i] = old - eps
            with loom.no_grad():
                down = f(x, w, b).item()
            values[i] = old
            assert abs((up - down) / (2 * eps) - grad[i]) < 1e-6


def test_no_grad_and_leaves():
    a = loom.randn(3, requires_grad=True)
    assert a.is_leaf and a.grad is None and a.grad_fn is None
    with loom.no_grad():
        assert not loom.is_grad_enabled()
        assert not (a * 2).requires_grad
        with loom.enable_grad():
            assert (a * 2).requires_grad
    assert loom.is_grad_enabled()
    c = (a * a).sum()
    assert c.requires_grad and c.grad_fn is not None
    c.backward()
    np.testing.assert_allclose(a.grad.numpy(), 2 * a.numpy(), rtol=1e-6)
    a.grad = None
    assert a.grad is None

    @loom.no_grad()
    def doubled(t):
        return t * 2

    assert not doubled(a).requires_grad


def test_backward_of_a_non_scalar_needs_a_gradient():
    a = loom.randn(3, requires_grad=True)
    with pytest.raises(loom.Error):
        (a * 2).backward()
    (a * 2).backward(loom.ones(3))
    assert a.grad.tolist() == [2.0, 2.0, 2.0]

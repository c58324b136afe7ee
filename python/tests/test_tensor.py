"""Tensors: creation, dtypes, devices, views, ops and operators, numpy and DLPack without copies, errors."""

import numpy as np
import pytest

import loom


def test_creation_dtypes_and_devices():
    t = loom.zeros(2, 3)
    assert t.shape == (2, 3) and t.dtype == loom.float32 and t.device == loom.device("cpu")
    assert loom.ones((4,), dtype="bf16").dtype == loom.bfloat16 == loom.bf16
    assert loom.full((2, 2), 7.0, dtype=loom.int64).tolist() == [[7, 7], [7, 7]]
    assert loom.arange(5).tolist() == [0, 1, 2, 3, 4] and loom.arange(5).dtype == loom.int64
    assert loom.arange(0, 1, 0.25).tolist() == [0.0, 0.25, 0.5, 0.75]
    loom.manual_seed(3)
    a = loom.randn(1000, dtype="f64")
    loom.manual_seed(3)
    assert np.array_equal(a.numpy(), loom.randn(1000, dtype="f64").numpy())
    assert abs(float(a.numpy().mean())) < 0.15
    assert str(loom.f16) == "f16" and loom.dtype("float32") == loom.f32 and loom.f32.itemsize == 4
    assert str(loom.device("cpu")) == "cpu" and loom.device("cpu") == "cpu"
    assert loom.tensor([[1.0, 2.0]]).dtype == loom.float32


def test_views_share_memory():
    t = loom.arange(0, 24, 1, dtype="f32").view(2, 3, 4)
    assert t.strides == (12, 4, 1)
    tt = t.transpose(0, 2)
    assert tt.shape == (4, 3, 2) and tt.strides == (1, 4, 12) and not tt.is_contiguous()
    assert tt.shares_storage_with(t)
    assert t.narrow(2, 1, 2).tolist() == t.numpy()[:, :, 1:3].tolist()
    assert t[1, :, ::2].tolist() == t.numpy()[1, :, ::2].tolist()
    assert t[..., -1].tolist() == t.numpy()[..., -1].tolist()
    assert t[None].shape == (1, 2, 3, 4)
    assert t.reshape(6, 4).shape == (6, 4) and t.permute(2, 0, 1).shape == (4, 2, 3)
    t[0, 0, 0] = 100.0
    assert t.numpy()[0, 0, 0] == 100.0
    assert t.flatten().shape == (24,) and t.unsqueeze(0).squeeze(0).shape == (2, 3, 4)


def test_ops_and_operators_match_numpy():
    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    a, b = loom.from_numpy(a_np), loom.from_numpy(b_np)
    np.testing.assert_allclose((a @ b).numpy(), a_np @ b_np, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((a + 1).numpy(), a_np + 1)
    np.testing.assert_allclose((2 - a).numpy(), 2 - a_np)
    np.testing.assert_allclose((a * a).numpy(), a_np * a_np)
    np.testing.assert_allclose((a / 2).numpy(), a_np / 2)
    np.testing.assert_allclose((-a).numpy(), -a_np)
    np.testing.assert_allclose(loom.ops.exp(a).numpy(), np.exp(a_np), rtol=1e-6)
    np.testing.assert_allclose(loom.ops.softmax(a, -1).numpy(),
                               np.exp(a_np) / np.exp(a_np).sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(a.sum(1).numpy(), a_np.sum(1), rtol=1e-5)
    np.testing.assert_allclose(loom.ops.mean(a).item(), a_np.mean(), rtol=1e-5)
    assert (a > 0).dtype == loom.bool and (a > 0).numpy().tolist() == (a_np > 0).tolist()
    assert loom.ops.argmax(a, 1).numpy().tolist() == a_np.argmax(1).tolist()
    np.testing.assert_allclose(loom.ops.cat([a, a], 0).numpy(), np.concatenate([a_np, a_np]))


def test_numpy_round_trip_without_copies():
    t = loom.randn(3, 5)
    n = t.numpy()
    assert n.ctypes.data == t.data_ptr()
    n[1, 2] = 42.0
    assert t[1, 2].item() == 42.0
    back = loom.from_numpy(n)
    assert back.data_ptr() == t.data_ptr()
    # A strided view of an array stays a view.
    a = np.arange(40, dtype=np.float64).reshape(5, 8)[:, 1::2]
    v = loom.from_numpy(a)
    assert v.data_ptr() == a.ctypes.data and v.strides == (8, 2) and v.tolist() == a.tolist()
    a[0, 0] = -1
    assert v[0, 0].item() == -1
    # The buffer protocol shares too.
    m = np.asarray(memoryview(t))
    assert m.ctypes.data == t.data_ptr()
    # The tensor keeps the array's memory alive, and the array the tensor's.
    def make():
        return loom.from_numpy(np.ones(1000, dtype=np.int32))
    assert make().sum().item() == 1000
    assert loom.ones(4).numpy().sum() == 4


def test_bfloat16_to_numpy_is_a_float32_copy():
    t = loom.tensor([1.5, -2.25], dtype="bf16")
    n = t.numpy()
    assert n.dtype == np.float32 and n.tolist() == [1.5, -2.25] and n.ctypes.data != t.data_ptr()


def test_negative_strides_and_read_only_arrays_are_copied():
    a = np.arange(6, dtype=np.float32)[::-1]
    t = loom.from_numpy(a)
    assert t.tolist() == a.tolist() and t.data_ptr() != a.ctypes.data
    r = np.arange(3, dtype=np.float32)
    r.setflags(write=False)
    assert loom.from_numpy(r).tolist() == [0, 1, 2]


def test_dlpack_round_trips_without_copies():
    t = loom.randn(4, 6)
    assert t.__dlpack_device__() == (1, 0)
    n = np.from_dlpack(t)
    assert n.ctypes.data == t.data_ptr() and n.tolist() == t.tolist()
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    u = loom.from_dlpack(a)
    assert u.data_ptr() == a.ctypes.data and u.dtype == loom.int64 and u.tolist() == a.tolist()
    w = loom.from_dlpack(t.transpose(0, 1))
    assert w.data_ptr() == t.data_ptr() and w.strides == (1, 6)
    bf = loom.ones(3, dtype="bf16")
    assert loom.from_dlpack(bf).dtype == loom.bf16 and loom.from_dlpack(bf).data_ptr() == bf.data_ptr()
    capsule = t.__dlpack__()
    assert loom.from_dlpack(capsule).data_ptr() == t.data_ptr()
    with pytest.raises(loom.Error, match="DLPack"):
        loom.from_dlpack(capsule)  # a capsule is consumed once


def test_errors_are_loom_errors_with_one_line():
    with pytest.raises(loom.Error) as e:
        loom.zeros(2, 3) @ loom.zeros(4, 5)
    assert "\n" not in str(e.value) and "matmul" in str(e.value)
    with pytest.raises(loom.Error):
        loom.zeros(6).view(4)
    with pytest.raises(loom.Error, match="dtype"):
        loom.zeros(2, dtype="f33")
    with pytest.raises(loom.Error, match="out of range"):
        loom.zeros(2)[5]
    with pytest.raises(loom.Error, match="cuda"):
        loom.zeros(2, device="tpu")
    assert issubclass(loom.Error, RuntimeError)

"""CUDA tensors between Loom and PyTorch through DLPack: no copies, the same values, dtypes and strides, writes seen on
both sides, and the work each side queued before the exchange seen by the other (the stream handshake). Skipped
without torch or a GPU that both see."""

import pytest

import loom

try:
    import torch
except ImportError:  # the tests are still collected, each skipped (a file of skipped tests passes)
    torch = None
pytestmark = pytest.mark.skipif(torch is None or not (torch.cuda.is_available() and loom.cuda_is_available()),
                                reason="needs torch and a GPU that torch and Loom both see")

# Loom's dtype and torch's, by name.
DTYPES = [("f32", "float32"), ("f64", "float64"), ("bf16", "bfloat16"), ("f16", "float16"), ("i64", "int64"),
          ("i32", "int32"), ("i8", "int8"), ("u8", "uint8"), ("bool", "bool")]
VALUES = [[4 * i + j for j in range(4)] for i in range(3)]  # exact in every dtype (bool: all but the first true)


def same_view(t, z):
    """A torch and a Loom tensor over the same memory, with the same shape, strides and values."""
    assert t.data_ptr() == z.data_ptr()
    assert tuple(t.shape) == z.shape and t.stride() == z.strides
    assert t.device == torch.device("cuda", z.device.index)
    assert t.cpu().tolist() == z.tolist()


@pytest.mark.parametrize("name,torch_dtype", DTYPES, ids=[d[0] for d in DTYPES])
def test_a_loom_tensor_in_torch_without_a_copy(name, torch_dtype):
    z = loom.tensor(VALUES, dtype=name, device="cuda")
    t = torch.from_dlpack(z)
    assert t.dtype == getattr(torch, torch_dtype)
    same_view(t, z)
    if name != "bool":
        assert t.cpu().tolist() == VALUES


@pytest.mark.parametrize("name,torch_dtype", DTYPES, ids=[d[0] for d in DTYPES])
def test_a_torch_tensor_in_loom_without_a_copy(name, torch_dtype):
    t = torch.tensor(VALUES, device="cuda").to(getattr(torch, torch_dtype))
    z = loom.from_dlpack(t)
    assert z.dtype == loom.dtype(name) and z.device == loom.device("cuda", t.device.index)
    same_view(t, z)


def test_strided_views_keep_their_strides_and_offsets():
    base = loom.arange(0, 48, 1, dtype="f32").view(6, 8).to("cuda")
    for view in (base.transpose(0, 1), base.narrow(1, 2, 4), base[1:5:2, ::3]):
        same_view(torch.from_dlpack(view), view)
    a = torch.arange(48.0, device="cuda").view(6, 8)
    for view in (a.t(), a[:, 2:6], a[1:5:2, ::3]):
        same_view(view, loom.from_dlpack(view))


def test_writes_through_either_side_are_seen_by_the_other():
    z = loom.zeros(4, 5, device="cuda")
    t = torch.from_dlpack(z)
    t[1, 2] = 5.0
    torch.cuda.synchronize()  # the whole device: Loom's stream too
    assert z.tolist()[1][2] == 5.0
    z[2, 3] = 6.0
    torch.cuda.synchronize()
    assert t[2, 3].item() == 6.0

    a = torch.zeros(6, 8, device="cuda")
    v = loom.from_dlpack(a.t())
    v[3, 1] = 2.0
    torch.cuda.synchronize()
    assert a[1, 3].item() == 2.0
    a[4, 5] = 3.0
    torch.cuda.synchronize()
    assert v.tolist()[5][4] == 3.0


def keep_torch_busy():
    """About 0.1 s of work on torch's current stream."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(200_000_000)  # clock cycles
    else:
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(100):
            x = torch.tanh(x @ x)


def keep_loom_busy():
    """Tens of milliseconds or more of work on Loom's current stream (matrix products of 4096 x 4096)."""
    x = loom.randn(4096, 4096, device="cuda")
    w = loom.randn(4096, 4096, device="cuda") * (1 / 64)
    for _ in range(100):
        x = loom.ops.tanh(x @ w)
    return x


def side_or_default(side):
    return torch.cuda.Stream() if side else torch.cuda.default_stream()


@pytest.mark.parametrize("side", [False, True], ids=["default_stream", "side_stream"])
def test_torch_work_queued_before_the_exchange_is_seen_by_loom(side):
    t = torch.zeros(1 << 16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side_or_default(side)):
        keep_torch_busy()
        t.fill_(7.0)
        z = loom.from_dlpack(t)  # Loom's stream waits for torch's current stream
    got = z.cpu().numpy()  # read on Loom's stream alone
    torch.cuda.synchronize()
    assert got.min() == 7.0 == got.max(), "Loom read the tensor before torch's queued work had written it"


@pytest.mark.parametrize("side", [False, True], ids=["default_stream", "side_stream"])
def test_loom_work_queued_before_the_exchange_is_seen_by_torch(side):
    z = loom.zeros(1 << 16, device="cuda")
    keep_loom_busy()  # first products: the caching allocator's blocks, cuBLAS's set-up
    z.cpu()  # Loom's stream idle
    keep_loom_busy()
    z.fill_(7.0)  # queued behind the products on Loom's stream
    with torch.cuda.stream(side_or_default(side)):
        t = torch.from_dlpack(z)  # torch's current stream waits for Loom's
        got = t.cpu()  # read on torch's current stream alone
    torch.cuda.synchronize()
    assert got.min().item() == 7.0 == got.max().item(), \
        "torch read the tensor before Loom's queued work had written it"

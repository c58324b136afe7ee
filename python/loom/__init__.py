"""Loom from Python: tensors, autograd, models, the trainer and generation over Loom's C++ library.

The extension module ``loom._loom`` binds the library's public API; this package re-exports it and adds what is
plain Python (``no_grad``, ``tensor``). docs/PYTHON.md is the guide.
"""

import functools as _functools

from . import _loom
from ._loom import (  # noqa: F401
    Error,
    Tensor,
    Tokenizer,
    Trainer,
    arange,
    conformance,
    cuda_is_available,
    data,
    device,
    dtype,
    empty,
    from_dlpack,
    from_numpy,
    from_pretrained,
    full,
    generate,
    is_grad_enabled,
    load_model,
    load_safetensors,
    manual_seed,
    models,
    nn,
    ones,
    ops,
    optim,
    providers,
    rand,
    randn,
    save_model,
    save_safetensors,
    set_allow_tf32,
    set_grad_enabled,
    version,
    zeros,
)

import sys as _sys

# The submodules of the extension, importable by name (import loom.nn, from loom.optim import AdamW).
for _name in ("data", "models", "nn", "ops", "optim", "providers"):
    _sys.modules[__name__ + "." + _name] = getattr(_loom, _name)
del _name

# The dtypes by their long and short names: loom.float32 is loom.f32.
for _name, _value in list(vars(_loom).items()) + list(dtype.__members__.items()):
    if isinstance(_value, dtype):
        globals()[_name] = _value
del _name, _value

__version__ = _loom.__version__


class _GradMode:
    _enabled = True

    def __enter__(self):
        self._previous = is_grad_enabled()
        set_grad_enabled(self._enabled)
        return self

    def __exit__(self, *exc):
        set_grad_enabled(self._previous)
        return False

    def __call__(self, fn):
        @_functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.__class__():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_GradMode):
    """Operations inside record no autograd history: ``with loom.no_grad(): ...``, or as a decorator."""

    _enabled = False


class enable_grad(_GradMode):
    """Turns autograd recording back on inside a ``no_grad`` block."""

    _enabled = True


def tensor(data, *, dtype=None, device=None, requires_grad=False):
    """A new tensor holding a copy of ``data`` (a number, nested lists, a numpy array or a Loom tensor)."""
    import numpy as np

    if isinstance(data, Tensor):
        t = data.detach().clone()
    else:
        array = np.array(data)
        if dtype is None and array.dtype == np.float64 and not isinstance(data, np.ndarray):
            array = array.astype(np.float32)  # Python floats become float32, as in torch
        t = from_numpy(np.ascontiguousarray(array).copy())
    if dtype is not None:
        t = t.to(dtype)
    if device is not None:
        t = t.to(device)
    if requires_grad:
        t.requires_grad = True
    return t

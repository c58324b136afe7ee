"""Loom beside other libraries that bring the C++ runtime into the process first (numpy, toml++, MPI, torch)."""

import os
import subprocess
import sys

SCRIPT = r"""
import ctypes, ctypes.util, sys
ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")  # the shared C++ runtime, loaded first
import numpy
import loom
model = loom.models.gpt2("tiny", seed=3)
try:
    loom.generate(model, [1], max_new_tokens=4, top_p=2.0)  # an error whose message formats a double
except loom.Error as e:
    print("error:", e)
print("value:", loom.tensor([0.25, 1.5]).sum().item())
"""


def test_loom_after_the_shared_cpp_runtime_and_numpy():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "error: generate: top_p must be in (0, 1], got 2" in run.stdout
    assert "value: 1.75" in run.stdout

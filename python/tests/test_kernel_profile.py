"""tools/bench/kernel_profile.py on the CPU: Loom's side end to end (the TOML it writes, loom.Trainer's callback
opening and closing the profiled window, the table and the RESULT line), with a stand-in for torch.profiler that
records when it runs and writes a chrome trace of known kernels; and its refusals."""

import os
import pathlib
import subprocess
import sys

from conftest import SOURCE_DIR

TOOL = SOURCE_DIR / "tools" / "bench" / "kernel_profile.py"

FAKE_TORCH = '''
__version__ = "stand-in"
class _Cuda:
    def init(self): pass
    def synchronize(self): pass
cuda = _Cuda()
'''

FAKE_PROFILER = '''
import json, os
class ProfilerActivity:
    CUDA = "cuda"
class profile:
    def __init__(self, activities=None):
        self.log = open(os.environ["FAKE_PROFILER_LOG"], "a")
    def start(self):
        self.log.write("start\\n"); self.log.flush()
    def stop(self):
        self.log.write("stop\\n"); self.log.flush()
    def export_chrome_trace(self, path):
        events = [{"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_h_bz_TNT", "dur": 900.0},
                  {"ph": "X", "cat": "kernel", "name": "adamw_kernel<4, true, float, float>", "dur": 100.0},
                  {"ph": "X", "cat": "kernel", "name": "residual_layer_norm_kernel", "dur": 60.0},
                  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000.0}]
        json.dump({"traceEvents": events}, open(path, "w"))
'''


def run_tool(tmp_path, *args):
    fake = tmp_path / "fake"
    (fake / "torch" / "profiler").mkdir(parents=True, exist_ok=True)
    (fake / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (fake / "torch" / "profiler" / "__init__.py").write_text(FAKE_PROFILER)
    env = dict(os.environ, FAKE_PROFILER_LOG=str(tmp_path / "profiler.log"),
               PYTHONPATH=os.pathsep.join([str(fake)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run([sys.executable, str(TOOL), *args], env=env, capture_output=True, text=True, timeout=300)


def test_loom_side_profiles_the_steps_after_the_warm_ones_and_tables_them(tmp_path):
    r = run_tool(tmp_path, "--model", "d2", "-b", "2", "-t", "32", "--device", "cpu", "--skip-torch", "--warm", "2",
                 "--profile-steps", "2", "--loom-set", "eval_batches=1", "--work", str(tmp_path / "work"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "profiler.log").read_text().split() == ["start", "stop"]
    lines = r.stdout.splitlines()
    rows = {line[:34].strip(): line[34:].split() for line in lines if line[:34].strip()}
    # The stand-in's trace holds each kernel once over the 2 profiled steps: per step half of it; CPU events left out.
    assert rows["matrix products"] == ["0.45"]
    assert rows["optimizer"] == ["0.05"]
    assert rows["norms"] == ["0.03"]
    assert rows["all kernels"] == ["0.53"]
    assert float(rows["step wall time (median)"][0]) > 0
    result = [line for line in lines if line.startswith("RESULT kernel_profile d2 b 2 t 32 loom_kernels_ms 0.53")]
    assert result, r.stdout
    config = (tmp_path / "work" / "run.toml").read_text()
    assert config.startswith("eval_batches = 1\n") and 'device = "cpu"' in config


def test_refusals_are_one_line(tmp_path):
    r = run_tool(tmp_path, "--loom-set", "fp8")
    assert r.returncode != 0 and "'fp8' is not KEY=VALUE" in r.stderr
    r = run_tool(tmp_path, "--device", "cpu")
    assert r.returncode != 0 and "the PyTorch side runs on CUDA only" in r.stderr

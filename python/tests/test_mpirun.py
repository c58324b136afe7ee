"""loom.Trainer under mpirun: two CPU ranks train data-parallel to loom-train's losses under the same launch."""

import json
import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import loom
losses = []
trainer = loom.Trainer(sys.argv[1], quiet=True)
trainer.run(on_step=lambda m: losses.append(m["loss"]))
with open(sys.argv[2] + ".rank" + str(__import__("os").environ.get("OMPI_COMM_WORLD_RANK", "0")), "w") as f:
    json.dump(losses, f)
"""


def test_two_ranks_match_loom_train(tmp_path, shards):
    mpirun, exe = os.environ.get("LOOM_MPIEXEC") or shutil.which("mpirun"), os.environ.get("LOOM_TRAIN_EXE")
    if not mpirun or not exe or os.environ.get("LOOM_MPI") != "ON":
        pytest.skip("no MPI backend, mpirun or loom-train (ctest sets LOOM_MPI, LOOM_MPIEXEC and LOOM_TRAIN_EXE)")
    train, _ = shards
    config = tmp_path / "ddp.toml"
    config.write_text(f'model = "d2"\ntrain_data = "{train}"\nbatch_size = 2\nseq_len = 16\nsteps = 3\n'
                      f'total_batch_tokens = 64\neval_interval = 0\nsample_tokens = 0\nwarmup = 1\n'
                      f'log_dir = "{tmp_path / "app"}"\n')
    launch = [mpirun, "--oversubscribe", "--allow-run-as-root", "-np", "2", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(launch + [exe, "--config", str(config)], check=True, env=env, stdout=subprocess.DEVNULL,
                   timeout=300)
    app = [json.loads(line)["train/loss"] for line in (tmp_path / "app" / "metrics.jsonl").read_text().splitlines()
           if "train/loss" in line]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config.write_text(config.read_text().replace(str(tmp_path / "app"), str(tmp_path / "py")))
    subprocess.run(launch + [sys.executable, str(script), str(config), str(tmp_path / "losses")], check=True,
                   env=env, stdout=subprocess.DEVNULL, timeout=300)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"losses.rank{rank}").read_text()) == app

"""loom.Trainer: the same settings and losses as loom-train, callbacks, config files and errors."""

import json
import os
import subprocess
import threading
import time

import pytest

import loom

SETTINGS = """
[model]
model = "d2"
[training]
batch_size = 2
seq_len = 32
steps = 6
eval_interval = 2
eval_batches = 2
sample_tokens = 0
seed = 7
[optimizer]
lr = 1e-3
warmup = 2
"""


def write_config(tmp_path, shards):
    train, val = shards
    path = tmp_path / "run.toml"
    path.write_text(SETTINGS.replace("seq_len = 32", f'seq_len = 32\ntrain_data = "{train}"\nval_data = "{val}"'))
    return path


def jsonl_losses(log_dir):
    """train/loss and val/loss by step, from a run's metrics.jsonl."""
    train, val = {}, {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "train/loss" in entry:
            train[entry["step"]] = entry["train/loss"]
        if "val/loss" in entry:
            val[entry["step"]] = entry["val/loss"]
    return train, val


def test_same_losses_as_loom_train_from_one_toml(tmp_path, shards):
    exe = os.environ.get("LOOM_TRAIN_EXE")
    if not exe:
        pytest.skip("LOOM_TRAIN_EXE not set (ctest sets it)")
    config = write_config(tmp_path, shards)
    subprocess.run([exe, "--config", str(config), "--log-dir", str(tmp_path / "app")], check=True,
                   stdout=subprocess.DEVNULL)
    app_train, app_val = jsonl_losses(tmp_path / "app")
    assert sorted(app_train) == [1, 2, 3, 4, 5, 6] and sorted(app_val) == [0, 2, 4, 6]

    steps, evals = [], []
    trainer = loom.Trainer(str(config), log_dir=str(tmp_path / "py"), quiet=True)
    trainer.run(on_step=steps.append, on_eval=evals.append)
    assert [s["loss"] for s in steps] == [app_train[k] for k in sorted(app_train)]
    assert {e["step"]: e["val/loss"] for e in evals} == app_val
    assert jsonl_losses(tmp_path / "py") == (app_train, app_val)
    assert trainer.step == 6 and [h["loss"] for h in trainer.history] == [s["loss"] for s in steps]
    assert set(steps[0]) >= {"step", "loss", "lr", "grad_norm", "ms", "tokens_per_second"}


def test_dict_settings_and_a_callback_that_stops(tmp_path, shards):
    train, val = shards
    config = {"model": {"model": "d2"}, "training": {"train_data": str(train), "batch_size": 2, "seq_len": 16,
                                                     "steps": 50, "eval_interval": 0, "sample_tokens": 0}}
    seen, evals = [], []

    def on_step(metrics):
        seen.append(metrics["step"])
        return metrics["step"] < 3  # False stops the run

    trainer = loom.Trainer(config, quiet=True, lr=3e-3)
    trainer.run(on_step=on_step, on_eval=evals.append)
    assert seen == [1, 2, 3] and trainer.step == 3
    assert [e["step"] for e in evals] == [3] and "train_data/loss" in evals[0]  # the run's end evaluates
    before = trainer.step
    trainer.train_step()
    assert trainer.step == before + 1 and trainer.evaluate(1) > 0
    assert trainer.model.num_parameters() > 0


def test_a_run_draws_from_its_seed_and_reports_its_routers(tmp_path, shards):
    """Two runs in one process draw the same random numbers (a router's jitter here): each starts from its seed; a
    mixture of experts reports its routers' auxiliary loss and dropped share every step."""
    train, _ = shards
    model = tmp_path / "moe.json"
    model.write_text(json.dumps({"family": "llama", "vocab_size": 50257, "max_seq_len": 64, "n_layer": 2,
                                 "n_head": 2, "n_kv_head": 1, "n_embd": 32, "ffn_hidden": 64, "num_experts": 4,
                                 "experts_per_token": 2, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.1,
                                 "capacity_factor": 1.0}))

    def run():
        steps = []
        loom.Trainer(quiet=True, model=str(model), train_data=str(train), batch_size=2, seq_len=16, steps=3,
                     eval_interval=0, sample_tokens=0, warmup=1).run(on_step=steps.append)
        return steps

    first, second = run(), run()
    assert [s["loss"] for s in first] == [s["loss"] for s in second]
    assert all(0 < s["moe/aux_loss"] < 1 and 0 <= s["moe/dropped_fraction"] < 1 for s in first)


def test_an_exception_in_a_callback_reaches_the_caller(shards):
    train, _ = shards
    trainer = loom.Trainer(quiet=True, model="d2", train_data=str(train), batch_size=2, seq_len=16, steps=5,
                           eval_interval=0, sample_tokens=0, warmup=1)

    def on_step(metrics):
        if metrics["step"] == 2:
            raise ValueError("stop here")

    with pytest.raises(ValueError, match="stop here"):
        trainer.run(on_step=on_step)
    assert trainer.step == 2


def test_training_releases_the_gil(shards):
    train, _ = shards
    trainer = loom.Trainer(quiet=True, model="d2", train_data=str(train), batch_size=4, seq_len=32, steps=3,
                           eval_interval=0, sample_tokens=0, warmup=1)
    ticks, done = [0], threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.05)
        before = ticks[0]
        trainer.run()  # no callbacks: Python runs here only if the trainer let go of the GIL
        during = ticks[0] - before
    finally:
        done.set()
        thread.join()
    assert during > 10


def test_checkpoints_resume_to_the_same_losses(tmp_path, shards):
    train, _ = shards
    common = dict(model="d2", train_data=str(train), batch_size=2, seq_len=16, eval_interval=0, sample_tokens=0,
                  schedule_steps=4, warmup=1)
    full = loom.Trainer(quiet=True, steps=4, **common)
    full.run()
    first = loom.Trainer(quiet=True, steps=2, checkpoint_dir=str(tmp_path / "ck"), **common)
    first.run()
    resumed = loom.Trainer(quiet=True, steps=4, resume=str(tmp_path / "ck"), **common)
    losses = []
    resumed.run(on_step=lambda m: losses.append(m["loss"]))
    assert losses == [h["loss"] for h in full.history[2:]]
    assert loom.load_model(str(tmp_path / "ck")).num_parameters() == full.model.num_parameters()


def test_bad_settings_are_loom_train_errors(tmp_path, shards):
    train, _ = shards
    with pytest.raises(loom.Error, match=r"the config dict: unknown key 'bach_size' in \[training\] \(did you mean 'batch_size'\?\)"):
        loom.Trainer({"training": {"bach_size": 2}})
    with pytest.raises(loom.Error, match=r"'lr' belongs in \[optimizer\]"):
        loom.Trainer({"training": {"lr": 2}})
    with pytest.raises(loom.Error, match="batch-size: .*must be at least 1"):
        loom.Trainer(train_data=str(train), batch_size=0)
    with pytest.raises(loom.Error, match="--train-data is required"):
        loom.Trainer(quiet=True)
    with pytest.raises(loom.Error, match="missing.toml"):
        loom.Trainer(str(tmp_path / "missing.toml"))

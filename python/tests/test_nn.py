"""Modules, models, optimizers, schedules, and checkpoints in Hugging Face's and Loom's formats."""

import numpy as np
import pytest

import loom


def test_linear_matches_numpy():
    loom.manual_seed(0)
    lin = loom.nn.Linear(4, 3)
    x = loom.randn(2, 4)
    expected = x.numpy() @ lin.weight.numpy().T + lin.bias.numpy()
    np.testing.assert_allclose(lin(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"] and lin.num_parameters() == 15
    assert loom.nn.Linear(4, 3, bias=False).bias is None
    state = lin.state_dict()
    other = loom.nn.Linear(4, 3)
    other.load_state_dict(state)
    assert other.weight.tolist() == lin.weight.tolist()
    with pytest.raises(loom.Error, match="shape"):
        other.load_state_dict({"weight": loom.zeros(3, 5), "bias": loom.zeros(3)})


class TwoLayers(loom.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = self.register_module("fc1", loom.nn.Linear(4, 16))
        self.fc2 = self.register_module("fc2", loom.nn.Linear(16, 1))
        self.scale = self.register_parameter("scale", loom.ones(1))

    def forward(self, x):
        return self.fc2(loom.ops.gelu(self.fc1(x))) * self.scale


def test_a_module_written_in_python_trains():
    loom.manual_seed(5)
    model = TwoLayers()
    names = {n for n, _ in model.named_parameters()}
    assert names == {"scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert model.num_parameters() == 4 * 16 + 16 + 16 + 1 + 1 and model.scale.requires_grad
    x = loom.randn(32, 4)
    y = loom.ops.sum(x, 1, keepdim=True)
    opt = loom.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = loom.ops.mean((model(x) - y) ** 2)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]
    model.eval()
    assert not model.training and not model.fc1.training


def test_gpt2_model_forward_and_training_lowers_the_loss():
    model = loom.models.gpt2("tiny", seed=1)
    cfg = model.config
    assert cfg.family == loom.models.Family.gpt2
    same = loom.models.make("gpt2-tiny", seed=1)
    assert same.state_dict()["wte.weight"].tolist() == model.state_dict()["wte.weight"].tolist()
    smaller = loom.models.gpt2("tiny", n_layer=1, seed=1)
    assert smaller.config.n_layer == 1 and smaller.num_parameters() < model.num_parameters()
    idx = loom.from_numpy(np.arange(16, dtype=np.int64).reshape(2, 8) % cfg.vocab_size)
    targets = loom.from_numpy((np.arange(16, dtype=np.int64).reshape(2, 8) + 1) % cfg.vocab_size)
    logits = model(idx)
    assert logits.shape == (2, 8, cfg.padded_vocab_size)
    opt = loom.optim.AdamW(loom.optim.param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    losses = []
    for _ in range(5):
        loss = model.forward_loss(idx, targets)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        loom.nn.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert losses[-1] < losses[0] and opt.step_count == 5
    assert abs(model.loss(model(idx), targets).item() - model.forward_loss(idx, targets).item()) < 1e-4
    with pytest.raises(loom.Error, match="unknown field"):
        loom.models.gpt2("tiny", n_layers=3)


def test_lr_schedule():
    s = loom.optim.LrSchedule("cosine", 1e-3, 10, 100, 0.1)
    assert s(0) == pytest.approx(1e-4) and s(9) == pytest.approx(1e-3) and s(100) == pytest.approx(1e-4)
    assert loom.optim.LrSchedule("constant", 1.0, 0, 10)(5) == 1.0
    with pytest.raises(loom.Error):
        loom.optim.LrSchedule("triangle", 1.0, 0, 10)


def test_hugging_face_directory_round_trip(tmp_path):
    model = loom.models.gpt2("tiny", seed=2)
    files = model.save_pretrained(str(tmp_path / "hf"))
    assert "config.json" in files and "model.safetensors" in files
    again = loom.from_pretrained(str(tmp_path / "hf"))
    idx = loom.arange(8).view(1, 8)
    with loom.no_grad():
        vocab = model.config.vocab_size  # the padding rows past it are not exported
        assert np.array_equal(model(idx).numpy()[..., :vocab], again(idx).numpy()[..., :vocab])
    assert loom.load_model(str(tmp_path / "hf")).num_parameters() == model.num_parameters()
    with pytest.raises(loom.Error):
        loom.from_pretrained(str(tmp_path / "missing"))


def test_loom_model_file_round_trip(tmp_path):
    model = loom.models.make("d2", seed=4)
    path = str(tmp_path / "model.safetensors")
    loom.save_model(model, path)
    again = loom.load_model(path)
    assert again.config.to_json() == model.config.to_json()
    idx = loom.arange(6).view(1, 6)
    with loom.no_grad():
        assert np.array_equal(model(idx).numpy(), again(idx).numpy())


def test_safetensors(tmp_path):
    path = str(tmp_path / "t.safetensors")
    loom.save_safetensors(path, {"a": loom.arange(4), "b": loom.ones(2, 2, dtype="bf16")}, {"note": "x"})
    back = loom.load_safetensors(path)
    assert back["a"].tolist() == [0, 1, 2, 3] and back["b"].dtype == loom.bf16

"""A vendor library from Python: loading it, routing to it, and its conformance report as data."""

import os
import pathlib

import pytest

import loom

BUILD = os.environ.get("LOOM_PLUGIN_DIR")


def plugin(name):
    if not BUILD or not (pathlib.Path(BUILD) / f"lib{name}.so").is_file():
        pytest.skip("the sample plugins are not built (LOOM_PLUGINS)")
    return str(pathlib.Path(BUILD) / f"lib{name}.so")


def test_load_route_and_check_a_library(tmp_path):
    loom.providers.set_verify_cache(str(tmp_path / "verified.json"))
    path = plugin("loom_cpu_sample")
    if "cpu_sample" not in loom.providers.names():
        assert loom.providers.load(path) == "cpu_sample"
    info = [p for p in loom.providers.loaded() if p["name"] == "cpu_sample"][0]
    assert "softmax@cpu" in info["ops"] and info["abi"].startswith("1.")
    report = loom.conformance("cpu_sample", ops=["softmax"], dtypes=["f32"])
    assert [(r["op"], r["dtype"], r["status"]) for r in report] == [("softmax", "f32", "verified")]
    assert report[0]["cases"] > 0 and report[0]["failed"] == 0
    loom.providers.set_policy("cpu_sample:softmax;native")
    try:
        assert "cpu_sample" in loom.providers.policy()
        assert "cpu_sample" in loom.providers.explain("softmax", "cpu", "f32")
        x = loom.randn(4, 8)
        assert loom.ops.softmax(x, -1).sum().item() == pytest.approx(4.0, rel=1e-5)
    finally:
        loom.providers.reset_policy()


def test_a_wrong_kernel_fails_its_cases(tmp_path):
    loom.providers.set_verify_cache(str(tmp_path / "verified.json"))
    path = plugin("loom_cpu_sample_wrong_softmax")
    if "cpu_sample_wrong" not in loom.providers.names():
        loom.providers.load(path)
    report = loom.conformance("cpu_sample_wrong", ops=["softmax"], dtypes=["f32"])
    assert report[0]["status"] == "failed" and report[0]["failed"] > 0 and report[0]["detail"]


def test_loading_a_missing_library_is_an_error():
    with pytest.raises(loom.Error):
        loom.providers.load("/nonexistent/libnothing.so")

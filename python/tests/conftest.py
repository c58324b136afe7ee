"""What the loom tests share: where the repository, its data and the built apps are."""

import os
import pathlib

import numpy as np
import pytest

import loom

SOURCE_DIR = pathlib.Path(os.environ.get("LOOM_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))


def shakespeare_path():
    """tinyshakespeare.txt from $LOOM_DATA_DIR, or ../shared/data beside the repository (None when absent)."""
    candidates = []
    if os.environ.get("LOOM_DATA_DIR"):
        candidates.append(pathlib.Path(os.environ["LOOM_DATA_DIR"]) / "tinyshakespeare.txt")
    candidates.append(SOURCE_DIR.parent / "shared" / "data" / "tinyshakespeare.txt")
    return next((p for p in candidates if p.is_file()), None)


@pytest.fixture
def shards(tmp_path):
    """A train and a val shard of tiny Shakespeare's bytes as token ids (any id fits GPT-2's vocabulary)."""
    path = shakespeare_path()
    if path is None:
        pytest.skip("tinyshakespeare.txt not found (set LOOM_DATA_DIR)")
    tokens = np.frombuffer(path.read_bytes()[:60000], dtype=np.uint8).astype(np.int32)
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    loom.data.write_tokens(str(train), tokens[:50000])
    loom.data.write_tokens(str(val), tokens[50000:])
    return train, val

"""Generation and tokenizers."""

import os
import pathlib

import pytest

import loom

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"


def gpt2_vocab_dir():
    base = os.environ.get("LOOM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "loom")
    d = pathlib.Path(base) / "gpt2"
    return d if (d / "encoder.json").is_file() else None


def test_generate_token_ids_greedy_and_sampled():
    model = loom.models.gpt2("tiny", seed=3)
    greedy = loom.generate(model, [1, 2, 3], max_new_tokens=8, temperature=0)
    assert len(greedy) == 8 and all(0 <= t < model.config.vocab_size for t in greedy)
    assert loom.generate(model, [1, 2, 3], max_new_tokens=8, temperature=0, use_kv_cache=False) == greedy
    a = loom.generate(model, [1, 2, 3], max_new_tokens=8, seed=5, top_k=20)
    assert a == loom.generate(model, [1, 2, 3], max_new_tokens=8, seed=5, top_k=20)
    streamed = []
    loom.generate(model, [1], max_new_tokens=6, temperature=0, on_token=lambda t: streamed.append(t) or len(streamed) < 3)
    assert len(streamed) == 3
    with pytest.raises(loom.Error):
        loom.generate(model, [1], max_new_tokens=4, top_p=2.0)


def test_gpt2_tokenizer_and_text_generation():
    vocab = gpt2_vocab_dir()
    if vocab is None:
        pytest.skip("GPT-2's vocabulary not fetched (scripts/fetch_gpt2_vocab.sh)")
    tok = loom.Tokenizer.gpt2()
    ids = tok.encode("Hello world")
    assert ids == [15496, 995] and tok.decode(ids) == "Hello world" and tok.vocab_size == 50257
    model = loom.models.gpt2("tiny", seed=3)
    text = loom.generate(model, "ROMEO:", max_new_tokens=5, temperature=0)
    assert isinstance(text, str)


def test_tokenizer_from_file_errors():
    with pytest.raises(loom.Error):
        loom.Tokenizer.from_file(str(FIXTURES / "missing_tokenizer.json"))

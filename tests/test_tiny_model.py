"""The tiny model that ships with minidecode (minidecode/assets/stdlib-tiny) and the script that trains it.

All on CPU, no network: the data is the running interpreter's own standard library.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "minidecode" / "assets" / "stdlib-tiny"
sys.path.insert(0, str(REPO / "training"))

import stdlib_corpus  # noqa: E402
import train_tiny_model  # noqa: E402

# Standard Hugging Face layout, plus the model card.
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
)
# Held-out scoring: this many windows of this many tokens from the start of the held-out stream.
EVAL_WINDOWS, EVAL_SEQ_LEN = 4, 1024
MIN_PERPLEXITY_RATIO = 10.0  # random-init perplexity / trained perplexity must be at least this


def test_split_rule_is_fixed() -> None:
    """The split depends on the relative path alone; these values pin the rule (sha1 % 50)."""
    assert stdlib_corpus.split_of("os.py") == "train"
    assert stdlib_corpus.split_of("asyncio/__init__.py") == "train"
    assert stdlib_corpus.split_of("contextlib.py") == "heldout"
    assert stdlib_corpus.split_of("_strptime.py") == "heldout"
    assert stdlib_corpus.split_of("datetime.py") == "valid"
    paths = stdlib_corpus.list_stdlib_files()
    assert "os.py" in paths and paths == sorted(paths)
    assert not any("site-packages/" in p for p in paths)
    counts = {s: sum(stdlib_corpus.split_of(p) == s for p in paths) for s in stdlib_corpus.SPLITS}
    assert counts["heldout"] > 0 and counts["valid"] > 0 and counts["train"] > 10 * counts["heldout"]


@pytest.mark.slow
def test_training_smoke_run_lowers_the_loss(tmp_path: Path) -> None:
    """A few CPU steps of a tiny config on a slice of the data: the loss goes down, files are written."""
    out = tmp_path / "smoke"
    summary = train_tiny_model.main(["--smoke", "--out", str(out)])
    losses = summary["train_losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"smoke run: training loss {first:.3f} -> {last:.3f} in {summary['steps']} steps")
    assert summary["steps"] == len(losses) >= 20
    assert last < first - 0.5
    assert summary["valid_history"][-1]["valid_loss"] < summary["valid_history"][0]["valid_loss"]
    for name in MODEL_FILES:
        assert (out / name).is_file(), name


def test_shipped_files_and_config() -> None:
    """Standard Hugging Face layout, Llama config with head_dim 64 and GQA, weights small enough."""
    for name in MODEL_FILES:
        assert (ASSET / name).is_file(), name
    assert (ASSET / "model.safetensors").stat().st_size <= 15 * 2**20
    config = json.loads((ASSET / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["head_dim"] == 64
    assert config["num_attention_heads"] > config["num_key_value_heads"]
    assert config["bos_token_id"] == 0 and config["eos_token_id"] == 1
    tok_config = json.loads((ASSET / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == train_tiny_model.BOS_TOKEN
    assert tok_config["eos_token"] == train_tiny_model.EOS_TOKEN


def test_tokenizer_round_trips_and_puts_bos_first() -> None:
    tok = tokenizers.Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    bos_id = tok.token_to_id(train_tiny_model.BOS_TOKEN)
    samples = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "\tx = {'a': [1, 2.5e-3, None]}  # tab, dict, exponent\n\n\n",
        'print("héllo wörld ✓ 日本語 🐍")\r\n',
        "",
    ]
    for text in samples:
        ids = tok.encode(text).ids
        assert ids[0] == bos_id and ids.count(bos_id) == 1, ids[:5]
        assert tok.decode(ids, skip_special_tokens=True) == text

    # transformers' loader over the same files: BOS once, at the start, and the same ids.
    hf_tok = transformers.AutoTokenizer.from_pretrained(ASSET)
    assert hf_tok.bos_token_id == bos_id
    assert hf_tok.eos_token_id == tok.token_to_id(train_tiny_model.EOS_TOKEN)
    assert hf_tok(samples[0]).input_ids == tok.encode(samples[0]).ids


def test_shipped_model_beats_random_init_on_heldout_stdlib() -> None:
    """Held-out perplexity of the shipped checkpoint, on held-out files of *this* interpreter's stdlib
    (same hash rule as training), is far below that of a random-init model of the same shape."""
    tok = tokenizers.Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    # ~3.4 characters per token: 60k characters comfortably cover EVAL_WINDOWS * EVAL_SEQ_LEN tokens.
    paths, texts = stdlib_corpus.load_split("heldout", max_chars=60_000)
    stream = train_tiny_model.encode_documents(tok, texts)
    assert stream.numel() > EVAL_WINDOWS * EVAL_SEQ_LEN, (paths, stream.numel())

    torch.manual_seed(0)
    trained = transformers.LlamaForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    random_init = transformers.LlamaForCausalLM(trained.config)
    nll = train_tiny_model.mean_nll(trained, stream, EVAL_SEQ_LEN, EVAL_WINDOWS, batch_size=2)
    nll_random = train_tiny_model.mean_nll(random_init, stream, EVAL_SEQ_LEN, EVAL_WINDOWS, batch_size=2)
    ppl, ppl_random = math.exp(nll), math.exp(nll_random)
    print(
        f"held-out stdlib ({len(paths)} files, {EVAL_WINDOWS * EVAL_SEQ_LEN} tokens): "
        f"perplexity {ppl:.2f} trained vs {ppl_random:.1f} random init ({ppl_random / ppl:.0f}x lower)"
    )
    assert ppl * MIN_PERPLEXITY_RATIO < ppl_random

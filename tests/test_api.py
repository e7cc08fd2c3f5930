"""The public API on tiny checkpoints, against transformers: sharded loading, chat rendering,
streaming, stop strings, sampling, eos ids from generation_config.json, log-probabilities."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from checkpoints import FAMILIES, ROPES
from helpers import max_rel_err
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import minidecode
from minidecode import LLM, SamplingParams
from minidecode.sampling import SamplingRows, _uniform, argmax, sample
from minidecode.sequence import TextStream
from minidecode.tokenizer import StreamDecoder

MAX_POS = 512
UNICODE_PROMPT = "Ünïcödé text, emoji 🙂 and CJK 漢字 長文脈 must survive"


def load(model_dir, **kw) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def llama(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=MAX_POS)


# ---- sharded checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen3"])
def test_sharded_checkpoint_loads_and_matches(checkpoint_factory, hf, prompt_ids, family):
    model_dir = checkpoint_factory(family, "default", shard_bytes=100_000)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (model_dir / "model.safetensors").exists()

    llm = load(model_dir)
    ids = prompt_ids(200, seed=5)
    assert max_rel_err(llm.logits(ids), hf.logits(model_dir, ids)) <= 1e-4
    out = llm.generate(token_ids=ids, max_new_tokens=16, temperature=0)
    assert out.token_ids == hf.greedy(model_dir, ids, 16, eos=True)


# ---- chat ------------------------------------------------------------------------------------

CHATS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 漢字? 🙂"},
        {"role": "assistant", "content": "Chinese characters."},
        {"role": "user", "content": "And 長文脈?"},
    ],
]


@pytest.mark.parametrize("messages", CHATS, ids=["one-turn", "multi-turn"])
def test_chat_ids_match_transformers_template(llama, hf, messages):
    tok = hf.tokenizer(llama)
    ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    llm = load(llama)
    ids = llm.encode(minidecode.Request(messages=messages).check())
    assert ids == list(ref)
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1  # the template writes BOS; no second one
    assert tok.decode(ids).endswith("<|start|>assistant\n")

    out = llm.generate(messages=messages, max_new_tokens=12, temperature=0)
    assert out.prompt_token_ids == list(ref)
    assert out.token_ids == hf.greedy(llama, list(ref), 12, eos=True)


def test_plain_prompt_gets_exactly_one_bos(llama, hf):
    tok = hf.tokenizer(llama)
    llm = load(llama)
    ids = llm.encode(minidecode.Request(prompt=UNICODE_PROMPT).check())
    assert ids == tok(UNICODE_PROMPT).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|begin_of_text|>")) == 1


# ---- streaming -------------------------------------------------------------------------------


def test_stream_decoder_never_splits_a_character(llama, hf):
    """Byte-level tokens of rare CJK are partial UTF-8: the decoder must hold them back."""
    tok = hf.tokenizer(llama)
    text = "漢字 長文脈 🙂 Ünïcödé 𝔘𝔫𝔦 end"
    ids = tok(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no partial-character token: the test is moot"
    decoder = StreamDecoder(load(llama).tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=4.0, top_k=200, seed=11)],
    ids=["greedy", "sampled", "hot"],
)
def test_stream_equals_generate_and_transformers_decode(llama, hf, sampling):
    llm = load(llama)
    kw = dict(max_new_tokens=96, **sampling)
    stream = llm.stream(UNICODE_PROMPT, **kw)
    pieces = list(stream)
    streamed = stream.result
    whole = llm.generate(UNICODE_PROMPT, **kw)

    assert streamed.token_ids == whole.token_ids  # same seed: same tokens
    assert "".join(pieces) == streamed.text == whole.text
    assert all(pieces)
    ref_text = hf.tokenizer(llama).decode(whole.token_ids, skip_special_tokens=True)
    assert whole.text == ref_text
    if sampling["temperature"] == 0:
        assert whole.token_ids == hf.greedy(llama, whole.prompt_token_ids, 96, eos=True)


def test_stream_of_multibyte_output(llama, hf):
    """Hot sampling over a byte-level vocabulary emits many partial characters: no piece may end
    inside a character that a later token completes."""
    tok = hf.tokenizer(llama)
    llm = load(llama)
    stream = llm.stream(UNICODE_PROMPT, max_new_tokens=200, temperature=8.0, seed=0)
    pieces = list(stream)
    ids = stream.result.token_ids
    assert sum(1 for i in ids if "\ufffd" in tok.decode([i])) >= 5  # partial characters were produced
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


# ---- stop strings ----------------------------------------------------------------------------


def stop_candidates(tok, ids: list[int], text: str, length: int):
    """Substrings of `text` that first occur at their start, hold no U+FFFD and span a token
    boundary: (start, stop string)."""
    boundaries = {len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(1, len(ids))}
    for start in range(len(text) // 4, len(text) - length):
        stop = text[start : start + length]
        if "\ufffd" in stop or text.find(stop) != start:
            continue
        if any(start < b < start + length for b in boundaries):
            yield start, stop


def test_stop_string_cuts_output(llama, hf):
    tok = hf.tokenizer(llama)
    prompt = "The quick brown fox"
    prompt_ids = tok(prompt).input_ids
    ref_ids = hf.greedy(llama, prompt_ids, 64, eos=True)
    ref_text = tok.decode(ref_ids, skip_special_tokens=True)
    start, stop = next(stop_candidates(tok, ref_ids, ref_text, 3))

    llm = load(llama)
    stream = llm.stream(prompt, max_new_tokens=64, temperature=0, stop=["<never>", stop])
    pieces = list(stream)
    out = stream.result
    assert out.finish_reason == "stop"
    assert out.text == ref_text[:start]
    assert "".join(pieces) == ref_text[:start]  # nothing of the stop string was streamed
    assert ref_ids[: len(out.token_ids)] == out.token_ids

    # The earliest of several stop strings wins; a single string works too.
    later = next(s for st, s in stop_candidates(tok, ref_ids, ref_text, 2) if st > start + 3)
    assert llm.generate(prompt, max_new_tokens=64, temperature=0, stop=[later, stop]).text == ref_text[:start]
    assert llm.generate(prompt, max_new_tokens=64, temperature=0, stop=stop).text == ref_text[:start]

    # A stop string that never appears: the whole output.
    full = llm.generate(prompt, max_new_tokens=64, temperature=0, stop="<never>")
    assert full.text == ref_text and full.finish_reason in ("length", "eos")


class PieceTokenizer:
    """Token id i decodes to pieces[i] (no merges, no specials): TextStream's tokenizer."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids: list[int], **_) -> str:
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize(
    "pieces, stop, last, text",
    [
        (["ab", "c", "de", "f", "g"], "cde", 2, "ab"),  # across tokens: ends at the one completing it
        (["ab", "xcdey", "f", "g"], "cde", 1, "abx"),  # inside one token
        (["cd", "e", "f"], "cde", 1, ""),  # at the start
        (["a", "b", "c", "d", "e"], "e", 4, "abcd"),  # the last token
        (["ab", "cd", "cde", "f"], "cdc", 2, "ab"),  # a partial match first, then the whole
    ],
)
def test_text_stream_stops_at_the_token_completing_the_stop_string(pieces, stop, last, text):
    """TextStream.push reports the stop on the token whose text completes the stop string (not one
    later), keeps the text before it, and hands out none of the stop string."""
    stream = TextStream(PieceTokenizer(pieces), ["<never>", stop])
    out = ""
    for i in range(len(pieces)):
        out += stream.push(i)
        assert stream.stopped == (i == last), (i, stream.text)
        if stream.stopped:
            break
    assert stream.text == text and (out + stream.flush()) == text


def test_stop_string_ends_generation_at_the_token_completing_it(llama, hf):
    """Generation ends on the very token whose text completes a stop string: the new tokens are
    the reference's up to and including that one, none after, and the text stops before it."""
    tok = hf.tokenizer(llama)
    prompt = "The quick brown fox"
    ref_ids = hf.greedy(llama, tok(prompt).input_ids, 64, eos=True)
    ref_text = tok.decode(ref_ids, skip_special_tokens=True)
    llm = load(llama)
    cases = [next(stop_candidates(tok, ref_ids, ref_text, n)) for n in (2, 3, 5)]
    for start, stop in cases:
        count = next(
            i for i in range(1, len(ref_ids) + 1) if stop in tok.decode(ref_ids[:i], skip_special_tokens=True)
        )
        out = llm.generate(prompt, max_new_tokens=64, temperature=0, stop=stop)
        assert out.finish_reason == "stop", stop
        assert out.token_ids == ref_ids[:count], (stop, len(out.token_ids), count)
        assert out.text == ref_text[:start] and out.stats.new_tokens == count


# ---- sampling --------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [50, 4096, 128256, 151936, 32003])
def test_two_pass_argmax_equals_torch_argmax_with_ties(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (6, vocab), generator=gen).float()  # many ties at the max
    x[1, vocab // 3] = x[1, -1] = 10.0  # a tie across rows of the two-pass view
    x[2, -1] = 11.0  # the max at the last index
    x[3] = torch.randn(vocab, generator=gen)
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.8),
        SamplingParams(temperature=2.0, top_k=1),
    ],
    ids=["plain", "top-k", "top-p", "top-k-top-p", "top-k-1"],
)
def test_sample_distribution_matches_transformers_warpers(params):
    V, N = 40, 40_000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 2.0
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    ref = warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0].softmax(-1)

    rows = SamplingRows.zeros(N, torch.device("cpu"))
    for i in range(N):  # N requests with N seeds: each draws once from the same logits
        rows.set(i, dataclasses.replace(params, seed=i))
    draws = sample(logits.expand(N, V).contiguous(), rows, torch.zeros(N, dtype=torch.long), params.mode)
    freq = torch.bincount(draws, minlength=V).double() / N
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    assert (freq - ref.double()).abs().max().item() < 0.015  # > 6 standard deviations


@pytest.mark.parametrize("seed", [1234, 2**40 + 7])
def test_one_seeds_draws_at_successive_positions_are_independent(seed):
    """One request's draws from flat logits, positions 0..N-1: uniform over the V tokens (a
    chi-square bound), no more repeats of the previous draw than chance, and the underlying
    uniforms of consecutive positions uncorrelated (a draw that ignored the position would repeat
    one token: each draw's distribution right, the sequence not random at all)."""
    V, N = 64, 8192
    rows = SamplingRows.zeros(N, torch.device("cpu"))
    for i in range(N):  # N rows of one request: one seed, each row another position
        rows.set(i, SamplingParams(temperature=1.0, seed=seed))
    positions = torch.arange(N)
    draws = sample(torch.zeros(N, V), rows, positions, SamplingParams(temperature=1.0).mode)
    counts = torch.bincount(draws, minlength=V).double()
    chi2 = ((counts - N / V) ** 2 / (N / V)).sum().item()
    assert chi2 < (V - 1) + 6 * (2 * (V - 1)) ** 0.5  # mean V - 1, sd sqrt(2 (V - 1))
    repeats = (draws[1:] == draws[:-1]).double().mean().item()
    assert repeats < 1 / V + 6 * (1 / V / N) ** 0.5  # chance: 1 / V
    u = _uniform(rows.seed, positions, V)  # [N, V]
    a, b = u[:-1].flatten().double(), u[1:].flatten().double()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < 6 / a.numel() ** 0.5


def test_seeded_sampling_is_reproducible(llama):
    kw = dict(max_new_tokens=32, temperature=1.0, top_p=0.95, seed=1234)
    a = load(llama).generate("The quick brown fox", **kw)
    b = load(llama).generate("The quick brown fox", **kw)  # a fresh LLM: same seed, same tokens
    assert a.token_ids == b.token_ids and a.text == b.text
    llm = load(llama)
    kw["ignore_eos"] = True
    runs = {tuple(llm.generate("The quick brown fox", **dict(kw, seed=s)).token_ids) for s in range(4)}
    assert len(runs) > 1  # other seeds: other tokens


@pytest.mark.parametrize(
    "sampling", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)], ids=["top-k-1", "top-p", "both"]
)
def test_degenerate_sampling_is_greedy(llama, hf, prompt_ids, sampling):
    ids = prompt_ids(100, seed=6)
    ref = hf.greedy(llama, ids, 32, eos=True)
    for seed in (0, 1):
        out = load(llama).generate(token_ids=ids, max_new_tokens=32, temperature=1.5, seed=seed, **sampling)
        assert out.token_ids == ref


def test_generation_config_sampling_defaults(llama, tmp_path, hf, prompt_ids):
    """do_sample in generation_config.json makes sampling the default; temperature=0 overrides it."""
    model_dir = tmp_path / "ckpt"
    shutil.copytree(llama, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=1.0, top_k=1)  # top_k=1: sampling that must equal greedy
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    ids = prompt_ids(50, seed=7)
    ref = hf.greedy(llama, ids, 16, eos=True)
    assert load(model_dir).generate(token_ids=ids, max_new_tokens=16, seed=0).token_ids == ref
    gen.update(top_k=0)
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    llm = load(model_dir)
    runs = [llm.generate(token_ids=ids, max_new_tokens=16, seed=s, ignore_eos=True) for s in range(3)]
    sampled = {tuple(run.token_ids) for run in runs}
    assert len(sampled) > 1  # the default samples
    assert llm.generate(token_ids=ids, max_new_tokens=16, temperature=0).token_ids == ref


# ---- eos ids from generation_config.json -----------------------------------------------------


@pytest.mark.parametrize("form", ["int", "list"])
def test_eos_ids_from_generation_config(llama, hf, prompt_ids, tmp_path, form):
    ids = prompt_ids(80, seed=8)
    free_run = hf.greedy(llama, ids, 32)  # eos off
    # A token the model emits at step k >= 4 and not before, and not the config's eos (1).
    k = next(i for i in range(4, 32) if free_run[i] not in free_run[:i] and free_run[i] != 1)
    assert 1 not in free_run[:k]
    eos = free_run[k]
    unused = next(t for t in range(2, 384) if t not in free_run)

    model_dir = tmp_path / "ckpt"
    shutil.copytree(llama, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = eos if form == "int" else [unused, eos]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))

    ref = hf.greedy(model_dir, ids, 32, eos=True)  # transformers reads the same file
    assert ref == free_run[:k]
    llm = load(model_dir)
    assert eos in llm.eos_ids
    out = llm.generate(token_ids=ids, max_new_tokens=32, temperature=0)
    assert out.token_ids == ref
    assert out.finish_reason == "eos"
    stream = llm.stream(token_ids=ids, max_new_tokens=32, temperature=0)
    assert "".join(stream) == out.text and stream.result.finish_reason == "eos"


# ---- log-probabilities -----------------------------------------------------------------------

LOGPROB_CASES = [(f, "default") for f in FAMILIES] + [("llama", r) for r in ROPES if r != "default"]


@pytest.mark.parametrize("family,rope", LOGPROB_CASES)
def test_rescoring_matches_incremental_logprobs(checkpoint_factory, hf, prompt_ids, family, rope):
    """Within 256 positions (LongRoPE's switch, below dynamic NTK's 512), so scoring the whole
    sequence at once sees the same RoPE as the incremental decode did."""
    model_dir = checkpoint_factory(family, rope, max_positions=MAX_POS)
    ids = prompt_ids(120, seed=9)
    llm = load(model_dir)
    out = llm.generate(
        token_ids=ids, max_new_tokens=32, temperature=1.0, seed=0, logprobs=True, ignore_eos=True
    )
    assert len(out.logprobs) == len(out.token_ids) == 32
    full = ids + out.token_ids
    positions = torch.arange(len(ids) - 1, len(full) - 1)
    new = torch.tensor(out.token_ids)
    ours = llm.logits(full).double().log_softmax(-1)[positions, new]
    ref = hf.logits(model_dir, full).double().log_softmax(-1)[positions, new]
    got = torch.tensor(out.logprobs, dtype=torch.float64)
    torch.testing.assert_close(got, ours, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_rescoring_long_chunked_prompt(checkpoint_factory, hf, prompt_ids):
    model_dir = checkpoint_factory("qwen2", "default", max_positions=MAX_POS)
    ids = prompt_ids(1040, seed=10)
    llm = load(model_dir, prefill_chunk=300)
    out = llm.generate(
        token_ids=ids,
        max_new_tokens=32,
        temperature=1.0,
        seed=1,
        logprobs=True,
        allow_extrapolation=True,
        ignore_eos=True,
    )
    full = ids + out.token_ids
    positions = torch.arange(len(ids) - 1, len(full) - 1)
    new = torch.tensor(out.token_ids)
    ref = hf.logits(model_dir, full).double().log_softmax(-1)[positions, new]
    ours = llm.logits(full).double().log_softmax(-1)[positions, new]
    got = torch.tensor(out.logprobs, dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, ours, rtol=0, atol=1e-4)


def test_interleaved_streams_of_one_thread_both_run(llama, hf, prompt_ids):
    """Two streams read in turn by one thread share the engine loop (one batch): each gets exactly
    its own tokens."""
    a_ids, b_ids = prompt_ids(60, seed=30), prompt_ids(40, seed=31)
    a_ref, b_ref = hf.greedy(llama, a_ids, 20), hf.greedy(llama, b_ids, 20)
    llm = load(llama)
    a = llm.stream(token_ids=a_ids, max_new_tokens=20, temperature=0, ignore_eos=True)
    a_events = a.events()
    for _ in range(3):
        next(a_events)
    b = llm.stream(token_ids=b_ids, max_new_tokens=20, temperature=0, ignore_eos=True)
    b_events = b.events()
    for _ in zip(a_events, b_events, strict=False):
        pass
    for _ in a_events:
        pass
    for _ in b_events:
        pass
    assert a.result.token_ids == a_ref
    assert b.result.token_ids == b_ref


# ---- the one-call function -------------------------------------------------------------------


def test_module_level_generate(llama, hf):
    tok = hf.tokenizer(llama)
    out = minidecode.generate(
        "def fibonacci(n):", model=llama, device="cpu", max_new_tokens=12, temperature=0
    )
    ref = hf.greedy(llama, tok("def fibonacci(n):").input_ids, 12, eos=True)
    assert out.token_ids == ref
    assert out.text == tok.decode(ref, skip_special_tokens=True)


# ---- long prompts: encoded in pieces -----------------------------------------------------------

PARAGRAPHS = (
    "First paragraph, with a trailing space \nand a line after it.\n\n"
    "Second paragraph:\n    indented code()\n\n\nThird, after two blank lines; 漢字 🙂 ünï.\r\n"
    "CRLF line\r\nanother\n  \n\tTabbed.\n"
    "Trailing space \n\nNext paragraph. \n \nAgain.\n"
)


LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def piece_tokenizer(
    tmp_path, add_prefix_space: bool = False, eos_suffix: bool = False, llama3_regex: bool = False
):
    """A byte-level BPE trained on text full of blank lines and trailing spaces, so that it has
    merges like "\\n\\n" and " \\n", saved as the only file of a folder. GPT-2's regex, or
    Llama 3's (a Split then a regex-free ByteLevel, as Llama 3 and Qwen2 ship it)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    if llama3_regex:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([PARAGRAPHS] * 50, trainer)
    single = "<s> $A </s>" if eos_suffix else "<s> $A"
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))]
    )
    assert tok.token_to_id("ĊĊ") is not None and tok.token_to_id("ĠĊ") is not None
    tok.save(str(tmp_path / "tokenizer.json"))
    return tok


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(llama3_regex=True), dict(add_prefix_space=True), dict(eos_suffix=True)],
    ids=["gpt2-regex", "llama3-regex", "prefix-space", "eos-suffix"],
)
def test_long_prompt_encoded_in_pieces_equals_whole(tmp_path, variant):
    from minidecode.tokenizer import Tokenizer

    ref_tok = piece_tokenizer(tmp_path, **variant)
    ours = Tokenizer(tmp_path)
    assert ours._splittable == (not variant.get("add_prefix_space"))  # else it must encode whole
    text = PARAGRAPHS * 40
    for add_special_tokens in (True, False):
        ref = ref_tok.encode(text, add_special_tokens=add_special_tokens).ids
        for piece_chars in (1, 7, 64, 1000):
            got = ours.encode_long(text, add_special_tokens=add_special_tokens, piece_chars=piece_chars)
            assert got == ref, (piece_chars, add_special_tokens)


# ---- several threads on one model -------------------------------------------------------------


def test_threads_take_turns_and_never_corrupt_each_other(llama, prompt_ids):
    """4 threads mixing generate and stream on one LLM: every output equals a single-threaded
    run (before the fix, a stream started mid-generation reallocated the cache under it)."""
    import threading

    llm = load(llama)
    prompts = [prompt_ids(20 + 7 * i, seed=40 + i) for i in range(8)]
    expected = [llm.generate(token_ids=p, max_new_tokens=12, temperature=0).token_ids for p in prompts]
    got: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for r in range(6):
                i = (w * 3 + r) % len(prompts)
                kw = dict(token_ids=prompts[i], max_new_tokens=12, temperature=0)
                if (w + r) % 2:
                    out = llm.generate(**kw)
                else:
                    # a longer context on every other stream: forces the cache to be reallocated
                    with llm.stream(**kw, max_context=200 + 50 * w) as stream:
                        for _ in stream:
                            pass
                    out = stream.result
                got[w, r] = (i, out.token_ids)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(got) == 24
    for i, tokens in got.values():
        assert tokens == expected[i]


def test_a_closed_or_abandoned_stream_frees_the_model(llama, prompt_ids):
    llm = load(llama)
    ids = prompt_ids(30, seed=50)
    ref = llm.generate(token_ids=ids, max_new_tokens=8, temperature=0).token_ids
    stream = llm.stream(token_ids=ids, max_new_tokens=8, temperature=0)
    next(iter(stream))
    stream.close()  # stopped early: the next call runs at once
    assert llm.generate(token_ids=ids, max_new_tokens=8, temperature=0).token_ids == ref
    llm.stream(token_ids=ids, max_new_tokens=8, temperature=0)  # never iterated, dropped at once
    assert llm.generate(token_ids=ids, max_new_tokens=8, temperature=0).token_ids == ref


def test_token_bytes_spell_the_text_in_byte_level_and_byte_fallback_vocabularies(tiny_llama, tmp_path):
    """Each token's bytes, concatenated, are the text's UTF-8 bytes, characters split over tokens
    included: a byte-level BPE (the test checkpoints'), and a byte-fallback BPE that spells an
    unknown character's bytes as <0xNN> tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from minidecode.tokenizer import Tokenizer

    text = "Ünïcödé, emoji 🙂🙃 and CJK 漢字 in a row"
    byte_level = Tokenizer(tiny_llama)
    ids = byte_level.encode(text, add_special_tokens=False)
    assert b"".join(byte_level.token_bytes(t) for t in ids) == text.encode()
    assert any(not _utf8(byte_level.token_bytes(t)) for t in ids)  # some token is part of a character

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {c: 256 + i for i, c in enumerate("▁abcdemojiwt,")}
    fallback = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    fallback.decoder = decoders.Sequence(steps)
    fallback.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(tmp_path)
    word = "émoji🙂"
    ids = ours.encode(word, add_special_tokens=False)
    assert len(ids) > len(word)  # é and 🙂 went to bytes
    assert b"".join(ours.token_bytes(t) for t in ids) == word.encode()


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True

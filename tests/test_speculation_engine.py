"""Speculation through the runtime (prompt-lookup drafts verified in the decode step): greedy output
with `speculate` is token for token the output without it, on the shipped model and on a
transformers-made checkpoint (against transformers' greedy generate), alone, in a batch beside
requests that do not speculate, with a reused prefix, with the FP8 cache, under stop strings and
max_new_tokens, and through the server; seeded sampling with speculation is reproducible; bad values
are one line in the API, the CLI and the server."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import random_ids
from typer.testing import CliRunner

from minidecode import LLM, Request
from minidecode.decode import bucket, draft_bucket
from minidecode.errors import UserError
from minidecode.plan import Decode, DecodeKind, StepPlan
from minidecode.sampling import SamplingParams
from minidecode.warm_up import decode_steps
from minidecode_cli.cli import app

# The shipped model repeats what it was shown: its answer copies the prompt's lines, so drafts match.
REPEATS = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
CODE = (
    'import os\nimport sys\n\n\ndef main(argv):\n    path = os.path.join(argv[1], "out")\n'
    "    return path\n\n\ndef main(argv):\n    path"
)
CLASS = "class A:\n    def f(self):\n        return self.x\n\n    def g(self):\n        return self."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32")


def greedy(llm: LLM, prompt, **settings):
    return llm.generate(prompt, temperature=0, reuse_prefix=False, **settings)


@pytest.mark.parametrize("prompt", [REPEATS, CODE, CLASS])
def test_greedy_with_speculation_is_greedy_without(llm, prompt):
    plain = greedy(llm, prompt, max_new_tokens=64)
    spec = greedy(llm, prompt, max_new_tokens=64, speculate=8)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    stats = spec.stats
    assert 0 < stats.accepted_tokens <= stats.proposed_tokens
    assert stats.decode_steps < len(spec.token_ids) - 1  # several tokens in some steps
    assert plain.stats.proposed_tokens == plain.stats.accepted_tokens == 0
    assert plain.stats.decode_steps >= len(plain.token_ids) - 1
    assert "drafts" in stats.summary() and "drafts" not in plain.stats.summary()


def test_one_draft_a_step(llm):
    plain = greedy(llm, REPEATS, max_new_tokens=32)
    spec = greedy(llm, REPEATS, max_new_tokens=32, speculate=1)
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.stats.accepted_tokens <= spec.stats.proposed_tokens <= spec.stats.decode_steps


def test_rejected_drafts_leave_the_output_unchanged(llm):
    """Drafts that the model turns down (a prompt whose repeats differ): the output is still exact."""
    prompt = "x = [1, 2, 3]\ny = [1, 2, 4]\nz = [1, 2, 5]\nw = [1, 2,"
    plain = greedy(llm, prompt, max_new_tokens=48)
    spec = greedy(llm, prompt, max_new_tokens=48, speculate=16)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens < spec.stats.proposed_tokens  # some drafts were rejected


@pytest.mark.parametrize("new", [1, 2, 3, 5, 9, 17])
def test_max_new_tokens_is_exact(llm, new):
    plain = greedy(llm, REPEATS, max_new_tokens=new)
    spec = greedy(llm, REPEATS, max_new_tokens=new, speculate=16)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == new
    assert spec.finish_reason == plain.finish_reason == "length"


def test_a_row_near_its_end_writes_nothing_past_its_region(llm):
    """Drafts are cut to what a row can still return: its K/V never reach past its region into the
    next one (here the region of the request admitted after it, whose output would change)."""
    batch = llm.generate(
        [Request(prompt=REPEATS, max_new_tokens=6, speculate=16), Request(prompt=CODE, max_new_tokens=30)],
        temperature=0, reuse_prefix=False,
    )  # fmt: skip
    assert batch[0].token_ids == greedy(llm, REPEATS, max_new_tokens=6).token_ids
    assert batch[0].stats.accepted_tokens > 0
    assert batch[1].token_ids == greedy(llm, CODE, max_new_tokens=30).token_ids


def test_the_token_history_holds_every_region_s_tokens(llm):
    """The drafts are looked up on the device in the token history beside the cache: after a batch
    (prefills beside running rows in mixed steps, steps with and without drafts, a reused prefix),
    each cached prefix's history is its ids, position for position, whether its request speculated
    or not."""
    requests = [Request(prompt=p, speculate=k) for p, k in ((REPEATS, 8), (CODE, 0), (CLASS, 4))]
    llm.release_cache()
    llm.generate(requests, temperature=0, max_new_tokens=30)
    llm.generate(Request(prompt=REPEATS + "    return", speculate=8), temperature=0, max_new_tokens=20)
    engine, prefixes = llm.engine, llm.loop.scheduler.prefixes
    assert len(prefixes) >= 3
    for prefix in prefixes:
        span = engine.history.span(prefix.start, 0, len(prefix.ids))
        assert span.tolist() == prefix.ids


def test_each_plan_hands_back_the_step_before_s_results():
    """The engine queues a step with drafts without waiting for it, as a plain one: each plan's
    StepOutput holds what the step before it gave (its token and, after a step with drafts, its
    verdicts), and a step verifies the drafts the step before it found on the device; the tokens
    handed back are greedy decoding's."""
    llm = LLM(device="cpu", dtype="float32")
    engine, ids = llm.engine, llm.tokenizer.encode(REPEATS)
    size = -(-(len(ids) + 64) // engine.granule) * engine.granule
    engine.resize(size)
    greedy_params = SamplingParams(temperature=0)
    kind = DecodeKind(greedy_params.mode, lookup=True)
    with torch.inference_mode():
        logits = engine.prefill(ids, 0, size, 0)
        engine.start_row(0, 0, len(ids), greedy_params, speculate=8, draft_end=len(ids) + 60)
        first = engine.sample_first(0, logits, greedy_params, False)
        out = engine.run(StepPlan(decode=Decode(1, kind)))  # a plain step; its lookup finds drafts
        assert out.tokens == [first] and out.verdicts is None
        state = engine.state
        held, drafts = state.tokens[0].item(), state.drafts[0, : state.draft_lens[0]].tolist()
        assert drafts  # the answer repeats the prompt
        out = engine.run(StepPlan(decode=Decode(1, kind, draft_bucket(len(drafts), engine.draft_sizes))))
        assert out.tokens == [held] and out.verdicts is None and out.draft_lens == [len(drafts)]
        after = state.tokens[0].item()
        out = engine.run(StepPlan(decode=Decode(1, kind)))
        proposed, accepted, *verified = out.verdicts[0]
        assert proposed == len(drafts) and verified[:proposed] == drafts and accepted > 0
        assert out.tokens == [after]
    want = greedy(llm, None, token_ids=ids, max_new_tokens=3 + accepted).token_ids
    assert [first, held, *drafts[:accepted], after] == want


@pytest.mark.parametrize("prompt", ["repeats", "random"])
def test_a_step_has_draft_rows_only_once_drafts_were_seen(llm, monkeypatch, prompt):
    """A step takes query rows for drafts only after a plan's results showed a row with drafts
    ready: a request whose lookups find nothing runs the plain steps, as without speculation
    (same shapes, so the same rounding in any dtype), and one whose answer repeats its prompt
    still keeps drafts."""
    seen = []
    execute = llm.loop.execute

    def recorded(plan, *args):
        if plan.decode is not None and plan.decode.queries > 1:
            assert any(seen), "a step with draft rows before any drafts were seen"
        out = execute(plan, *args)
        seen.extend(out.draft_lens or [])
        return out

    monkeypatch.setattr(llm.loop, "execute", recorded)
    ids = llm.tokenizer.encode(REPEATS) if prompt == "repeats" else random_ids(120, seed=3)
    plain = greedy(llm, None, token_ids=ids, max_new_tokens=24)
    spec = greedy(llm, None, token_ids=ids, max_new_tokens=24, speculate=8)
    assert spec.token_ids == plain.token_ids
    if prompt == "repeats":
        assert spec.stats.accepted_tokens > 0
    else:
        assert spec.stats.proposed_tokens == 0 and not any(seen)
        assert spec.stats.decode_steps == plain.stats.decode_steps


def recorded_plans(llm: LLM, monkeypatch) -> list[StepPlan]:
    """The list that every step plan llm's loop executes from now on is appended to."""
    plans = []
    execute = llm.loop.execute

    def recorded(plan, *args):
        plans.append(plan)
        return execute(plan, *args)

    monkeypatch.setattr(llm.loop, "execute", recorded)
    return plans


def test_a_step_verifies_at_most_the_draft_size_below_the_setting(llm, monkeypatch):
    """speculate=8 on the shipped model (4 query heads a KV head: draft sizes 1, 3, 7, 15): every
    step takes 1, 4 or 8 query rows a sequence (a row that kept its drafts asks for at least 3),
    never verifies more than 7 drafts, and gives the plain tokens."""
    assert llm.engine.draft_sizes == (1, 3, 7, 15)
    plain = greedy(llm, REPEATS, max_new_tokens=64)
    plans = recorded_plans(llm, monkeypatch)
    spec = greedy(llm, REPEATS, max_new_tokens=64, speculate=8)
    assert spec.token_ids == plain.token_ids
    steps = [plan.decode.queries for plan in plans if plan.decode is not None]
    assert set(steps) <= {1, 4, 8} and 8 in steps
    stats = spec.stats
    assert stats.proposed_tokens <= 7 * sum(q > 1 for q in steps) and stats.accepted_tokens > 0


def test_every_step_with_drafts_has_its_graph_prepared_before_its_prefill(llm, monkeypatch):
    """The plans' prepare lists hold every (bucket, kind, queries) a later step runs, each added with
    the admission of a sequence that can speculate: no step captures a graph (on the CPU nothing
    captures, so the plans are what is checked)."""
    plans = recorded_plans(llm, monkeypatch)
    requests = [Request(prompt=REPEATS, speculate=16), Request(prompt=CODE, speculate=3)]
    requests.append(Request(prompt=CLASS))
    llm.generate(requests, temperature=0, max_new_tokens=40, reuse_prefix=False)
    admissions = [plan.prepare for plan in plans if plan.admit is not None]
    # speculate 16: the draft sizes its steps can take (the shipped model's 4 heads a KV head: 3, 7
    # and 15 drafts, whose 4 / 8 / 16 positions fill 16 / 32 / 64-row tiles; 1 draft only for rows
    # whose limit is 1), then the plain step without the lookup (for rows left after it)
    assert [(q, kind.lookup) for _, kind, q in admissions[0]] == [(q, True) for q in (1, 4, 8, 16)] + [
        (1, False)
    ]
    assert {rows for rows, _, _ in admissions[1]} == {2} and len(admissions[1]) == 5  # (16 still runs)
    prepared, drafted = set(), 0
    for plan in plans:
        prepared |= {(bucket(rows), kind, queries) for rows, kind, queries in plan.prepare}
        if plan.decode is not None:
            assert (bucket(plan.decode.rows), plan.decode.kind, plan.decode.queries) in prepared
            drafted += plan.decode.queries > 1
    assert drafted > 0


def test_the_llm_default_applies_where_a_request_sets_none(llm):
    """LLM(speculate=K): a request without its own speculates up to K drafts (the same tokens as
    greedy without); its own setting, 0 included, wins; a bad default is one line."""
    plain = greedy(llm, REPEATS, max_new_tokens=48)
    default = LLM(device="cpu", dtype="float32", speculate=8)
    spec = greedy(default, REPEATS, max_new_tokens=48)
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0
    off = greedy(default, REPEATS, max_new_tokens=48, speculate=0)
    assert off.token_ids == plain.token_ids and off.stats.proposed_tokens == 0
    bad = ((17, "speculate must be <= 16, got 17"), (-1, "speculate must be >= 0"), (True, "integer"))
    for value, message in bad:
        with pytest.raises(UserError, match=message) as refused:
            LLM(device="cpu", dtype="float32", speculate=value)
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("default", [16, 0])
def test_the_load_compiles_the_steps_the_default_takes(llm, monkeypatch, default):
    """Every decode step that requests of the LLM's speculate default take (alone and in a batch:
    their buckets, kinds and query rows, as the plans prepare them) is one warm_up compiles at
    load (warm_up.decode_steps); without a default, the steps with drafts are not."""
    plans = recorded_plans(llm, monkeypatch)
    llm.generate(REPEATS, temperature=0, max_new_tokens=24, reuse_prefix=False, speculate=16)
    llm.generate([REPEATS, CODE, CLASS], temperature=0, max_new_tokens=24, reuse_prefix=False, speculate=16)
    taken = {(bucket(rows), kind, queries) for plan in plans for rows, kind, queries in plan.prepare}
    assert any(queries == 16 for _, _, queries in taken)  # the largest draft size's, 15 + 1
    compiled = set(decode_steps(llm.engine, default))
    assert (taken <= compiled) == (default == 16), taken - compiled


def test_stop_strings_end_where_they_would(llm):
    plain = greedy(llm, REPEATS, max_new_tokens=64, stop="a + b\n\ndef")
    spec = greedy(llm, REPEATS, max_new_tokens=64, stop="a + b\n\ndef", speculate=8)
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason == "stop"
    assert spec.token_ids == plain.token_ids


def test_a_batch_mixing_speculation_and_none(llm):
    prompts = [REPEATS, CODE, CLASS, CODE]
    settings = [0, 8, 4, 16]
    alone = [greedy(llm, p, max_new_tokens=40).token_ids for p in prompts]
    batch = llm.generate(
        [Request(prompt=p, speculate=k) for p, k in zip(prompts, settings, strict=True)],
        temperature=0, max_new_tokens=40, reuse_prefix=False,
    )  # fmt: skip
    assert [r.token_ids for r in batch] == alone
    assert batch[0].stats.proposed_tokens == 0
    assert all(r.stats.accepted_tokens > 0 for r in batch[1:])


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_rows_with_log_probs_or_processors_beside_speculating_rows(llm, mode):
    """Log-probs, top log-probs and logits processors are one token a step: such rows make no drafts
    but run in the steps with drafts beside those that do, with what they get alone."""
    sampling = {"temperature": 0} if mode == "greedy" else {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    others = [
        Request(prompt=CODE, logprobs=True, **sampling),
        Request(prompt=CLASS, top_logprobs=3, **sampling),
        Request(
            prompt=CODE, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={"13": 2.0}, **sampling
        ),
        Request(prompt=CLASS, min_tokens=20, frequency_penalty=0.4, **sampling),
    ]
    alone = [llm.generate(r, max_new_tokens=24, reuse_prefix=False) for r in others]
    batch = llm.generate(
        [Request(prompt=REPEATS, speculate=8, temperature=0), *[replace(r, speculate=8) for r in others]],
        max_new_tokens=24, reuse_prefix=False,
    )  # fmt: skip
    assert batch[0].token_ids == greedy(llm, REPEATS, max_new_tokens=24).token_ids
    assert batch[0].stats.accepted_tokens > 0 and batch[0].stats.decode_steps < 20
    for got, want in zip(batch[1:], alone, strict=True):
        assert got.token_ids == want.token_ids and got.stats.proposed_tokens == 0
        if want.logprobs is not None:
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
        if want.top_logprobs is not None:
            assert [[i for i, _ in t] for t in got.top_logprobs] == [
                [i for i, _ in t] for t in want.top_logprobs
            ]


def test_a_reused_prefix(llm):
    first = llm.generate(REPEATS, temperature=0, max_new_tokens=32, speculate=8)
    again = llm.generate(REPEATS + "    return", temperature=0, max_new_tokens=32, speculate=8)
    assert again.stats.reused_tokens > 0 and again.stats.accepted_tokens > 0
    assert again.token_ids == greedy(llm, REPEATS + "    return", max_new_tokens=32).token_ids
    assert first.token_ids == greedy(llm, REPEATS, max_new_tokens=32).token_ids


def test_the_fp8_cache():
    fp8 = LLM(device="cpu", dtype="float32", kv_cache_dtype="fp8")
    plain = greedy(fp8, CODE, max_new_tokens=48)
    spec = greedy(fp8, CODE, max_new_tokens=48, speculate=8)
    assert spec.stats.kv_cache_dtype == "fp8_e4m3"
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0


def test_seeded_sampling_with_speculation_is_reproducible(llm):
    """A seeded request draws the same tokens with speculation as without (each draft is checked
    against the sampler's own draw at its position), and again the next time."""
    runs = [
        llm.generate(REPEATS, temperature=0.7, top_k=50, seed=3, max_new_tokens=48, speculate=k)
        for k in (8, 8, 0)
    ]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids and runs[0].text == runs[2].text
    assert runs[0].stats.accepted_tokens > 0
    other = llm.generate(REPEATS, temperature=0.7, top_k=50, seed=4, max_new_tokens=48, speculate=8)
    assert other.token_ids != runs[0].token_ids  # the seed matters


def test_seeded_sampling_draws_the_same_tokens_in_a_batch(llm):
    """A seeded request's drafts follow its own tokens only: beside others (a greedy one among
    them: the step samples, its row stays greedy) it draws what it draws alone."""
    sampled = Request(prompt=CLASS, temperature=0.8, seed=11, speculate=8)
    alone = llm.generate(sampled, max_new_tokens=40, reuse_prefix=False)
    others = (
        Request(prompt=REPEATS, temperature=0, speculate=4),
        Request(prompt=CODE, temperature=1.2, speculate=16),
    )
    batch = llm.generate([others[0], sampled, others[1]], max_new_tokens=40, reuse_prefix=False)
    assert batch[1].token_ids == alone.token_ids and alone.stats.accepted_tokens > 0
    assert batch[0].token_ids == greedy(llm, REPEATS, max_new_tokens=40).token_ids


def test_a_transformers_checkpoint_against_transformers_greedy(tiny_llama, hf):
    llm = LLM(tiny_llama, device="cpu", dtype="float32")
    ids = random_ids(12, seed=5) * 3  # a prompt that repeats itself
    want = hf.greedy(tiny_llama, ids, 40)
    got = [greedy(llm, None, token_ids=ids, max_new_tokens=40, ignore_eos=True, speculate=k) for k in (0, 6)]
    assert got[0].token_ids == want and got[1].token_ids == want
    assert got[1].stats.proposed_tokens > 0


@pytest.mark.parametrize("value", [-1, 17, 2.5, True, "4"])
def test_bad_values_are_one_line(llm, value):
    with pytest.raises(UserError, match="speculate") as refused:
        llm.generate(REPEATS, max_new_tokens=2, speculate=value)
    assert "\n" not in str(refused.value) and refused.value.field == "speculate"


def test_the_cli_option(llm):
    runner = CliRunner()
    args = ["generate", "--device", "cpu", "--dtype", "float32", "--prompt", REPEATS, "-n", "24"]
    ok = runner.invoke(app, [*args, "--temperature", "0", "--speculate", "8", "--json"])
    assert ok.exit_code == 0, ok.output
    stats = json.loads(ok.stdout)["stats"]
    assert stats["accepted_tokens"] > 0 and stats["decode_steps"] < 23
    assert json.loads(ok.stdout)["token_ids"] == greedy(llm, REPEATS, max_new_tokens=24).token_ids
    bad = runner.invoke(app, [*args, "--speculate", "99"])
    assert bad.exit_code != 0 and "speculate must be <= 16" in bad.output


def test_the_batch_summary_shows_the_drafts(tmp_path):
    """`minidecode batch`'s last line: the drafts kept of those proposed and the tokens a step made,
    summed over the results' stats, where speculation ran; nothing of drafts where it did not."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate([REPEATS, CODE]))
    )
    args = ["batch", str(requests), "--device", "cpu", "--dtype", "float32", "-n", "32", "--temperature", "0"]
    summaries, results = [], []
    for extra in (["--speculate", "8"], []):
        done = CliRunner().invoke(app, [*args, "--no-progress", *extra])
        assert done.exit_code == 0, done.output
        summaries.append(done.stderr.strip().splitlines()[-1])
        results.append([json.loads(line)["stats"] for line in done.stdout.splitlines()])
    stats = results[0]
    proposed, accepted = (sum(s[key] for s in stats) for key in ("proposed_tokens", "accepted_tokens"))
    steps = sum(s["decode_steps"] for s in stats)
    assert 0 < accepted <= proposed
    assert summaries[0].startswith("2 done, 0 failed of 2 requests | ")
    assert summaries[0].endswith(
        f" | drafts {accepted:,} of {proposed:,} accepted, {(steps + accepted) / steps:.2f} tok/step"
    )
    assert "drafts" not in summaries[1] and summaries[1].startswith("2 done, 0 failed of 2 requests | ")


def test_the_server_default_and_the_extension_field(llm):
    pytest.importorskip("openai")
    from test_server import metrics, post, started

    reference = LLM(device="cpu")  # the server's dtype
    want = reference.generate(REPEATS, temperature=0, max_new_tokens=32, reuse_prefix=False).text
    body = {"model": "stdlib-tiny", "prompt": REPEATS, "max_tokens": 32, "temperature": 0}
    with started(None, "--speculate", "4") as served:
        status, answer = post(served.base, "/v1/completions", body)  # the server's default
        assert status == 200 and answer["choices"][0]["text"] == want
        accepted = metrics(served.base)["minidecode_accepted_tokens_total"]
        assert accepted > 0
        status, answer = post(served.base, "/v1/completions", {**body, "speculate": 0})
        assert status == 200 and answer["choices"][0]["text"] == want
        assert metrics(served.base)["minidecode_accepted_tokens_total"] == accepted  # off: none
        status, answer = post(served.base, "/v1/completions", {**body, "speculate": 16})
        assert status == 200 and answer["choices"][0]["text"] == want
        numbers = metrics(served.base)
        assert numbers["minidecode_accepted_tokens_total"] > accepted
        assert numbers["minidecode_proposed_tokens_total"] >= numbers["minidecode_accepted_tokens_total"]
        assert 0 < numbers["minidecode_decode_steps_total"] < numbers["minidecode_generation_tokens_total"]
        status, answer = post(served.base, "/v1/completions", {**body, "speculate": 17})
        assert status == 400 and answer["error"]["param"] == "speculate"
        assert "speculate must be <= 16" in answer["error"]["message"]


def test_serve_refuses_a_bad_default():
    refused = CliRunner().invoke(app, ["serve", "--device", "cpu", "--speculate", "-1"])
    assert refused.exit_code != 0 and "--speculate must be >= 0" in refused.output


@pytest.mark.slow
@pytest.mark.parametrize("split", ["--tp", "--cp"])
def test_batch_under_torchrun_speculates_and_gives_one_process_greedy_text(tmp_path, split):
    """torchrun --tp 2 / --cp 2: rank 0's drafts go to both ranks in the plan, and each rank
    verifies them on its heads or its positions; the text is one process's. (The step with drafts
    over positions dealt to both ranks: tests/test_distributed.py.)"""
    pytest.importorskip("fastapi")
    import subprocess
    import sys

    from test_torchrun import _env, _torchrun

    lines = [
        {"prompt": REPEATS, "id": "a"},
        {"prompt": CLASS, "id": "b", "speculate": 16},
        {"prompt": CODE, "id": "c"},
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = ["--max-new-tokens", "32", "--temperature", "0", "--device", "cpu", "--no-progress"]

    def run(command: list[str], out, *extra: str) -> dict[str, dict]:
        proc = subprocess.run(
            [*command, str(requests), *options, *extra, "--output", str(out)],
            env=_env(), capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}

    single = run(
        [sys.executable, "-m", "minidecode_cli.cli", "batch"], tmp_path / "one.jsonl"
    )  # b speculates
    ranks = run(_torchrun("batch", split, "2"), tmp_path / "two.jsonl", "--speculate", "8")
    for key, want in single.items():
        assert ranks[key]["token_ids"] == want["token_ids"] and ranks[key]["text"] == want["text"]
        assert ranks[key]["stats"]["accepted_tokens"] > 0
    assert single["a"]["stats"]["proposed_tokens"] == single["c"]["stats"]["proposed_tokens"] == 0


@pytest.mark.parametrize("kernels", ["twins", "triton"])
@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_the_step_with_drafts_is_the_step_one_token_at_a_time(checkpoint_factory, kernels, kv, monkeypatch):
    """Transformer.decode_drafts over ragged rows (q_lens 3, 1, 4 and an idle row) against decode
    run token by token: the same logits at every real row, the same K/V at every real position, and
    nothing written outside them but the spare position. kernels "triton": the CUDA path's Triton
    kernels (interpreter) for every op, the fused RoPE + cache write and the multi-query lean kernel
    included."""
    from minidecode.kernels import ops

    model_dir = checkpoint_factory(
        "gpu-llama-hd64", "default", max_positions=512
    )  # the GPU kernel's head_dim
    llm = LLM(model_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8" if kv == "fp8" else "auto")
    engine, model = llm.engine, llm.model
    if kernels == "triton":
        monkeypatch.setattr(ops, "_triton", lambda x, triton: True if triton is None else triton)
    granule, Q = engine.granule, 4
    size = -(-40 // granule) * granule
    engine.resize(3 * size)
    prompts = [random_ids(n, seed=n) for n in (9, 17, 5)]
    starts = [0, size, 2 * size]
    for ids, start in zip(prompts, starts, strict=True):
        engine.prefill(ids, start, size, 0)
    before = {name: t.clone() for name, t in engine.cache.tensors().items()}
    q_lens = [3, 1, 4]
    tokens = [random_ids(Q, seed=20 + b) for b in range(3)]
    # token by token: each sequence's real rows through the plain decode step, its own batch of one
    want_logits = torch.zeros(4, Q, model.config.vocab_size)
    with torch.inference_mode():
        for b in range(3):
            for j in range(q_lens[b]):
                hidden = model.decode(
                    torch.tensor([tokens[b][j]]), torch.tensor([len(prompts[b]) + j]), engine.cache,
                    starts=torch.tensor([starts[b]]), active=torch.ones(1, dtype=torch.int32),
                )  # fmt: skip
                want_logits[b, j] = model.logits(hidden)[0]
        want_cache = {name: t.clone() for name, t in engine.cache.tensors().items()}
        for name, t in engine.cache.tensors().items():
            t.copy_(before[name])
        spare = engine.spare_start
        got = model.logits(
            model.decode_drafts(
                torch.tensor([*tokens, [0] * Q]), torch.tensor([len(p) for p in prompts] + [0]),
                torch.tensor([*q_lens, 1], dtype=torch.int32), engine.cache, spare,
                starts=torch.tensor([*starts, spare]), active=torch.tensor([1, 1, 1, 0], dtype=torch.int32),
            )
        )  # fmt: skip
    for b in range(3):
        # (FP8: a later layer's K/V, a last bit apart in float32, may round to the next e4m3 step)
        tol = 1e-4 if kv == "model" else 2e-3
        torch.testing.assert_close(got[b, : q_lens[b]], want_logits[b, : q_lens[b]], rtol=tol, atol=tol)
    real = torch.zeros(engine.cache.tensors()["k"].shape[3], dtype=torch.bool)
    for b in range(3):
        first = starts[b] + len(prompts[b])
        real[first : first + q_lens[b]] = True
    untouched = ~real
    untouched[spare : spare + granule] = False
    for name, t in engine.cache.tensors().items():
        got_rows, want_rows, old_rows = (rows(x) for x in (t, want_cache[name], before[name]))
        same = got_rows[:, :, :, untouched].view(torch.uint8) == old_rows[:, :, :, untouched].view(
            torch.uint8
        )
        assert bool(same.all()), name  # (bytes: the unwritten cache is uninitialized, NaN included)
        if t.dtype == torch.float32:  # (FP8: the same values rounded, to a step of e4m3 apart)
            torch.testing.assert_close(
                got_rows[:, :, :, real], want_rows[:, :, :, real], rtol=1e-4, atol=1e-5
            )


def rows(t):
    """A cache tensor as [layers, 1, Hkv, positions, ...] (an FP8 cache's blocked V unblocked; FP8
    values as their bytes)."""
    if t.dtype == torch.float32 or t.dtype == torch.bfloat16:
        return t
    t = t.view(torch.uint8)
    if t.dim() == 6:  # V: [layers, 1, Hkv, blocks, D, V_BLOCK]
        L, C, H, blocks, D, block = t.shape
        return t.permute(0, 1, 2, 3, 5, 4).reshape(L, C, H, blocks * block, D)
    return t


def test_sampling_with_speculation_keeps_the_models_distribution(llm):
    """Sampled tokens at positions the drafts verify, over many seeds, against the model's own
    distribution there (its logits, scored in one pass): the total variation stays within the
    sampling noise (1.5x its expected size for n draws, sum over t of min(sqrt(p(1 - p) / n), 2p)
    halved), while drafts are checked and kept."""
    from collections import Counter

    seeds = range(600)
    batch = [Request(prompt=CLASS, seed=s, speculate=8) for s in seeds]
    results = llm.generate(batch, temperature=1.0, max_new_tokens=7, reuse_prefix=False)
    assert sum(r.stats.accepted_tokens for r in results) > len(seeds) // 2  # drafts were kept
    prompt = llm.tokenizer.encode(CLASS)
    # the first decode step's token, and the third's first (the first step whose drafts, made by the
    # second, are verified: its token is a kept draft or the model's draw given the draft's rejection)
    for at in (1, 3):
        before = Counter(tuple(r.token_ids[:at]) for r in results).most_common(1)[0][0]
        drawn = Counter(r.token_ids[at] for r in results if tuple(r.token_ids[:at]) == before)
        n = sum(drawn.values())
        assert n >= 200
        p = torch.softmax(llm.logits(prompt + list(before))[-1].double(), -1)
        tv = (sum(abs(drawn[t] / n - float(p[t])) for t in drawn) + float(p.sum() - p[list(drawn)].sum())) / 2
        noise = float(torch.minimum((p * (1 - p) / n).sqrt(), 2 * p).sum()) / 2
        assert tv < 1.5 * noise, (at, tv, noise, drawn.most_common(4), p.topk(4))

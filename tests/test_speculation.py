"""Prompt-lookup drafts (minidecode/speculation.py) on hand-made token lists, and the
verification rules: greedy exactness, and the sampled rule's output distribution against p."""

import pytest
import torch

from minidecode import speculation as spec
from minidecode.sampling import _uniform


def lookup(tokens, **kw):
    kw.setdefault("initial_draft", 8)
    return spec.PromptLookup(tokens, **kw)


# ---- the drafter ------------------------------------------------------------------------------


def test_continues_after_the_latest_longest_match():
    # "5 6 7" occurred twice before the end; the latest one (followed by 8 9) wins over 10 11
    tokens = [5, 6, 7, 10, 11, 1, 5, 6, 7, 8, 9, 2, 3, 6, 7]
    d = lookup(tokens, max_ngram=3, min_ngram=2)
    assert d.match() == (2, 9)  # "6 7" (the longest suffix seen before) last ended at 9
    assert d.propose() == [8, 9, 2, 3, 6, 7, 8, 9]  # past the end it runs on through its own drafts
    assert d.propose(max_tokens=3) == [8, 9, 2]


def test_prefers_the_longest_ngram():
    # "3 4" last occurred followed by 9, but "2 3 4" occurred followed by 7
    tokens = [2, 3, 4, 7, 0, 3, 4, 9, 1, 2, 3, 4]
    d = lookup(tokens, max_ngram=4, min_ngram=1)
    assert d.match() == (3, 3)
    assert d.propose(2) == [7, 0]
    assert lookup(tokens, max_ngram=2, min_ngram=1).propose(2) == [9, 1]


def test_no_match_gives_no_drafts():
    assert lookup([1, 2, 3, 4, 5]).propose() == []
    assert lookup([]).propose() == []
    assert lookup([7]).propose() == []
    d = lookup([1, 2, 3, 9, 2], min_ngram=2)  # "9 2" unseen; "2" alone is below min_ngram
    assert d.propose() == []
    assert lookup([1, 2, 3, 9, 2], min_ngram=1).propose(3) == [3, 9, 2]


def test_overlapping_match_continues_the_period():
    # a repeat whose earlier occurrence overlaps the suffix: the copy continues the pattern
    d = lookup([4, 1, 2, 1, 2, 1, 2], max_ngram=4)
    assert d.match() == (4, 5)
    assert d.propose() == [1, 2, 1, 2, 1, 2, 1, 2]
    assert lookup([3, 3, 3], max_ngram=4, min_ngram=1).propose(5) == [3] * 5


def test_extension_indexes_generated_tokens():
    d = lookup([10, 11, 12, 13], max_ngram=3, min_ngram=2)
    assert d.propose() == []
    d.extend([20, 21, 22])
    assert d.propose() == []  # "21 22" not seen before
    d.extend([5, 20, 21])  # "20 21" was generated earlier, followed by 22 5
    assert d.match() == (2, 6)
    assert d.propose(4) == [22, 5, 20, 21]
    d.extend([22, 5, 20, 21, 22])  # the latest occurrence of "20 21 22" moves to the new one
    assert d.match() == (3, 11) and d.propose(2) == [5, 20]
    assert len(d) == 15


def test_extension_matches_building_at_once():
    """An index built from a prefix and extended token by token finds what one built from the
    whole sequence so far finds, at every step (a small alphabet: many repeats)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (200,), generator=gen).tolist()
    grown = lookup(tokens[:37], max_ngram=4, min_ngram=1)
    for m in range(37, 200):
        whole = lookup(tokens[:m], max_ngram=4, min_ngram=1)
        assert grown.match() == whole.match() and grown.propose() == whole.propose()
        grown.extend(tokens[m : m + 1])


def test_large_prompt_builds_and_looks_up():
    """A 512k-token prompt (timing-free: the index is vectorised; a lookup reads dicts only)."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128_000, (524_288,), generator=gen)
    prompt[-6:] = prompt[1000:1006]  # the prompt ends with a quote of itself
    d = spec.PromptLookup(prompt, max_ngram=4, min_ngram=2, initial_draft=5)
    assert d.match() == (4, 1006)
    assert d.propose() == prompt[1006:1011].tolist()


def test_draft_length_follows_acceptance():
    d = lookup([1, 2, 3], max_draft=12, initial_draft=4)
    assert d.k == 4
    d.record(4, 4)
    assert d.k == 8
    d.record(8, 8)
    assert d.k == 12  # capped at max_draft
    d.record(12, 3)
    assert d.k == 4  # one more than were accepted
    d.record(4, 0)
    assert d.k == 1
    d.record(0, 0)  # nothing proposed: no change
    assert d.k == 1
    d.record(1, 1)
    assert d.k == 2


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_ngram"):
        spec.PromptLookup([1, 2], max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_draft"):
        spec.PromptLookup([1, 2], max_draft=0)


# ---- verification ---------------------------------------------------------------------------


def test_accept_greedy_is_exact():
    """Accept while the drafts equal the argmax, then the argmax at the first disagreement (or
    the bonus one after the last draft): what one-token-at-a-time greedy decoding gives. One
    batch: a row for each place of the first disagreement, and rows with fewer drafts."""
    gen = torch.Generator().manual_seed(0)
    K = 5
    logits = torch.randn(K + 3, K + 1, 50, generator=gen)
    best = logits.argmax(-1)  # [B, K + 1]
    drafts = best[:, :K].clone()
    lens = torch.full((K + 3,), K)
    for b in range(K):  # row b disagrees first at draft b; row K agrees throughout
        drafts[b, b] = (best[b, b] + 1) % 50
    lens[K + 1], lens[K + 2] = 2, 0  # fewer drafts: a bonus after the second, or no drafts at all
    drafts[K + 1, 2:] = -1  # past draft_lens: never read
    accepted, nxt = spec.accept_greedy(drafts, logits, lens)
    want = torch.tensor([*range(K), K, 2, 0])
    assert torch.equal(accepted, want)
    assert torch.equal(nxt, best.gather(1, want[:, None])[:, 0])


def emitted(drafts, probs, n, position=100):
    """The tokens verification emits (drafts[:accepted] + [next]) for seeds 0..n-1, in one batch."""
    K = len(drafts)
    accepted, nxt = spec.accept_sampled(
        torch.tensor(drafts).expand(n, K), probs.expand(n, *probs.shape), torch.full((n,), K),
        torch.arange(n), torch.full((n,), position),
    )  # fmt: skip
    return [[*drafts[:a], t] for a, t in zip(accepted.tolist(), nxt.tolist(), strict=True)]


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


@pytest.mark.parametrize("draft", [0, 2, 4], ids=["likely", "mid", "unlikely"])
def test_accept_sampled_first_token_is_distributed_as_p(draft):
    """For a fixed draft x, the first emitted token is distributed as p whatever x: accepted with
    probability p(x), else drawn from p without x. 50000 seeded draws, total variation < 0.015
    (its expected size here is about 0.004)."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    probs = torch.stack([p, torch.full((5,), 0.2)])  # k = 1: row 1 is the bonus token's
    runs = emitted([draft], probs, 50_000)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=5).float()
    assert tv(first, p) < 0.015
    accept_rate = sum(len(r) == 2 for r in runs) / len(runs)
    assert abs(accept_rate - p[draft].item()) < 0.01


def test_accept_sampled_joint_distribution():
    """k = 2 drafts over different rows: the first token is distributed as p0, and after an
    accepted first draft the second as p1; the bonus after both accepted, as p2."""
    p0 = torch.tensor([0.6, 0.3, 0.1])
    p1 = torch.tensor([0.2, 0.2, 0.6])
    p2 = torch.tensor([0.1, 0.7, 0.2])
    runs = emitted([0, 2], torch.stack([p0, p1, p2]), 50_000, position=7)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=3).float()
    assert tv(first, p0) < 0.015
    second = torch.bincount(torch.tensor([r[1] for r in runs if len(r) >= 2]), minlength=3).float()
    assert abs(second.sum().item() / len(runs) - p0[0].item()) < 0.01
    assert tv(second, p1) < 0.015
    bonus = torch.bincount(torch.tensor([r[2] for r in runs if len(r) == 3]), minlength=3).float()
    assert tv(bonus, p2) < 0.03


def test_accept_sampled_is_reproducible_and_uses_the_samplers_stream():
    """The same (seed, position) verifies the same way in any batch; with every draft accepted
    (p(x) = 1) the bonus token is the one sampling.sample's exponential race draws there."""
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(40, 4, 30, generator=gen), -1)
    drafts = torch.randint(0, 30, (40, 3), generator=gen)
    lens, seeds, positions = torch.full((40,), 3), torch.arange(40) * 7919, torch.arange(40) + 50
    first = spec.accept_sampled(drafts, probs, lens, seeds, positions)
    order = torch.randperm(40, generator=gen)  # the same rows, another batch order
    again = spec.accept_sampled(drafts[order], probs[order], lens[order], seeds[order], positions[order])
    assert torch.equal(first[0][order], again[0]) and torch.equal(first[1][order], again[1])
    moved = spec.accept_sampled(drafts, probs, lens, seeds, positions + 1)
    assert not torch.equal(first[1], moved[1])  # the position counts
    sure = probs.clone()
    sure[:, :3] = 0
    sure.scatter_(-1, drafts[..., None], 1.0)  # rows 0..2 certain of their draft; row 3 as it was
    accepted, nxt = spec.accept_sampled(drafts, sure, lens, seeds, positions)
    noise = -torch.log(_uniform(seeds, positions + 3, 30))
    assert accepted.eq(3).all() and torch.equal(nxt, (probs[:, 3] / noise).argmax(-1))

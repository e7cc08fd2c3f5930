"""Speculation's rules (minidecode/speculation.py): how many drafts a row's next lookup asks for,
greedy verification's exactness, and the sampled rule's output distribution against p. (The
lookup itself: tests/test_prompt_lookup.py.)"""

import pytest
import torch

from minidecode import speculation as spec
from minidecode.sampling import _uniform

# ---- the draft count --------------------------------------------------------------------------


def test_draft_count_follows_acceptance():
    """next_draft_counts against the rule row by row: doubled up to the limit when every draft was
    kept, one more than the kept ones otherwise, unchanged where no draft was verified."""
    cases = [  # (count, proposed, accepted, most) -> next
        ((4, 4, 4, 12), 8), ((8, 8, 8, 12), 12), ((12, 12, 3, 12), 4), ((4, 4, 0, 12), 1),
        ((1, 0, 0, 12), 1), ((1, 1, 1, 12), 2), ((8, 2, 2, 16), 16), ((3, 3, 3, 4), 4),
    ]  # fmt: skip
    columns = [torch.tensor(c) for c in zip(*(case for case, _ in cases), strict=True)]
    assert spec.next_draft_counts(*columns).tolist() == [want for _, want in cases]


# ---- verification ---------------------------------------------------------------------------


def test_accept_keeps_the_drafts_that_match_the_models_own_tokens():
    """Accept while the drafts equal the token the step would emit at their place, then that token
    at the first disagreement (or the bonus one after the last draft): what one-token-at-a-time
    decoding gives. One batch: a row for each place of the first disagreement, and rows with
    fewer drafts."""
    gen = torch.Generator().manual_seed(0)
    K = 5
    own = torch.randint(0, 50, (K + 3, K + 1), generator=gen)  # [B, K + 1]
    drafts = own[:, :K].clone()
    lens = torch.full((K + 3,), K)
    for b in range(K):  # row b disagrees first at draft b; row K agrees throughout
        drafts[b, b] = (own[b, b] + 1) % 50
    lens[K + 1], lens[K + 2] = 2, 0  # fewer drafts: a bonus after the second, or no drafts at all
    drafts[K + 1, 2:] = -1  # past draft_lens: never read
    accepted, nxt = spec.accept(drafts, own, lens)
    want = torch.tensor([*range(K), K, 2, 0])
    assert torch.equal(accepted, want)
    assert torch.equal(nxt, own.gather(1, want[:, None])[:, 0])


def emitted(drafts, probs, n, position=100):
    """The tokens verification emits (drafts[:accepted] + [next]) for seeds 0..n-1, in one batch,
    against the tokens the sampler's exponential race draws at each draft's place (sampling.sample:
    argmax p / E, E from the counter-based uniforms of (seed, position))."""
    K, V = len(drafts), probs.shape[-1]
    seeds = torch.arange(n)
    own = torch.stack(
        [
            (probs[j] / -torch.log(_uniform(seeds, torch.full((n,), position + j), V))).argmax(-1)
            for j in range(K + 1)
        ],
        dim=1,
    )  # [n, K + 1]
    accepted, nxt = spec.accept(torch.tensor(drafts).expand(n, K), own, torch.full((n,), K))
    return [[*drafts[:a], t] for a, t in zip(accepted.tolist(), nxt.tolist(), strict=True)]


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


@pytest.mark.parametrize("draft", [0, 2, 4], ids=["likely", "mid", "unlikely"])
def test_sampled_first_token_is_distributed_as_p(draft):
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
    rejected = torch.bincount(torch.tensor([r[0] for r in runs if len(r) == 1]), minlength=5).float()
    without = p.clone()
    without[draft] = 0
    assert rejected[draft] == 0 and tv(rejected, without / without.sum()) < 0.02  # p without x


def test_sampled_joint_distribution():
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

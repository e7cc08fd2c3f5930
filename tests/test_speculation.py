"""Speculation's rules (minidecode/speculation.py): how many drafts a row's next lookup asks for,
greedy verification's exactness, and the sampled rule's output distribution against p. (The
lookup itself: tests/test_prompt_lookup.py.)"""

import math

import pytest
import torch

from minidecode import speculation as spec
from minidecode.request import MAX_SPECULATE
from minidecode.sampling import _uniform

# ---- the draft count --------------------------------------------------------------------------


def tile(rows: int) -> int:
    """The decode kernel's tile height for `rows` query rows: a power of two, 16 at least."""
    return max(16, 2 ** math.ceil(math.log2(rows)))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8])
def test_draft_sizes_are_the_counts_that_fill_a_tile(group):
    """Each draft size past the smallest tile is the most drafts whose group * (k + 1) query rows
    fit their tile, and every other count up to the largest size runs in the tile of the size
    above it: no size is missing, none pays for a tile it leaves partly empty. Against a table
    (Llama-2-7B's 1 query head a KV head, Llama-3-8B's 4, Qwen2.5-7B's 7, Qwen2.5-14B's 5)."""
    sizes = spec.draft_sizes(group)
    assert sizes[0] == 1 and list(sizes) == sorted(set(sizes)) and sizes[-1] <= MAX_SPECULATE
    for k in sizes:
        assert tile(group * (k + 1)) == 16 or tile(group * (k + 2)) > tile(group * (k + 1))
    for k in range(1, sizes[-1] + 1):
        assert tile(group * (spec.size_up(k, sizes) + 1)) == tile(group * (k + 1))
    assert tile(group * (MAX_SPECULATE + 1)) > tile(group * (sizes[-1] + 1))  # nothing fills a larger tile
    table = {1: (1, 3, 7, 15), 3: (1, 3, 4, 9), 4: (1, 3, 7, 15), 5: (1, 2, 5, 11), 7: (1, 3, 8)}
    table[8] = table[4]
    assert sizes == table.get(group, sizes)


def test_draft_count_follows_acceptance():
    """The rule against cases worked by hand (draft sizes 1, 3, 7, 15, then a group of 5's 1, 2, 5,
    11), on the host (next_draft_count, then the row's limit) and on the device's table, all rows
    at once (DraftCounts.next): the size that holds twice as many when every draft was kept, up to
    the limit; else the largest size up to one more than the kept ones; unchanged where none was
    verified."""
    cases = {
        (1, 3, 7, 15): [  # (count, proposed, accepted, most) -> next
            ((3, 3, 3, 15), 7), ((7, 7, 7, 15), 15), ((15, 15, 15, 15), 15), ((7, 7, 3, 15), 3),
            ((7, 7, 6, 15), 7), ((15, 15, 9, 15), 7), ((7, 7, 0, 15), 1), ((1, 0, 0, 15), 1),
            ((1, 1, 1, 15), 3), ((7, 2, 2, 15), 15), ((3, 3, 3, 3), 3), ((3, 3, 3, 7), 7), ((0, 0, 0, 0), 0),
        ],
        (1, 2, 5, 11): [((2, 2, 2, 11), 5), ((5, 5, 5, 11), 11), ((11, 11, 4, 11), 5), ((11, 11, 1, 11), 2)],
    }  # fmt: skip
    for sizes, rows in cases.items():
        want = [nxt for _, nxt in rows]
        assert [min(spec.next_draft_count(c, p, a, sizes), m) for (c, p, a, m), _ in rows] == want
        columns = [torch.tensor(c) for c in zip(*(case for case, _ in rows), strict=True)]
        assert spec.DraftCounts.make(sizes, "cpu").next(*columns).tolist() == want


def test_a_rows_setting_is_rounded_down_to_a_draft_size():
    """A row's limit is the largest size up to its speculate setting (8 -> 7 with sizes 1, 3, 7,
    15); its first lookup asks for the size that holds FIRST_DRAFTS, within it; the scheduler's room
    for its next step is the size that holds twice the drafts it had ready (none: a plain step)."""
    sizes = (1, 3, 7, 15)
    assert [spec.most_drafts(s, sizes) for s in (0, 1, 2, 3, 8, 15, 16)] == [0, 1, 1, 3, 7, 15, 15]
    assert spec.FIRST_DRAFTS == 4
    assert [spec.first_draft_count(m, sizes) for m in (1, 3, 7, 15)] == [1, 3, 7, 7]
    assert [spec.grown_draft_count(r, 15, sizes) for r in (0, 1, 2, 3, 4, 8)] == [0, 3, 7, 7, 15, 15]
    assert spec.grown_draft_count(3, 3, sizes) == 3


def test_a_step_is_sized_only_at_the_query_rows_its_rows_settings_can_reach():
    """step_queries, the graphs an admission and the load prepare, against cases worked by hand:
    with sizes 1, 3, 7, 15 a row that kept its drafts asks for at least 3 next, so 2 query rows (1
    draft) are reached only where every row's limit is 1; with sizes 1, 2, 5, 11 (5 heads a KV head)
    the fewest drafts a row that drafts asks for is 2 (3 rows)."""
    from minidecode.scheduler import step_queries

    cases = {
        (1, 3, 7, 15): [([0], [1]), ([1], [1, 2]), ([2], [1, 2]), ([3], [1, 4]), ([8], [1, 4, 8]),
                        ([16], [1, 4, 8, 16]), ([1, 8], [1, 2, 4, 8]), ([0, 3, 8], [1, 4, 8])],
        (1, 2, 5, 11): [([8], [1, 3, 6]), ([16], [1, 3, 6, 12]), ([1], [1, 2])],
    }  # fmt: skip
    for sizes, rows in cases.items():
        assert [step_queries(limits, sizes) for limits, _ in rows] == [want for _, want in rows]


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

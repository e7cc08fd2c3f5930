"""Tensor- and context-parallel decode over torch.distributed, on CPU processes (gloo): 2 and 4
ranks give one process's logits and greedy tokens, on checkpoints and on random-weight models; the
context-parallel merge against float64; the launch errors. Each parallel run spawns its ranks as
torchrun would (its environment), under a time limit. On 2 GPUs (marker gpu): NCCL and the
one-shot symmetric-memory collectives give one GPU's logits, and the CLI under torchrun its tokens."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import make_checkpoint
from conftest import random_ids
from helpers import max_rel_err
from ranks import as_torchrun_rank, run_ranks

from minidecode import LLM, UserError
from minidecode.distributed import OneShot
from minidecode.kernels import collectives, ops
from minidecode.kernels.reference import decode_attention_reference
from minidecode.models import sharding
from minidecode.models.cache import KVCache
from minidecode.models.config import ConfigError, ModelConfig
from minidecode.models.presets import PRESETS
from minidecode.models.sharding import shard_plan
from minidecode.validate import check_parallel

REPO = Path(__file__).resolve().parents[1]
MAX_POS = 256
TOL = 1e-4  # fp32: the ranks sum the row-split projections and the attention ranges in another order


# ---- the ranks: a worker per process, as torchrun would start it ---------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One rank: torchrun's environment, then the job; rank r's results saved to out/r.pt."""
    as_torchrun_rank(rank, world, port)
    job = job["per_rank"][rank] if "per_rank" in job else job
    try:
        result = run_job(job)
    except UserError as e:
        result = {"error": str(e)}
    torch.save(result, Path(out) / f"{rank}.pt")


def spawn(world: int, job: dict, tmp_path: Path, timeout: float = 300) -> list[dict]:
    """Run `job` on `world` ranks; -> each rank's result. Ranks still running after `timeout`
    seconds (a collective that never completes) are killed and the test fails."""
    args = (world, _free_port(), str(tmp_path), job)
    run_ranks(_rank_main, args, world, timeout)  # killed and failed after a deadline, not left to hang
    return [torch.load(tmp_path / f"{r}.pt") for r in range(world)]


def decode_logits(llm: LLM, prompt: list[int], steps: int) -> torch.Tensor:
    """float32 logits [steps, V] of a greedy run: the prefill's last position, then each decode
    step's, through the model's own prefill and decode (the engine's step without sampling)."""
    model, engine = llm.model, llm.engine
    with torch.inference_mode():
        # (+ 1: the spare position after the region, where a rank writes a token it does not hold)
        cfg, positions = model.config, model.cache_len(len(prompt) + steps) + 1
        layout = (cfg.num_layers, 1, cfg.num_kv_heads, positions, cfg.head_dim)
        cache = KVCache(*layout, engine.kv_dtype, llm.device)
        hidden = model.prefill(torch.tensor([prompt], device=llm.device), cache, engine.prefill_chunk)
        logits = [model.logits(hidden)]
        position = torch.tensor([len(prompt)], device=llm.device)
        for _ in range(steps - 1):
            token = logits[-1].argmax(-1)
            logits.append(model.logits(model.decode(token, position, cache)))
            position += 1
    return torch.cat(logits)


def draft_logits(llm: LLM, prompt: list[int], drafts: list[int], padding: int) -> torch.Tensor:
    """float32 logits [len(drafts), V] of one step with drafts after the prompt's prefill: the rows
    of `drafts` (the token after the prompt, then its drafts) through Transformer.decode_drafts,
    with `padding` more query rows that are not real (they write only the spare position)."""
    model, engine = llm.model, llm.engine
    q_len, Q = len(drafts), len(drafts) + padding
    with torch.inference_mode():
        cfg, positions = model.config, model.cache_len(len(prompt) + Q) + 1  # + 1: the spare position
        layout = (cfg.num_layers, 1, cfg.num_kv_heads, positions, cfg.head_dim)
        cache = KVCache(*layout, engine.kv_dtype, llm.device)
        model.prefill(torch.tensor([prompt], device=llm.device), cache, engine.prefill_chunk)
        tokens = torch.tensor([drafts + [0] * padding], device=llm.device)  # [1, Q]
        position = torch.tensor([len(prompt)], device=llm.device)
        q_lens = torch.tensor([q_len], dtype=torch.int32, device=llm.device)
        hidden = model.decode_drafts(tokens, position, q_lens, cache, positions - 1)  # [1, Q, hidden]
        return model.logits(hidden)[0, :q_len]


def run_job(job: dict) -> dict:
    """The job's generations and logits, every tensor on the CPU (ranks on different GPUs save
    theirs, and the test compares them with a reference computed on another)."""
    PRESETS.update(job.get("presets", {}))  # a test's random-weight shape (spawned ranks import afresh)
    if "cp_chunk" in job:  # a small model's short prompts dealt in small chunks (spawned ranks only)
        sharding.CP_CHUNK = job["cp_chunk"]
    llm = LLM(
        job["model"],
        device=job.get("device", "cpu"),
        dtype="float32",
        prefill_chunk=job.get("chunk"),
        tp=job.get("tp", 1),
        cp=job.get("cp", 1),
        kv_cache_dtype=job.get("kv", "auto"),
    )
    if llm.parallel is not None:
        llm.parallel.use_one_shot = job.get("one_shot", True)  # before the first step's graph
        if job.get("gloo_one_shot"):
            par = llm.parallel
            par.tp_one_shot = GlooOneShot(par.tp_group) if par.tp > 1 else None
            par.cp_one_shot = GlooOneShot(par.cp_group) if par.cp > 1 else None
    prompt, new = job["prompt"], job["new"]
    if llm.rank != 0:  # rank 0's plans (every step's tokens checked against rank 0's), until it closes
        result = {"plans": llm.serve_plans()}
    else:
        greedy = llm.generate(
            token_ids=prompt, max_new_tokens=new, temperature=0, logprobs=True, ignore_eos=True
        )
        result = {
            "tokens": greedy.token_ids,
            "logprobs": torch.tensor(greedy.logprobs),
            "scores": llm.logits(prompt + greedy.token_ids).cpu(),  # every position, in one prefill
        }
        if job.get("sample"):  # no seed given: the ranks must still draw the same tokens
            sampled = llm.generate(token_ids=prompt, max_new_tokens=new, temperature=1.0, ignore_eos=True)
            result["sampled"] = sampled.token_ids  # (an unseeded draw may sample the eos id: every step runs)
        if job.get("reuse"):  # the same prompt again (its K/V cached on every rank), then a batch
            again = llm.generate(token_ids=prompt, max_new_tokens=new, temperature=0, ignore_eos=True)
            result["again"] = (again.token_ids, again.stats.reused_tokens)
            batch = llm.generate([prompt, prompt[::-1]], max_new_tokens=new, temperature=0, ignore_eos=True)
            result["batch"] = [r.token_ids for r in batch]
        if job.get("speculate"):  # drafts by prompt lookup, verified in steps of several rows
            settings = dict(max_new_tokens=new, temperature=0, ignore_eos=True, speculate=job["speculate"])
            spec = llm.generate(token_ids=prompt, **settings)
            result["speculated"] = (spec.token_ids, spec.stats.accepted_tokens)
        llm.loop.close()  # the other ranks leave serve_plans
    result["steps"] = decode_logits(llm, prompt, new).cpu()  # the model's own passes, every rank in step
    if "drafts" in job:
        result["drafts"] = draft_logits(llm, prompt, job["drafts"], job.get("padding", 0)).cpu()
    if llm.parallel is not None:
        par = llm.parallel
        result["one_shot"] = par.use_one_shot and (par.tp_one_shot or par.cp_one_shot) is not None
        result["one_shot_problem"] = par.one_shot_problem
        if job.get("gloo_one_shot"):
            result["one_shot_calls"] = sum(o.calls for o in (par.tp_one_shot, par.cp_one_shot) if o)
            result["one_shot_norms"] = sum(o.norms for o in (par.tp_one_shot, par.cp_one_shot) if o)
    return result


class GlooOneShot(OneShot):
    """OneShot's place in the model on CPU ranks (the tp 2 residual fold, which collectives take it,
    the size limit), with its kernels (tests/test_collectives.py: the one-shot kernel, and the GEMV
    that sums in its launch) stood in for by the ops' twins and gloo's all-reduce and all-gather."""

    def __init__(self, group):
        self.group, self.size, self.rank, self.calls, self.norms = group, group.size(), group.rank(), 0, 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and collectives.fits(x)

    def can_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.shape[0] == 1 and collectives.fits_one_chunk(x) and weight.dtype == x.dtype

    def sum(self, x: torch.Tensor, out: torch.Tensor, norm=None) -> torch.Tensor:
        total = x.clone()
        torch.distributed.all_reduce(total, group=self.group)  # 2 ranks: the same sum on both
        self.calls += 1
        if norm is not None:  # the kernel's RMSNorm of the sum, by the twin
            weight, eps, normed = norm
            normed.copy_(ops.rms_norm(total, weight, eps, triton=False))
            self.norms += 1
        return out.copy_(total)

    def sum_of_linear(self, x, weight, bias, out, residual=None, norm=None, pdl=False) -> None:
        if residual is not None:
            ops.linear_residual(x, weight, bias, residual, triton=False)
        self.sum(residual if residual is not None else ops.linear(x, weight, bias, triton=False), out, norm)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(self.size, *x.shape)
        torch.distributed.all_gather(list(out.unbind(0)), x, group=self.group)
        self.calls += 1
        return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny fp32 checkpoints: qwen2 (q/k/v bias), llama with o_proj / down_proj bias, a GQA model
    of 8 query / 2 KV heads whose vocabulary (390) does not divide by 4, the FP8-cache one."""
    made = {}

    def get(name: str) -> str:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            if name == "gqa":
                made[name] = str(make_checkpoint(out, "llama-8q-2kv", max_positions=MAX_POS, vocab_size=390))
            else:
                made[name] = str(make_checkpoint(out, name, max_positions=MAX_POS))
            randomize_biases(Path(made[name]))
        return made[name]

    return get


def randomize_biases(model_dir: Path) -> None:
    """transformers initialises biases to zero, where a bias added twice (or to the wrong rows)
    would go unseen: give them random values."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=generator) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})


def check_ranks_match_one_process(results: list[dict], job: dict) -> None:
    split = ("tp", "cp", "cp_chunk", "sample", "one_shot", "gloo_one_shot")
    reference = run_job({k: v for k, v in job.items() if k not in split})
    for rank, result in enumerate(results):
        assert "error" not in result, result
        if rank:  # it ran rank 0's plans (its tokens agreed with rank 0's, or the loop had failed)
            assert result["plans"] > 0
        else:
            assert result["tokens"] == reference["tokens"], rank
        for key in ("logprobs", "steps", "scores", "drafts") if rank == 0 else ("steps", "drafts"):
            if key not in reference:
                continue
            err = max_rel_err(result[key], reference[key])
            assert err <= TOL, (rank, key, err)
    if "speculated" in results[0]:  # greedy with speculation: the tokens of greedy without it
        tokens, accepted = results[0]["speculated"]
        assert tokens == reference["tokens"] and accepted > 0, (tokens, reference["tokens"], accepted)
    if "sampled" in results[0]:  # drawn with the other ranks' plans, agreeing at every step
        assert len(results[0]["sampled"]) == job["new"]


# ---- tensor parallel -------------------------------------------------------------------------------


def test_prefix_reuse_and_a_batch_under_tensor_parallel(checkpoints, tmp_path):
    """Under tp 2 rank 0's scheduler plans for both ranks: the same prompt again reuses the cached
    positions of both ranks' KV heads, and a batch of two decodes together, each with one process's
    tokens."""
    job = dict(model=checkpoints("llama"), tp=2, prompt=random_ids(19, seed=6), new=6, reuse=True)
    results = spawn(2, job, tmp_path)
    check_ranks_match_one_process(results, job)
    reference = run_job(dict(job, tp=1))
    tokens, reused = results[0]["again"]
    assert tokens == reference["tokens"] and reused == len(job["prompt"]) - 1
    assert results[0]["batch"] == reference["batch"] and results[0]["batch"][0] == reference["tokens"]


@pytest.mark.parametrize("family", ["qwen2", "llama-bias"])
def test_tensor_parallel_2_ranks_match_one_process(checkpoints, tmp_path, family):
    """tp 2 on a model with 4 q / 2 KV heads: one KV head each; the q/k/v biases are split with
    their rows, the o_proj and down_proj biases added once after the all-reduce."""
    job = dict(model=checkpoints(family), tp=2, prompt=random_ids(23, seed=1), new=8, chunk=8, sample=True)
    check_ranks_match_one_process(spawn(2, job, tmp_path), job)


def test_tensor_parallel_4_ranks_replicate_kv_heads(checkpoints, tmp_path):
    """8 query / 2 KV heads on 4 ranks: each rank holds the one KV head its 2 query heads read
    (replicated on 2 ranks); the 390-row vocabulary is split 98 x 4 with 2 padding rows."""
    job = dict(model=checkpoints("gqa"), tp=4, prompt=random_ids(19, seed=2, vocab_size=390), new=6)
    check_ranks_match_one_process(spawn(4, job, tmp_path), job)


# A random-weight shape small enough for CPU ranks: q/k/v biases (split with their rows), a vocabulary
# (390) that tp 2 splits evenly but tp 4 pads, 8 query / 2 KV heads.
TINY_PRESET = {
    "tiny-qwen2": dict(
        model_type="qwen2", vocab_size=390, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=MAX_POS, qkv_bias=True,
    )
}  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4])
def test_synthetic_model_is_the_same_at_any_tp(tmp_path, tp, monkeypatch):
    """`synthetic:` draws each tensor in blocks of rows, each block from a generator seeded by
    (seed, tensor name, block): tp ranks that each draw their part hold the one-process model, so
    their logits and greedy tokens are one process's (4 ranks: KV heads replicated, vocabulary
    rows padded)."""
    monkeypatch.setitem(PRESETS, "tiny-qwen2", TINY_PRESET["tiny-qwen2"])  # for the reference here
    job = dict(
        model="synthetic:tiny-qwen2",
        presets=TINY_PRESET,
        tp=tp,
        prompt=random_ids(17, seed=7),
        new=6,
        chunk=8,
    )
    check_ranks_match_one_process(spawn(tp, job, tmp_path), job)


def test_random_weights_drawn_in_blocks_are_slices_of_the_whole(monkeypatch):
    """Each tensor-parallel rank's random weights are exactly its rows or columns of the whole
    tensor that one process draws, whatever the block size (small blocks: several per tensor, the
    rank's range starting and ending inside a block), with the lm_head's padding rows zero."""
    from minidecode import loading
    from minidecode.distributed import Parallel
    from minidecode.models.llama import Transformer
    from minidecode.models.parallel import ParallelTransformer
    from minidecode.models.presets import preset_config

    monkeypatch.setitem(PRESETS, "tiny-qwen2", TINY_PRESET["tiny-qwen2"])
    monkeypatch.setattr(loading, "RANDOM_BLOCK", 1000)
    cfg, cpu = preset_config("tiny-qwen2"), torch.device("cpu")
    with torch.device("meta"):
        whole = Transformer(cfg)
    loading.init_random_weights(whole, cpu, torch.float32)
    expected = dict(whole.named_parameters())
    assert expected["lm_head.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    for rank in range(4):
        with torch.device("meta"):
            model = ParallelTransformer(cfg, Parallel(4, 1, rank, cpu))
        loading.init_random_weights(model, cpu, torch.float32)
        for name, got in model.named_parameters():
            want = expected[name]
            if (part := model.shard(name)) is not None:
                dim, start, stop = part
                held = min(stop, want.shape[dim]) - start
                assert torch.equal(
                    got.narrow(dim, held, stop - start - held),
                    torch.zeros_like(got).narrow(dim, held, stop - start - held),
                )
                got, want = got.narrow(dim, 0, held), want.narrow(dim, start, held)
            assert torch.equal(got, want), (rank, name)


@pytest.mark.parametrize(
    "split", [dict(tp=2, family="llama-bias"), dict(cp=2, family="qwen2")], ids=["tp-fold", "cp-gather"]
)
def test_one_shot_paths_match_one_process(checkpoints, tmp_path, split):
    """The decode step's one-shot paths (GPU-only; here their kernel is gloo's all-reduce and
    all-gather): at tp 2 rank 0 adds the residual stream and the o_proj / down_proj biases to its
    partial sum, the sum lands in the residual and the next RMSNorm comes with it; the logits and
    the context-parallel partials are gathered. The ranks give one process's logits and tokens."""
    family = split.pop("family")
    job = dict(
        model=checkpoints(family), prompt=random_ids(21, seed=8), new=8, chunk=8, gloo_one_shot=True,
        cp_chunk=4, **split,
    )  # fmt: skip
    results = spawn(2, job, tmp_path)
    assert all(result.get("one_shot_calls", 0) > 0 for result in results)
    if "tp" in split:  # every all-reduce of a decode step brought its norm
        assert all(result["one_shot_norms"] > 0 for result in results)
    check_ranks_match_one_process(results, job)


# ---- context parallel ------------------------------------------------------------------------------


def test_context_parallel_2_ranks_match_one_process(checkpoints, tmp_path):
    """cp 2, a 21-token prompt dealt in chunks of 4: rank 0 positions 0-3, 12-19, rank 1 4-11, 20
    (two rounds, the second dealt back), prefilled in chunks of 4 rows (rank 0's 12 rows and rank
    1's 9 run the same units); 12 decode steps write positions 21.. where the dealing puts them,
    each merging both ranks' partials."""
    job = dict(
        model=checkpoints("llama"), cp=2, cp_chunk=4, prompt=random_ids(21, seed=3), new=12, chunk=4,
        sample=True,
    )  # fmt: skip
    check_ranks_match_one_process(spawn(2, job, tmp_path), job)


def test_prefix_reuse_and_a_batch_under_context_parallel(checkpoints, tmp_path):
    """Under cp 2 (chunks of 4) the same prompt again reuses every rank's share of its cached
    positions (each where the prompt's dealing put it), and a batch of two decodes together, each
    with one process's tokens."""
    job = dict(model=checkpoints("llama"), cp=2, cp_chunk=4, prompt=random_ids(19, seed=6), new=6, reuse=True)
    results = spawn(2, job, tmp_path)
    check_ranks_match_one_process(results, job)
    reference = run_job({k: v for k, v in job.items() if k not in ("cp", "cp_chunk")})
    tokens, reused = results[0]["again"]
    assert tokens == reference["tokens"] and reused == len(job["prompt"]) - 1
    assert results[0]["batch"] == reference["batch"] and results[0]["batch"][0] == reference["tokens"]


def test_context_parallel_verifies_drafts_across_ranks(checkpoints, tmp_path):
    """cp 2, chunks of 4, an 18-token prompt that repeats itself: a step with 5 real query rows
    and one padding row at positions 18-23 writes 18-19 on rank 0 and 20-22 on rank 1, and each
    row attends to both ranks' positions up to its own (row_limits), merged: the logits of one
    process's step. Then greedy generation with speculate 4 (drafts found in the prompt and the
    output, each step's 5 rows on both ranks) gives the tokens of greedy without speculation."""
    half = random_ids(9, seed=15)  # (in one process 20 drafts of 20 accepted, in 11 steps)
    job = dict(
        model=checkpoints("gqa"), cp=2, cp_chunk=4, prompt=half + half, new=32, chunk=4,
        drafts=random_ids(5, seed=12), padding=1, speculate=4,
    )  # fmt: skip
    check_ranks_match_one_process(spawn(2, job, tmp_path), job)


def test_context_parallel_3_ranks_odd_split(checkpoints, tmp_path):
    """cp 3, a 17-token prompt in chunks of 2: three rounds (ranks of 6, 6 and 5 rows); 16 decode
    steps, past the prompt's length, on every rank in turn."""
    job = dict(model=checkpoints("qwen2"), cp=3, cp_chunk=2, prompt=random_ids(17, seed=9), new=16, chunk=4)
    check_ranks_match_one_process(spawn(3, job, tmp_path), job)


def test_context_parallel_4_ranks_prompt_shorter_than_a_round(checkpoints, tmp_path):
    """cp 4, a 7-token prompt in chunks of 2, fewer positions than a round: rank 3 holds one row,
    and decode goes on into the next rounds, each step merging 4 partials."""
    job = dict(model=checkpoints("qwen2"), cp=4, cp_chunk=2, prompt=random_ids(7, seed=4), new=14, chunk=4)
    check_ranks_match_one_process(spawn(4, job, tmp_path), job)


def test_tensor_and_context_parallel_combined_fp8_cache(checkpoints, tmp_path):
    """tp 2 x cp 2 with an FP8 cache (chunks of 4): each rank holds one KV head over half the
    positions; its prefill quantizes its own rows after attending over the gathered unquantized
    K/V, like one process."""
    job = dict(
        model=checkpoints("llama"), tp=2, cp=2, cp_chunk=4, prompt=random_ids(12, seed=5), new=8, chunk=5,
        kv="fp8",
    )  # fmt: skip
    check_ranks_match_one_process(spawn(4, job, tmp_path), job)


# ---- the context-parallel merge, against float64 ------------------------------------------------


class KeepsPacked:
    """Stands in for a Parallel in ContextParallelAttention.merge: keeps the rank's packed part."""

    def all_gather_cp(self, x: torch.Tensor) -> torch.Tensor:
        self.packed = x
        return x[None]


# merge() also merges the one part KeepsPacked hands back: for the empty range every lse is -inf
# and that merge (discarded) is NaN, as the contract allows; the interpreter warns about it.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("triton", [False, True], ids=["twin", "lean"])
def test_context_parallel_merge_matches_float64(triton):
    """Attention over 4 disjoint ranges of a 300-position context (one range empty, and one
    sequence with no position in another: their outputs left as NaN like unwritten kernel
    outputs), each range's (o, lse) from decode_attention, packed by ContextParallelAttention
    (which sends an empty range as o 0, lse -inf) and merged by log-sum-exp (the Triton kernels
    with the lean kernel, PyTorch with the twin): the float64 attention over the whole context.
    The lean kernel's lse (segments split over several CTAs, so its merge store writes it too) is
    checked on the way."""
    from minidecode.models.parallel import ContextParallelAttention

    torch.manual_seed(0)
    B, Hq, Hkv, S, D = 2, 8, 2, 300, 64
    q, k, v = torch.randn(B, Hq, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    lengths = torch.tensor([300, 157])
    scale = D**-0.5
    exact = decode_attention_reference(q.double(), k.double(), v.double(), lengths, scale, torch.float64)
    bounds = [0, 120, 120, 250, 300]  # rank 1's range is empty; sequence 1 has nothing in rank 3's
    gathered = KeepsPacked()
    attend = ContextParallelAttention(gathered)
    parts = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        held = (lengths - lo).clamp(0, hi - lo).to(torch.int32)
        k_r, v_r = k[:, :, lo:hi].contiguous(), v[:, :, lo:hi].contiguous()
        if hi == lo:  # no positions at all
            o, lse = torch.full_like(q, float("nan")), torch.full((B, Hq), float("nan"))
        else:
            o, lse = ops.decode_attention(q, k_r, v_r, held, scale, triton=triton, return_lse=True)
            ref_o, ref_lse = decode_attention_reference(
                q.double(), k_r.double(), v_r.double(), held, scale, torch.float64, return_lse=True
            )
            valid = held > 0
            assert (lse[valid] - ref_lse[valid]).abs().max() < 1e-5
            o = torch.where(valid[:, None, None], o, float("nan"))  # what the kernel leaves unwritten
            lse = torch.where(valid[:, None], lse, float("nan"))
        attend.merge(o, lse, held, torch.float32, triton=triton)
        parts.append(gathered.packed)
    parts = torch.stack(parts)  # [4, B, Hq, D + 1]
    merged = ops.merge_ranks(parts, torch.float32, triton=triton)  # the kernel, or the twin
    assert merged.dtype == torch.float32 and max_rel_err(merged, exact) < 2e-6
    assert max_rel_err(ops.merge_partials(parts[..., :-1], parts[..., -1]), exact) < 2e-6


class RankPacks(KeepsPacked):
    """KeepsPacked as context-parallel rank `cp_rank` of `cp`."""

    def __init__(self, cp: int, cp_rank: int):
        self.cp, self.cp_rank = cp, cp_rank


# A query row that sees none of a rank's positions has lse -inf (log of 0), and padding rows none
# anywhere: their merge is 0 / 0, as in a step without drafts an idle row's; the interpreter warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
@pytest.mark.parametrize("triton", [False, True], ids=["twin", "lean"])
def test_context_parallel_step_with_drafts_matches_float64(triton):
    """A step with drafts over a context dealt to 2 ranks in chunks of 16 (rank 0 holds 0-15 and
    48-63): sequence 0's 5 query rows at positions 45-49 (padded to 6) and sequence 1's 3 at 14-16
    fall on both ranks (where rank 1 holds none of sequence 1's rows 14 and 15 see: limit 0). Each rank
    attends over the positions it holds with its row_limits (ContextParallelAttention.draft_slots:
    the multi-query lean kernel, or the twin), packs every query row and the parts are merged:
    each real row's float64 attention over the whole context up to its own position. A rank's
    written slots are where the dealing puts each position it holds."""
    from minidecode.kernels.reference import multi_query_attention_reference
    from minidecode.models.parallel import ContextParallelAttention

    torch.manual_seed(0)
    B, Q, Hq, Hkv, S, D, cp, chunk = 2, 6, 8, 2, 64, 64, 2, 16
    positions, q_lens = torch.tensor([45, 14]), torch.tensor([5, 3], dtype=torch.int32)
    q, k, v = torch.randn(B, Q, Hq, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    scale = D**-0.5
    context = positions + q_lens  # [B]: the new rows' K/V already in k and v
    exact = multi_query_attention_reference(
        q.double(), k.double(), v.double(), context, q_lens, scale, torch.float64
    )  # [B, Q, Hq, D]
    parts = []
    for rank in range(cp):
        mine = [p for p in range(S) if sharding.owner(p, cp, chunk)[0] == rank]
        slots = torch.tensor([sharding.owner(p, cp, chunk)[1] for p in mine])
        k_r, v_r = torch.zeros(B, Hkv, len(mine) + 1, D), torch.zeros(B, Hkv, len(mine) + 1, D)
        k_r[:, :, slots], v_r[:, :, slots] = k[:, :, mine], v[:, :, mine]  # its positions, in order
        gathered = RankPacks(cp, rank)
        attend = ContextParallelAttention(gathered, chunk)
        spare = len(mine)
        written, lengths, limits = attend.draft_slots(positions, q_lens, Q, spare)
        for b in range(B):
            for j in range(Q):
                p = int(positions[b]) + j
                held_here = j < q_lens[b] and sharding.owner(p, cp, chunk)[0] == rank
                assert written[b, j] == (sharding.owner(p, cp, chunk)[1] if held_here else spare)
        attend(q, k_r, v_r, lengths, scale, q_lens=q_lens, row_limits=limits, triton=triton)
        parts.append(gathered.packed)
    merged = ops.merge_ranks(torch.stack(parts), torch.float32, triton=triton).view(B, Q, Hq, D)
    for b in range(B):
        assert max_rel_err(merged[b, : q_lens[b]], exact[b, : q_lens[b]]) < 2e-6


# ---- errors ------------------------------------------------------------------------------------------


def config(heads: int, kv_heads: int, intermediate: int = 128) -> ModelConfig:
    return ModelConfig("llama", 384, 64, intermediate, 2, heads, kv_heads, 16, MAX_POS)


def test_shard_plan_splits_heads_and_refuses_what_does_not_split():
    plans = [shard_plan(config(8, 2), 4, r) for r in range(4)]
    assert [(p.q_lo, p.q_hi, p.kv_lo, p.kv_hi) for p in plans] == [
        (0, 2, 0, 1),
        (2, 4, 0, 1),
        (4, 6, 1, 2),
        (6, 8, 1, 2),
    ]
    assert [(p.q_lo, p.kv_lo, p.kv_hi) for p in (shard_plan(config(8, 4), 2, r) for r in range(2))] == [
        (0, 0, 2),
        (4, 2, 4),
    ]
    with pytest.raises(
        ConfigError, match=r"^--tp 3 does not split .* 8 query / 2 KV heads.*use --tp 1 or 2 or 4 or 8$"
    ):
        shard_plan(config(8, 2), 3, 0)
    with pytest.raises(ConfigError, match="12 query / 6 KV heads"):  # 3 q heads a rank: 2 KV groups, unevenly
        shard_plan(config(12, 6), 4, 0)
    with pytest.raises(ConfigError, match="intermediate size 100"):
        shard_plan(config(8, 2, intermediate=100), 8, 0)


def test_launch_errors():
    assert check_parallel(1, 1, None) == 1 and check_parallel(2, 2, 4) == 4
    with pytest.raises(
        UserError, match=r"runs 2 processes .*`torchrun --nproc-per-node 2 .*WORLD_SIZE is not set"
    ):
        check_parallel(2, 1, None)
    with pytest.raises(UserError, match="torchrun started 2 processes but --tp 4 x --cp 1 needs 4"):
        check_parallel(4, 1, 2)
    with pytest.raises(UserError, match="torchrun started 2 processes but --tp 1 x --cp 1 needs 1"):
        check_parallel(1, 1, 2)
    with pytest.raises(UserError, match="cp must be >= 1"):
        check_parallel(2, 0, 2)


def test_ranks_started_differently_are_refused(checkpoints, tmp_path):
    """Rank 0 asks for tp 2, rank 1 for cp 2 (same world size): both refuse, naming the difference."""
    job = dict(model=checkpoints("llama"), prompt=[1, 2, 3], new=2)
    results = spawn(2, {"per_rank": [dict(job, tp=2), dict(job, cp=2)]}, tmp_path)
    for result in results:
        assert result == {
            "error": "the ranks were started differently: tp 2 on rank 0 but 1, cp 1 on rank 0 "
            "but 2 on rank 1"
        }


def run_cli(args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run a command in a session of its own: past `timeout` seconds it is killed with everything it
    started (torchrun's ranks), and the test fails."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("WORLD_SIZE", None)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen(args, env=env, start_new_session=True, **pipes, **kw) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            pytest.fail(f"{' '.join(args[:6])} ... did not finish within {timeout:.0f} s")
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def test_cli_without_torchrun_is_one_error_line():
    proc = run_cli([sys.executable, "-m", "minidecode_cli.cli", "generate", "--prompt", "x", "--tp", "2"])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --tp 2 --cp 1 runs 2 processes")


def test_cli_wrong_world_size_fails_every_rank_with_one_line():
    """torchrun with 2 processes, --tp 4: rank 0 prints one error line, rank 1 nothing; both exit 2
    (torchrun then reports the failed ranks itself)."""
    proc = run_cli(
        [
            "torchrun",
            "--nproc-per-node",
            "2",
            "-m",
            "minidecode_cli.cli",
            "generate",
            "--prompt",
            "x",
            "--tp",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and errors[0].endswith(
        "error: torchrun started 2 processes but --tp 4 x --cp 1 needs 4: "
        "give --nproc-per-node 4, or --tp / --cp whose product is 2"
    )


def test_readme_torchrun_command(tmp_path):
    """The README's CPU torchrun command, exactly as written (2 gloo ranks, the shipped model): the
    text once (rank 0 prints), the same as one process's."""
    block = (REPO / "README.md").read_text().split("## Several GPUs", 1)[1].split("```", 2)[1]
    prefix = "torchrun --nproc-per-node 2 -m minidecode generate"
    (command,) = [line for line in block.splitlines() if line.startswith(prefix)]
    proc = run_cli(["bash", "-c", command], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    one = command.removeprefix("torchrun --nproc-per-node 2 -m minidecode").replace(" --tp 2", "")
    single = run_cli(["bash", "-c", "minidecode" + one], cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    assert proc.stdout == single.stdout and len(proc.stdout.strip()) > 10
    assert proc.stderr.count("[length] prompt") == 1


# ---- two GPUs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    """A tiny fp32 llama with head_dim 64 (the lean kernel's) and random q/k/v, o_proj and
    down_proj biases: rank 0 of a one-shot tp 2 sum adds the row-split projections' bias."""
    from checkpoints import GPU_FAMILIES

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    family = {"model_type": "llama", "head_dim": 64, "attention_bias": True, "mlp_bias": True}
    GPU_FAMILIES.setdefault("gpu-llama-bias-hd64", family)
    model = make_checkpoint(
        tmp_path_factory.mktemp("gpu-model"), "gpu-llama-bias-hd64", max_positions=MAX_POS
    )
    randomize_biases(model)
    return str(model)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "split",
    [{"tp": 2}, {"tp": 2, "one_shot": False}, {"cp": 2}],
    ids=["tp-one-shot", "tp-nccl", "cp-one-shot"],
)
def test_two_gpus_match_one(tmp_path, gpu_checkpoint, split):
    """The lean kernel and the CUDA-graph decode step with its collectives captured, through the
    one-shot symmetric-memory kernels (which must be set up on 2 GPUs of one host) or NCCL: 2 GPUs
    give one GPU's greedy tokens and logits (fp32). cp: a 20-token prompt dealt in 4 chunks of 5,
    then 24 decode steps round robin, each merging both ranks' partials."""
    job = dict(
        model=gpu_checkpoint, device="cuda", prompt=random_ids(20, seed=6), new=24, sample=True, **split
    )
    results = spawn(2, job, tmp_path, timeout=150)
    for result in results:
        wanted = split.get("one_shot", True)
        assert "error" in result or result["one_shot"] == wanted, result["one_shot_problem"]
    check_ranks_match_one_process(results, job)


GPU_CLI_ARGS = [
    "--prompt",
    "def fibonacci(n):",
    "-n",
    "24",
    "--temperature",
    "0",
    "--dtype",
    "float32",
    "--json",
]


@pytest.fixture(scope="module")
def one_gpu_cli_result(gpu_checkpoint) -> dict:
    """`generate --json` on one GPU: the result the torchrun launches must give."""
    one = run_cli([sys.executable, "-m", "minidecode_cli.cli", "generate", gpu_checkpoint, *GPU_CLI_ARGS])
    assert one.returncode == 0, one.stderr[-3000:]
    return json.loads(one.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["--tp", "--cp"])
def test_cli_under_torchrun_on_two_gpus_gives_one_gpus_tokens(gpu_checkpoint, one_gpu_cli_result, split):
    """`torchrun --nproc-per-node 2 ... generate --tp 2` (and --cp 2) on a checkpoint: rank 0 prints
    the JSON result once, with one GPU's greedy tokens."""
    launch = [
        "torchrun",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        "-m",
        "minidecode_cli.cli",
    ]
    two = run_cli([*launch, "generate", gpu_checkpoint, *GPU_CLI_ARGS, split, "2"], timeout=150)
    assert two.returncode == 0, two.stderr[-3000:]
    (result,) = [json.loads(line) for line in two.stdout.splitlines() if line.startswith("{")]
    expected = one_gpu_cli_result
    assert len(expected["token_ids"]) >= 8  # up to 24: the model's eos may end it (not seen on the CPU)
    assert result["token_ids"] == expected["token_ids"]
    assert result["text"] == expected["text"]


def test_info_plans_each_gpu():
    """`info --tp 4` on Llama-3-70B shapes: one GPU's weights (a quarter of every layer's
    projections, the whole embedding, a quarter of the lm_head's 128,256 rows, rounded up) and
    KV cache (2 of the 8 KV heads), counted here from the published shape; `--cp 4` holds a
    quarter of the positions."""
    from minidecode.info import describe

    h, inter, layers, vocab, d = 8192, 28672, 80, 128256, 128
    per_layer = h * d * (16 + 2 + 2 + 16) + 3 * h * inter // 4 + 2 * h  # q, k, v, o; MLP; norms
    weights = layers * per_layer + vocab * h + 32064 * h + h
    plan = describe("synthetic:llama-3-70b", context=524288, dtype="bf16", device="cpu", tp=4)
    assert f"weights {weights * 2 / 2**30:.2f} GiB" in plan
    kv = 524288 * 2 * layers * 2 * d * 2  # positions x (K, V) x layers x 2 KV heads x D x bf16
    assert f"KV cache {kv / 2**30:.2f} GiB in bfloat16 (80 KiB/token)" in plan
    assert "per GPU" in plan and "16 q / 2 kv heads" in plan
    plan = describe("synthetic:llama-3-70b", context=524288, dtype="bf16", device="cpu", cp=4)
    assert (
        f"KV cache {131072 * 320 * 1024 / 2**30:.2f} GiB" in plan and "131,072 cache positions" in plan
    )
    assert "context parallel pays at long contexts" in plan  # where it helps, measured
    assert "context parallel" not in describe("synthetic:llama-3-70b", context=4096, device="cpu", tp=4)


def _summed_rank_main(rank: int, world: int, port: int, out: str) -> None:
    """A row-split projection summed in its GEMV's launch (ops.linear_summed through OneShot), on
    2 GPUs in bf16, with bf16 and FP8 weights: against the same product then the one-shot kernel
    (equal bits), and against the float32 sum of the ranks' products, eager and replayed 20 times
    in a CUDA graph of 32 chained calls with PDL (ordering between ranks and launches shows only on
    GPUs). Rank 0 folds the residual stream and the bias in, as models/parallel.py does."""
    from minidecode.distributed import init_parallel
    from minidecode.kernels.fp8_weights import FP8Weight, quantize_weight

    as_torchrun_rank(rank, world, port)
    par = init_parallel(2, 1, None)
    dev, errors = par.device, []
    gen = torch.Generator().manual_seed(100 + rank)  # each rank's columns of x and the weight
    shared = torch.Generator().manual_seed(99)  # the residual stream, bias and norm every rank has
    for fp8 in (False, True):
        x = torch.randn(1, 2048, generator=gen).to(dev, torch.bfloat16)
        w = torch.randn(4096, 2048, generator=gen) / 45
        weight = (
            FP8Weight(*(t.to(dev) for t in quantize_weight(w)), 1, 2048) if fp8 else w.to(dev, torch.bfloat16)
        )
        bias = torch.randn(4096, generator=shared).to(dev, torch.bfloat16)
        h = torch.randn(1, 4096, generator=shared).to(dev, torch.bfloat16)
        norm_w = (1 + torch.randn(4096, generator=shared)).to(dev, torch.bfloat16)
        name = "fp8 weights" if fp8 else "bf16 weights"
        errors += _check_summed(
            par.tp_one_shot, rank, x, weight, bias if rank == 0 else None, h, norm_w, name
        )
    torch.cuda.synchronize()
    torch.save(errors, Path(out) / f"{rank}.pt")


def _check_summed(shot, rank, x, weight, bias, h, norm_w, name) -> list[str]:
    def summed(residual, normed):
        fold = residual if rank == 0 else None
        shot.sum_of_linear(x, weight, bias, residual, fold, (norm_w, 1e-5, normed), pdl=True)

    def apart(residual, normed):  # the product, then the one-shot kernel
        if rank == 0:
            ops.linear_residual(x, weight, bias, residual, pdl=True)
        part = residual if rank == 0 else ops.linear(x, weight, None, pdl=True)
        shot.sum(part, residual, (norm_w, 1e-5, normed))

    part = h.clone()
    if rank == 0:
        ops.linear_residual(x, weight, bias, part)
    else:
        part = ops.linear(x, weight, None)
    want = shot.gather(part).float().sum(0).to(torch.bfloat16)  # rank order, float32
    got = {}
    for way, fn in (("in the GEMV", summed), ("apart", apart)):
        residual, normed = h.clone(), torch.empty_like(h)
        fn(residual, normed)
        got[way] = (residual, normed)
    errors = []
    if not torch.equal(got["in the GEMV"][0], want):
        errors.append(f"{name}: the sum differs from the float32 sum of the ranks' products")
    if not all(torch.equal(a, b) for a, b in zip(got["in the GEMV"], got["apart"], strict=True)):
        errors.append(f"{name}: in the GEMV's launch and apart differ")
    # 32 chained calls in a graph, each on its own row of the residual stream, replayed
    rows, normed = h.repeat(32, 1), torch.empty(32, 1, h.shape[1], dtype=h.dtype, device=h.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        summed(h.clone(), torch.empty_like(h))  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(32):
            summed(rows[i : i + 1], normed[i])
    for _ in range(20):
        rows.copy_(h.expand(32, -1))
        graph.replay()
        same_norm = torch.equal(normed, got["apart"][1].expand(32, 1, -1))
        if not (torch.equal(rows, want.expand(32, -1)) and same_norm):
            errors.append(f"{name}: a graph replay differs")
            break
    return errors


@pytest.mark.gpu
def test_two_gpus_projection_summed_in_its_gemv_launch(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(_summed_rank_main, (2, _free_port(), str(tmp_path)), 2, timeout=150)
    assert [torch.load(tmp_path / f"{r}.pt") for r in range(2)] == [[], []]

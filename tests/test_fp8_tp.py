"""FP8 weights under tensor parallelism, on CPU processes (gloo), spawned as torchrun would start
them and killed after a deadline: quantize-on-load, per-channel and block-scaled FP8 checkpoints
and a random-weight model under tp 2 (and tp 4 with replicated KV heads) give one process's FP8
tokens; every rank holds exactly its rows or columns of one process's e4m3 values and scales; a
split that would cut a scale block is refused with one line; the CLI under torchrun prints one
process's FP8 text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from checkpoints import make_checkpoint
from conftest import random_ids
from ranks import as_torchrun_rank, run_ranks
from test_distributed import MAX_POS, GlooOneShot, _free_port, randomize_biases, run_cli
from test_fp8_weights import FORMATS, build_fp8_checkpoint

from minidecode import LLM, UserError
from minidecode.info import describe
from minidecode.loading import read_config, weight_plan
from minidecode.memory import gib
from minidecode.models.llama import FP8Linear, weight_bytes
from minidecode.models.presets import PRESETS

E4M3 = torch.float8_e4m3fn
# Block scales of 16 x 32 with input groups of 32 (the tiny models: q 64 rows, k/v 32, MLP 128,
# hidden 64, vocabulary 384): tp 2 splits every layer on block boundaries (k/v at row 16, o_proj at
# column 32, the lm_head, quantized too, at row 192).
BLOCK_FORMAT = dict(
    family="llama-bias", method="compressed-tensors", weights="block", block=(16, 32), acts="group", group=32,
    scale_dtype=torch.float32, ignore=[],
)  # fmt: skip
# The per-channel compressed-tensors format of tests/test_fp8_weights.py (inputs per token, layer 1's
# MLP left in float32).
CHANNEL_FORMAT = dict(
    family="llama-bias", method="compressed-tensors", weights="channel", acts="token",
    scale_dtype=torch.bfloat16, ignore=["lm_head", "re:model\\.layers\\.1\\.mlp\\..*"],
)  # fmt: skip
CHECKPOINT_FORMATS = {"channel": CHANNEL_FORMAT, "block": BLOCK_FORMAT}
CHECKPOINT_FORMATS["tensor-static"] = FORMATS["ct-tensor-static"]
# 48-row blocks: tp 2 splits q_proj's 64 rows at row 32, inside the first block.
CUT_FORMAT = dict(family="llama", method="compressed-tensors", weights="block", block=(48, 32), acts="token")
TINY_FP8 = {
    "tiny-fp8": dict(
        model_type="llama", vocab_size=390, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=MAX_POS,
    )
}  # fmt: skip


def _rank_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One rank: torchrun's environment, then the job; its result saved to out/rank.pt."""
    as_torchrun_rank(rank, world, port)
    try:
        result = run_job(job)
    except UserError as e:
        result = {"error": str(e)}
    torch.save(result, Path(out) / f"{rank}.pt")


def run_job(job: dict) -> dict:
    """Rank 0's greedy tokens and logits (the others run its plans), and every rank's FP8
    parameters with the part of the checkpoint tensor each one holds."""
    PRESETS.update(job.get("presets", {}))
    llm = LLM(
        job["model"], device="cpu", dtype="float32", prefill_chunk=8, tp=job.get("tp", 1),
        quantization=job.get("quantization"),
    )  # fmt: skip
    if job.get("gloo_one_shot"):  # the decode step's one-shot sums (an FP8 GEMV's), gloo standing in
        llm.parallel.tp_one_shot = GlooOneShot(llm.parallel.tp_group)
    model, prompt, new = llm.model, job["prompt"], job["new"]
    result = {"fp8": {}, "weight_bytes": weight_bytes(model)}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            for param, p in module.named_parameters(prefix=name):
                shard = getattr(model, "shard", lambda _: None)(param)
                result["fp8"][param] = (p.detach().clone(), shard)
    if llm.rank == 0:
        greedy = llm.generate(token_ids=prompt, max_new_tokens=new, temperature=0, ignore_eos=True)
        result["tokens"] = greedy.token_ids
        result["logits"] = llm.logits(prompt + greedy.token_ids)
        if llm.parallel is not None:
            llm.loop.close()  # the other ranks leave serve_plans
    else:
        result["plans"] = llm.serve_plans()
    if job.get("gloo_one_shot"):
        result["one_shot_calls"] = llm.parallel.tp_one_shot.calls
    return result


def spawn(world: int, job: dict, tmp_path: Path, timeout: float = 240) -> list[dict]:
    run_ranks(_rank_main, (world, _free_port(), str(tmp_path), job), world, timeout)
    return [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(world)]


def check_one_process(results: list[dict], job: dict, exact: bool) -> dict:
    """Every rank's FP8 values and scales are its part of one process's, bit for bit, and rank 0's
    greedy tokens are one process's. exact: the ranks round every layer's input as one process
    does (block checkpoints' input groups): logits within float32 summation order. Else (inputs
    rounded per token, over each rank's columns of o_proj / down_proj) the logits differ by that
    rounding, and a step where one process's top two logits are closer than twice the difference
    may pick either (none does in these runs before the last steps); -> the one-process result."""
    reference = run_job({k: v for k, v in job.items() if k not in ("tp", "gloo_one_shot")})
    assert reference["fp8"], "no FP8 layers"
    for rank, result in enumerate(results):
        assert "error" not in result, result
        assert result["fp8"].keys() == reference["fp8"].keys()
        for name, (got, part) in result["fp8"].items():
            want = reference["fp8"][name][0]
            if (
                part is None and got.shape != want.shape
            ):  # a per-tensor scale, held per row: the weight's rows
                part = result["fp8"][f"{name.rpartition('.')[0]}.weight"][1]
            if part is not None:
                dim, start, stop = part
                want = want.narrow(dim, start, stop - start)
            assert got.dtype == want.dtype and got.shape == want.shape, (rank, name)
            if got.dtype == E4M3:  # compared as bytes (no float8 equality on the CPU)
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(got, want), (rank, name)
        if rank:
            assert result["plans"] > 0
    prompt, new = len(job["prompt"]), job["new"]
    ours, ref = results[0]["logits"], reference["logits"]  # [prompt + new, V]
    diff = (ours[:prompt] - ref[:prompt]).abs().max().item()  # the same tokens: the prompt's positions
    err = diff / ref[:prompt].abs().max().item()
    top2 = ref[prompt - 1 : -1].topk(2, dim=-1).values  # [new, 2]: one process's each step
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    print(f"tp {job['tp']}: logits vs one process {err:.1e}; top-2 gaps {[round(g, 4) for g in gaps]}")
    assert err <= (1e-4 if exact else 5e-2), err
    near_tie = new if exact else next((i for i, g in enumerate(gaps) if g < 2 * diff), new)
    assert near_tie >= new // 2 and results[0]["tokens"][:near_tie] == reference["tokens"][:near_tie]
    return reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny fp32 Llama with random o_proj / down_proj biases (added once, after the sum)."""
    path = make_checkpoint(tmp_path_factory.mktemp("fp8-tp"), "llama-bias", max_positions=MAX_POS)
    randomize_biases(path)
    return path


@pytest.fixture(scope="module")
def fp8_dir(model_dir, tmp_path_factory):
    """fp8_dir(name, format) -> that FP8 checkpoint of model_dir's weights (made once)."""
    made = {}

    def build(name: str, fmt: dict) -> str:
        if name not in made:
            made[name] = str(build_fp8_checkpoint(model_dir, tmp_path_factory.mktemp(name), name, fmt)[0])
        return made[name]

    return build


def test_quantize_on_load_under_tp_2_is_one_process(model_dir, tmp_path):
    """--quantization fp8 under tp 2: q/k/v and gate/up rows keep their per-channel scales, o_proj and
    down_proj columns take the scales of the whole rows (read from the checkpoint), so each rank
    holds one process's e4m3 values; the decode step's one-shot sums run the FP8 GEMVs' partial
    sums. Each rank rounds its o_proj / down_proj input per token over its own columns: the logits
    differ from one process's by that rounding, the greedy tokens do not."""
    job = dict(model=str(model_dir), quantization="fp8", tp=2, prompt=random_ids(21, seed=3), new=8)
    results = spawn(2, dict(job, gloo_one_shot=True), tmp_path)
    check_one_process(results, dict(job, gloo_one_shot=True), exact=False)
    assert results[0]["one_shot_calls"] > 0
    rank_bytes = results[0]["weight_bytes"]  # what `info --tp 2` plans for each GPU
    assert rank_bytes == weight_plan(read_config(model_dir), torch.float32, "fp8", tp=2)[0]
    plan = describe(str(model_dir), device="cpu", dtype="float32", tp=2, quantization="fp8")
    assert f"weights {gib(rank_bytes)} + KV cache" in plan and "(per GPU)" in plan


@pytest.mark.parametrize("name", ["channel", "block", "tensor-static"])
def test_fp8_checkpoint_under_tp_2_is_one_process(fp8_dir, tmp_path, name):
    """A per-channel checkpoint (a layer's MLP left in float32) splits its scales with the rows; a
    block-scaled one splits its [rows / 16, columns / 32] scales on block boundaries, its input
    groups of 32 columns whole on each rank; a per-tensor one with static input scales keeps them
    whole. The last two round every input as one process does: their logits agree to float32
    summation order."""
    job = dict(model=fp8_dir(name, CHECKPOINT_FORMATS[name]), tp=2, prompt=random_ids(21, seed=4), new=8)
    check_one_process(spawn(2, job, tmp_path), job, exact=name != "channel")


def test_random_fp8_weights_with_replicated_kv_heads_under_tp_4(tmp_path, monkeypatch):
    """A synthetic model with --quantization fp8 on 4 ranks (8 query / 2 KV heads: each KV head on
    2 ranks; a vocabulary of 390 padded to 4 x 98): each rank's e4m3 weights are one process's."""
    monkeypatch.setitem(PRESETS, "tiny-fp8", TINY_FP8["tiny-fp8"])  # for the reference here
    job = dict(
        model="synthetic:tiny-fp8", presets=TINY_FP8, quantization="fp8", tp=4,
        prompt=random_ids(13, seed=5, vocab_size=390), new=5,
    )  # fmt: skip
    check_one_process(spawn(4, job, tmp_path), job, exact=False)


def test_a_split_inside_a_scale_block_is_refused_in_one_line(fp8_dir, tmp_path):
    """48-row blocks: tp 2 would split q_proj inside a block. Every rank refuses (under torchrun:
    one error line), naming the split and the tp that works."""
    model = fp8_dir("cut", CUT_FORMAT)
    message = (
        "--tp 2 splits model.layers.0.self_attn.q_proj's FP8 weights at row 32, inside a weight block "
        "of 48 rows (fp8_e4m3 block 48x32 W8A8-dynamic per token); use --tp 1"
    )
    with pytest.raises(UserError) as refused:
        weight_plan(read_config(Path(model)), torch.float32, tp=2)  # `minidecode info --tp 2`'s plan
    assert str(refused.value) == message
    launch = ["torchrun", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    args = ["-m", "minidecode_cli.cli", "generate", model, "--prompt", "x", "--tp", "2", "--device", "cpu"]
    proc = run_cli([*launch, *args])
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and errors[0].endswith(f"error: {message}"), errors


def test_cli_under_torchrun_prints_one_process_fp8_text(fp8_dir, tmp_path):
    """`torchrun ... generate CHECKPOINT --tp 2` of the block-scaled checkpoint: one process's text,
    printed once."""
    common = ["generate", fp8_dir("block", BLOCK_FORMAT), "--prompt", "def fibonacci(n):", "-n", "16"]
    common += ["--temperature", "0", "--device", "cpu", "--dtype", "float32"]
    launch = ["torchrun", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    ranks = run_cli([*launch, "-m", "minidecode_cli.cli", *common, "--tp", "2"], cwd=tmp_path)
    single = run_cli([sys.executable, "-m", "minidecode_cli.cli", *common], cwd=tmp_path)
    assert ranks.returncode == 0 and single.returncode == 0, ranks.stderr + single.stderr
    assert ranks.stdout == single.stdout and len(single.stdout.strip()) > 10
    assert ranks.stderr.count("[length] prompt") == 1  # rank 0's stats line only

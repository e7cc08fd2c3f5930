"""FP8 KV cache on a long context: accuracy against the bf16 cache, and (--fill) decode speed.

Accuracy (default): synthetic llama-3-8b, one random prompt of --context tokens prefilled twice,
once into a bf16 cache and once into an FP8 cache (prefill attends over the unquantized prompt in
both). The bf16 run decodes --steps greedy tokens; the FP8 run is fed the same tokens
(teacher-forced), so each step's logits are compared on the same history: KL(bf16 || fp8) of
the step's distribution (mean, max) and top-1 agreement.

    python bench/fp8_accuracy.py                     # 131,072 tokens, 64 steps (~1-2 min, H200)

Decode speed with --fill (CLEARLY NOT A GENERATION: no prefill runs): the cache is filled with
random finite values up to --context positions, then 3 windows of --steps decode steps (CUDA
graph replays, as in generation) are timed from that context: median (min-max) tok/s. Tokens are
meaningless; only the speed is real (--quantization fp8: with FP8 weights):

    python bench/fp8_accuracy.py --fill --context 1048576 --kv-cache-dtype fp8
    python bench/fp8_accuracy.py --fill --context 524288 --kv-cache-dtype fp8 --quantization fp8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from timing import start_filled  # bench/timing.py (run as a script: bench/ is on the import path)

from minidecode import LLM
from minidecode.cache import kv_dtype_name
from minidecode.models.cache import FP8, KVCache
from minidecode.models.llama import weights_description
from minidecode.plan import DecodeKind
from minidecode.sampling import GREEDY

WINDOWS = 3  # --fill: timed windows of --steps decode steps each


@torch.inference_mode()
def step_logits(llm: LLM, cache: KVCache, prompt: list[int], feed: list[int] | None, steps: int):
    """Prefill `prompt` into `cache`, then `steps` eager decode steps fed greedily (feed None) or
    with `feed`: the float32 logits [steps, V] of the decode steps and the tokens fed."""
    model, device = llm.model, llm.device
    hidden = model.prefill(torch.tensor([prompt], device=device), cache, 8192)
    token = int(model.logits(hidden)[0].argmax())
    logits, fed = [], []
    for i in range(steps):
        token = token if feed is None else feed[i]
        fed.append(token)
        positions = torch.tensor([len(prompt) + i], device=device)
        out = model.logits(model.decode(torch.tensor([token], device=device), positions, cache))[0]
        logits.append(out)
        token = int(out.argmax())
    return torch.stack(logits), fed


def accuracy(llm: LLM, context: int, steps: int) -> None:
    cfg, device = llm.config, llm.device
    prompt = llm.random_prompt(context, seed=0)
    rows = {}
    for kv_dtype in (torch.bfloat16, FP8):
        cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, context + steps, cfg.head_dim, kv_dtype, device)
        t0 = time.perf_counter()
        feed = None if kv_dtype == torch.bfloat16 else rows[torch.bfloat16][1]
        rows[kv_dtype] = step_logits(llm, cache, prompt, feed, steps)
        print(f"{kv_dtype_name(kv_dtype)}: prefill + {steps} steps in {time.perf_counter() - t0:.1f} s")
        del cache
        torch.cuda.empty_cache()
    ref, fp8 = rows[torch.bfloat16][0].double(), rows[FP8][0].double()
    log_p, log_q = ref.log_softmax(-1), fp8.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [steps] nats
    agree = (ref.argmax(-1) == fp8.argmax(-1)).double().mean().item()
    print(
        f"\nFP8 vs bf16 KV cache, {llm.name}, {context:,}-token prompt, {steps} teacher-forced decode steps"
    )
    print("| context | steps | KL mean (nats) | KL max (nats) | top-1 agreement |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {context:,} | {steps} | {kl.mean().item():.2e} | {kl.max().item():.2e} | {100 * agree:.1f}% |")


@torch.inference_mode()
def fill_speed(llm: LLM, context: int, steps: int) -> None:
    """Decode tok/s at `context` with a cache FILLED WITH RANDOM VALUES (no prefill)."""
    engine = llm.engine
    llm.release_cache()
    cache = start_filled(engine, context, WINDOWS * steps + 8)
    if cache.dtype == FP8:
        for t in (cache.k, cache.v):
            t.view(torch.uint8).random_(0, 0x7E)  # finite positive e4m3 values (0x7F is NaN)
        cache.kv_scale.fill_(0.01)
    else:
        cache.k.normal_()
        cache.v.normal_()
    for _ in range(4):  # warm-up replays
        engine.step(1, DecodeKind(GREEDY))
    rates = []
    for _ in range(WINDOWS):  # the context grows by `steps` a window; its spread is the run's noise
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step(1, DecodeKind(GREEDY))
        torch.cuda.synchronize()
        rates.append(steps / (time.perf_counter() - t0))
    rates.sort()
    kv = context * engine.planner.kv_bytes_per_token / 2**30
    llm.release_cache()
    print(f"\nFILLED CACHE (random values, no prefill): decode speed only, {llm.name}, weights "
          f"{weights_description(llm.model)}")  # fmt: skip
    print("| context | KV cache | KV GiB | steps | decode tok/s | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| {context:,} | {kv_dtype_name(cache.dtype)} | {kv:.1f} | {WINDOWS} x {steps} | "
        f"{statistics.median(rates):.1f} ({rates[0]:.1f}-{rates[-1]:.1f}) n={WINDOWS} | "
        f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="synthetic:llama-3-8b")
    parser.add_argument("--context", type=int, default=131072, help="prompt (or filled) tokens")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--fill", action="store_true", help="speed only: fill the cache, no prefill")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"], help="with --fill")
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="with --fill: FP8 weights")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.fill:
        llm = LLM(
            args.model, device="cuda", dtype="bfloat16", kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
        )  # fmt: skip
        fill_speed(llm, args.context, args.steps)
    else:
        accuracy(LLM(args.model, device="cuda", dtype="bfloat16"), args.context, args.steps)


if __name__ == "__main__":
    main()

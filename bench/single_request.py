"""One request at a time through the public API: time to first token, prefill and decode speed at
each prompt length, as a JSON line per request. It uses only what every minidecode version's API
has (LLM, generate, result.stats), so an A/B of two commits runs it under each in turn, in one
session on one card (bench/gpu_run.sh, stage `ab`).

Usage: python bench/single_request.py [--model synthetic:llama-3-8b] [--lengths 1024 131072]
"""

from __future__ import annotations

import argparse
import json

import torch

from minidecode import LLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:llama-3-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 131072])
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="requests per length up to 32k (one above)")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    llm = LLM(args.model)
    context = max(args.lengths) + args.new
    gen = torch.Generator().manual_seed(0)

    def ask(length: int) -> dict:
        ids = torch.randint(3, llm.config.vocab_size, (length,), generator=gen).tolist()
        stats = llm.generate(
            token_ids=ids, max_new_tokens=args.new, temperature=0, ignore_eos=True, max_context=context,
            allow_extrapolation=True, reuse_prefix=False,
        ).stats  # fmt: skip
        return {
            "label": args.label, "prompt": length, "ttft_s": stats.time_to_first_token,
            "prefill_s": stats.prefill_seconds, "decode_tok_s": stats.decode_tokens_per_s,
        }  # fmt: skip

    ask(min(args.lengths))  # warm-up: one cache of the largest size for every request, kernels compiled
    for length in args.lengths:
        for _ in range(args.repeats if length <= 32768 else 1):
            print(json.dumps(ask(length)), flush=True)


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: graph vs eager step time, and the kernels of one eager step.

Usage: python bench/decode_profile.py [synthetic:llama-3-8b] [context]
Prints the step time with the CUDA graph (with and without programmatic dependent launch
between the step's kernels) and eager, the weight+KV roofline for the same step (measured copy
bandwidth), and the top kernels of one step by total time and launch count.
"""

from __future__ import annotations

import sys

import torch

from minidecode import LLM
from minidecode.bench import copy_bandwidth
from minidecode.kernels import fused


def step_ms(llm: LLM, steps: int = 64) -> float:
    engine = llm.engine
    step = engine._prepare_decode(engine._params, False)
    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


@torch.inference_mode()
def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "synthetic:llama-3-8b"
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for graph, pdl in ((True, True), (True, False), (False, True)):
        fused.PDL = pdl
        llm = LLM(name, cuda_graph=graph)
        llm.generate(
            token_ids=llm.random_prompt(context), max_new_tokens=4, temperature=0, max_context=context + 256
        )
        ms = step_ms(llm)
        weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
        kv = llm.config.kv_bytes_per_token(llm.dtype.itemsize) * context
        floor = (weights + kv) / bandwidth * 1e3
        rows.append((graph, pdl, ms, floor))
        if not graph:
            engine = llm.engine
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                engine._decode_step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            print("kernels per step:", sum(e.count for e in events))
        del llm
        torch.cuda.empty_cache()
    print(f"bandwidth {bandwidth / 1e12:.2f} TB/s; {name} at context {context}")
    print("| mode | step ms | floor ms | % of floor |")
    for graph, pdl, ms, floor in rows:
        mode = ("cuda graph" if graph else "eager") + (", PDL" if pdl else ", no PDL")
        print(f"| {mode} | {ms:.3f} | {floor:.3f} | {100 * floor / ms:.1f}% |")


if __name__ == "__main__":
    main()

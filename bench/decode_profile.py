"""Where a decode step's time goes: graph vs eager step time, and the kernels of one eager step.

Usage: python bench/decode_profile.py [synthetic:llama-3-8b] [context]
Prints the step time with the CUDA graph (with and without programmatic dependent launch
between the step's kernels) and eager, the read roofline of the same step (the bytes
minidecode.benchmarks.e2e.step_bytes counts, over the read ceiling measured in this run), and the top
kernels of one step by total time and launch count.
"""

from __future__ import annotations

import sys

import torch
from timing import start_filled  # bench/timing.py (run as a script: bench/ is on the import path)

from minidecode import LLM
from minidecode.benchmarks.e2e import measure_ceilings, step_bytes
from minidecode.plan import DecodeKind
from minidecode.sampling import GREEDY


def step_ms(llm: LLM, steps: int = 64) -> float:
    """Milliseconds per decode step of one sequence (a graph replay, or the eager step)."""
    for _ in range(3):
        llm.engine.step(1, DecodeKind(GREEDY))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        llm.engine.step(1, DecodeKind(GREEDY))
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


@torch.inference_mode()
def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "synthetic:llama-3-8b"
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    ceiling = measure_ceilings(torch.device("cuda")).read_bytes_per_s
    rows = []
    for graph, pdl in ((True, True), (True, False), (False, True)):
        llm = LLM(name, cuda_graph=graph)
        llm.engine.pdl = pdl
        start_filled(llm.engine, context, 256)  # random-valued cache: decode time only
        for t in llm.engine.cache.tensors().values():  # a bf16 cache (the default): K and V
            t.normal_()
        ms = step_ms(llm)
        floor = step_bytes(llm.config, llm.dtype.itemsize).at(context + 70) / ceiling * 1e3
        rows.append((graph, pdl, ms, floor))
        if not graph:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.engine.step(1, DecodeKind(GREEDY))
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            print("kernels per step:", sum(e.count for e in events))
        del llm
        torch.cuda.empty_cache()
    print(f"read ceiling {ceiling / 1e12:.2f} TB/s; {name} at context {context}")
    print("| mode | step ms | floor ms | % of floor |")
    for graph, pdl, ms, floor in rows:
        mode = ("cuda graph" if graph else "eager") + (", PDL" if pdl else ", no PDL")
        print(f"| {mode} | {ms:.3f} | {floor:.3f} | {100 * floor / ms:.1f}% |")


if __name__ == "__main__":
    main()

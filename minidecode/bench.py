"""End-to-end benchmark: prefill and decode speed per prompt length, against the memory-bandwidth
roofline and (optionally) Hugging Face transformers' `generate`, measured in the same process.

Roofline: a decode step must read every weight and the whole KV cache once, so the fastest
possible step is (weight bytes + KV bytes) / bandwidth, with the bandwidth measured in the same
run (a device-to-device copy, counting bytes read and written).
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .errors import UserError
from .llm import LLM


@dataclass
class BenchRow:
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    prefill_tokens_per_s: float
    time_to_first_token: float
    decode_tokens_per_s: float
    step_ms: float
    bytes_per_step: int  # weights + KV at the mean decode context
    achieved_gb_per_s: float
    roofline_tokens_per_s: float
    percent_of_roofline: float
    peak_memory_gib: float
    peer: str | None = None  # "transformers <version>" when compared
    peer_prefill_seconds: float | None = None
    peer_decode_tokens_per_s: float | None = None
    peer_error: str | None = None
    decode_speedup: float | None = None  # ours / peer, same run
    prefill_speedup: float | None = None


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted): the practical ceiling."""
    if device.type != "cuda":
        return float("nan")
    n = int(gib * 2**30) // 2
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n * 2 / statistics.median(times[2:])


def run_bench(
    llm: LLM, prompt_lengths: list[int], new_tokens: int = 64, compare: str | None = None, log=print
) -> tuple[list[BenchRow], float]:
    """Benchmark `llm` at each prompt length; returns the rows and the measured bandwidth."""
    if new_tokens < 2:
        raise UserError("bench needs --new-tokens >= 2 to time decode")
    if compare not in (None, "transformers"):
        raise UserError(f"unknown --compare {compare!r}; only 'transformers' is supported")
    bandwidth = copy_bandwidth(llm.device)
    cfg = llm.config
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    kv_per_token = cfg.kv_bytes_per_token(llm.dtype.itemsize)
    # One cache for the longest request, allocated and graph-captured during warm-up, so every
    # measured length replays the same graph.
    max_context = max(prompt_lengths) + new_tokens
    llm.generate(
        token_ids=llm.random_prompt(min(prompt_lengths), seed=1),
        max_new_tokens=min(8, new_tokens),
        temperature=0,
        max_context=max_context,
        allow_extrapolation=True,
    )
    rows = []
    for length in prompt_lengths:
        result = llm.generate(
            token_ids=llm.random_prompt(length, seed=length),
            max_new_tokens=new_tokens,
            temperature=0,
            max_context=max_context,
            allow_extrapolation=True,
        )
        st = result.stats
        mean_context = length + new_tokens / 2
        step_bytes = int(weight_bytes + kv_per_token * mean_context)
        step_s = 1 / st.decode_tokens_per_s if st.decode_tokens_per_s else float("nan")
        roofline = bandwidth / step_bytes
        rows.append(
            BenchRow(
                prompt_tokens=length,
                new_tokens=st.new_tokens,
                prefill_seconds=st.prefill_seconds,
                prefill_tokens_per_s=st.prefill_tokens_per_s,
                time_to_first_token=st.time_to_first_token,
                decode_tokens_per_s=st.decode_tokens_per_s,
                step_ms=step_s * 1e3,
                bytes_per_step=step_bytes,
                achieved_gb_per_s=step_bytes / step_s / 1e9,
                roofline_tokens_per_s=roofline,
                percent_of_roofline=100 * st.decode_tokens_per_s / roofline,
                peak_memory_gib=st.peak_memory_bytes / 2**30,
            )
        )
        log(
            f"minidecode {length:>8,} tok: prefill {st.prefill_seconds:7.2f} s, "
            f"decode {st.decode_tokens_per_s:6.1f} tok/s "
            f"({rows[-1].percent_of_roofline:.0f}% of roofline {roofline:.0f})"
        )
    if compare == "transformers":
        llm.engine.cache = None  # give the peer the memory
        llm.engine._graph = llm.engine._graph_key = None
        gc.collect()
        torch.cuda.empty_cache() if llm.device.type == "cuda" else None
        _compare_transformers(llm, rows, new_tokens, log)
    return rows, bandwidth


def _compare_transformers(llm: LLM, rows: list[BenchRow], new_tokens: int, log) -> None:
    try:
        import transformers
    except ImportError:
        raise UserError("--compare transformers needs the transformers package") from None
    model = transformers_peer(llm)
    peer = f"transformers {transformers.__version__}"
    for row in rows:
        row.peer = peer
        ids = torch.tensor([llm.random_prompt(row.prompt_tokens, seed=row.prompt_tokens)], device=llm.device)
        clock = _TokenClock()
        try:
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    ids,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    streamer=clock,
                    pad_token_id=0,
                )
            if llm.device.type == "cuda":
                torch.cuda.synchronize()
            first, last = clock.times[1], clock.times[-1]  # times[0] is the prompt itself
            row.peer_prefill_seconds = first - start
            row.peer_decode_tokens_per_s = (len(clock.times) - 2) / (last - first)
            row.decode_speedup = row.decode_tokens_per_s / row.peer_decode_tokens_per_s
            row.prefill_speedup = row.peer_prefill_seconds / row.prefill_seconds
            log(
                f"{peer} {row.prompt_tokens:>8,} tok: prefill {row.peer_prefill_seconds:7.2f} s, "
                f"decode {row.peer_decode_tokens_per_s:6.1f} tok/s"
            )
        except torch.OutOfMemoryError as e:
            asked = re.search(r"Tried to allocate [\d.]+ \w+", str(e))
            row.peer_error = "out of memory" + (f" ({asked.group(0).lower()})" if asked else "")
            log(f"{peer} {row.prompt_tokens:>8,} tok: {row.peer_error}")
        finally:
            del ids
            gc.collect()
            if llm.device.type == "cuda":
                torch.cuda.empty_cache()


class _TokenClock:
    """A transformers streamer that only notes when each token arrives (first put: the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_config(llm: LLM):
    """The transformers config for `llm`: the checkpoint's own, or one built from a preset."""
    import transformers

    if llm.model_dir is not None:
        return transformers.AutoConfig.from_pretrained(llm.model_dir)
    cfg = llm.config
    rope = {k: v for k, v in asdict(cfg.rope).items() if v is not None and k not in ("theta", "truncate")}
    rope["rope_theta"] = cfg.rope.theta
    return transformers.AutoConfig.for_model(
        cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=None,
    )


def transformers_peer(llm: LLM):
    """A transformers model that shares `llm`'s weight tensors (no second copy in memory)."""
    import transformers

    config = hf_config(llm)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=llm.dtype)
    state = dict(llm.model.state_dict())
    if llm.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # Buffers (RoPE inverse frequencies) are not in the state dict: rebuild them on the device.
    with torch.device(llm.device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.eval()


def format_table(rows: list[BenchRow], bandwidth: float) -> str:
    head = (
        "| prompt | prefill s | prefill tok/s | TTFT s | decode tok/s | roofline tok/s | % roofline "
        "| GB/s | peak GiB |"
    )
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        lines.append(
            f"| {r.prompt_tokens:,} | {r.prefill_seconds:.2f} | {r.prefill_tokens_per_s:,.0f} | "
            f"{r.time_to_first_token:.2f} | {r.decode_tokens_per_s:.1f} | {r.roofline_tokens_per_s:.0f} | "
            f"{r.percent_of_roofline:.0f}% | {r.achieved_gb_per_s:.0f} | {r.peak_memory_gib:.1f} |"
        )
    if any(r.peer for r in rows):
        lines += [
            "",
            f"| prompt | {rows[0].peer} prefill s | decode tok/s | decode speedup | prefill speedup |",
            "|" + " --- |" * 5,
        ]
        for r in rows:
            if r.peer_error:
                lines.append(f"| {r.prompt_tokens:,} | {r.peer_error} | - | - | - |")
            else:
                lines.append(
                    f"| {r.prompt_tokens:,} | {r.peer_prefill_seconds:.2f} | "
                    f"{r.peer_decode_tokens_per_s:.1f} | {r.decode_speedup:.1f}x | {r.prefill_speedup:.1f}x |"
                )
    lines.append("")
    lines.append(f"bandwidth ceiling (device copy, measured in this run): {bandwidth / 1e12:.2f} TB/s")
    return "\n".join(lines)


def plot(rows: list[BenchRow], path: str, title: str) -> None:
    """Decode tokens/s and the roofline vs context (matplotlib, imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.prompt_tokens for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r.roofline_tokens_per_s for r in rows], "k--", label="roofline (bandwidth)")
    ax.plot(x, [r.decode_tokens_per_s for r in rows], "o-", label="minidecode")
    peer = [(r.prompt_tokens, r.peer_decode_tokens_per_s) for r in rows if r.peer_decode_tokens_per_s]
    if peer:
        ax.plot(*zip(*peer, strict=True), "s-", label=rows[0].peer)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

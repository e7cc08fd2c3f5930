"""Where the default (bf16, SDPA) prefill spends its time, against transformers, in one run:
synthetic Llama-3-8B, prompts of 1k, 32k and 128k tokens (issue 36: on an H100 minidecode
prefilled 128k in 14.55 s against transformers' 12.13 s, and 1k in 0.07 against 0.04 s).

    python bench/prefill_probe.py --out bench/results/prefill-probe
    python bench/prefill_probe.py --lengths 1024 32768     # skip 128k

For each length it measures, in the same process:
1. model.prefill (the default path: choose_backend's SDPA backend), cold (the first call at this
   length: cuDNN plans for new shapes) and warm; wall time, GPU time between CUDA events, and the
   host time until prefill returns (enqueue): enqueue close to wall means the host is the limit;
2. the engine's whole prefill (minidecode.benchmarks.e2e.timed_generation: what `minidecode bench`
   reports) against model.prefill alone: the work around the model;
3. a per-part breakdown from an instrumented copy of Transformer.prefill's loop (CUDA events
   and host time per part: RoPE angles, norm, qkv + RoPE + the q / K / V writes, attention,
   o_proj, MLP; checked to give model.prefill's output bit for bit);
4. variants, end to end: the FP8 kernel; the replica, and the replica with RoPE and the q / K / V
   writes in PyTorch (ops.rope_into's twin: prefill before its Triton kernel); below 128k also SDPA
   flash or cuDNN forced, one attention call per layer for all heads (as transformers does)
   instead of one per KV head, RoPE angles made once per chunk instead of once per layer, and both;
   one warm-up and 5 runs at 1k, one warm-up and one run from 32k;
5. one layer's attention alone in each form (per KV head with each backend, all heads in one
   call, the FP8 kernel), and choose_backend's own 16k measurement;
6. transformers' prefill (generate of one token, as the bench times it) on the same weights
   (warmed up at each length, as minidecode's prefill is);
7. the allocator: peak memory and cudaMalloc retries during the warm prefill.
Prints a table per length and writes <out>.md / .json. Each part runs under its own try, so a
failure is reported and the rest still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

from minidecode import LLM
from minidecode.benchmarks.e2e import provenance
from minidecode.kernels import ops
from minidecode.kernels import prefill as prefill_mod
from minidecode.kernels.prefill import BLOCK, CANDIDATES, causal_attention, choose_backend
from minidecode.models.cache import KVCache
from minidecode.models.llama import Transformer

K = 1024


class PartTimer:
    """CUDA events and host time around named parts of a prefill; `parts()` sums each name."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: dict[str, list] = defaultdict(list)
        self.host: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        yield
        end.record()
        self.host[name] += time.perf_counter() - t0
        self.events[name].append((start, end))

    def parts(self) -> dict[str, dict]:
        torch.cuda.synchronize()
        return {
            name: {
                "gpu_ms": sum(s.elapsed_time(e) for s, e in pairs),
                "host_ms": 1e3 * self.host[name],
                "calls": len(pairs),
            }
            for name, pairs in self.events.items()
        }


@torch.inference_mode()
def replica_prefill(
    model: Transformer,
    tokens,
    cache,
    chunk,
    backend,
    timer,
    hoist_rope=False,
    all_heads=False,
    torch_rope=False,
):
    """Transformer.prefill's bf16-cache path (start 0, last position), its parts timed; the
    variants change only what their names say (torch_rope: RoPE and the q / K / V writes by
    ops.rope_into's PyTorch twin, as prefill ran them before the Triton kernel).
    -> final-normed hidden [B, hidden]."""
    cfg = model.config
    B, T = tokens.shape
    G, D = cfg.group_size, cfg.head_dim
    seq_len = torch.tensor(T, device=tokens.device)
    with timer("embedding"):
        x = model.model.embed_tokens(tokens)
        q_all = torch.empty(B, cfg.num_heads, T, D, dtype=x.dtype, device=x.device)
    angles = {}
    if hoist_rope:
        with timer("rope angles"):
            for s in range(0, T, chunk):
                positions = torch.arange(s, min(s + chunk, T), device=x.device).expand(B, -1)
                angles[s] = model.rope.cos_sin(positions, seq_len)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        k_cache, v_cache = cache.layer(i)[:2]
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            if hoist_rope:
                cos, sin = angles[s]
            else:
                with timer("rope angles"):
                    positions = torch.arange(s, e, device=x.device).expand(B, e - s)
                    cos, sin = model.rope.cos_sin(positions, seq_len)
            outs = q_all[:, :, s:e], k_cache[:, :, s:e], v_cache[:, :, s:e]
            with timer("norm"):
                normed = layer.input_layernorm(x[:, s:e])
            if torch_rope:
                with timer("qkv"):
                    qkv = ops.linear(normed, attn.qkv_weight, attn.qkv_bias)
                with timer("RoPE + q/k/v writes"):
                    norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
                    ops.rope_into(qkv, cos, sin, *outs, *norms, attn.norm_eps, triton=False)
            else:
                with timer("qkv + RoPE + q/k/v writes"):
                    attn.project_into(normed, cos, sin, *outs)
        with timer("attention"):
            if all_heads:  # every head in one causal_attention call, written over q_all
                causal_attention(q_all, k_cache[:, :, :T], v_cache[:, :, :T], attn.scale, backend, out=q_all)
            else:
                for h in range(cfg.num_kv_heads):
                    group = q_all[:, h * G : (h + 1) * G]
                    group.copy_(
                        causal_attention(
                            group, k_cache[:, h : h + 1, :T], v_cache[:, h : h + 1, :T], attn.scale, backend
                        )
                    )
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            with timer("o_proj (+ gather, residual)"):
                out = q_all[:, :, s:e].transpose(1, 2).reshape(B, e - s, -1)
                x[:, s:e] += attn.o_proj(out)
            with timer("mlp (+ norm, residual)"):
                x[:, s:e] += layer.mlp(layer.post_attention_layernorm(x[:, s:e]))
    with timer("final norm"):
        return model.model.norm(x[:, -1])


def timed(fn, repeats: int) -> dict:
    """fn() `repeats` times after nothing (the caller warms up): wall, GPU (events) and enqueue
    seconds of each, with the medians."""
    walls, gpus, enqueues = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        enqueue = time.perf_counter() - t0
        end.record()
        end.synchronize()
        walls.append(time.perf_counter() - t0)
        gpus.append(start.elapsed_time(end) / 1e3)
        enqueues.append(enqueue)
    med = statistics.median
    return {
        "wall_s": med(walls),
        "gpu_s": med(gpus),
        "enqueue_s": med(enqueues),
        "walls": walls,
        "n": repeats,
    }


class Probe:
    def __init__(self, llm: LLM, chunk: int):
        self.llm, self.model, self.chunk = llm, llm.model, chunk
        self.cfg = llm.config
        self.device = llm.device
        self.backend = choose_backend(self.device, self.cfg.head_dim, self.cfg.group_size, llm.dtype)
        self.report: dict = {"chosen_backend": self.backend, "lengths": {}}

    def ids(self, T: int) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(T)
        return torch.randint(1000, self.cfg.vocab_size - 1000, (1, T), generator=gen).to(self.device)

    def cache(self, T: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, 1, c.num_kv_heads, T, c.head_dim, self.llm.dtype, self.device)

    def prefill(self, ids, cache, backend):
        with torch.inference_mode():
            return self.model.prefill(ids, cache, self.chunk, backend)

    def section(self, out: dict, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as error:  # keep going: the rest of the probe still means something
            out[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            traceback.print_exc()
            torch.cuda.empty_cache()
        print(
            f"  {name}: {json.dumps(out[name], default=str)[:400]} ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )

    def run_length(self, T: int, hf) -> dict:
        out: dict = {}
        self.report["lengths"][T] = out
        ids, cache = self.ids(T), self.cache(T)
        n = 5 if T <= 4 * K else 2 if T <= 32 * K else 1
        long = T > 32 * K

        defaults = []  # the default's last hidden state, which the variants are compared with

        def model_prefill():
            cold = timed(lambda: defaults.append(self.prefill(ids, cache, self.backend)), 1)
            torch.cuda.reset_peak_memory_stats()
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            warm = timed(lambda: self.prefill(ids, cache, self.backend), n)
            warm["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
            warm["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            return {"cold": cold, "warm": warm}

        self.section(out, "model.prefill", model_prefill)

        def engine():
            from minidecode.benchmarks.e2e import timed_generation

            ids_list = ids[0].tolist()
            timed_generation(self.llm, ids_list, 1, T + 8)  # warm (allocates the engine's cache)
            runs = [timed_generation(self.llm, ids_list, 1, T + 8)[0].prefill_seconds for _ in range(n)]
            self.llm.release_cache()
            torch.cuda.empty_cache()
            return {"prefill_s": statistics.median(runs), "runs": runs}

        if not long:
            self.section(out, "engine prefill (bench's figure)", engine)

        def breakdown():
            timer = PartTimer(True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hidden = replica_prefill(self.model, ids, cache, self.chunk, self.backend, timer)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            parts = timer.parts()
            default = defaults[-1] if defaults else self.prefill(ids, cache, self.backend)
            same = bool(torch.equal(hidden, default))
            return {"wall_s": wall, "parts": parts, "replica_equals_model_prefill": same}

        self.section(out, "breakdown", breakdown)

        variants = {"fp8 kernel": lambda: self.prefill(ids, cache, "fp8")}
        off = PartTimer(False)
        replica = functools.partial(replica_prefill, self.model, ids, cache, self.chunk, self.backend, off)
        variants["replica (as model.prefill)"] = replica
        variants["RoPE and q/k/v writes in PyTorch (before)"] = functools.partial(replica, torch_rope=True)
        if not long:
            for name in CANDIDATES:
                variants[f"backend {name}"] = functools.partial(self.prefill, ids, cache, name)
            variants["RoPE angles once per chunk"] = functools.partial(replica, hoist_rope=True)
            variants["one attention call per layer"] = functools.partial(replica, all_heads=True)
            variants["both"] = functools.partial(replica, hoist_rope=True, all_heads=True)

        def run_variants():
            result = {}
            default = defaults[-1] if defaults else self.prefill(ids, cache, self.backend)  # [1, hidden]
            for name, fn in variants.items():
                outputs = []
                try:
                    call = lambda f=fn, o=outputs: o.append(f())  # noqa: E731 - keeps the result
                    # Warm-up at every length: compilation and cuDNN plans. At 128k too: attention there
                    # takes fewer KV heads a call, which the FP8 kernel compiles for anew (~3 s).
                    call()
                    result[name] = timed(call, n if T <= 4 * K else 1)
                    got = outputs[-1]
                    result[name]["equal_to_default"] = bool(torch.equal(got, default))
                    diff = (got.float() - default.float()).norm() / default.float().norm()
                    result[name]["rel_diff_vs_default"] = diff.item()
                except Exception as error:
                    result[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
                torch.cuda.empty_cache()
            return result

        self.section(out, "variants", run_variants)
        self.section(out, "one layer's attention", lambda: self.layer_attention(cache, T))
        cache = variants = None  # free the cache (16 GiB at 128k) before transformers runs
        torch.cuda.empty_cache()
        if hf is not None:
            self.section(out, "transformers prefill", lambda: self.transformers(hf, ids, n))
        return out

    def layer_attention(self, cache: KVCache, T: int) -> dict:
        """Layer 0's attention over the K/V the prefill left in the cache (random q), ms per form."""
        cfg = self.cfg
        G, D = cfg.group_size, cfg.head_dim
        k, v = cache.layer(0)[:2]
        q = torch.randn(1, cfg.num_heads, T, D, device=self.device, dtype=self.llm.dtype)
        scale = D**-0.5
        forms = {}
        for name in [*CANDIDATES, "fp8"]:
            forms[f"per KV head, {name}"] = lambda b=name: [
                causal_attention(
                    q[:, h * G : (h + 1) * G], k[:, h : h + 1, :T], v[:, h : h + 1, :T], scale, b
                )
                for h in range(cfg.num_kv_heads)
            ]
        for name in [*CANDIDATES, "fp8"]:
            forms[f"all heads one call, {name}"] = lambda b=name: causal_attention(
                q, k[:, :, :T], v[:, :, :T], scale, b
            )
        if T > BLOCK:

            def unblocked():  # the blocked cuDNN path's peer: one causal call per KV head
                saved, prefill_mod.BLOCK = prefill_mod.BLOCK, 1 << 30
                try:
                    return forms["per KV head, cudnn"]()
                finally:
                    prefill_mod.BLOCK = saved

            forms["per KV head, cudnn, one causal call (no blocks)"] = unblocked
        result = {}
        for name, fn in forms.items():
            try:
                fn()
                r = timed(fn, 3 if T <= 32 * K else 2)
                result[name] = round(r["gpu_s"] * 1e3, 3)
            except Exception as error:
                result[name] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
        return result

    def transformers(self, hf, ids, n) -> dict:
        """transformers' prefill as the bench times it (0: a pad id the prompt never holds), warmed
        up at this length as minidecode's prefill is here."""
        from minidecode.benchmarks.e2e import peer_generation

        peer_generation(hf, ids, 1, 0)
        runs = [peer_generation(hf, ids, 1, 0)[0] for _ in range(n)]
        torch.cuda.empty_cache()
        return {"prefill_s": statistics.median(runs), "runs": runs}


def choose_backend_timings(device, head_dim: int, group: int, dtype) -> dict:
    """choose_backend's 16k measurement, repeated here with its numbers (ms for 3 calls)."""
    T = 16384
    q = torch.randn(1, group, T, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, 1, T, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    times = {}
    for name in CANDIDATES:
        causal_attention(q, k, v, head_dim**-0.5, name)
        r = timed(lambda n=name: [causal_attention(q, k, v, head_dim**-0.5, n) for _ in range(3)], 3)
        times[name] = [round(1e3 * w, 3) for w in r["walls"]]
    return times


def markdown(env: dict, report: dict) -> str:
    lines = [
        "# Prefill probe: where the default bf16 prefill spends its time (synthetic Llama-3-8B)",
        "",
        f"Device: {env['device']} · date {env['date']} · commit {env['commit']} · torch {env['torch']} · "
        f"chosen SDPA backend: {report['chosen_backend']} · prefill chunk {env['chunk']}",
        "",
        f"choose_backend's 16k measurement (ms for 3 calls, 3 repeats): {report.get('choose_backend_16k')}",
        "",
    ]
    for T, out in report["lengths"].items():
        lines += [f"## {int(T) // K}k tokens", ""]
        mp = out.get("model.prefill", {})
        if "warm" in mp:
            w, c = mp["warm"], mp["cold"]
            lines.append(
                f"model.prefill: warm {w['wall_s']:.3f} s wall, {w['gpu_s']:.3f} s GPU, "
                f"{w['enqueue_s']:.3f} s to enqueue (n={w['n']}); cold {c['wall_s']:.3f} s; "
                f"peak {w['peak_gib']:.1f} GiB; allocator retries {w['alloc_retries']}"
            )
        for key in ("engine prefill (bench's figure)", "transformers prefill"):
            if key in out and "prefill_s" in out[key]:
                lines.append(
                    f"{key}: {out[key]['prefill_s']:.3f} s (runs {[round(r, 3) for r in out[key]['runs']]})"
                )
        bd = out.get("breakdown", {})
        if "parts" in bd:
            lines += [
                "",
                f"Per part (instrumented copy of the loop, {bd['wall_s']:.3f} s wall; equals model.prefill: "
                f"{bd['replica_equals_model_prefill']}):",
                "",
                "| part | GPU ms | host ms | calls |",
                "| --- | --- | --- | --- |",
            ]
            for name, p in sorted(bd["parts"].items(), key=lambda kv: -kv[1]["gpu_ms"]):
                lines.append(f"| {name} | {p['gpu_ms']:.1f} | {p['host_ms']:.1f} | {p['calls']} |")
        var = out.get("variants", {})
        if var and "error" not in var:
            lines += [
                "",
                "| variant | wall s | GPU s | enqueue s | last hidden state against the default's |",
                "| --- | --- | --- | --- | --- |",
            ]
            for name, r in var.items():
                if "error" in r:
                    lines.append(f"| {name} | {r['error']} | | | |")
                    continue
                same = (
                    "bitwise equal" if r["equal_to_default"] else f"rel. diff {r['rel_diff_vs_default']:.1e}"
                )
                lines.append(
                    f"| {name} | {r['wall_s']:.3f} | {r['gpu_s']:.3f} | {r['enqueue_s']:.3f} | {same} |"
                )
        la = out.get("one layer's attention", {})
        if la and "error" not in la:
            lines += ["", "One layer's attention (GPU ms): " + "; ".join(f"{k}: {v}" for k, v in la.items())]
        errors = {k: v["error"] for k, v in out.items() if isinstance(v, dict) and "error" in v}
        if errors:
            lines += ["", f"Errors: {errors}"]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1 * K, 32 * K, 128 * K])
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="prefix of the .md/.json results")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    commit = args.commit
    if commit is None:
        commit = provenance()["commit"] or "none"  # minidecode's own, whatever the current folder
    llm = LLM("synthetic:llama-3-8b")
    probe = Probe(llm, getattr(llm.engine, "prefill_chunk", 8192))
    env = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "chunk": probe.chunk,
        "command": "python3 bench/prefill_probe.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(env), f"chosen backend {probe.backend}", flush=True)
    probe.section(
        probe.report, "choose_backend_16k", lambda: choose_backend_timings(llm.device, 128, 4, llm.dtype)
    )
    hf = None
    if not args.no_transformers:
        try:
            from minidecode.benchmarks.e2e import transformers_peer

            hf = transformers_peer(llm)
        except Exception as error:
            print(f"transformers peer unavailable: {error}", flush=True)

    def save() -> str:  # after every length: a timeout keeps what was measured
        text = markdown(env, probe.report)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            results = {"env": env, "report": probe.report}
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
            args.out.with_suffix(".md").write_text(text)
        return text

    for T in args.lengths:
        print(f"== {T} tokens", flush=True)
        probe.run_length(T, hf)
        torch.cuda.empty_cache()
        save()
    print(save())


if __name__ == "__main__":
    main()

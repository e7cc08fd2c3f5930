"""End-to-end benchmark: prefill and decode speed per prompt length, against the memory-bandwidth
roofline and (optionally) Hugging Face transformers' `generate`, measured in the same process.

Method (the results files repeat it):
- Decode: one generation per prompt length yields 1 + repeats x window tokens. The first token
  comes from prefill and is excluded; the rest are cut into `repeats` consecutive windows of
  `window` steps, each timed from the host timestamps of the tokens as they are yielded. Each
  window's roofline is taken at its own mean context.
- Prefill: `repeats` full requests where the prompt is at most `prefill_repeat_max_tokens` long,
  one sample beyond (every figure carries its n).
- Peers (transformers, sharing our weight tensors): eager (SDPA, dynamic cache) and static cache
  + torch.compile; same prompt, an all-ones attention mask, a pad id that is not in the prompt,
  a warm-up first; the compiled peer's warm-up (compilation) time is reported on its own.
- Speculation (--speculate K): the timed generations speculate (prompt lookup; random prompts
  hold little to match), and a table gives their decode steps, tokens a step and drafts kept.
  The roofline stays one token a step's.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import minidecode
from minidecode import __version__
from minidecode.errors import UserError
from minidecode.llm import LLM
from minidecode.models.config import ModelConfig
from minidecode.models.llama import step_weight_bytes
from minidecode.request import Request
from minidecode.sequence import GenerationStats

FORMULA = (
    "bytes per decode step = (all weights - embedding table + one embedding row) * dtype bytes "
    "[tied lm_head: all weights, the table counted once, as lm_head; FP8 weights: 1 byte a weight "
    "plus their float32 scales] "
    "+ KV bytes per token * context (the step's attention length; an fp8_e4m3 cache: 1 byte per "
    "K/V element plus a 2-byte bfloat16 scale per token, KV head and K or V); "
    "roofline tok/s = read ceiling / bytes per step"
)
PEERS = {
    "eager": "transformers eager (sdpa, dynamic cache)",
    "compiled": "transformers static cache + torch.compile",
}


# ---- what a decode step reads --------------------------------------------------------------------
@dataclass
class StepBytes:
    weights: int  # read by every step, whatever the context
    kv_per_token: int  # K and V of one position, all layers

    def at(self, context: float) -> float:
        """Bytes one decode step reads when its attention spans `context` positions."""
        return self.weights + self.kv_per_token * context


def step_bytes(cfg: ModelConfig, dtype_bytes: int, kv_bytes_per_token: int | None = None) -> StepBytes:
    """The roofline's byte count (FORMULA): a step reads one row of the embedding table, not all
    of it; a tied lm_head reads the whole table, which then counts once. kv_bytes_per_token: the
    cache's (Engine.planner.kv_bytes_per_token, scales included); default, a cache in the model dtype."""
    table = cfg.vocab_size * cfg.hidden_size
    params = cfg.num_parameters()
    if not cfg.tie_word_embeddings:
        params += cfg.hidden_size - table
    kv = cfg.kv_bytes_per_token(dtype_bytes) if kv_bytes_per_token is None else kv_bytes_per_token
    return StepBytes(params * dtype_bytes, kv)


def window_contexts(prompt_tokens: int, window: int, count: int) -> list[float]:
    """Mean attention length of each decode window. The step that makes new token k (k = 1, 2,
    ...; token 0 comes from prefill) attends over prompt_tokens + k positions; window r holds
    tokens r * window + 1 ... (r + 1) * window."""
    return [prompt_tokens + r * window + (window + 1) / 2 for r in range(count)]


def window_rates(token_times: list[float], window: int) -> list[float]:
    """Decode tokens/s of each full window. token_times[0] is when the first token (from prefill)
    arrived; it only starts the first window's clock."""
    count = (len(token_times) - 1) // window
    return [window / (token_times[(r + 1) * window] - token_times[r * window]) for r in range(count)]


# ---- statistics ------------------------------------------------------------------------------------
@dataclass
class Spread:
    """Median and range of n samples."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("no samples")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def format(self, digits: int = 1) -> str:
        text = f"{self.median:,.{digits}f}"
        if self.n > 1:
            text += f" ({self.low:,.{digits}f}-{self.high:,.{digits}f})"
        return text + f" n={self.n}"


# ---- ceilings ----------------------------------------------------------------------------------------
@dataclass
class Ceilings:
    read_bytes_per_s: float  # a read-only reduction: the decode step's ceiling
    copy_bytes_per_s: float  # a device copy, read + write counted (for reference)
    buffer_bytes: int


def measure_ceilings(device: torch.device, gib: float = 2.0, repeats: int = 8) -> Ceilings:
    """Best of `repeats` of a sum over a `gib` GiB float32 buffer (bytes read) and of a copy of it
    (bytes read + written), measured now on `device`. float32: a bf16 sum is compute-bound on CPUs."""
    n = int(gib * 2**30) // 4
    a = torch.ones(n, device=device, dtype=torch.float32)
    b = torch.empty_like(a)
    read = 4 * n / _best_seconds(lambda: a.sum(), device, repeats)
    copy = 8 * n / _best_seconds(lambda: b.copy_(a), device, repeats)
    return Ceilings(read, copy, 4 * n)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


# ---- prompts ---------------------------------------------------------------------------------------
def special_token_ids(llm: LLM) -> set[int]:
    """bos / eos / pad ids of the config and generation config, and the tokenizer's special tokens."""
    cfg = llm.config
    ids = set(llm.eos_ids) | set(cfg.eos_token_ids) | {cfg.bos_token_id}
    for name in ("config.json", "generation_config.json"):  # pad ids live only in these files
        path = None if llm.model_dir is None else llm.model_dir / name
        if path is not None and path.exists():
            ids.add(json.loads(path.read_text()).get("pad_token_id"))
    backend = getattr(llm.tokenizer, "backend", None)  # a tokenizers.Tokenizer (real checkpoints)
    if backend is not None:
        ids |= {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    return {i for i in ids if isinstance(i, int) and 0 <= i < cfg.vocab_size}


def pad_id_for(special: set[int]) -> int:
    """The peer's pad_token_id: a special id (never drawn into a prompt), or 0, kept out of prompts."""
    return min(special) if special else 0


def benchmark_prompt(vocab_size: int, length: int, seed: int, excluded: set[int]) -> list[int]:
    """`length` random ids, uniform over the vocabulary minus `excluded` (special and pad ids:
    transformers builds a full attention mask for a prompt that contains its pad id)."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[sorted(excluded)] = False
    pool = allowed.nonzero()[:, 0]
    generator = torch.Generator().manual_seed(seed)
    return pool[torch.randint(0, len(pool), (length,), generator=generator)].tolist()


# ---- results ---------------------------------------------------------------------------------------
@dataclass
class PeerResult:
    peer: str  # a PEERS key
    version: str
    prefill_seconds: Spread | None = None
    decode_tokens_per_s: Spread | None = None
    compile_warmup_seconds: float | None = None  # compiled peer: warm-up incl. compilation
    peak_memory_gib: float | None = None
    error: str | None = None  # "out of memory (tried to allocate 14.00 GiB)", ...

    def summary(self) -> str:
        if self.error:
            return self.error
        text = f"prefill {self.prefill_seconds.format(2)} s, decode {self.decode_tokens_per_s.format()} tok/s"
        if self.compile_warmup_seconds is not None:
            text += f", warm-up incl. compile {self.compile_warmup_seconds:.0f} s"
        return text


@dataclass
class Drafts:
    """Speculation in a length's timed generation (bench --speculate K): its decode steps, the
    draft tokens verified and those kept; tokens_per_step = (decode_steps + accepted_tokens) /
    decode_steps (1.0: one token a step), acceptance = accepted / proposed (None: none proposed)."""

    speculate: int
    decode_steps: int
    proposed_tokens: int
    accepted_tokens: int
    tokens_per_step: float
    acceptance: float | None

    @classmethod
    def of(cls, speculate: int, stats: GenerationStats) -> Drafts:
        steps, proposed, accepted = stats.decode_steps, stats.proposed_tokens, stats.accepted_tokens
        per_step = (steps + accepted) / max(steps, 1)
        return cls(speculate, steps, proposed, accepted, per_step, accepted / proposed if proposed else None)


@dataclass
class LengthResult:
    prompt_tokens: int
    window: int
    prefill_seconds: Spread
    first_token_wait_seconds: Spread  # time to first token - prefill
    decode_tokens_per_s: Spread
    window_mean_contexts: list[float]
    bytes_per_step: Spread
    achieved_gb_per_s: Spread
    roofline_tokens_per_s: Spread
    percent_of_read_ceiling: Spread
    peak_memory_gib: float | None
    peers: list[PeerResult] = field(default_factory=list)
    drafts: Drafts | None = None  # with --speculate


@dataclass
class BenchSettings:
    prompt_lengths: list[int]
    window: int = 64  # decode steps per timed window (--new-tokens)
    repeats: int = 3
    prefill_repeat_max_tokens: int = 32768
    peers: list[str] = field(default_factory=list)
    peer_max_tokens: int | None = None  # every peer: only prompts up to this length
    compiled_max_tokens: int | None = None  # the compiled peer: only up to this length
    ceiling_gib: float = 2.0
    allow_extrapolation: bool = False  # prompts past the model's trained positions (--allow-extrapolation)
    speculate: int = 0  # the most draft tokens a decode step (Request.speculate; --speculate)

    def validate(self) -> None:
        Request(speculate=self.speculate).check(need_prompt=False, names={"speculate": "--speculate"})
        if not self.prompt_lengths or any(n < 1 for n in self.prompt_lengths):
            raise UserError("--prompt-tokens must be >= 1")
        if self.window < 2:
            raise UserError("bench needs --new-tokens >= 2 to time decode")
        if self.repeats < 1:
            raise UserError("--repeats must be >= 1")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise UserError(f"unknown peer {unknown[0]!r}; known: {', '.join(PEERS)}")

    def peer_runs(self, peer: str, length: int) -> bool:
        limit = self.peer_max_tokens
        if peer == "compiled" and self.compiled_max_tokens is not None:
            limit = self.compiled_max_tokens if limit is None else min(limit, self.compiled_max_tokens)
        return limit is None or length <= limit


# ---- minidecode --------------------------------------------------------------------------------
def timed_generation(
    llm: LLM,
    ids: list[int],
    new_tokens: int,
    max_context: int,
    allow_extrapolation: bool = True,
    on_prefill_progress: Callable[[int, int], None] | None = None,
    speculate: int = 0,
) -> tuple[GenerationStats, list[float]]:
    """Greedy generation of exactly new_tokens (eos ignored): its stats and the host time at which
    each token was yielded. allow_extrapolation: as the request's (the bench passes the user's;
    other scripts time any length); speculate: as the request's (0: off)."""
    times = []
    stream = llm.stream(
        token_ids=ids,
        temperature=0,
        max_new_tokens=new_tokens,
        max_context=max_context,
        ignore_eos=True,
        allow_extrapolation=allow_extrapolation,
        reuse_prefix=False,  # every measured prefill runs in full, even on a repeated prompt
        on_prefill_progress=on_prefill_progress,
        speculate=speculate,
    )
    for event in stream.events():
        if event.token is not None:
            times.append(time.perf_counter())
    return stream.result.stats, times


def check_lengths(
    llm: LLM, longest: int, context: int, allow_extrapolation: bool, log: Callable[[str], None]
) -> None:
    """Refuse, before anything is measured or drawn (drawing 10^10 ids fails in the allocator
    first), a request of `longest` prompt tokens on a cache of `context` positions that the
    runtime would refuse: one the memory plan cannot hold (LLM.check_fits), or one past the
    positions the model was trained for (LLM.check_context, the check every request passes: the
    same message as generate's), which allow_extrapolation turns into a warning."""
    llm.check_fits(context, longest)
    if llm.check_context(context, allow_extrapolation):
        log(
            f"warning: a context of {context:,} positions exceeds the {llm.config.max_position_embeddings:,} "
            f"{llm.name} was trained for: extrapolating (--allow-extrapolation)"
        )


def run_bench(
    llm: LLM,
    settings: BenchSettings,
    log: Callable[[str], None] = print,
    progress: Callable[[], Callable[[int, int], None]] | None = None,
) -> tuple[list[LengthResult], Ceilings]:
    """Benchmark `llm` (and the peers) at each prompt length; returns the results and the ceilings.
    progress: makes a prefill progress display for each prompt length's first (timed) request."""
    settings.validate()
    transformers = import_transformers("--compare transformers") if settings.peers else None
    window, repeats, allow = settings.window, settings.repeats, settings.allow_extrapolation
    new_tokens = 1 + repeats * window
    # One cache for the longest request, allocated and graph-captured by the warm-up, so every
    # measured length replays the same graph.
    max_context = max(settings.prompt_lengths) + new_tokens
    check_lengths(llm, max(settings.prompt_lengths), max_context, allow, log)
    ceilings = measure_ceilings(llm.device, settings.ceiling_gib if llm.device.type == "cuda" else 0.25)
    log(
        f"read ceiling {ceilings.read_bytes_per_s / 1e9:,.0f} GB/s, "
        f"copy {ceilings.copy_bytes_per_s / 1e9:,.0f} GB/s (read + write)"
    )
    # the weights a step reads as loaded (FP8 weights: 1 byte a weight and their scales)
    per_step = StepBytes(step_weight_bytes(llm.model), llm.engine.planner.kv_bytes_per_token)
    special = special_token_ids(llm)
    pad_id = pad_id_for(special)
    excluded = special | {pad_id}
    warm_ids = benchmark_prompt(llm.config.vocab_size, min(settings.prompt_lengths), 1, excluded)
    speculate = settings.speculate
    timed_generation(llm, warm_ids, min(8, new_tokens), max_context, allow, speculate=speculate)
    results = []
    for length in settings.prompt_lengths:
        ids = benchmark_prompt(llm.config.vocab_size, length, length, excluded)
        shown = progress() if progress is not None else None
        stats, times = timed_generation(llm, ids, new_tokens, max_context, allow, shown, speculate)
        firsts = [stats]
        if length <= settings.prefill_repeat_max_tokens:
            firsts += [timed_generation(llm, ids, 1, max_context, allow)[0] for _ in range(repeats - 1)]
        prefill = [s.prefill_seconds for s in firsts]
        # what the user waits beyond the prefill for the first token (sampling, host hand-out)
        wait = [s.time_to_first_token - s.prefill_seconds for s in firsts]
        rates = window_rates(times, window)
        step = [per_step.at(c) for c in window_contexts(length, window, repeats)]
        roofline = [ceilings.read_bytes_per_s / b for b in step]
        peak = stats.peak_memory_bytes / 2**30 if llm.device.type == "cuda" else None
        results.append(
            LengthResult(
                prompt_tokens=length,
                window=window,
                prefill_seconds=Spread.of(prefill),
                first_token_wait_seconds=Spread.of(wait),
                decode_tokens_per_s=Spread.of(rates),
                window_mean_contexts=window_contexts(length, window, repeats),
                bytes_per_step=Spread.of(step),
                achieved_gb_per_s=Spread.of([b * r / 1e9 for b, r in zip(step, rates, strict=True)]),
                roofline_tokens_per_s=Spread.of(roofline),
                percent_of_read_ceiling=Spread.of(
                    [100 * r / f for r, f in zip(rates, roofline, strict=True)]
                ),
                peak_memory_gib=peak,
                drafts=Drafts.of(speculate, stats) if speculate else None,
            )
        )
        r = results[-1]
        log(
            f"minidecode {length:>9,} tok: prefill {r.prefill_seconds.format(2)} s, "
            f"decode {r.decode_tokens_per_s.format()} tok/s, {r.percent_of_read_ceiling.median:.0f}% of "
            f"the read roofline ({r.roofline_tokens_per_s.median:.0f} tok/s)"
            + (f", {r.drafts.tokens_per_step:.2f} tok/step" if r.drafts is not None else "")
        )
    if transformers is not None:
        llm.release_cache()  # give the peer the memory
        _free(llm.device)
        model = transformers_peer(llm)
        for peer in settings.peers:
            lengths = [r for r in results if settings.peer_runs(peer, r.prompt_tokens)]
            if peer == "eager" and lengths:  # one short request first: allocator, kernels, cuBLAS
                warm = torch.tensor([warm_ids], device=llm.device)
                peer_generation(model, warm, 8, pad_id)
            for r in lengths:
                prompt = benchmark_prompt(llm.config.vocab_size, r.prompt_tokens, r.prompt_tokens, excluded)
                ids = torch.tensor([prompt], device=llm.device)  # the same prompt minidecode saw
                result = _run_peer(model, peer, ids, settings, pad_id)
                result.version = transformers.__version__
                r.peers.append(result)
                log(f"{PEERS[peer]} {r.prompt_tokens:>9,} tok: {result.summary()}")
                del ids
                _free(llm.device)
    return results, ceilings


# ---- provenance ------------------------------------------------------------------------------------
PACKAGE_DIR = Path(minidecode.__file__).resolve().parent  # the runtime package's folder


def provenance(package_dir: Path = PACKAGE_DIR) -> dict[str, str | None]:
    """minidecode's own version and git commit, whatever the current folder: the commit of the
    checkout whose minidecode/ folder is `package_dir` (the minidecode package's: an editable install)
    and whose pyproject.toml names the project minidecode, with "+changes" when tracked files
    differ from it; MINIDECODE_COMMIT where a tree was copied without its history; else None (an
    installed wheel has no commit, even inside a checkout)."""
    commit = os.environ.get("MINIDECODE_COMMIT")
    if not commit:
        commit = _checkout_commit(package_dir)
    return {"version": __version__, "commit": commit}


def _checkout_commit(folder: Path) -> str | None:
    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", *args], cwd=folder, capture_output=True, text=True, timeout=10, check=True
        )
        return run.stdout.strip()

    try:
        root = Path(git("rev-parse", "--show-toplevel"))
        pyproject = root / "pyproject.toml"
        if root / "minidecode" != folder.resolve() or not pyproject.is_file():
            return None  # a wheel installed into a folder of some checkout
        if not re.search(r'(?m)^name\s*=\s*"minidecode"\s*$', pyproject.read_text()):
            return None  # another project's checkout holds this folder
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return None  # no git, or not a checkout
    return commit + ("+changes" if changed else "")


# ---- transformers -----------------------------------------------------------------------------
def import_transformers(option: str, hint: str = ""):
    """The transformers module, which the peer `option` (the command line's words) runs: a
    UserError when it does not import (`hint`: what else the user can do)."""
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"{option} needs the transformers package (pip install transformers){hint}"
        ) from None
    return transformers


class TokenClock:
    """A transformers streamer that notes when each put arrives (the first put is the prompt)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def peer_generation(
    model, ids: torch.Tensor, new_tokens: int, pad_id: int, static: bool = False
) -> tuple[float, list[float]]:
    """transformers' greedy generate of exactly new_tokens after `ids` [1, T] (no pad id in it):
    (seconds to the first new token, host times of the new tokens)."""
    clock = TokenClock(ids.device)
    extra = {"cache_implementation": "static"} if static else {}
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # all ones: transformers takes SDPA's causal path
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
            **extra,
        )
    new = clock.times[1:]
    return new[0] - start, new


def _run_peer(model, peer: str, ids: torch.Tensor, settings: BenchSettings, pad_id: int) -> PeerResult:
    result = PeerResult(peer, "")
    device, length = ids.device, ids.shape[1]
    new_tokens = 1 + settings.repeats * settings.window
    static = peer == "compiled"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        if static:  # the first calls compile the decode step for this cache size: timed apart
            t0 = time.perf_counter()
            for _ in range(2):
                peer_generation(model, ids, new_tokens, pad_id, static=True)
            result.compile_warmup_seconds = time.perf_counter() - t0
        first, times = peer_generation(model, ids, new_tokens, pad_id, static=static)
        prefill = [first]
        if not static and length <= settings.prefill_repeat_max_tokens:
            prefill += [peer_generation(model, ids, 1, pad_id)[0] for _ in range(settings.repeats - 1)]
        result.prefill_seconds = Spread.of(prefill)
        result.decode_tokens_per_s = Spread.of(window_rates(times, settings.window))
    except torch.OutOfMemoryError as e:
        result.error = out_of_memory_message(e)
    if device.type == "cuda":
        result.peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def out_of_memory_message(error: BaseException) -> str:
    asked = re.search(r"Tried to allocate [\d.]+ \w+", str(error))
    return "out of memory" + (f" ({asked.group(0).lower()})" if asked else "")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


# ---- output --------------------------------------------------------------------------------------
def finite_or_none(value):
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def format_tables(results: list[LengthResult], ceilings: Ceilings) -> str:
    """Markdown tables: minidecode against the roofline, then each peer with the speedups."""
    lines = [
        "| prompt | prefill s | TTFT - prefill s | decode tok/s | read roofline tok/s | % of read ceiling "
        "| GB/s | peak GiB |",
        "|" + " --- |" * 8,
    ]
    for r in results:
        peak = "-" if r.peak_memory_gib is None else f"{r.peak_memory_gib:.1f}"
        lines.append(
            f"| {r.prompt_tokens:,} | {r.prefill_seconds.format(2)} | "
            f"{r.first_token_wait_seconds.format(3)} | {r.decode_tokens_per_s.format()} | "
            f"{r.roofline_tokens_per_s.median:,.0f} | {r.percent_of_read_ceiling.format(0)} | "
            f"{r.achieved_gb_per_s.median:,.0f} | {peak} |"
        )
    drafted = [r for r in results if r.drafts is not None]
    if drafted:  # --speculate: the decode windows above ran with drafts
        lines += [
            "",
            "| prompt | speculate | decode steps | tokens / step | drafts accepted / proposed | acceptance |",
            "|" + " --- |" * 6,
        ]
        for r in drafted:
            d = r.drafts
            acceptance = "-" if d.acceptance is None else f"{d.acceptance:.2f}"
            lines.append(
                f"| {r.prompt_tokens:,} | {d.speculate} | {d.decode_steps:,} | {d.tokens_per_step:.2f} | "
                f"{d.accepted_tokens:,} / {d.proposed_tokens:,} | {acceptance} |"
            )
    for peer, title in PEERS.items():
        rows = [(r, p) for r in results for p in r.peers if p.peer == peer]
        if not rows:
            continue
        lines += [
            "",
            f"| prompt | {title} {rows[0][1].version}: prefill s | decode tok/s | compile warm-up s "
            "| decode speedup | prefill speedup |",
            "|" + " --- |" * 6,
        ]
        for r, p in rows:
            if p.error:
                lines.append(f"| {r.prompt_tokens:,} | {p.error} | - | - | - | - |")
                continue
            warm = "-" if p.compile_warmup_seconds is None else f"{p.compile_warmup_seconds:.0f}"
            lines.append(
                f"| {r.prompt_tokens:,} | {p.prefill_seconds.format(2)} | {p.decode_tokens_per_s.format()} | "
                f"{warm} | {r.decode_tokens_per_s.median / p.decode_tokens_per_s.median:.2f}x | "
                f"{p.prefill_seconds.median / r.prefill_seconds.median:.2f}x |"
            )
    lines += [
        "",
        f"read ceiling (sum over {ceilings.buffer_bytes / 2**30:.2f} GiB, best of several, this run): "
        f"{ceilings.read_bytes_per_s / 1e9:,.0f} GB/s; copy (read + write): "
        f"{ceilings.copy_bytes_per_s / 1e9:,.0f} GB/s",
        "figures: median (min-max) n=samples; speedups are ratios of medians",
    ]
    return "\n".join(lines)


def plot(results: list[LengthResult], path: str, title: str) -> None:
    """Decode tokens/s (median, min-max bars) and the read roofline vs context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bars(spreads):
        return [[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]]

    x = [r.prompt_tokens for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r.roofline_tokens_per_s.median for r in results], "k--", label="read roofline")
    ours = [r.decode_tokens_per_s for r in results]
    ax.errorbar(x, [s.median for s in ours], yerr=bars(ours), fmt="o-", capsize=3, label="minidecode")
    for peer, title_ in PEERS.items():
        points = [
            (r.prompt_tokens, p.decode_tokens_per_s) for r in results for p in r.peers if p.peer == peer
        ]
        points = [(n, s) for n, s in points if s is not None]
        if points:
            xs, spreads = zip(*points, strict=True)
            ax.errorbar(
                xs, [s.median for s in spreads], yerr=bars(spreads), fmt="s-", capsize=3, label=title_
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

"""Train the tiny Llama model that ships with minidecode (minidecode/assets/stdlib-tiny).

The corpus is the running interpreter's own standard library (see stdlib_corpus.py), or another
CPython stdlib tree given with --stdlib-root: no download, PSF-licensed, and split into train / valid /
heldout by a hash of each file's relative path. The script then

1. trains a byte-level BPE tokenizer on the training files, Llama-3 style: `<|begin_of_text|>` is
   prepended by the post-processor and `<|end_of_text|>` closes every document;
2. tokenizes each split into one stream, every file as BOS + tokens + EOS;
3. trains transformers' LlamaForCausalLM from scratch on random contiguous windows of the training
   stream (AdamW, linear warmup then cosine decay; bf16 autocast on CUDA, fp32 on CPU), keeping the
   weights with the lowest validation loss;
4. saves a standard Hugging Face folder (config.json, model.safetensors in bf16, tokenizer.json,
   tokenizer_config.json, generation_config.json) plus a model card README.md with the measured
   held-out loss of the trained model and of a random-init model of the same shape.

Examples:
    python training/train_tiny_model.py --smoke --out /tmp/stdlib-tiny-smoke        # CPU, seconds
    python training/train_tiny_model.py --device cuda --stdlib-root /path/to/lib/python3.11 \
        --stdlib-name "CPython 3.11.7" --out out/stdlib-tiny                      # the shipped model

The defaults are the shipped model's recipe (about 70 s on one H200). They make about 11 passes over
the 8.9M training tokens of a complete 3.11 stdlib; longer runs overfit (see the model card).

Debian and Ubuntu system Pythons ship the stdlib without its test suite (a separate package), which
leaves about a third of the text; --stdlib-root can point at a complete tree instead, e.g. the
`lib/python3.X` folder of a python.org, pyenv or uv installation, or the `Lib` folder of a CPython
source release.

With --time-budget the script times the warmup steps and then fixes the total step count so that
the training loop fits the budget; the model card records that count, and `--steps N` alone reruns
the same schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402  (sits next to this script; the path line above makes it importable)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SAMPLE_PROMPT = "def fibonacci(n):"

# Defaults of the shipped sampling settings (generation_config.json): mild temperature plus nucleus
# sampling reads better than greedy decoding, which makes a model this small repeat itself.
GEN_TEMPERATURE = 0.8
GEN_TOP_P = 0.95

# --smoke: a tiny model on a slice of the data, on CPU, for tests and for trying the script out.
# Explicit flags still override these.
SMOKE_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "layers": 2,
    "heads": 2,
    "kv_heads": 1,
    "head_dim": 32,
    "seq_len": 128,
    "batch_size": 8,
    "steps": 40,
    "warmup_steps": 5,
    "eval_interval": 20,
    "eval_windows": 4,
    "heldout_windows": 4,
    "log_interval": 5,
    "max_train_files": 30,
    "max_eval_files": 3,
    "sample_tokens": 16,
}


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over `texts`, with BOS/EOS specials (ids 0 and 1) and a BOS-prepending
    post-processor, as Llama-3 tokenizers have."""
    tok = Tokenizer(models.BPE())
    # GPT-2 style pre-split (letters, digits, punctuation runs, whitespace runs) then bytes -> printable
    # characters; runs of spaces stay together, so indentation becomes a few tokens.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for transformers' generic fast tokenizer over tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,  # already done by tokenizer.json's post-processor; stated for readers
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }


def encode_documents(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One 1-D int32 token stream: every text as BOS + tokens + EOS, back to back. Shape [n_tokens]."""
    eos_id = tok.token_to_id(EOS_TOKEN)
    pieces = []
    for enc in tok.encode_batch(texts):  # parallel in Rust; the post-processor adds BOS
        pieces.append(torch.tensor(enc.ids + [eos_id], dtype=torch.int32))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Model, batches, schedule, evaluation
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float


def llama_config(shape: ModelShape, bos_id: int, eos_id: int) -> LlamaConfig:
    """A plain Llama config: RMSNorm, SiLU MLP, RoPE, GQA, tied input/output embeddings."""
    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        attn_implementation="sdpa",
    )


def sample_windows(
    stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random contiguous windows of the stream: inputs [batch, seq_len] and next-token targets
    [batch, seq_len] (the same window shifted by one). Both int64 on the stream's device."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen, device=stream.device)
    offsets = torch.arange(seq_len + 1, device=stream.device)
    windows = stream[starts[:, None] + offsets].long()  # [batch, seq_len + 1]
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, total_steps: int, warmup_steps: int, peak_lr: float, min_ratio: float) -> float:
    """Linear warmup to peak_lr over warmup_steps, then cosine decay to min_ratio * peak_lr."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (weights and optimizer state stay fp32); plain fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def next_token_loss(model: LlamaForCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next token, computed in fp32. inputs/targets: [B, T]."""
    logits = model(input_ids=inputs, use_cache=False).logits  # [B, T, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def mean_nll(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    seq_len: int,
    max_windows: int | None = None,
    batch_size: int = 16,
) -> float:
    """Mean next-token negative log-likelihood (nats per token) over consecutive non-overlapping
    windows of `stream` from its start; each window is scored on its own (no carried context).
    exp() of the result is the perplexity."""
    device = next(model.parameters()).device
    n_windows = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window of {seq_len}")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for first in range(0, n_windows, batch_size):
        idx = torch.arange(first, min(first + batch_size, n_windows))
        rows = (idx[:, None] * seq_len + torch.arange(seq_len + 1)).to(stream.device)  # [b, seq_len+1]
        windows = stream[rows].long().to(device)
        with autocast_for(device):
            logits = model(input_ids=windows[:, :-1], use_cache=False).logits
        nll = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten(), reduction="sum")
        total += nll.item()
        count += windows[:, 1:].numel()
    model.train(was_training)
    return total / count


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (the tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def sample_text(
    model: LlamaForCausalLM, tok: Tokenizer, prompt: str, max_new_tokens: int, do_sample: bool, seed: int = 0
) -> str:
    """The prompt and its continuation (stops at EOS), decoded without special tokens."""
    device = next(model.parameters()).device
    ids = torch.tensor([tok.encode(prompt).ids], device=device)  # BOS + prompt tokens
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"do_sample": do_sample}
    if do_sample:
        kwargs.update(temperature=GEN_TEMPERATURE, top_p=GEN_TOP_P, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        eos_token_id=tok.token_to_id(EOS_TOKEN),
        pad_token_id=tok.token_to_id(EOS_TOKEN),
        **kwargs,
    )
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder for the model files")
    p.add_argument("--smoke", action="store_true", help="tiny model, slice of the data, CPU, seconds")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stdlib-root", type=Path, default=None, help="stdlib tree to train on (default: this interpreter's)"
    )
    p.add_argument(
        "--stdlib-name", default=None, help="name of that stdlib for the model card, e.g. 'CPython 3.11.7'"
    )
    p.add_argument("--summary-json", type=Path, default=None, help="also write the run's summary here")
    g = p.add_argument_group("model shape")
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--intermediate-size", type=int, default=768)
    g.add_argument("--layers", type=int, default=6)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=4096)
    g.add_argument("--rope-theta", type=float, default=10000.0)
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=1024, help="tokens per training window")
    g.add_argument("--batch-size", type=int, default=64, help="windows per step")
    g.add_argument(
        "--steps", type=int, default=1500, help="optimizer steps (an upper bound with --time-budget)"
    )
    g.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds for the training loop; the step count is then set from the measured speed (0: off)",
    )
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    g.add_argument("--warmup-steps", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g = p.add_argument_group("evaluation and data slicing")
    g.add_argument("--eval-interval", type=int, default=100, help="steps between validation runs")
    g.add_argument("--eval-windows", type=int, default=300, help="validation windows per run")
    g.add_argument("--heldout-windows", type=int, default=512, help="held-out windows for the final score")
    g.add_argument("--log-interval", type=int, default=250)
    g.add_argument("--max-train-files", type=int, default=None, help="use only the first N training files")
    g.add_argument(
        "--max-eval-files", type=int, default=None, help="use only the first N valid/heldout files"
    )
    g.add_argument("--sample-tokens", type=int, default=80, help="tokens generated for the card's samples")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags; with --smoke the SMOKE_DEFAULTS replace the defaults (explicit flags still win)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE_DEFAULTS)
        args = parser.parse_args(argv)
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole pipeline (corpus, tokenizer, training, saving, scoring); return a summary dict."""
    t_start = time.time()
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    )
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}, device {device} ({device_name})"
    )

    # ---- corpus ---------------------------------------------------------------------------
    root = stdlib_corpus.stdlib_root() if args.stdlib_root is None else args.stdlib_root
    stdlib_name = args.stdlib_name or (
        f"CPython {platform.python_version()}" if args.stdlib_root is None else f"the tree {root.name}"
    )
    train_paths, train_texts = stdlib_corpus.load_split("train", root, max_files=args.max_train_files)
    valid_paths, valid_texts = stdlib_corpus.load_split("valid", root, max_files=args.max_eval_files)
    held_paths, held_texts = stdlib_corpus.load_split("heldout", root, max_files=args.max_eval_files)
    print(
        f"stdlib of {stdlib_name}: train {len(train_paths)} files, "
        f"valid {len(valid_paths)}, heldout {len(held_paths)}"
    )

    # ---- tokenizer and token streams ------------------------------------------------------
    t0 = time.time()
    tok = train_tokenizer(train_texts, args.vocab_size)
    bos_id, eos_id = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    train_stream = encode_documents(tok, train_texts)
    valid_stream = encode_documents(tok, valid_texts)
    held_stream = encode_documents(tok, held_texts)
    train_chars = sum(len(t) for t in train_texts)
    print(
        f"tokenizer: {tok.get_vocab_size()} tokens, trained and applied in {time.time() - t0:.1f}s; "
        f"train {train_stream.numel():,} tokens ({train_chars / train_stream.numel():.2f} chars/token), "
        f"valid {valid_stream.numel():,}, heldout {held_stream.numel():,}"
    )
    for name, stream in (("train", train_stream), ("valid", valid_stream), ("heldout", held_stream)):
        if stream.numel() < args.seq_len + 2:
            raise SystemExit(f"the {name} split has {stream.numel()} tokens, fewer than one window")

    # ---- model and optimizer --------------------------------------------------------------
    shape = ModelShape(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
    )
    config = llama_config(shape, bos_id, eos_id)
    model = LlamaForCausalLM(config).to(device)
    n_params = count_parameters(model)
    print(f"model: {shape}, {n_params:,} parameters")

    # Weight decay on matrices (projections, embedding) only, not on the RMSNorm gains.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    train_stream_dev = train_stream.to(device)
    valid_stream_dev = valid_stream.to(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    def validate() -> float:
        return mean_nll(model, valid_stream_dev, args.seq_len, args.eval_windows, batch_size=args.batch_size)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # ---- training loop --------------------------------------------------------------------
    total_steps = args.steps
    best_valid = validate()  # the first call also pays for one-time kernel setup...
    t_eval = time.time()
    validate()  # ...so a second one is timed, for the time budget
    eval_seconds = time.time() - t_eval
    best_state = copy.deepcopy(model.state_dict())
    best_step = 0
    history: list[dict[str, float]] = [{"step": 0, "valid_loss": best_valid}]
    print(f"step 0: valid loss {best_valid:.4f} (random init; ln(vocab) = {math.log(shape.vocab_size):.4f})")

    # With a time budget, the warmup steps after the first few (which pay for one-time setup) are
    # timed, and at the end of the warmup total_steps is fixed. The warmup's learning rates do not
    # depend on total_steps, so the run follows exactly the schedule of `--steps total_steps`.
    calib_from, calib_to = min(10, args.warmup_steps // 4), args.warmup_steps
    budget_mode = args.time_budget > 0 and calib_to > calib_from
    t_loop = time.time()
    t_calib = t_loop
    pending: list[torch.Tensor] = []  # per-step losses kept on the device: no sync every step
    train_losses: list[float] = []
    t_log, tokens_per_step = time.time(), args.batch_size * args.seq_len
    model.train()
    step = 0
    while step < total_steps:
        if budget_mode and step in (calib_from, calib_to):
            sync()
            if step == calib_from:
                t_calib = time.time()
            else:
                per_step = (time.time() - t_calib) / (calib_to - calib_from)
                per_step += eval_seconds / args.eval_interval  # amortized validation runs
                left = args.time_budget - (time.time() - t_loop)
                total_steps = min(args.steps, step + max(0, int(0.97 * left / per_step)))
                print(f"timed {per_step * 1000:.1f} ms/step: training for {total_steps} steps in total")
                if step >= total_steps:
                    break

        if budget_mode and time.time() - t_loop > 1.25 * args.time_budget:
            print(f"stopping at step {step}: the training loop ran 25% past its time budget")
            break
        lr = lr_at(step, total_steps, args.warmup_steps, args.lr, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = sample_windows(train_stream_dev, args.batch_size, args.seq_len, gen)
        with autocast_for(device):
            loss = next_token_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pending.append(loss.detach())
        step += 1

        if step % args.log_interval == 0 or step == total_steps:
            train_losses.extend(torch.stack(pending).tolist())
            recent = train_losses[-len(pending) :]
            elapsed = time.time() - t_log
            print(
                f"step {step}/{total_steps}: loss {sum(recent) / len(recent):.4f}, lr {lr:.2e}, "
                f"{len(pending) * tokens_per_step / elapsed:,.0f} tok/s, {time.time() - t_loop:.0f}s"
            )
            pending, t_log = [], time.time()
        if step % args.eval_interval == 0 or step == total_steps:
            valid = validate()
            history.append({"step": step, "valid_loss": valid})
            marker = ""
            if valid < best_valid:
                best_valid, best_step, marker = valid, step, " (best)"
                best_state = copy.deepcopy(model.state_dict())
            print(f"step {step}: valid loss {valid:.4f}{marker}")
    sync()
    train_seconds = time.time() - t_loop
    tail = train_losses[-max(1, min(len(train_losses), 100)) :]
    final_train_loss = sum(tail) / len(tail)
    print(f"trained {step} steps in {train_seconds:.0f}s; keeping step {best_step} (valid {best_valid:.4f})")

    # ---- save: bf16 weights, tokenizer files, generation defaults --------------------------
    model.load_state_dict(best_state)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        do_sample=True,
        temperature=GEN_TEMPERATURE,
        top_p=GEN_TOP_P,
        top_k=0,
    )
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(args.max_position_embeddings), indent=2) + "\n"
    )

    # ---- score what was saved (reloaded, fp32) against a random-init model of the same shape --
    saved = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device)
    held_dev = held_stream.to(device)
    held_windows = min(args.heldout_windows, (held_stream.numel() - 1) // args.seq_len)
    held_loss = mean_nll(saved, held_dev, args.seq_len, held_windows)
    torch.manual_seed(args.seed + 1)
    random_model = LlamaForCausalLM(config).to(device)
    random_loss = mean_nll(random_model, held_dev, args.seq_len, held_windows)
    del random_model
    print(
        f"heldout ({held_windows * args.seq_len:,} tokens): loss {held_loss:.4f}, "
        f"perplexity {math.exp(held_loss):.2f}; random init: loss {random_loss:.4f}, "
        f"perplexity {math.exp(random_loss):.1f}"
    )
    greedy = sample_text(saved, tok, SAMPLE_PROMPT, args.sample_tokens, do_sample=False)
    sampled = sample_text(saved, tok, SAMPLE_PROMPT, args.sample_tokens, do_sample=True, seed=args.seed)
    print(
        f"--- greedy ---\n{greedy}\n--- sampled (T={GEN_TEMPERATURE}, top_p={GEN_TOP_P}) ---\n{sampled}\n---"
    )

    summary: dict[str, Any] = {
        "python_version": platform.python_version(),
        "stdlib_name": stdlib_name,
        "stdlib_is_running_interpreter": args.stdlib_root is None,
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "device": f"{device.type} ({device_name})",
        "files": {"train": len(train_paths), "valid": len(valid_paths), "heldout": len(held_paths)},
        "train_chars": train_chars,
        "tokens": {
            "train": train_stream.numel(),
            "valid": valid_stream.numel(),
            "heldout": held_stream.numel(),
        },
        "vocab_size": shape.vocab_size,
        "shape": shape.__dict__,
        "parameters": n_params,
        "safetensors_bytes": (out_dir / "model.safetensors").stat().st_size,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "steps": step,
        "warmup_steps": args.warmup_steps,
        "lr": args.lr,
        "min_lr_ratio": args.min_lr_ratio,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / train_stream.numel(),
        "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "final_train_loss": final_train_loss,
        "train_losses": train_losses,
        "best_step": best_step,
        "best_valid_loss": best_valid,
        "valid_history": history,
        "heldout_tokens_scored": held_windows * args.seq_len,
        "heldout_loss": held_loss,
        "heldout_perplexity": math.exp(held_loss),
        "random_init_heldout_loss": random_loss,
        "random_init_heldout_perplexity": math.exp(random_loss),
        "sample_greedy": greedy,
        "sample_sampled": sampled,
    }
    (out_dir / "README.md").write_text(model_card(summary, args))
    if args.summary_json is not None:
        args.summary_json.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"saved to {out_dir} in {summary['total_seconds']:.0f}s total")
    return summary


# ----------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------


def reproduce_command(args: argparse.Namespace, steps: int) -> str:
    """The command line that reruns this schedule with the step count fixed (no time budget)."""
    parts = ["python training/train_tiny_model.py", f"--device {args.device}"]
    if args.smoke:
        parts.append("--smoke")
    if args.stdlib_root is not None:
        parts.append("--stdlib-root STDLIB_DIR")
        parts.append(f"--stdlib-name {shlex.quote(args.stdlib_name or args.stdlib_root.name)}")
    parts += [
        f"--vocab-size {args.vocab_size}",
        f"--hidden-size {args.hidden_size}",
        f"--intermediate-size {args.intermediate_size}",
        f"--layers {args.layers}",
        f"--heads {args.heads}",
        f"--kv-heads {args.kv_heads}",
        f"--head-dim {args.head_dim}",
        f"--max-position-embeddings {args.max_position_embeddings}",
        f"--seq-len {args.seq_len}",
        f"--batch-size {args.batch_size}",
        f"--steps {steps}",
        f"--lr {args.lr:g}",
        f"--min-lr-ratio {args.min_lr_ratio:g}",
        f"--warmup-steps {args.warmup_steps}",
        f"--weight-decay {args.weight_decay:g}",
        f"--seed {args.seed}",
        "--out OUTPUT_DIR",
    ]
    return " \\\n    ".join(parts)


def model_card(s: dict[str, Any], args: argparse.Namespace) -> str:
    """README.md for the model folder, filled from the run's summary."""
    where = (
        "the standard library of the interpreter that ran the script"
        if s["stdlib_is_running_interpreter"]
        else "a complete stdlib tree given with `--stdlib-root`"
    )
    shape = s["shape"]
    mib = s["safetensors_bytes"] / 2**20
    budget = (
        f" (the step count was set from a {args.time_budget:.0f} s budget for the training loop)"
        if args.time_budget > 0
        else ""
    )
    fence = "```"
    attention = (
        f"{shape['heads']} query heads, {shape['kv_heads']} key/value heads, head_dim {shape['head_dim']}"
    )
    software = (
        f"Python {s['python_version']}, torch {s['torch_version']}, transformers {s['transformers_version']}"
    )
    return f"""# stdlib-tiny

A {s["parameters"] / 1e6:.1f}M-parameter Llama-architecture language model trained from scratch on
the source code of the {s["stdlib_name"]} standard library. It ships with minidecode so that the
runtime produces real text with no download and no checkpoint of your own.

**Intended use:** demos, smoke tests and numerical tests of the runtime. It writes plausible-looking
Python, but it is not an assistant and not a useful code model: do not rely on what it writes.

## Model

| | |
| --- | --- |
| architecture | `LlamaForCausalLM` (model_type `llama`): RMSNorm, SiLU MLP, RoPE, grouped-query attention |
| layers | {shape["layers"]} |
| hidden size / MLP size | {shape["hidden_size"]} / {shape["intermediate_size"]} |
| attention | {attention} |
| vocabulary | {s["vocab_size"]} tokens, input and output embeddings tied |
| RoPE | default, theta {shape["rope_theta"]:g}; max_position_embeddings {shape["max_position_embeddings"]} |
| parameters | {s["parameters"]:,} |
| weights | `model.safetensors`, bfloat16, {s["safetensors_bytes"]:,} bytes ({mib:.1f} MiB) |

It was trained on windows of {s["seq_len"]} tokens: it runs at any length up to
max_position_embeddings, but text beyond the training length gets worse.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files: {s["vocab_size"]} tokens including the 256
byte symbols, GPT-2 style pre-splitting (runs of spaces stay together, so indentation is cheap).
Special tokens: `<|begin_of_text|>` (BOS, id 0) and `<|end_of_text|>` (EOS, id 1). As with Llama 3,
the post-processor in `tokenizer.json` prepends BOS to every encoded text; the decoder is ByteLevel.

## Data

The `.py` files of the {s["stdlib_name"]} standard library ({where}),
sorted by path; folders named `site-packages`/`dist-packages` and the build-generated
`_sysconfigdata*`/`config-*` files are skipped. Each file goes to a split by the SHA-1 of its path
relative to the stdlib root: remainder 0 modulo 50 is **held out** (used only for the scores below),
remainder 1 is **validation** (picks the checkpoint), the rest is training. The rule gives every path
the same split on every Python version.

| split | files | tokens |
| --- | --- | --- |
| train | {s["files"]["train"]} | {s["tokens"]["train"]:,} ({s["train_chars"]:,} characters) |
| valid | {s["files"]["valid"]} | {s["tokens"]["valid"]:,} |
| heldout | {s["files"]["heldout"]} | {s["tokens"]["heldout"]:,} |

Every file is one document: BOS + tokens + EOS, documents back to back in one stream.

**Licence of the data:** the Python standard library is distributed under the Python Software
Foundation License (PSF-2.0). The model is trained on that code and can reproduce fragments of it;
such output is PSF-licensed code.

## Training

`training/train_tiny_model.py` in the minidecode repository: a plain PyTorch loop over
transformers' `LlamaForCausalLM`; batches of {s["batch_size"]} random contiguous windows of
{s["seq_len"]} tokens; AdamW (betas 0.9/0.95, weight decay {s["weight_decay"]:g} on matrices) with
{s["warmup_steps"]} warmup steps to a peak learning rate of {s["lr"]:g}, then cosine decay to
{s["min_lr_ratio"]:g}x that; gradient clipping at 1.0; bf16 autocast on CUDA.

| | |
| --- | --- |
| device | {s["device"]} |
| software | {software} |
| steps | {s["steps"]}{budget} |
| tokens seen | {s["tokens_seen"]:,} ({s["epochs"]:.1f} epochs of the training stream) |
| training time | {s["train_seconds"]:.0f} s (whole script: {s["total_seconds"]:.0f} s) |
| final training loss | {s["final_train_loss"]:.3f} (mean of the last 100 steps) |
| kept checkpoint | step {s["best_step"]}, lowest validation loss {s["best_valid_loss"]:.3f} |

## Evaluation

Held-out loss over the first {s["heldout_tokens_scored"]:,} tokens of the held-out stream, in windows of
{s["seq_len"]} tokens, with the saved bf16 weights loaded in fp32:

| model | loss (nats/token) | perplexity |
| --- | --- | --- |
| stdlib-tiny | {s["heldout_loss"]:.3f} | {s["heldout_perplexity"]:.2f} |
| random init, same shape | {s["random_init_heldout_loss"]:.3f} | {s["random_init_heldout_perplexity"]:.1f} |

`tests/test_tiny_model.py` repeats this check on the held-out files of whichever Python runs the tests.

## Generation defaults

`generation_config.json`: sampling with temperature {GEN_TEMPERATURE} and top_p {GEN_TOP_P} (no top-k);
greedy decoding of a model this small tends to loop. Samples from the prompt `{SAMPLE_PROMPT}`:

Greedy:

{fence}python
{s["sample_greedy"]}
{fence}

Sampled (temperature {GEN_TEMPERATURE}, top_p {GEN_TOP_P}, seed {s["seed"]}):

{fence}python
{s["sample_sampled"]}
{fence}

## Reproduce

{fence}
{reproduce_command(args, s["steps"])}
{fence}

Results depend on the Python version (its stdlib is the data) and, slightly, on the GPU and library
versions.
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    hf_logging.disable_progress_bar()  # keeps the training log readable
    return train(parse_args(argv))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Everything the GPU has to show, in one device call: install, GPU tests (each file in its own
# process: the CPU kernel tests switch a process to the Triton interpreter), the decode-step
# profile, and the end-to-end benchmark against transformers (eager and static cache + compile).
# Environment:
#   STAGES       which of: tests attention fp8 fp8w fp8gemv fp8prefill profile bench demo prefix
#                suffix batch integ multi ab serve stall chunk speculate fresh (default "tests profile
#                bench"; multi needs 2 or 4 GPUs)
#   TEST_FILES   what the tests stage runs (default: every file of tests/)
#   SERVE_PARTS  what serve runs: loads and/or stall (default both); STALL_BUDGETS the stall
#                measurement's mixed-step budgets, 0 = the default (default "0"; stage stall: "0")
#   FRESH_RUNS   what fresh runs: "length:label:flags" items, ";"-separated
#   MULTI_PARTS  what multi runs: tests and/or bench (default "tests bench")
#   FP8P_PARTS   which parts of fp8prefill: tests kernel accuracy probe (default: all four)
#   SKIP_INSTALL set: minidecode is installed already (two runs side by side, one GPU each)
#   LOG_DIR      logs (default bench/logs)
#   RESULTS_DIR  where bench writes e2e.{json,md,png} (default $LOG_DIR; bench/results republishes)
#   LENGTHS      prompt lengths (default "1024 4096 32768 131072 524288")
#   REPEATS      samples per figure (default 3)
#   PEER_MAX, COMPILED_MAX   longest prompt for the transformers peers (eager, compiled)
# The bench stage is sized for about 9 minutes on an H200: minidecode's 512k prefill is ~135 s
# (one sample: prompts above 32k are prefilled once), the compiled peer's warm-up ~30 s a length.
set -uo pipefail
export PYTHONUNBUFFERED=1
LOG_DIR=${LOG_DIR:-bench/logs}
RESULTS_DIR=${RESULTS_DIR:-$LOG_DIR}
mkdir -p "$LOG_DIR" "$RESULTS_DIR"
STAGES=${STAGES:-"tests profile bench"}
LENGTHS=${LENGTHS:-"1024 4096 32768 131072 524288"}
REPEATS=${REPEATS:-3}
PEER_MAX=${PEER_MAX:-524288}
COMPILED_MAX=${COMPILED_MAX:-32768}
summary=()
if [[ -z ${SKIP_INSTALL:-} ]]; then  # set when another run in the same session installed it already
  install_log=$(mktemp)
  python3 -m pip install --no-deps --no-build-isolation -e . -q >"$install_log" 2>&1 || { cat "$install_log"; exit 1; }
fi
python3 -c "import minidecode.kernels.lean_attention, minidecode.models.llama" || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

if [[ $STAGES == *tests* ]]; then
  # Every test marked gpu, in one process (with CUDA present no test switches to the interpreter;
  # each LLM's warm-up compiles every decode batch bucket's kernels: minutes on an empty Triton cache).
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=15 ${TEST_FILES:-tests} \
    >"$LOG_DIR/gpu-tests.log" 2>&1
  summary+=("gpu tests: $(tail -1 "$LOG_DIR/gpu-tests.log")")
fi
if [[ $STAGES == *attention* ]]; then
  # The decode-attention table (bf16 and FP8 caches, SDPA flash and cuDNN) -> attention.{md,json,png}.
  timeout 300 python3 bench/attention.py --no-flex --out "$RESULTS_DIR/attention" 2>&1 | tee "$LOG_DIR/attention.log" | tail -25
  summary+=("attention exit ${PIPESTATUS[0]}")
fi
if [[ " $STAGES " == *" fp8 "* ]]; then  # the word: fp8w and fp8prefill are stages of their own
  # FP8 cache: accuracy against bf16 at 128k (teacher-forced), decode speed on filled caches
  # (labelled as such: no prefill) at 512k for both cache dtypes and at 1M for FP8 (a bf16 1M
  # cache does not fit one H200), and the end-to-end bench with the FP8 cache.
  {
    timeout 150 python3 bench/fp8_accuracy.py --context 131072
    for dt in auto fp8; do timeout 90 python3 bench/fp8_accuracy.py --fill --context 524288 --kv-cache-dtype $dt; done
    timeout 120 python3 bench/fp8_accuracy.py --fill --context 1048576 --kv-cache-dtype fp8
  } 2>&1 | tee "$LOG_DIR/fp8.log" | grep -A3 "^| context"
  timeout 150 python3 -m minidecode_cli.cli bench synthetic:llama-3-8b --kv-cache-dtype fp8 \
    --prompt-tokens 1024 --prompt-tokens 131072 --new-tokens 64 --repeats 3 --out "$RESULTS_DIR/e2e-fp8" \
    2>&1 | tee -a "$LOG_DIR/fp8.log" | tail -12
  summary+=("fp8 bench exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *fp8w* ]]; then
  # FP8 weights (about 5 minutes on an H100): the GPU tests of tests/test_fp8_weights*.py (the FP8
  # GEMV against float64 for every shape and scale layout, graph == eager over 256 steps, a batch
  # == each request alone), then bench/fp8_weights.py -> fp8-weights.{md,json}: the GEMV against
  # its read roofline and the bf16 GEMV, decode at 1k and 32k and prefill at 32k with FP8 weights
  # against bf16 weights (synthetic Llama-3-8B, same process), and FP8 logits against bf16 at 4k.
  if [[ ${FP8W_PARTS:-tests bench} == *tests* ]]; then
    timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_fp8_weights.py \
      tests/test_fp8_weights_gpu.py >"$LOG_DIR/fp8w-tests.log" 2>&1
    summary+=("fp8w tests: $(tail -1 "$LOG_DIR/fp8w-tests.log")")
  fi
  timeout 240 python3 bench/fp8_weights.py --out "$RESULTS_DIR" 2>&1 | tee "$LOG_DIR/fp8w-bench.log" | tail -28
  summary+=("fp8w bench exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *fp8gemv* ]]; then
  # The FP8 GEMV's launch configs at one row, the best checked at 8 and 32 (bench/tune_gemv.py
  # --fp8, ~100 s on an H100) -> tune-gemv-fp8.{md,json}.
  timeout 300 python3 bench/tune_gemv.py --fp8 --out "$RESULTS_DIR" 2>&1 | tee "$LOG_DIR/fp8gemv.log" | tail -70
  summary+=("fp8gemv exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *profile* ]]; then
  timeout 240 python3 bench/decode_profile.py synthetic:llama-3-8b 1024 2>&1 | tee "$LOG_DIR/decode-profile.log" | tail -6
fi
if [[ $STAGES == *bench* ]]; then
  args=()
  for n in $LENGTHS; do args+=(--prompt-tokens "$n"); done
  timeout 590 python3 -m minidecode_cli.cli bench synthetic:llama-3-8b "${args[@]}" --new-tokens 64 \
    --repeats "$REPEATS" --compare transformers --peer eager,compiled \
    --peer-max-tokens "$PEER_MAX" --compiled-max-tokens "$COMPILED_MAX" \
    --out "$RESULTS_DIR/e2e" --plot \
    2>&1 | tee "$LOG_DIR/e2e.log"
  summary+=("bench exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *demo* ]]; then
  # The CLI on a 512k-token prompt file (synthetic models read text as bytes: 1 byte = 1 token).
  cat $(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")/*.py | head -c 524288 >"$LOG_DIR/prompt-512k.txt"
  timeout 300 python3 -m minidecode_cli.cli generate synthetic:llama-3-8b --prompt-file "$LOG_DIR/prompt-512k.txt" \
    --max-new-tokens 64 --temperature 0 >"$LOG_DIR/demo-stdout.txt" 2>"$LOG_DIR/demo-stderr.txt"
  summary+=("demo exit $?")
  tr '\r' '\n' <"$LOG_DIR/demo-stderr.txt" | tail -4
  rm -f "$LOG_DIR/prompt-512k.txt"
fi
if [[ $STAGES == *prefix* ]]; then
  # Second-question TTFT on a 128k cached document, cache file save/load (about 1.5 min, H200);
  # PREFIX_512K=1 adds the 512k document (about 3 more minutes).
  timeout 540 python3 bench/prefix_reuse.py --dir "${PREFIX_DIR:-/tmp}" ${PREFIX_512K:+--with-512k} 2>&1 \
    | tee "$LOG_DIR/prefix-reuse.log" | tail -9
  summary+=("prefix exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *suffix* ]]; then
  # A short suffix after a long cached prefix: one full call over the past against the split one.
  timeout 120 python3 bench/prefill_blocks.py --suffix 2>&1 | tee "$LOG_DIR/suffix.log" | tail -8
fi
if [[ $STAGES == *batch* ]]; then
  # Batched decode against the batched roofline, the padded-flash runtime and transformers.
  timeout 420 python3 -m minidecode_cli.cli bench synthetic:llama-3-8b --batch 8x32k --batch 32x4k \
    --batch 256k,4k,8k,16k,32k,4k,8k,16k --new-tokens 32 --repeats 3 --out "$RESULTS_DIR/batch" \
    2>&1 | tee "$LOG_DIR/batch.log" | tail -8
  summary+=("batch exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *integ* ]]; then
  # Cache-file checksums and the weights fingerprint (bench/cache_checksum.py): a 128k cache
  # (Llama-3-8B shapes, 16 GiB) saved and loaded from disk with the checksums and without them (the
  # same streaming, as the peer), the checksums alone on the GPU, and the full-weights fingerprint
  # of the 8B against a read of the same bytes; first the cache-file GPU tests. About 2 min on an
  # H100; needs 17 GiB free in INTEG_DIR (default /tmp), where one file at a time is written and
  # deleted.
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_cache_file.py >"$LOG_DIR/integ-tests.log" 2>&1
  summary+=("integ gpu tests: $(tail -1 "$LOG_DIR/integ-tests.log")")
  timeout 300 python3 bench/cache_checksum.py --dir "${INTEG_DIR:-/tmp}" --out "$RESULTS_DIR/cache-checksum" \
    2>&1 | tee "$LOG_DIR/integ.log" | tail -9
  summary+=("integ exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *multi* ]]; then
  # Several GPUs (~8 min on 2 x H100): the 2-GPU tests (one-shot and NCCL collectives against one
  # GPU, the CLI under torchrun; ~2 min), then bench/distributed.py (one GPU, tp N, cp N, each part
  # under its own limit; ~5 min) -> distributed-{N}gpu-{card}.{md,json}. NVLink multicast stays off.
  export NCCL_NVLS_ENABLE=0
  nvidia-smi topo -m >"$LOG_DIR/multi-topology.txt" 2>&1
  if [[ ${MULTI_PARTS:-tests bench} == *tests* ]]; then
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_distributed.py \
      >"$LOG_DIR/multi-tests.log" 2>&1
    summary+=("multi tests (exit $?): $(tail -1 "$LOG_DIR/multi-tests.log")")
  fi
  if [[ ${MULTI_PARTS:-tests bench} == *bench* ]]; then
    timeout 450 python3 bench/distributed.py --out "$RESULTS_DIR/distributed" >"$LOG_DIR/multi-bench.log" 2>&1
    summary+=("multi bench exit $?: $(grep -c '^!!' "$LOG_DIR/multi-bench.log") failed parts")
    sed -n '/^# Several GPUs/,$p' "$LOG_DIR/multi-bench.log" | head -60
  fi
fi
if [[ $STAGES == *fp8prefill* ]]; then
  # FP8 prefill attention (issue 36), about 6-7 minutes on an H100: its GPU tests (every candidate
  # config against float64, repeatability, chunked == whole, routing), the kernel against SDPA flash
  # and cuDNN at 4k-1M with the config sweep and accuracy (prefill-attention.md), the model-level
  # accuracy on the synthetic 8B at 32k and 128k and the needle check on the shipped model
  # (prefill-fp8-accuracy.md), and the default prefill's probe against transformers at 1k, 32k
  # and 128k (prefill-probe.md). Each part under its own timeout; a failed part does not stop the rest.
  parts=${FP8P_PARTS:-"tests kernel accuracy probe"}
  fp8p=("fp8prefill parts: $parts")
  fp8p_part() {  # name, time limit (s), log; then the command
    local name=$1 limit=$2 log=$3
    shift 3
    timeout "$limit" "$@" >"$log" 2>&1
    local rc=$?
    fp8p+=("fp8prefill $name: exit $rc$([ $rc = 124 ] && echo " (timed out after $limit s)")")
    if [ $rc != 0 ]; then echo "---- $name failed ($rc), end of $log:"; tail -8 "$log"; fi
  }
  if [[ $parts == *tests* ]]; then
    fp8p_part "gpu tests" 240 "$LOG_DIR/fp8prefill-tests.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
      -rfE -s tests/test_prefill_fp8.py tests/test_prefill_attention.py
    fp8p+=("fp8prefill gpu tests: $(tail -1 "$LOG_DIR/fp8prefill-tests.log")")
  fi
  if [[ $parts == *kernel* ]]; then
    fp8p_part "kernel vs SDPA" 200 "$LOG_DIR/prefill-attention.log" \
      python3 bench/prefill_attention.py --out "$RESULTS_DIR/prefill-attention"
  fi
  if [[ $parts == *accuracy* ]]; then
    fp8p_part "model accuracy" 150 "$LOG_DIR/prefill-fp8-accuracy.log" \
      python3 -m bench.fp8_prefill_accuracy --lengths 32768 131072 --out "$RESULTS_DIR/prefill-fp8-accuracy"
  fi
  if [[ $parts == *probe* ]]; then
    fp8p_part "default prefill probe" 240 "$LOG_DIR/prefill-probe.log" \
      python3 bench/prefill_probe.py --out "$RESULTS_DIR/prefill-probe"
  fi
  for f in prefill-attention prefill-fp8-accuracy prefill-probe; do
    if [ -f "$RESULTS_DIR/$f.md" ]; then echo "---- $f.md"; grep -v "^$" "$RESULTS_DIR/$f.md" | head -70; fi
  done
  grep -E "passed|failed|error" "$LOG_DIR/fp8prefill-tests.log" 2>/dev/null | tail -12
  summary+=("${fp8p[@]}")
fi
if [[ $STAGES == *ab* ]]; then
  # One request at a time, A/B: the commit before the engine loop (a tree in AB_BASE_TAR, made by
  # `git archive`) against this tree, alternating base / new twice in one session on one card
  # (bench/single_request.py: TTFT, prefill and decode tok/s at 1k x3 and 128k x1 a process).
  base_tar=${AB_BASE_TAR:-bench/logs/base.tar}
  rm -rf /tmp/ab-base /tmp/ab-pkg && mkdir -p /tmp/ab-base && tar -xf "$base_tar" -C /tmp/ab-base
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/ab-pkg /tmp/ab-base >"$LOG_DIR/ab-install.log" 2>&1
  (cd /tmp && PYTHONPATH=/tmp/ab-pkg python3 -c "import minidecode, sys; sys.exit('/tmp/ab-pkg' not in minidecode.__file__)") \
    || summary+=("ab: the base tree did not import")
  : >"$LOG_DIR/ab.jsonl"
  for label in base new base new; do
    if [[ $label == base ]]; then pp=/tmp/ab-pkg; else pp=; fi
    PYTHONPATH=$pp timeout 150 python3 bench/single_request.py --label "$label" ${AB_LENGTHS:+--lengths $AB_LENGTHS} \
      >>"$LOG_DIR/ab.jsonl" 2>>"$LOG_DIR/ab.log"
  done
  python3 - "$LOG_DIR/ab.jsonl" <<'PY' | tee "$RESULTS_DIR/ab-single-request.md"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print("| prompt | figure | base (median, min-max, n) | new (median, min-max, n) | new / base |")
print("| --- | --- | --- | --- | --- |")
for prompt in sorted({r["prompt"] for r in rows}):
    for key in ("ttft_s", "prefill_s", "decode_tok_s"):
        cells = []
        for label in ("base", "new"):
            v = sorted(r[key] for r in rows if r["prompt"] == prompt and r["label"] == label)
            cells.append((statistics.median(v), v[0], v[-1], len(v)) if v else None)
        text = [f"{m:.4g} ({lo:.4g}-{hi:.4g}, n={n})" if c else "-" for c in cells for m, lo, hi, n in [c or (0, 0, 0, 0)]]
        ratio = f"{cells[1][0] / cells[0][0]:.3f}" if all(cells) else "-"
        print(f"| {prompt:,} | {key} | {text[0]} | {text[1]} | {ratio} |")
PY
  summary+=("ab: $(grep -c '^{' "$LOG_DIR/ab.jsonl") requests timed")
fi
if [[ $STAGES == *serve* ]]; then
  # The server under load (bench/serve.py, about 6 minutes on an H100): 1, 8, 32 clients with 4k
  # prompts through the openai client (the server in a process of its own) against the Python
  # API, alternating python / http twice, each phase a process; then 8 running streams while a
  # 128k prompt prefills. Its packages (fastapi, uvicorn, prometheus-client, openai) come from
  # WHEELS, a folder of wheels carried to the machine.
  python3 -m pip install -q --no-index --find-links "${WHEELS:-.whl}" fastapi uvicorn prometheus-client openai \
    >"$LOG_DIR/serve-install.log" 2>&1 || summary+=("serve: install failed (serve-install.log)")
  timeout "${SERVE_TIMEOUT:-480}" python3 bench/serve.py --parts ${SERVE_PARTS:-loads stall} \
    --stall-step-tokens ${STALL_BUDGETS:-0} --out "$RESULTS_DIR/serve" >"$LOG_DIR/serve.log" 2>&1
  summary+=("serve exit $?")
  tail -15 "$LOG_DIR/serve.log"
fi
if [[ $STAGES == *speculate* ]]; then
  # Speculative decoding end to end (bench/speculate.py, about 3 minutes on an H200): the shipped model
  # re-emitting code its prompt holds and repeating a 3k-token document, and random ids on the
  # synthetic 8B at 32k (nothing to match; its 32k prefill, ~1.2 s, runs 12 times), 512 new tokens
  # each with and without --speculate 8, alternated, 5 timed pairs a task, the outputs checked
  # equal -> speculate.{md,json}.
  timeout "${SPECULATE_TIMEOUT:-360}" python3 bench/speculate.py --new-tokens 512 --repeats "${SPECULATE_REPEATS:-5}" \
    --out "$RESULTS_DIR/speculate" 2>&1 \
    | tee "$LOG_DIR/speculate.log" | tail -8
  summary+=("speculate exit ${PIPESTATUS[0]}")
fi
if [[ $STAGES == *stall* ]]; then
  # The long prompt's prefill beside 8 running streams, once per mixed-step budget (STALL_BUDGETS;
  # 0 = the default), each in a process of its own (bench/serve.py --parts stall; at 128k about
  # 2 minutes a budget on an H200 at 4119ee6, whose mixed steps took 66 s) -> serve-stall.{md,json}.
  timeout "${STALL_TIMEOUT:-300}" python3 bench/serve.py --parts stall --stall-step-tokens ${STALL_BUDGETS:-0} \
    ${STALL_LONG:+--long $STALL_LONG} --out "$RESULTS_DIR/serve-stall" >"$LOG_DIR/stall.log" 2>&1
  summary+=("stall exit $?")
  tail -8 "$LOG_DIR/stall.log"
fi
if [[ $STAGES == *chunk* ]]; then
  # A mixed step's chunk attention (kernels/chunk_attention.py, each launch config) against SDPA's
  # flash forward, at pasts of 0-512k and 64-384 rows (about a minute) -> chunk-attention.{md,json}.
  timeout 240 python3 bench/chunk_attention.py --out "$RESULTS_DIR/chunk-attention" >"$LOG_DIR/chunk.log" 2>&1
  summary+=("chunk attention exit $?")
  tail -20 "$LOG_DIR/chunk.log"
fi
if [[ $STAGES == *fresh* ]]; then
  # Time to first token minus prefill, each run a fresh process with an empty Triton cache (what a
  # user on a fresh install pays): `minidecode generate --json` on a random prompt; the process's
  # wall time (load and warm-up included) beside it -> fresh.jsonl and a table.
  : >"$LOG_DIR/fresh.jsonl"
  IFS=';' read -ra fresh_runs <<<"${FRESH_RUNS:-131072:bf16:}"
  for run in "${fresh_runs[@]}"; do
    IFS=':' read -r length label flags <<<"$run"
    cache=$(mktemp -d)
    start=$(date +%s.%N)
    TRITON_CACHE_DIR=$cache timeout "${FRESH_TIMEOUT:-240}" python3 -m minidecode generate "${FRESH_MODEL:-synthetic:llama-3-8b}" \
      --prompt-tokens "$length" --seed 1 --max-new-tokens 16 --temperature 0 --ignore-eos --json $flags \
      >"$LOG_DIR/fresh-out.json" 2>>"$LOG_DIR/fresh.log"
    rc=$?
    wall=$(python3 -c "import sys; print(round($(date +%s.%N) - $start, 1))")
    python3 - "$LOG_DIR/fresh-out.json" "$label" "$length" "$flags" "$rc" "$wall" >>"$LOG_DIR/fresh.jsonl" <<'PY'
import json, sys
path, label, length, flags, rc, wall = sys.argv[1:]
row = {"label": label, "prompt": int(length), "flags": flags, "exit": int(rc), "process_s": float(wall)}
try:
    stats = json.load(open(path))["stats"]
    row |= {"ttft_s": round(stats["time_to_first_token"], 3), "prefill_s": round(stats["prefill_seconds"], 3)}
    row["ttft_minus_prefill_s"] = round(row["ttft_s"] - row["prefill_s"], 3)
except Exception as e:  # the run failed: its exit code and log say why
    row["error"] = repr(e)[:200]
print(json.dumps(row))
PY
    rm -rf "$cache"
  done
  python3 - "$LOG_DIR/fresh.jsonl" <<'PY' | tee "$RESULTS_DIR/fresh.md"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| run | prompt | flags | prefill s | TTFT s | TTFT - prefill s | process s (load, warm-up, run) |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    cells = [r.get(k, "-") for k in ("prefill_s", "ttft_s", "ttft_minus_prefill_s")]
    print(f"| {r['label']} | {r['prompt']:,} | `{r['flags'] or '-'}` | {' | '.join(map(str, cells))} | {r['process_s']} |")
PY
  summary+=("fresh: $(grep -c ttft_s "$LOG_DIR/fresh.jsonl") of ${#fresh_runs[@]} runs timed")
fi
echo "==== summary"
printf '%s\n' "${summary[@]}"
if [ -f "$LOG_DIR/decode-profile.log" ]; then tail -4 "$LOG_DIR/decode-profile.log"; fi
if [ -f "$LOG_DIR/e2e.log" ]; then grep -A40 "^| prompt" "$LOG_DIR/e2e.log" | head -30; fi
if [ -f "$LOG_DIR/multi-tests.log" ]; then grep -E "^(FAILED|ERROR)|passed|failed" "$LOG_DIR/multi-tests.log" | tail -8; fi

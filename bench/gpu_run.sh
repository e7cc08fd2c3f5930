#!/usr/bin/env bash
# Everything the GPU has to show, in one device call: install, GPU tests (each file in its own
# process: the CPU kernel tests switch a process to the Triton interpreter), the decode-step
# profile, and the end-to-end benchmark against transformers. Logs and results go to $LOG_DIR;
# a short summary prints last. STAGES picks among: tests profile bench demo.
set -uo pipefail
export PYTHONUNBUFFERED=1
LOG_DIR=${LOG_DIR:-bench/logs}
mkdir -p "$LOG_DIR"
STAGES=${STAGES:-"tests profile bench"}
LENGTHS=${LENGTHS:-"1024 131072 524288"}
summary=()
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$LOG_DIR/install.log" 2>&1 || { cat "$LOG_DIR/install.log"; exit 1; }
python3 -c "import minidecode.kernels.lean_attention, minidecode.models.llama" || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

if [[ $STAGES == *tests* ]]; then
  for f in tests/test_lean_attention_gpu.py tests/test_fused_kernels.py tests/test_prefill_attention.py tests/test_parity_gpu.py; do
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider "$f" 2>&1 | tee -a "$LOG_DIR/gpu-tests.log" | tail -3
    summary+=("$f: $(tail -1 "$LOG_DIR/gpu-tests.log")")
  done
fi
if [[ $STAGES == *profile* ]]; then
  timeout 240 python3 bench/decode_profile.py synthetic:llama-3-8b 1024 2>&1 | tee "$LOG_DIR/decode-profile.log" | tail -6
fi
if [[ $STAGES == *bench* ]]; then
  args=()
  for n in $LENGTHS; do args+=(--prompt-tokens "$n"); done
  timeout 420 python3 -m minidecode_cli.cli bench synthetic:llama-3-8b "${args[@]}" --new-tokens 64 \
    --compare transformers --json "$LOG_DIR/e2e.json" --plot "$LOG_DIR/e2e.png" 2>&1 | tee "$LOG_DIR/e2e.log"
fi
if [[ $STAGES == *demo* ]]; then
  # The CLI on a 512k-token prompt file (synthetic models read text as bytes: 1 byte = 1 token).
  cat $(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")/*.py | head -c 524288 >"$LOG_DIR/prompt-512k.txt"
  timeout 300 python3 -m minidecode_cli.cli generate synthetic:llama-3-8b --prompt-file "$LOG_DIR/prompt-512k.txt" \
    --max-new-tokens 64 --temperature 0 >"$LOG_DIR/demo-stdout.txt" 2>"$LOG_DIR/demo-stderr.txt"
  echo "demo exit $?"; tr '\r' '\n' <"$LOG_DIR/demo-stderr.txt" | tail -4
  rm -f "$LOG_DIR/prompt-512k.txt"
fi
echo "==== summary"
printf '%s\n' "${summary[@]}"
if [ -f "$LOG_DIR/decode-profile.log" ]; then tail -4 "$LOG_DIR/decode-profile.log"; fi
if [ -f "$LOG_DIR/e2e.log" ]; then grep -A30 "^| prompt" "$LOG_DIR/e2e.log" | head -14; fi

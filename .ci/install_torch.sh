#!/usr/bin/env bash
# The CPU build of PyTorch into the active venv, pinned by its version string, before the project:
# a plain `torch` requirement would pull several GB of CUDA packages, and with the CPU build
# installed it is satisfied. Both CI stages install it through this one script.
# TORCH_INDEX_URL (optional): an extra package index that serves the CPU build (see .ci/run).
set -euo pipefail
python -m pip install -q ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==2.13.0+cpu"
# (-W: in a venv that has no numpy yet torch warns that it is missing; the project brings it)
python -W ignore::UserWarning -c "import torch; assert torch.version.cuda is None, torch.__version__"

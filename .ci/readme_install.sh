#!/usr/bin/env bash
# CI stage 2: install the project the README's way in a fresh venv of its own (PyTorch's CPU build,
# pinned as the test stage pins it, then `pip install -e ".[serve]"`: no test extra, no pytest, so
# nothing brings a package the project forgot to declare) and run the README's user commands
# there (.ci/readme_commands.py). A missing dependency or install step fails here. About 70 s
# on two cores, half of it installing PyTorch. Runs on its own too:
# `.ci/readme_install.sh` from any shell (an active venv is left out of it).
set -euo pipefail
cd "$(dirname "$0")/.."
# Leave the active venv (the test stage's): its bin/ must not stand in for anything the new one lacks.
if [ -n "${VIRTUAL_ENV:-}" ]; then
    path=":$PATH:"
    path=${path//":$VIRTUAL_ENV/bin:"/:}
    path=${path#:}
    PATH=${path%:}
    unset VIRTUAL_ENV
fi
unset PYTHONPATH PYTHONHOME
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
.ci/install_torch.sh
# The README's install command, as written (readme_commands.py checks that the README still says it):
pip install -q -e ".[serve]"
python .ci/readme_commands.py

#!/usr/bin/env bash
# Install megatron-md into an NGC PyTorch container (or any environment that already has the
# torch, Transformer Engine and apex it should keep): every such package the environment has is
# pinned as a pip constraint, so resolving megatron-core, emerging-optimizers and wandb can never
# replace them; then the start-up check runs (a mismatch fails the build, naming it).
#
#   bash container/install.sh [REPO]            # REPO: this checkout (default: its directory)
#   bash container/install.sh --dry-run [REPO]  # print what pip would install, change nothing
#
# EXTRAS (default data,analysis): tokenizers/transformers for data preparation and megatron's
# HuggingFaceTokenizer, matplotlib for the analysis tools; installed under the same constraints.
set -euo pipefail
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run --quiet --report -); shift; fi
REPO=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PYTHON=${PYTHON:-python}
EXTRAS=${EXTRAS-data,analysis}
KEEP='^(torch|torchvision|torchaudio|transformer[-_]engine[-_a-z0-9]*|apex|triton|flash[-_]attn|numpy|nvidia-[-a-z0-9]+)=='
constraints=$(mktemp)
"$PYTHON" -m pip list --format=freeze 2>/dev/null | grep -iE "$KEEP" > "$constraints" || true
echo "[install] keeping $(wc -l < "$constraints") packages of this environment:" >&2
sed 's/^/[install]   /' "$constraints" >&2
# --no-build-isolation: the environment's setuptools builds the editable install (no download)
"$PYTHON" -m pip install --no-cache-dir --no-build-isolation "${DRY[@]}" -c "$constraints" \
  -e "$REPO${EXTRAS:+[$EXTRAS]}"
rm -f "$constraints"
if [ "${#DRY[@]}" = 0 ]; then
  "$PYTHON" -m megatron.md.stack --strict
fi

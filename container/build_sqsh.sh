#!/usr/bin/env bash
# An enroot/pyxis squashfs image of megatron-md on the NGC PyTorch container (for clusters that
# run `srun --container-image=...`): import the base, install with container/install.sh (the
# container's torch, TE and apex are kept), export.
#
#   bash container/build_sqsh.sh [OUT.sqsh]     # knobs: NGC_TAG (25.10-py3), ENROOT_NAME
#
# The package is installed editable at /workspace/megatron-md: the launcher mounts the checkout
# there itself (CONTAINER_WORKDIR), so code changes need no new image.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NGC_TAG=${NGC_TAG:-25.10-py3}
NAME=${ENROOT_NAME:-megatron-md-build}
OUT=${1:-megatron-md-${NGC_TAG}.sqsh}
command -v enroot >/dev/null || { echo "error: enroot not found (build on a cluster node)" >&2; exit 2; }
base=$(mktemp -u --suffix=.sqsh)
enroot import -o "$base" "docker://nvcr.io#nvidia/pytorch:${NGC_TAG}"
enroot remove -f "$NAME" 2>/dev/null || true
enroot create -n "$NAME" "$base"
enroot start --rw --mount "$REPO:/workspace/megatron-md" "$NAME" \
  bash /workspace/megatron-md/container/install.sh /workspace/megatron-md
enroot export -o "$OUT" "$NAME"
enroot remove -f "$NAME"
rm -f "$base"
echo "[build_sqsh] $OUT (mount the checkout at /workspace/megatron-md when running it)"

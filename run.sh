#!/usr/bin/env bash
# Fresh-machine entry: creates/reuses a Python 3.12 venv, installs Megatron-MD, then runs
#   bash run.sh demo        - tiny pretraining on 2 CPU processes: AdamW vs MuonMD (pretrain_gpt.py)
#   bash run.sh test        - the test suite
#   bash run.sh optimizers  - single-process comparison of AdamW, AdamMD, Muon, MuonMD (20 s)
# Knobs: MEGATRON_MD_VENV (venv path, default ~/.venvs/megatron-md).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${MEGATRON_MD_VENV:-$HOME/.venvs/megatron-md}

find_python() {
  local c
  for c in python3.12 "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.12"*/bin/python)" \
      "$HOME"/.pyenv/versions/3.12*/bin/python; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null \
      && { echo "$c"; return; }
  done
  echo "error: Python 3.12 not found (install it, e.g. 'pyenv install 3.12')" >&2; exit 1
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[run.sh] creating venv $VENV"
  "$(find_python)" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp="$VENV/.megatron-md-$(sha1sum setup.py | cut -c1-12)"
here_installed() {  # is megatron.md imported from this checkout? (editable installs move with clones)
  local here=$PWD  # (read before the cd: inside the subshell $PWD is /)
  (cd / && "$VENV/bin/python" -c "import importlib.util as u, sys; s = u.find_spec('megatron.md'); \
sys.exit(0 if s and s.submodule_search_locations[0].startswith('$here/') else 1)" 2>/dev/null)
}
if [ ! -f "$stamp" ] || ! here_installed; then
  echo "[run.sh] installing megatron-md and its dependencies into $VENV (first time: several minutes)"
  # this machine's pip config may name local package folders that do not exist: pip warns
  # about each one on every call; nothing to act on
  # (and setuptools' notice about editable installs: PYTHONWARNINGS reaches pip's build step)
  PYTHONWARNINGS=ignore "$VENV/bin/pip" install -q -e ".[torch,dev]" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  touch "$stamp"
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"  # torchrun, shellcheck and python of the venv for child processes
export THP_MEM_ALLOC_ENABLE=${THP_MEM_ALLOC_ENABLE:-1}  # torch: huge pages for big CPU tensors

case "${1:-demo}" in
  demo) shift || true; exec "$PY" examples/md_decoupling/pretrain_demo.py "$@" ;;
  optimizers) shift || true; exec "$PY" examples/md_decoupling/cpu_demo.py "$@" ;;
  test) shift || true; exec "$PY" -m pytest -q -rs --durations=12 tests "$@" ;;  # -rs: every skip with its reason
  *) echo "usage: bash run.sh {demo|test|optimizers} [args...]" >&2; exit 2 ;;
esac

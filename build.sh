#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs deepinfer_fn (editable) with its test extra.
#   DEEPINFER_ACCELERATOR=cpu (default) | nvidia (adds JAX's CUDA 13 plugin) | ascend
set -euo pipefail
cd "$(dirname "$0")"
accel="${DEEPINFER_ACCELERATOR:-cpu}"
case "$accel" in
  cpu|nvidia) ;;
  ascend)
    echo "build.sh: the Ascend backend needs Huawei CANN 9.2 and a jax Ascend plugin;" >&2
    echo "          it is not available in this build (dispatch points only, see deepinfer_fn/kernels.py)." >&2
    exit 2 ;;
  *) echo "build.sh: unknown DEEPINFER_ACCELERATOR=$accel (expected cpu, nvidia or ascend)" >&2; exit 2 ;;
esac

py=""
for cand in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py="$cand"; break
  fi
done
if [ -z "$py" ] && command -v pyenv >/dev/null 2>&1; then
  v=$(pyenv versions --bare | grep -E '^3\.12' | tail -1 || true)
  [ -n "$v" ] && py="$(pyenv root)/versions/$v/bin/python3.12"
fi
[ -n "$py" ] || { echo "build.sh: Python 3.12 not found (install it, e.g. 'pyenv install 3.12')" >&2; exit 1; }

[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
extras="test"
[ "$accel" = nvidia ] && extras="test,cuda"
.venv/bin/python -m pip install -q -e ".[${extras}]"
.venv/bin/python -c "import jax, deepinfer_fn; print('deepinfer_fn ready; jax', jax.__version__, jax.devices())"

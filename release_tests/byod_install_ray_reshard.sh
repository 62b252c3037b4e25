#!/bin/bash
# Post-build step of the BYOD image: install ray-reshard (and cupy on GPU images) on top of the
# image's Ray and torch. RAY_RESHARD_SRC names what to install (a path, a git URL or a pip
# requirement); by default the checkout this script sits in (release_tests/..).
set -exo pipefail
pip3 install --no-cache-dir -U "pyarrow>=14" "numpy>=1.24"
if command -v nvidia-smi >/dev/null 2>&1; then
  pip3 install --no-cache-dir "cupy-cuda12x>=13"
fi
pip3 install --no-cache-dir "${RAY_RESHARD_SRC:-$(cd "$(dirname "$0")/.." && pwd)}"

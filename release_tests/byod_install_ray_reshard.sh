#!/bin/bash
# Post-build step of the BYOD image: install ray-reshard (and cupy on GPU images) on top of the
# image's Ray and torch. Run from the repository root's parent layout: working_dir is
# release_tests/, so the package is one level up.
set -exo pipefail
pip3 install --no-cache-dir -U "pyarrow>=14" "numpy>=1.24"
if command -v nvidia-smi >/dev/null 2>&1; then
  pip3 install --no-cache-dir "cupy-cuda12x>=13"
fi
pip3 install --no-cache-dir -e "$(dirname "$0")/.."

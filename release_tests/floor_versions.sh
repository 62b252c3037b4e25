#!/usr/bin/env bash
# Release job: install the lowest versions pyproject.toml allows (each `>=` floor of the core
# dependencies, pinned exactly) into a fresh venv and run a refit on them: the demo (a two-node
# local Ray cluster on CPU, a small MoE model refit from Megatron to vLLM layouts and verified
# bit-exactly) and the quickstart example.
#
#     bash release_tests/floor_versions.sh            # venv in $FLOOR_VENV (/tmp/ray-reshard-floor)
#
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) picks where torch comes from; by
# default PyPI's build, which on Linux pulls CUDA libraries (a few GB). Ray's floor is the first
# release with `ray.util.collective.backend_registry`, which the runtime registers its
# collective backends with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FLOOR_VENV:-/tmp/ray-reshard-floor}

# "name[extra]>=X.Y" -> "name[extra]==X.Y" for every core dependency with a floor.
"$PY" - > /tmp/ray-reshard-floor-pins.txt <<'EOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
    m = re.match(r"^([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)\s*>=\s*([0-9][0-9.]*)", dep)
    if not m:
        raise SystemExit(f"dependency without a >= floor: {dep!r}")
    print(f"{m.group(1)}=={m.group(2)}")
EOF
echo "floor versions:"; sed 's/^/  /' /tmp/ray-reshard-floor-pins.txt

rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
torch_pin=$(grep '^torch==' /tmp/ray-reshard-floor-pins.txt)
"$VENV/bin/python" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$torch_pin"
# Everything else at its floor (torch already there: the constraint keeps it; constraints
# cannot carry extras).
sed 's/\[[^]]*\]//' /tmp/ray-reshard-floor-pins.txt > /tmp/ray-reshard-floor-constraints.txt
"$VENV/bin/python" -m pip install -q -c /tmp/ray-reshard-floor-constraints.txt \
    $(grep -v '^torch==' /tmp/ray-reshard-floor-pins.txt) .
"$VENV/bin/python" - <<'EOF'
import numpy, pyarrow, ray, torch
print(f"installed: ray {ray.__version__}, torch {torch.__version__}, numpy {numpy.__version__}, "
      f"pyarrow {pyarrow.__version__}")
EOF

cd /tmp      # run against the installed package, not the checkout
"$VENV/bin/python" -m ray_reshard demo --repeats 1
"$VENV/bin/python" "$OLDPWD/examples/quickstart.py" --rows 256 --cols 64
echo "floor versions: ok"

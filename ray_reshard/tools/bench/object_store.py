"""reshard vs the Ray object store (zero-copy numpy), now one of the peers of `bench-peers`.

    python -m ray_reshard bench-object-store [--mb 256] [--counts 32,1024,4096] [--repeats 5]

The same run as `python -m ray_reshard bench-peers` (see `ray_reshard.tools.bench.peers`): every
peer on the same actors, the object store sized for the payload and checked for spills.
"""
from __future__ import annotations

from .peers import main

if __name__ == "__main__":
    raise SystemExit(main())

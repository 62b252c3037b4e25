"""`python -m ray_reshard`: the command line (ray_reshard/tools/cli.py)."""
from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

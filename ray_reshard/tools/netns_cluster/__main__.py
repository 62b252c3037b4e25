"""`python -m ray_reshard.tools.netns_cluster check | clean` (and the driver's `serve`)."""
import sys

from .box import clean_leftovers
from .driver import serve
from .spec import unavailable


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else ""
    if cmd == "serve":
        return serve(int(argv[1]), int(argv[2]), int(argv[3]))
    if cmd == "clean":
        why = unavailable()
        if why:
            print(f"nothing to clean: {why}")
            return 0
        gone = clean_leftovers()
        print(f"removed {len(gone)} box(es) left by dead runs" +
              (f": {', '.join(gone)}" if gone else ""))
        return 0
    if cmd == "check":
        why = unavailable()
        print(why or "network namespaces, bridges and tc work here")
        return 1 if why else 0
    print("usage: python -m ray_reshard.tools.netns_cluster clean | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

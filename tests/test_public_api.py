"""The package's public names: each in `__all__` resolves, and importing the package loads no
Ray (the runtime loads on first use)."""
import subprocess
import sys

import ray_reshard as rr


def test_every_public_name_resolves():
    assert len(set(rr.__all__)) == len(rr.__all__)
    missing = [n for n in rr.__all__ if getattr(rr, n, None) is None]
    assert not missing, missing
    assert set(rr.__all__) <= set(dir(rr))


def test_importing_the_package_loads_no_ray():
    code = ("import sys, ray_reshard; "
            "assert 'ray' not in sys.modules, 'ray loaded'; "
            "assert 'ray_reshard.runtime' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

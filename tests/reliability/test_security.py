"""Security properties: shared-memory segments are private (mode 0600, owner only), named with
128 random bits, never followed through symlinks or reused, unlinked once mapped; refits work
under Ray's default configuration, which in Ray 2.60 is token authentication, and a client
without the token is turned away.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from ray_reshard.errors import TransportError
from ray_reshard.runtime.transport.segment import SHM_DIR
from ray_reshard.runtime.transport.shm import ShmRing

SEG = re.compile(r"rr-[0-9a-f]{32}")
pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ segments, in this process
def test_segment_mode_ignores_umask_and_names_are_random():
    old = os.umask(0)                  # the most permissive umask: files would be 0666
    try:
        rings = [ShmRing.create(4096, 2) for _ in range(64)]
    finally:
        os.umask(old)
    try:
        names = [r.name for r in rings]
        assert all(SEG.fullmatch(n) for n in names), names[:3]
        assert len(set(names)) == len(names)
        # 128 random bits: across 64 names every hex digit shows up in every position mix
        assert len({c for n in names for c in n[3:]}) == 16
        for n in names:
            st = os.stat(os.path.join(SHM_DIR, n))
            assert st.st_mode & 0o7777 == 0o600, (n, oct(st.st_mode))
            assert st.st_uid == os.getuid()
    finally:
        for r in rings:
            r.close()
            ShmRing.unlink(r.name)


def test_segment_never_reuses_or_follows_a_planted_name(tmp_path):
    planted = "rr-" + "ab" * 16
    path = os.path.join(SHM_DIR, planted)
    target = tmp_path / "victim"
    target.write_bytes(b"do not touch")
    os.symlink(target, path)
    try:
        with pytest.raises(FileExistsError):
            ShmRing.create(4096, 2, name=planted)           # O_EXCL: never adopts a name
        with pytest.raises(OSError):
            ShmRing.attach(planted)                          # O_NOFOLLOW: never follows a link
        assert target.read_bytes() == b"do not touch"
    finally:
        os.unlink(path)
    # A plain file planted under a name is not taken for a ring either.
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        with pytest.raises(TransportError, match="not a ray-reshard ring"):
            ShmRing.attach(planted)
    finally:
        os.unlink(path)
    for bad in ("../etc/passwd", "rr-x/../../y", "", "a" * 300):
        with pytest.raises(ValueError, match="invalid shared-memory segment name"):
            ShmRing.attach(bad)


# ------------------------------------------------------------------ a cluster in its default config
@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """Start security_probe.py in a clean environment: its own HOME (so no token exists yet),
    no RAY_AUTH_* variables, no RAY_ADDRESS: Ray's defaults decide."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env["HOME"] = str(home)
    script = os.path.join(os.path.dirname(__file__), "security_probe.py")
    p = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                       timeout=280, cwd=str(home))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):]), p.stderr


def test_default_config_uses_token_auth(probe):
    out, stderr = probe
    assert "Token authentication is enabled for this Ray cluster" in stderr
    assert out["driver_auth"] and out["token_file"]
    assert out["worker_auth"] == [True] * 4


def test_refit_works_under_token_auth(probe):
    out, _ = probe
    assert out["refit_exact"]


def test_client_without_the_token_is_refused(probe):
    out, _ = probe
    assert out["intruder"]["connected"] is False and out["intruder"]["rc"] != 0, out["intruder"]


def test_rings_are_private_and_sealed(probe):
    out, _ = probe
    names = out["ring_names"]
    assert names and all(SEG.fullmatch(n) for n in names)
    assert out["in_dev_shm"] == []                       # sealed: no name left to open
    seen = {}
    for per_proc in out["mapped"]:
        for n, info in per_proc.items():
            seen.setdefault(n, 0)
            seen[n] += 1
            assert info["mode"] == 0o600 and info["uid"] == out["uid"], (n, info)
            assert info["nlink"] == 0 and info["deleted"], (n, info)
    assert set(seen) == set(names)
    assert all(c == 2 for c in seen.values()), seen       # one producer, one consumer
    assert out["mapped_after_close"] == [{}] * 4          # close() unmapped every ring


def test_helper_segments_private_until_destroyed(probe):
    out, _ = probe
    names = out["helper_names"]
    assert len(names) == 3 and all(SEG.fullmatch(n) for n in names)
    assert sorted(out["helper_segments"]) == sorted(names)
    for n, info in out["helper_files"].items():
        assert info["mode"] == 0o600 and info["uid"] == out["uid"], (n, info)
    assert out["helper_left"] == []

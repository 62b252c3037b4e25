"""The delta codec: every encoding round-trips exactly, the smallest one is chosen, payload
sizes are what `encoded_bytes` predicts, and the GPU path gives the CPU path's bytes."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_reshard.execution import delta as D


def bucket(n_bytes, fraction, seed, g=2):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    n = n_bytes // g
    k = int(round(fraction * n))
    if k:
        idx = torch.randperm(n, generator=gen)[:k]
        for b in range(g):                      # change every byte of the chosen granules
            new.view(-1, g)[idx, b] ^= 0x5A
    return base, new, k


def roundtrip(new, base, g):
    e = D.encode(new, base, g)
    out = base.clone()
    if e.kind == D.DENSE:
        out.copy_(e.payload)
    elif e.kind != D.SAME:
        D.decode(e.kind, e.payload, out, g)
    assert torch.equal(out, new)
    if e.kind != D.DENSE:
        assert e.check == D.checksum(new)
    return e


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 3000),
       st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.1, 0.5, 0.9, 1.0]), st.integers(0, 99))
def test_roundtrip_and_smallest_encoding(g, n, fraction, seed):
    base, new, k = bucket(n * g, fraction, seed, g)
    e = roundtrip(new, base, g)
    kind, size = D.encoded_bytes(n * g, g, k)
    if k == 0:
        assert e.kind == D.SAME and e.nbytes == 0
    elif e.kind != D.DENSE or kind == D.DENSE:
        assert (e.kind, e.nbytes) == (kind, size)
    assert e.nbytes <= n * g


def test_many_chunks_and_a_ragged_tail(monkeypatch):
    monkeypatch.setattr(D, "CHUNK", 1024)          # ten chunks and a ragged last one
    for fraction in (0.0, 0.002, 0.1, 0.6):
        base, new, _ = bucket(2 * 10_007, fraction, 3)
        roundtrip(new, base, 2)


def test_kinds_follow_density():
    n = 1 << 16
    kinds = {}
    for fraction in (0.0, 0.001, 0.1, 1.0):
        base, new, _ = bucket(2 * n, fraction, 1)
        kinds[fraction] = D.encode(new, base, 2).kind
    assert kinds == {0.0: D.SAME, 0.001: D.INDEX, 0.1: D.MASK, 1.0: D.DENSE}
    # mostly changed: dense without comparing the rest
    base, new, _ = bucket(2 * n, 0.95, 2)
    e = D.encode(new, base, 2)
    assert e.kind == D.DENSE and e.payload.data_ptr() == new.data_ptr()


def test_granule_and_prediction():
    assert D.granule(12, 4) == 4 and D.granule(10, 4) == 2 and D.granule(9, 8) == 1
    assert D.granule(16, 3) == 2
    assert D.expected_bytes(1 << 20, 2, 0.0) == 0
    assert D.expected_bytes(1 << 20, 2, 1.0) == 1 << 20
    # 10% of bf16 granules: a bit each plus the changed values, about 0.16 of dense
    assert 0.15 < D.expected_bytes(1 << 20, 2, 0.1) / (1 << 20) < 0.17


def test_decode_refuses_a_payload_that_does_not_fit():
    base, new, _ = bucket(2 * 4096, 0.1, 4)
    e = D.encode(new, base, 2)
    with pytest.raises((ValueError, RuntimeError)):
        D.decode(e.kind, e.payload[:-2], base.clone(), 2)


@pytest.mark.gpu
def test_gpu_encoding_is_the_cpu_encoding():
    for fraction in (0.0, 0.001, 0.1, 1.0):
        base, new, _ = bucket(2 * 300_001, fraction, 5)
        cpu = D.encode(new, base, 2)
        gpu = D.encode(new.cuda(), base.cuda(), 2)
        assert gpu.kind == cpu.kind and gpu.check == cpu.check
        if cpu.kind in (D.MASK, D.INDEX):
            assert torch.equal(gpu.payload.cpu(), cpu.payload)
            out = base.cuda()
            D.decode(gpu.kind, gpu.payload, out, 2)
            assert torch.equal(out.cpu(), new)

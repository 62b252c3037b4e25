"""The cluster simulator: closed-form cases, exact vs aggregate replay, bounds, the CLI."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import ray_reshard as rr
from ray_reshard.execution.program import PER_ITEM_MIN_BYTES
from ray_reshard.sim import (Cluster, gather_broadcast_seconds, messages_aggregate,
                             messages_exact, preset, replay, simulate)
from ray_reshard.tools.simulate import main as cli_main

GB = 1e9
BARE = Cluster("bare", 4, nvlink_Bps=100 * GB, nic_Bps=10 * GB, latency_s=0.0, item_s=0.0,
               tensor_s=0.0, refit_overhead_s=0.0)


def _tp4_to_tp2dp2(n=4, rows=4096, cols=1024):
    train = rr.Layout(rr.Mesh([0, 1, 2, 3]), (rr.Shard(0),))
    infer = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))
    return {f"w{i}": rr.TensorSpec((rows, cols), torch.float32, src=train, dst=infer)
            for i in range(n)}


def test_one_transfer_closed_form():
    lay = rr.Layout.replicated([0])
    specs = {"w": rr.TensorSpec((1000, 1000), torch.float32, src=lay, dst=lay)}
    p = rr.plan(specs, ["a"], ["b"])
    cl = BARE.with_(latency_s=1e-3, refit_overhead_s=2e-3)
    res = simulate(p, cl, bucket_bytes=1 << 30)
    # GPU presets pack every network bucket: one copy in at the sender, one out at the receiver
    copies = 2 * 4e6 / cl.contig_copy_Bps
    assert res.predicted_s == pytest.approx(4e6 / (10 * GB) + copies + 1e-3 + 2e-3)
    assert res.bound_s == pytest.approx(4e6 / (10 * GB))
    # four buckets, one per round: each pays the latency; packing the next bucket overlaps
    # the transfer of the one before, so only the first pack and the last unpack add
    res4 = simulate(p, cl, bucket_bytes=1_000_000)
    assert res4.rounds == 4
    assert res4.predicted_s == pytest.approx(4e6 / (10 * GB) + 4e-3 + 2e-6 + 2e-3)


def _two_buckets():
    lay = rr.Layout.replicated([0])
    specs = {"w": rr.TensorSpec((2000, 1000), torch.float32, src=lay, dst=lay)}
    return rr.plan(specs, ["a"], ["b"])


def test_two_round_pipeline_by_hand():
    """Two 4 MB buckets, one pair: pack p = 1 ms, transfer x = 4 ms, unpack u = 1 ms.

    window 2: pack 0 | transfer 0 while packing 1 | transfer 1 | unpack 1 (unpack 0 ran
    during transfer 1): p + 2x + u. window 1: bucket 1 waits for bucket 0's staging buffer at
    both ends: the sender packs it after transfer 0 (2p + x), the receiver posts it after
    unpacking 0 (p + x + u); then x + u."""
    cl = BARE.with_(nic_Bps=1 * GB, contig_copy_Bps=4 * GB)
    p = _two_buckets()
    w2 = simulate(p, cl, bucket_bytes=4_000_000, window=2)
    w1 = simulate(p, cl, bucket_bytes=4_000_000, window=1)
    assert w2.rounds == 2 and w2.window == 2 and w1.window == 1
    assert w2.predicted_s == pytest.approx(1e-3 + 8e-3 + 1e-3)
    assert w1.predicted_s == pytest.approx(max(2e-3 + 4e-3, 1e-3 + 4e-3 + 1e-3) + 4e-3 + 1e-3)
    assert w2.bound_s == pytest.approx(8e-3)


@pytest.mark.parametrize("step_ms", [0.5, 2.0])
def test_host_overlap_by_hand(step_ms):
    """Two 4 MB buckets, one pair, transfers instant: a bucket end is a host step s and a copy
    c = 1 ms. Without host overlap every end costs s + c in turn: pack 0, pack 1, unpack 1
    after unpack 0, 3 (s + c). With it the host issues each copy and goes on: the copies queue
    on the stream, the receiver's first unpack starts at s + c (after pack 0) and its second
    once pack 1 is done and unpack 0's copy is: 2 (s + c) + max(s, c)."""
    s, c = step_ms * 1e-3, 1e-3
    cl = BARE.with_(nic_Bps=1e9 * GB, contig_copy_Bps=4 * GB, step_s=s)
    p = _two_buckets()
    serial = simulate(p, cl, bucket_bytes=4_000_000, window=2).predicted_s
    overlap = simulate(p, cl.with_(host_overlap=True), bucket_bytes=4_000_000,
                       window=2).predicted_s
    assert serial == pytest.approx(3 * (s + c), rel=1e-6)
    assert overlap == pytest.approx(2 * (s + c) + max(s, c), rel=1e-6)


def _forwarding_plan():
    """TP4 -> TP2 x DP2 across two 4-GPU domains: every network piece is forwarded once."""
    return rr.plan(_tp4_to_tp2dp2(n=8, rows=2048, cols=512), ["n0"] * 4, ["n1"] * 4)


@pytest.mark.parametrize("cluster", [
    BARE, BARE.with_(item_s=20e-6, contig_copy_Bps=20 * GB, copy_Bps=5 * GB, latency_s=50e-6),
    preset("dgx-h100"), preset("gb200-nvl72").with_(gpus_per_domain=4), preset("local")])
def test_window_bounds(cluster):
    """No window beats the busiest link. Window 1 runs a process's buckets one at a time, its
    sends and receives included: at least the busiest process's sent plus received bytes over
    its NIC. Wider windows put a send and a receive in one group, so they run together."""
    p = _forwarding_plan()
    for bucket in (1 << 20, 4 << 20):
        m = messages_exact(p, bucket)
        net = m.path == 0
        per_proc = (np.bincount(m.sender[net], m.nbytes[net], minlength=8)
                    + np.bincount(m.receiver[net], m.nbytes[net], minlength=8))
        w1 = simulate(p, cluster, bucket, "exact", window=1)
        assert w1.replay_s >= per_proc.max() / cluster.nic_Bps
        for w in (None, 2, 4, 8):
            res = simulate(p, cluster, bucket, "exact", window=w)
            assert res.predicted_s >= res.bound_s > 0
            assert res.replay_s >= res.nic_bound_s


def test_window_hides_cpu_work():
    """With copies to make, buckets in flight overlap one bucket's packing and unpacking with
    another's transfer: the executor's default window is faster than one at a time (a plan
    without forwarding, whose forwards would otherwise queue behind the receives)."""
    p = rr.plan(_tp4_to_tp2dp2(n=8, rows=2048, cols=512), n_src=4, n_dst=4)
    cl = BARE.with_(item_s=20e-6, contig_copy_Bps=20 * GB, copy_Bps=5 * GB)
    for bucket in (1 << 20, 4 << 20):
        serial = simulate(p, cl, bucket, "exact", window=1)
        windowed = simulate(p, cl, bucket, "exact")
        assert windowed.window > 1
        assert windowed.predicted_s < serial.predicted_s


def test_forward_waits_for_its_network_bucket():
    """A forwarder passes a piece on only after it arrived: one 1 MiB tensor crosses into a
    4-rank domain once and is forwarded to the three others, so on a link-only cluster the
    refit takes at least its network transfer plus one forward."""
    specs = {"w": rr.TensorSpec((256, 1024), torch.float32, src=rr.Layout.replicated([0]),
                                dst=rr.Layout.replicated([0, 1, 2, 3]))}
    p = rr.plan(specs, ["a"], ["D"] * 4)
    assert p.stats.network_bytes == 1 << 20
    res = simulate(p, BARE, 4 << 20, "exact")
    assert res.predicted_s >= (1 << 20) / BARE.nic_Bps + (1 << 20) / BARE.nvlink_Bps


def test_in_place_items_cost_no_copy_on_cpu_wire_format():
    """On a CPU cluster contiguous network items at the per-item threshold or above travel in
    place (no copy); on GPU presets every network bucket is packed and unpacked."""
    p = _two_buckets()
    slow = BARE.with_(contig_copy_Bps=1 * GB)
    packed = simulate(p, slow, 8 << 20).predicted_s
    in_place = simulate(p, slow.with_(per_item_min_bytes=PER_ITEM_MIN_BYTES), 8 << 20).predicted_s
    assert packed == pytest.approx(in_place + 2 * 8e6 / GB)


def test_single_copy_rings_drop_the_senders_copy():
    """Where ring receivers read the sender's memory themselves (CPU cross-memory reads), a
    contiguous sender copies nothing; a receiver with strided regions copies into a bucket
    and then out of it, so there the copies move from the senders to the receiver."""
    lay = rr.Layout.replicated([0])
    cols = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(1),))
    slow = BARE.with_(contig_copy_Bps=1 * GB, copy_Bps=1 * GB)
    plain = {"w": rr.TensorSpec((2000, 1000), torch.float32, src=lay, dst=lay)}
    p = rr.plan(plain, ["a"], ["a"])
    assert p.stats.domain_bytes == 8_000_000
    two = simulate(p, slow, 16 << 20).predicted_s
    one = simulate(p, slow.with_(single_copy_rings=True), 16 << 20).predicted_s
    assert two == pytest.approx(one + 8e6 / GB)
    # contiguous column shards at the senders, column blocks of the whole at the receiver
    strided = {"w": rr.TensorSpec((2000, 1000), torch.float32, src=cols, dst=lay)}
    p = rr.plan(strided, ["a"] * 2, ["a"])
    assert p.stats.domain_bytes == 8_000_000
    two = simulate(p, slow, 16 << 20).predicted_s        # senders 4 MB each, at once
    one = simulate(p, slow.with_(single_copy_rings=True), 16 << 20).predicted_s
    assert one == pytest.approx(two - 4e6 / GB + 8e6 / GB)


def test_exact_and_aggregate_agree():
    specs = _tp4_to_tp2dp2()
    p = rr.plan(specs, ["n0"] * 4, ["n1"] * 4)
    ex = simulate(p, preset("dgx-h100"), 4 << 20, "exact")
    ag = simulate(p, preset("dgx-h100"), 4 << 20, "aggregate")
    assert ex.mode == "exact" and ag.mode == "aggregate"
    assert ag.predicted_s == pytest.approx(ex.predicted_s, rel=0.05)
    assert ag.bound_s == pytest.approx(ex.bound_s)
    assert ex.predicted_s >= ex.bound_s
    fp = _forwarding_plan()
    for cl in (BARE, preset("local")):
        ex = simulate(fp, cl, 1 << 20, "exact")
        ag = simulate(fp, cl, 1 << 20, "aggregate")
        assert ag.predicted_s == pytest.approx(ex.predicted_s, rel=0.05)


def test_domain_aware_beats_direct_and_gather_broadcast():
    """TP4 -> TP2 x DP2 in one destination domain: each source shard crosses the network once
    instead of twice, then the replicas exchange over NVLink."""
    specs = _tp4_to_tp2dp2()
    aware = rr.plan(specs, ["n0"] * 4, ["n1"] * 4)
    direct = rr.plan(specs, n_src=4, n_dst=4)
    assert aware.stats.network_bytes * 2 == direct.stats.network_bytes
    a = simulate(aware, BARE, 1 << 20)
    d = simulate(direct, BARE.with_(gpus_per_domain=1), 1 << 20)
    assert a.predicted_s < 0.7 * d.predicted_s
    assert a.nvlink_bound_s > 0 and a.busiest_links
    assert gather_broadcast_seconds(aware, BARE, 1 << 20) > a.predicted_s
    assert a.timeline and all(r["end_s"] > r["start_s"] for r in a.timeline)


def test_item_costs_can_dominate():
    specs = _tp4_to_tp2dp2(n=64, rows=64, cols=64)
    p = rr.plan(specs, ["n0"] * 4, ["n1"] * 4)
    cheap = simulate(p, BARE, 1 << 20)
    costly = simulate(p, BARE.with_(item_s=1e-3), 1 << 20)
    assert costly.predicted_s > cheap.predicted_s + 0.05
    assert costly.cpu_s > 0


def test_copy_tables_cost_per_bucket_end_not_per_item():
    """With copy tables a bucket end costs `step_s` whatever its item count (the per-item cost
    no longer applies to reshard buckets); without them each item costs `item_s`."""
    p = rr.plan(_tp4_to_tp2dp2(n=64, rows=64, cols=64), ["n0"] * 4, ["n1"] * 4)
    tables = BARE.with_(copy_tables=True, step_s=1e-4)
    a = simulate(p, tables.with_(item_s=1e-3), 1 << 20, "exact")
    b = simulate(p, tables.with_(item_s=0.0), 1 << 20, "exact")
    assert a.predicted_s == pytest.approx(b.predicted_s) and a.cpu_s == pytest.approx(b.cpu_s)
    bare = simulate(p, BARE, 1 << 20, "exact")
    ends = 2 * bare.messages
    assert a.cpu_s > bare.cpu_s and a.cpu_s <= bare.cpu_s + ends * 1e-4 * (1 + 1e-9)
    per_item = simulate(p, BARE.with_(item_s=1e-3, step_s=1e-4), 1 << 20, "exact")
    assert per_item.cpu_s > a.cpu_s + 0.05


def test_a_refit_checks_local_tensors_not_shards():
    """Shards living in one fused local tensor (a layer's experts) cost one check there."""
    from ray_reshard.layout.spec import Slot
    from ray_reshard.sim.engine import checks_per_process
    src = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(0),))
    dst = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(1),))
    specs = {f"e{k}": rr.TensorSpec((8, 8), torch.float32, src, dst,
                                    dst_slots={r: Slot("experts", index=(k,)) for r in (0, 1)})
             for k in range(6)}
    specs["norm"] = rr.TensorSpec((8, 8), torch.float32, src, dst)
    p = rr.plan(specs, ["a", "a"], ["b", "b"])
    local, shards = checks_per_process(p)
    assert shards.tolist() == [7, 7, 7, 7]
    assert local.tolist() == [7, 7, 2, 2]
    base = simulate(p, BARE, 1 << 20, "exact")
    checked = simulate(p, BARE.with_(tensor_s=1e-3), 1 << 20, "exact")
    assert checked.cpu_s == pytest.approx(base.cpu_s + 7e-3)
    assert simulate(p, BARE.with_(shard_s=1e-3), 1 << 20, "exact").cpu_s == pytest.approx(
        base.cpu_s + 7e-3)


def test_cli_json(capsys):
    rc = cli_main(["--model", "llama70b", "--train", "megatron:tp=8,pp=4",
                   "--infer", "vllm:tp=8,dp=4", "--cluster", "dgx-h100", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("predicted_s", "bound_s", "gather_broadcast_s", "network_bytes", "min_network_bytes",
              "direct_s"):
        assert k in out
    assert out["network_bytes"] == out["min_network_bytes"]
    assert out["bound_s"] <= out["predicted_s"] < out["gather_broadcast_s"]


def test_cli_cpu_cost_options(capsys):
    """`--copy-tables off` charges each region on its own (the GPU presets otherwise charge a
    bucket end one launch); zero CPU costs leave the links."""
    base = ["--model", "llama70b", "--train", "megatron:tp=8,pp=4", "--infer", "vllm:tp=8,dp=4",
            "--cluster", "gb200-nvl72", "--json"]
    out = {}
    for name, extra in (("tables", []), ("per_item", ["--copy-tables", "off"]),
                        ("links", ["--step-us", "0", "--tensor-us", "0", "--shard-us", "0"])):
        assert cli_main(base + extra) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert "copy-table launch" in out["tables"]["cluster_description"]
    assert "per item" in out["per_item"]["cluster_description"]
    assert out["links"]["cpu_s"] < out["tables"]["cpu_s"] < out["per_item"]["cpu_s"]
    assert out["links"]["predicted_s"] <= out["tables"]["predicted_s"]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "nope", "--train", "megatron:pp=2", "--infer", "vllm:tp=2"], "--model"),
    (["--model", "llama70b", "--train", "fsdp:pp=2", "--infer", "vllm:tp=2"], "--train"),
    (["--model", "llama70b", "--train", "megatron:pp=x", "--infer", "vllm:tp=2"], "pp must be"),
    (["--model", "llama70b", "--train", "megatron:pp=2", "--infer", "vllm:tp=2,ep=3"], "--infer"),
    (["--model", "llama70b", "--train", "megatron:pp=2", "--infer", "vllm:tp=2",
      "--cluster", "dgx-a1"], "unknown cluster"),
    (["--model", "llama70b", "--train", "megatron:pp=2"], "--infer"),
])
def test_cli_bad_arguments(capsys, argv, needle):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_cli_registered():
    proc = subprocess.run([sys.executable, "-m", "ray_reshard", "simulate", "--model", "llama70b",
                           "--train", "megatron:tp=8,pp=4", "--infer", "vllm:tp=8,dp=4,pp=0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ray-reshard simulate: error: argument --infer")


def test_sim_imports_no_ray_and_no_runtime():
    code = ("import sys, ray_reshard.sim; "
            "assert 'ray' not in sys.modules and 'ray_reshard.runtime' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_message_cost_only_for_items_sent_as_their_own():
    """`message_s` is paid per item at both ends where items travel as their own messages
    (the CPU wire format), and nowhere on a cluster that packs every bucket."""
    p = _two_buckets()                        # one pair, one 8 MB item in one bucket
    cl = BARE.with_(per_item_min_bytes=PER_ITEM_MIN_BYTES)
    base = simulate(p, cl, 8 << 20).predicted_s
    assert simulate(p, cl.with_(message_s=1e-3), 8 << 20).predicted_s == pytest.approx(base + 2e-3)
    packed = BARE.with_(message_s=1e-3)
    assert simulate(p, packed, 8 << 20).predicted_s == pytest.approx(
        simulate(p, BARE, 8 << 20).predicted_s)


def _eight_items(kib=256):
    """Eight contiguous `kib` KiB network items, one pair (all in one bucket of 1 GiB)."""
    lay = rr.Layout.replicated([0])
    specs = {f"w{i}": rr.TensorSpec((kib, 256), torch.float32, src=lay, dst=lay)
             for i in range(8)}
    return rr.plan(specs, ["a"], ["b"])


@pytest.mark.parametrize("build", [messages_exact, messages_aggregate])
def test_in_place_follows_the_clusters_threshold(build):
    """Which network items travel as their own messages, in place, is the cluster's
    `per_item_min_bytes`: the same plan on the local preset (128 KiB) sends its eight
    256 KiB items as eight messages without copies; with a threshold above every item it
    packs them into one message and charges both ends' staging copies."""
    p = _eight_items()
    bucket, nbytes = 1 << 30, 8 * (256 << 10)
    local = preset("local")
    above = local.with_(per_item_min_bytes=1 << 20)
    for cl, per_item in ((local, True), (local.with_(per_item_min_bytes=1), True),
                         (above, False)):
        m = build(p, bucket, cl.per_item_min_bytes)
        net = m.path == 0
        assert m.per_item_min_bytes == cl.per_item_min_bytes
        assert int(m.nbytes[net].sum()) == nbytes and m.per_item[net].all() == per_item
        wire = np.where(m.per_item, m.items, 1)[net].sum()
        assert wire == (8 if per_item else net.sum())
        copied = (m.strided_send + m.contig_send + m.strided_recv + m.contig_recv)[net].sum()
        assert copied == (0 if per_item else 2 * nbytes)
    # the replay charges what the messages say: copies instead of a message per item per end
    mode = "exact" if build is messages_exact else "aggregate"
    res_in, res_packed = (simulate(p, cl, bucket, mode) for cl in (local, above))
    assert res_packed.cpu_s - res_in.cpu_s == pytest.approx(
        nbytes / local.contig_copy_Bps - 8 * local.message_s)
    bare = BARE.with_(contig_copy_Bps=1 * GB, message_s=1e-3)
    by_item = simulate(p, bare.with_(per_item_min_bytes=1), bucket, mode).predicted_s
    packed = simulate(p, bare.with_(per_item_min_bytes=1 << 20), bucket, mode).predicted_s
    assert packed - by_item == pytest.approx(2 * nbytes / GB - 2 * 8 * 1e-3)
    assert simulate(p, bare, bucket, mode).predicted_s == pytest.approx(packed)


def test_replay_refuses_messages_of_another_threshold():
    p = _eight_items()
    msgs = messages_exact(p, 1 << 30)                   # packed: no threshold
    with pytest.raises(ValueError, match="per_item_min_bytes=None.*131072"):
        replay(p, msgs, preset("local"), 1 << 30)
    with pytest.raises(ValueError, match="per_item_min_bytes must be a positive int"):
        messages_exact(p, 1 << 30, 0)


def test_ring_receive_orders():
    """The executor's runs of ring steps (take what is ready first) never hold a receiver up
    longer than taking ring buckets strictly in key order, nor beat taking them whenever they
    arrive; none beats the links."""
    p = _forwarding_plan()
    for cl in (BARE, BARE.with_(item_s=20e-6, ring_latency_s=50e-6), preset("gb200-nvl72").with_(
            gpus_per_domain=4)):
        runs = simulate(p, cl, 1 << 20, "exact")
        in_order = simulate(p, cl, 1 << 20, "exact", ring_recv="in_order")
        as_ready = simulate(p, cl, 1 << 20, "exact", ring_recv="as_ready")
        # (with host overlap the what-if's copies queue on the stream before their buckets
        # arrive, which can cost the posts behind them a little: within 1%)
        assert as_ready.bound_s <= as_ready.predicted_s <= runs.predicted_s * (
            1.01 if cl.host_overlap else 1 + 1e-9)
        assert runs.predicted_s <= in_order.predicted_s * (1 + 1e-9)
    with pytest.raises(ValueError, match="ring_recv"):
        simulate(p, BARE, 1 << 20, ring_recv="whenever")


def _many_replicas_plan(n=16):
    """TP4 -> TP4 x DP4 into one 16-GPU domain (each piece forwarded to 3 replicas), plus small
    replicated tensors every destination rank holds."""
    train = rr.Layout(rr.Mesh([0, 1, 2, 3]), (rr.Shard(0),))
    infer = rr.Layout(rr.Mesh(np.arange(16).reshape(4, 4).tolist(), ("dp", "tp")),
                      (rr.Replicate(), rr.Shard(0)))
    rep = rr.Layout.replicated(list(range(16)))
    specs = {f"w{i}": rr.TensorSpec((1024, 512), torch.float32, src=train, dst=infer)
             for i in range(n)}
    specs.update({f"norm{i}": rr.TensorSpec((512,), torch.float32,
                                            src=rr.Layout.replicated([0, 1, 2, 3]), dst=rep)
                  for i in range(n)})
    return rr.plan(specs, ["n0"] * 4, ["n1"] * 16)


@pytest.mark.parametrize("window", [2, 8])
def test_exact_and_aggregate_agree_with_many_replicas(window):
    """Many replicas in a domain (the GB200 NVL72 case): the aggregate replay follows the
    schedule's merged forwards, so both replays agree."""
    p = _many_replicas_plan()
    cl = preset("gb200-nvl72").with_(gpus_per_domain=16)
    ex = simulate(p, cl, 1 << 20, "exact", window=window)
    ag = simulate(p, cl, 1 << 20, "aggregate", window=window)
    assert ag.predicted_s == pytest.approx(ex.predicted_s, rel=0.1)
    assert ag.messages == pytest.approx(ex.messages, rel=0.25)


def test_packing_over_the_link_is_the_transfer():
    """On GPU clusters a ring sender's packing kernel writes into the receiver's slot over
    NVLink: one cost, not a copy and then a transfer."""
    p = _forwarding_plan()
    slow_copy = BARE.with_(contig_copy_Bps=50 * GB, copy_Bps=50 * GB)
    apart = simulate(p, slow_copy, 1 << 20, "exact", ring_recv="as_ready")
    over = simulate(p, slow_copy.with_(pack_over_link=True), 1 << 20, "exact",
                    ring_recv="as_ready")
    assert over.predicted_s < apart.predicted_s
    assert over.predicted_s >= over.bound_s


def test_link_takes_the_earliest_gap():
    """A transfer replayed later but ready earlier uses a gap left on the link; both links of
    a transfer must be free together."""
    from ray_reshard.sim.processes import Link, earliest_free
    a, b = Link(), Link()
    a.book(2.0, 1.0)                     # busy [2, 3)
    assert a.free_from(0.0, 1.5) == 0.0 and a.free_from(0.0, 2.5) == 3.0
    a.book(0.0, 1.5)                     # [0, 1.5) [2, 3)
    assert a.free_from(0.5, 0.5) == 1.5 and a.free_from(0.5, 1.0) == 3.0
    a.book(1.5, 0.5)                     # merges into [0, 3)
    assert (a.starts, a.ends) == ([0.0], [3.0])
    b.book(3.0, 2.0)                     # [3, 5)
    assert earliest_free(a, b, 0.0, 1.0) == 5.0
    assert earliest_free(b, a, 0.0, 1.0) == 5.0


def test_ring_slots_by_hand():
    """One ring, four 4 MB buckets, pack and unpack 1 ms each, transfer 0.04 ms. With one slot
    the sender packs bucket k + 1 only once the receiver has unpacked bucket k (2.04 ms a
    bucket); with two the sender never waits (the receiver frees bucket k before bucket k + 2
    is packed), the same as without a limit."""
    lay = rr.Layout.replicated([0])
    specs = {"w": rr.TensorSpec((4000, 1000), torch.float32, src=lay, dst=lay)}
    p = rr.plan(specs, ["a"], ["a"])                     # one domain: a ring
    cl = BARE.with_(ring_latency_s=0.0, contig_copy_Bps=4 * GB, copy_Bps=4 * GB)
    free = simulate(p, cl.with_(ring_slots=0), 4_000_000, "exact").predicted_s
    assert free == pytest.approx(4 * 1.04e-3 + 1e-3)
    assert simulate(p, cl, 4_000_000, "exact").predicted_s == pytest.approx(free)
    one = simulate(p, cl.with_(ring_slots=1), 4_000_000, "exact").predicted_s
    assert one == pytest.approx(1.04e-3 + 3 * 2.04e-3 + 1e-3)
    assert cl.ring_slots == 2 and "2 slots per ring" in cl.describe()
    with pytest.raises(ValueError, match="ring_slots"):
        BARE.with_(ring_slots=-1)


def test_fewer_ring_slots_never_help():
    p = _many_replicas_plan()
    cl = preset("gb200-nvl72").with_(gpus_per_domain=16)
    t = [simulate(p, cl.with_(ring_slots=k), 1 << 20, "exact").predicted_s for k in (1, 2, 0)]
    assert t[0] >= t[1] * (1 - 1e-9) and t[1] >= t[2] * (1 - 1e-9)


def test_simulate_names_an_fsdp_trainers_experts_as_plan_does(monkeypatch):
    """`simulate --train fsdp:...` takes `--hf-experts` (default split, as `plan`), whatever
    transformers is installed: the prediction never depends on the library's version."""
    import ray_reshard.engines.fsdp.layout as fsdp_layout
    from ray_reshard.tools.simulate import build_parser, run

    def tensors(*extra):
        args = build_parser().parse_args(["--model", "small-moe", "--train", "fsdp:shard=2",
                                          "--infer", "vllm:tp=2", "--gpus-per-domain", "2",
                                          *extra])
        return run(args)["tensors"]

    split, fused = tensors(), tensors("--hf-experts", "fused")
    assert split > fused                  # one tensor per expert and projection when split
    assert tensors("--hf-experts", "split") == split
    # "auto" would follow the installed transformers: make it say "fused"; nothing changes
    monkeypatch.setattr(fsdp_layout, "resolve_hf_experts",
                        lambda h: "fused" if h == "auto" else h)
    assert tensors() == split

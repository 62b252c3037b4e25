"""Pictures of a plan (matplotlib, the `viz` extra).

`draw_tilings`: one parameter: how the sources tile it (each box with the ranks holding it), how
the destinations tile it, and the pieces (intersections) that each replica of one destination
shard inside one domain receives, coloured by path (network / domain / local). 1-d tensors are
drawn as one row. `draw_domain_traffic`: network bytes from each source domain to each destination domain.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..planning.plan import Plan
from ..planning.moves import DOMAIN, LOCAL, NETWORK

PATH_COLOURS = {NETWORK: "#d95f02", DOMAIN: "#1b9e77", LOCAL: "#7570b3"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install 'ray-reshard[viz]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _rect(box, shape):
    """(x, y, width, height) of a box: columns on x, rows on y (row 0 at the top)."""
    if len(shape) == 1:
        return box.offsets[0], 0, box.sizes[0], 1
    return box.offsets[1], box.offsets[0], box.sizes[1], box.sizes[0]


def pick_parameter(plan: Plan) -> str:
    """A telling parameter to draw: a 1-d/2-d tensor with many distinct shards on both sides and
    moves on several paths (the largest such)."""
    best, key = None, None
    for name, spec, tp in zip(plan.names, plan.specs, plan.tensor_plans):
        shape = tuple(spec.shape)
        if len(shape) not in (1, 2):
            continue
        n_src = len(set(spec.src.boxes(shape).values()))
        n_dst = len(set(spec.dst.boxes(shape).values()))
        k = (min(n_src, n_dst) > 1, n_src != n_dst, len({m.path for m in tp.moves}),
             len(shape), spec.numel)
        if key is None or k > key:
            best, key = name, k
    if best is None:
        raise ValueError("the plan has no 1-d or 2-d tensor to draw")
    return best


def draw_tilings(plan: Plan, name: str, path: str, max_labels: int = 64,
                 max_receivers: int = 3) -> str:
    """Source tiling, destination tiling, then what each destination rank of one shard's
    replicas in one domain receives, coloured by path (the domain de-duplication made visible:
    each replica takes a share over the network and the rest from its peers)."""
    from matplotlib.patches import Patch, Rectangle

    plt = _pyplot()
    if name not in plan.index:
        raise KeyError(f"no tensor {name!r} in the plan")
    i = plan.index[name]
    spec, tp = plan.specs[i], plan.tensor_plans[i]
    shape = tuple(spec.shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"{name} has shape {shape}: only 1-d and 2-d tensors can be drawn")
    width, height = (shape[0], 1) if len(shape) == 1 else (shape[1], shape[0])
    dst_boxes = spec.dst.boxes(shape)
    first = min(dst_boxes)
    doms = plan.topology.dst_domains
    receivers = [r for r in sorted(dst_boxes) if dst_boxes[r] == dst_boxes[first]
                 and doms[r] == doms[first]][:max_receivers]
    fig, axes = plt.subplots(1, 2 + len(receivers), figsize=(4.6 * (2 + len(receivers)), 5.2))

    def tiles(ax, layout, side):
        held: dict = {}
        for r, box in layout.boxes(shape).items():
            held.setdefault(box, []).append(r)
        for box, ranks in held.items():
            x, y, w, h = _rect(box, shape)
            ax.add_patch(Rectangle((x, y), w, h, facecolor="#e8e8e8", edgecolor="black", lw=0.8))
            if len(held) <= max_labels:
                label = ",".join(map(str, ranks[:4])) + ("…" if len(ranks) > 4 else "")
                ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=7)
        ax.set_title(f"{side} ranks: {len(held)} distinct shards\nover {len(layout.ranks)} ranks",
                     fontsize=10)

    tiles(axes[0], spec.src, "source")
    tiles(axes[1], spec.dst, "destination")
    for ax, r in zip(axes[2:], receivers):
        count = {NETWORK: 0, DOMAIN: 0, LOCAL: 0}
        for m in tp.moves:
            if m.dst != r:
                continue
            x, y, w, h = _rect(m.box, shape)
            ax.add_patch(Rectangle((x, y), w, h, facecolor=PATH_COLOURS[m.path], alpha=0.75,
                                   edgecolor="white", lw=0.6))
            count[m.path] += 1
        x, y, w, h = _rect(dst_boxes[r], shape)
        ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="black", lw=1.2))
        ax.set_title(f"destination rank {r} ({doms[r]}) receives\n"
                     + ", ".join(f"{p} {n}" for p, n in count.items() if n) + " pieces",
                     fontsize=10)
    axes[-1].legend(handles=[Patch(facecolor=PATH_COLOURS[p], alpha=0.75, label=lab)
                             for p, lab in ((NETWORK, "network (between domains)"),
                                            (DOMAIN, "domain (NVLink / shm)"),
                                            (LOCAL, "local (same device)"))],
                    loc="lower right", fontsize=7, framealpha=0.9)
    for a in axes:
        a.set_xlim(0, width)
        a.set_ylim(height, 0)
        a.set_xlabel("columns" if len(shape) == 2 else "elements")
        a.set_ylabel("rows" if len(shape) == 2 else "")
    fig.suptitle(f"{name} {list(shape)} {str(spec.dtype).replace('torch.', '')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_domain_traffic(matrix: Sequence[Sequence[int]], src_labels: Sequence[str],
                        dst_labels: Sequence[str], path: str,
                        title: Optional[str] = None) -> str:
    """Heat map of network GB from each source domain (rows) to each destination domain."""
    import numpy as np

    plt = _pyplot()
    m = np.asarray(matrix, dtype=float) / 1e9
    fig, ax = plt.subplots(figsize=(2.5 + 0.4 * max(len(dst_labels), 8),
                                    1.5 + 0.35 * max(len(src_labels), 8)))
    im = ax.imshow(m, cmap="viridis", aspect="auto", vmin=0)
    fig.colorbar(im, ax=ax, label="network GB", format="%.3g")
    ax.set_xticks(range(len(dst_labels)), [str(x) for x in dst_labels], rotation=90, fontsize=7)
    ax.set_yticks(range(len(src_labels)), [str(x) for x in src_labels], fontsize=7)
    ax.set_xlabel("destination domain")
    ax.set_ylabel("source domain")
    if m.size <= 256:
        top = m.max() if m.size else 0
        for (r, c), v in np.ndenumerate(m):
            ax.text(c, r, f"{v:.2g}", ha="center", va="center", fontsize=6,
                    color="black" if v > 0.6 * top else "white")
    ax.set_title(title or "network bytes between NVLink domains", fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

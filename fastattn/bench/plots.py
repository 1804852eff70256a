"""PNG plots of a results JSON (matplotlib, Agg backend; optional: without it plots are skipped).

throughput.png  forward GF/s vs L, one panel per forward sweep, the sgemm peak as a dashed line
memory.png      peak extra memory vs L for every implementation (the first forward sweep)
decode.png      decode GB/s vs KV length, the measured read bandwidth as a dashed line
backward.png    backward GF/s vs L
"""
from __future__ import annotations

import os

from .cases import TARGET

MISSING = "plots skipped: matplotlib is not installed (pip install 'fastattn[bench]')"


def _series(data: dict, sweep: str, value):
    """{impl: ([x], [y])} for one sweep, x = the swept size, only successful points."""
    out: dict = {}
    for rec in data["records"]:
        if rec["sweep"] != sweep:
            continue
        s = rec["shape"]
        x = s["S"] if s["L"] == 1 else s["L"]
        for impl, e in rec["results"].items():
            y = value(e)
            if y is not None:
                xs, ys = out.setdefault(impl, ([], []))
                xs.append(x)
                ys.append(y)
    return out


def _sweeps(data: dict, pred) -> list[str]:
    """Sweeps to plot, in run order; the single target cases are table-only."""
    seen = []
    for rec in data["records"]:
        if rec["sweep"].startswith(TARGET):
            continue
        if pred(rec) and rec["sweep"] not in seen:
            seen.append(rec["sweep"])
    return seen


def _panel(ax, series, colors, xlabel, ylabel, title, peak=None, peak_label="", logy=False):
    for impl, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", ms=4, label=impl, color=colors.get(impl))
    if peak:
        ax.axhline(peak, ls="--", color="gray", lw=1, label=peak_label)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for xs, _ in series.values() for x in xs})
    if ticks:                                # label the measured sizes: 256, 1k, 64k
        ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)
                              for t in ticks])
        ax.minorticks_off()
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def write_plots(data: dict, out_dir: str) -> tuple[list[str], str | None]:
    """Write the PNGs into out_dir; (paths written, a note when something was skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], MISSING
    impls = data["meta"]["impls"]
    cmap = plt.get_cmap("tab10")
    colors = {impl: cmap(i % 10) for i, impl in enumerate(impls)}
    p = data["probes"]
    sub = (f"{data['meta']['cpu']}, {data['meta']['threads']} threads, "
           f"{data['meta']['date'][:10]}")
    gflops = lambda e: e.get("gflops")                     # noqa: E731
    written = []

    def save(fig, name, title):
        fig.suptitle(f"{title}\n{sub}", fontsize=11)
        by_label = {}                                # one legend for all panels, no repeats
        for ax in fig.axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                by_label.setdefault(lab, h)
        if by_label:
            fig.legend(list(by_label.values()), list(by_label), loc="lower center",
                       ncol=min(4, len(by_label)), fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    plain = lambda r: r["shape"]["L"] > 1                  # noqa: E731
    fwd = _sweeps(data, lambda r: plain(r) and r["shape"]["kind"] == "fwd")
    if fwd:
        cols = min(2, len(fwd))
        rows = (len(fwd) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows + 0.8), squeeze=False)
        for ax, sweep in zip(axes.flat, fwd):
            _panel(ax, _series(data, sweep, gflops), colors, "L (= S)", "GF/s", sweep,
                   p.get("sgemm_peak_gflops"), "sgemm peak")
        for ax in list(axes.flat)[len(fwd):]:
            ax.set_visible(False)
        save(fig, "throughput.png", "Forward attention throughput")

        fig, ax = plt.subplots(figsize=(6.5, 4.6))
        _panel(ax, _series(data, fwd[0], lambda e: e.get("extra_mb") if "time_ms" in e else None),
               colors, "L (= S)", "peak extra memory, MB", fwd[0], logy=True)
        save(fig, "memory.png", "Memory beyond the inputs during one call")

    dec = _sweeps(data, lambda r: not plain(r))
    if dec:
        fig, ax = plt.subplots(figsize=(6.5, 4.6))
        for sweep in dec:
            _panel(ax, _series(data, sweep, lambda e: e.get("gbytes_per_s") if "time_ms" in e
                               else None), colors, "S (KV length)", "GB/s (q, k, v, out)", sweep,
                   p.get("bandwidth_gbytes_per_s"), "read bandwidth")
        save(fig, "decode.png", "Decode: one query against a long KV cache")

    bwd = _sweeps(data, lambda r: plain(r) and r["shape"]["kind"] == "bwd")
    if bwd:
        fig, axes = plt.subplots(1, len(bwd), figsize=(5.5 * len(bwd), 4.4), squeeze=False)
        for ax, sweep in zip(axes.flat, bwd):
            _panel(ax, _series(data, sweep, gflops), colors, "L (= S)", "GF/s", sweep,
                   p.get("sgemm_peak_gflops"), "sgemm peak")
        save(fig, "backward.png", "Backward attention throughput (2.5× forward FLOPs)")
    return written, None

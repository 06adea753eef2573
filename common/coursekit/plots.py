"""Plots drawn from results records (never from numbers typed in)."""
import matplotlib.pyplot as plt

from .results import column, format_shape, label, load_recorded_gpu, rows


def plot_sweep(ax, record, op, dtype, variants=None, title=None, x=None, xlabel="elements",
               xscale=("log", 2), ceiling=True):
    """Achieved GB/s against a swept quantity (problem size by default), one line per variant,
    with the copy ceiling. x(row) picks the swept quantity from a row."""
    x = x or (lambda r: r["shape"][0])
    sweep = [r for r in rows(record, op=op, dtype=dtype) if r.get("sweep")]
    variants = variants or list(dict.fromkeys(column(r) for r in sweep))
    for variant in variants:
        pts = sorted((x(r), r["GBps"]) for r in sweep if column(r) == variant)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **{"label": variant, **_style(variant)})
    copy = record["ceilings"].get("copy_GBps")
    if ceiling and copy:
        ax.axhline(copy, color="grey", linestyle=":", label=f"copy ceiling {copy:.0f} GB/s")
    if xscale[0] == "log":
        ax.set_xscale("log", base=xscale[1])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(title or f"{op} {dtype}: {label(record)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _style(variant):
    """torch baselines dashed (eager black); the default dispatch a wide pale band drawn under the
    rungs, so the envelope it follows shows through; rungs plain lines with markers."""
    if variant.startswith("torch"):
        # A part of the eager chain ("torch (F.linear)") keeps the dashes, in a colour of its own.
        return dict(color=None if "(" in variant else "black", linestyle="--", marker="o", ms=3)
    if variant == "default":
        return dict(color="tab:orange", linewidth=7, alpha=0.35, zorder=0,
                    label="default (version=None)")
    return dict(marker="o", ms=3)


def plot_bars(ax, record, op, dtype, shape, title=None, view=None):
    """GB/s of every variant at one size, with the copy ceiling: the ladder at a glance."""
    picked = [r for r in rows(record, op=op, dtype=dtype) if r["shape"] == list(shape)
              and not r.get("sweep") and r.get("view") == view]
    # Long baseline names (torch.transpose(-2,-1)) would overlap their neighbours: break them
    # at the dot and set every label at an angle.
    names = [column(r).replace(".", ".\n", 1) for r in picked]
    values = [r["GBps"] for r in picked]
    colors = ["black" if r["variant"].startswith("torch") else
              "tab:orange" if r["variant"] == "default" else "tab:blue" for r in picked]
    bars = ax.bar(range(len(names)), values, color=colors)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    for bar, r in zip(bars, picked):
        if "pct_of_copy" in r:
            ax.annotate(f"{r['pct_of_copy']:.0f}%", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=7)
    ceiling = record["ceilings"].get("copy_GBps")
    if ceiling:
        ax.axhline(ceiling, color="grey", linestyle=":", label="copy ceiling")
        ax.legend(fontsize=7)
    ax.set_ylabel("GB/s")
    what = f"{view} ({format_shape(shape)})" if view else f"{format_shape(shape)} elements"
    ax.set_title(title or f"{op} {dtype}, {what}\n{label(record)}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cpu_vs_recorded(record, out_dir, chapter, panel, figsize=(13, 4.5)):
    """On a run without a GPU, <chapter>_cpu_vs_recorded.png: panel(ax, record) drawn from this
    run beside the same panel drawn from the newest recorded GPU results of `chapter`, so that a
    learner without a GPU sees both. panel draws from what its record holds (sizes differ: the
    CPU runs small ones). Returns [the figure's path], or [] on a GPU run or where no GPU results
    are recorded."""
    if record["device"].get("capability") is not None:
        return []
    recorded = load_recorded_gpu(chapter)
    if recorded is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=figsize)
    for ax, shown, where in zip(axes, (record, recorded), ("measured here", "recorded")):
        panel(ax, shown)
        ax.set_title(f"{where}: {ax.get_title()}", fontsize=9)
    return [save(fig, out_dir / f"{chapter}_cpu_vs_recorded.png")]

"""Small helpers shared by the tools in `tools/`: CSV files, smoothing, PNG plots.

matplotlib is imported lazily (with the non-interactive Agg backend), so
importing this module costs nothing.

Example:

>>> import plots
>>> plots.sliding_mean([1, 1, 0, 0], window=2).tolist()
[1.0, 1.0, 0.5, 0.0]
"""

import csv
import math
import os

import numpy as np


def write_csv(path, rows, fields=None):
    """Writes a list of dicts as CSV (columns: `fields`, else the union in order)."""
    if fields is None:
        fields = []
        for row in rows:
            fields += [k for k in row if k not in fields]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k, "")) for k in fields})
    return path


def _fmt(v):
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return v


def read_csv(path):
    """Reads a CSV written by `write_csv` as a list of dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def sliding_mean(values, window, weights=None):
    """Mean over the last `window` points (fewer at the start), optionally weighted.

    With `weights`, point i stands for `weights[i]` minibatches and the mean
    covers the last `window` minibatches (the A-SGD paper smooths training
    error over 400 minibatches).
    """
    values = np.asarray(values, np.float64)
    if weights is None:
        weights = np.ones_like(values)
    weights = np.asarray(weights, np.float64)
    cw = np.concatenate([[0.0], np.cumsum(weights)])
    cv = np.concatenate([[0.0], np.cumsum(values * weights)])
    out = np.empty_like(values)
    for i in range(len(values)):
        # Earliest start j with cw[i+1] - cw[j] <= window, at least the point itself.
        j = int(np.searchsorted(cw, cw[i + 1] - window, side="left"))
        j = min(j, i)
        out[i] = (cv[i + 1] - cv[j]) / (cw[i + 1] - cw[j])
    return out


def plot_panels(path, panels, ncols=2, title=None, panel_size=(5.0, 3.6)):
    """Saves a grid of line or bar panels as a PNG.

    Each panel is a dict: `title`, `xlabel`, `ylabel`, `series` (a list of
    `(label, x, y)`, or `(label, x, y, y_min, y_max)` for a line with a
    shaded min-max band), optional `kind` (`"line"`, `"bar"` or `"scatter"`),
    `logx`, `logy`, `ylim`, `hline` (`(y, label)`: a dashed reference line).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False
    )
    for ax, panel in zip(axes.flat, panels):
        series = panel.get("series", [])
        kind = panel.get("kind", "line")
        width = 0.8 / max(1, len(series))
        for k, (label, x, y, *band) in enumerate(series):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            if band:
                ax.fill_between(x, band[0], band[1], alpha=0.2)
            if kind == "bar":
                ax.bar(x + (k - (len(series) - 1) / 2) * width, y, width=width, label=label)
            elif kind == "scatter":
                ax.scatter(x, y, label=label, s=10, alpha=0.7)
            else:
                ax.plot(x, y, label=label, lw=1.2)
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        if panel.get("logx"):
            ax.set_xscale("log")
        if panel.get("logy"):
            ax.set_yscale("log")
        if panel.get("ylim"):
            ax.set_ylim(*panel["ylim"])
        if panel.get("hline"):
            ax.axhline(panel["hline"][0], ls="--", color="k", lw=0.8, label=panel["hline"][1])
        ax.grid(alpha=0.3)
        if (series and any(s[0] for s in series)) or panel.get("hline"):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

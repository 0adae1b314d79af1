"""The benchmark harness: what every suite shares, apart from its metrics (`metrics.py`).

Each suite builds its flags with `parser(__doc__, out=..., workers=..., ...)`: `--out` and
the sweep flags (`SWEEP_FLAGS`) are defined here once, with one type each. Also: clusters,
compiling, CSV, Markdown and plots; the accuracy studies' setups are in `setups.py`.
TensorFlow, Keras, tf_asgd and matplotlib load inside the helpers: the throughput suite's
stock-PS child sets `TF_USE_LEGACY_KERAS` first, and `--help` needs none of them.
"""

import argparse
import csv
import math
import os
import sys

import numpy as np

# TensorFlow's C++ INFO lines (each freed function's "Ignoring error status ...") are not
# the suites' output; warnings and errors still show. Set before any suite imports TF.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def int_list(text):
    """`"1,2,4"` -> `[1, 2, 4]` (an argparse `type`)."""
    return [int(v) for v in text.split(",") if v]


def str_list(text):
    """`"a,b"` -> `["a", "b"]` (an argparse `type`)."""
    return [v for v in text.split(",") if v]


def float_list(text):
    """`"0.05,0.1"` -> `[0.05, 0.1]` (an argparse `type`)."""
    return [float(v) for v in text.split(",") if v]


# The sweep flags every suite shares: (type, metavar, help). A suite that takes one
# value of a flag reads it with `single`.
SWEEP_FLAGS = {
    "workers": (int_list, "N,...", "worker counts, e.g. 1,2,4"),
    "n_sync": (int_list, "N,...", "steps per window (n_sync), e.g. 10,100"),
    "seeds": (int_list, "S,...", "seeds, e.g. 0,1,2"),
    "device_ms": (
        float_list,
        "MS,...",
        "emulated device time per batch in milliseconds (no CPU), e.g. 0,20",
    ),
}


def parser(doc, out, **defaults):
    """A suite's parser, described by `doc`, with `--out` (default `out`) and each sweep
    flag named in `defaults` (`workers=[1, 2]`, `device_ms=None`, ...) with its default."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=out, help="output folder (default: %(default)s)")
    for name, default in defaults.items():
        kind, metavar, text = SWEEP_FLAGS[name]
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=default,
            metavar=metavar,
            help=f"{text} (default: {_shown(default)})",
        )
    return p


def _shown(default):
    if isinstance(default, (list, tuple)):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
    return str(default)


def apply_quick(args, argv, quick):
    """A `--quick` smoke run: sets each of `quick`'s values on `args` unless its flag was
    given on the command line (`argv`, else `sys.argv`)."""
    given = {
        a.split("=")[0].lstrip("-").replace("-", "_")
        for a in (argv or sys.argv[1:])
        if a.startswith("--")
    }
    for k, v in quick.items():
        if k not in given:
            setattr(args, k, v)


def single(p, args, name):
    """The one value of sweep flag `name` (`None` if unset), for a suite that
    takes one: a list of another length is a usage error of parser `p`."""
    values = getattr(args, name)
    if values is None:
        return None
    if len(values) != 1:
        p.error(f"--{name.replace('_', '-')} takes one value here, got {values}")
    return values[0]


def local_cluster(workers, num_ps=1, processes="shared", bandwidth=None):
    """A `tf_asgd.LocalCluster` (a context manager), its loopback limited to `bandwidth` if
    given: every task in one child process (`processes="shared"`: 32 workers fit) or one
    process per task (`"separate"`: each with its own threads, as on real machines)."""
    import tf_asgd

    if processes not in ("shared", "separate"):
        raise ValueError(f"processes must be 'shared' or 'separate', got {processes!r}.")
    return tf_asgd.LocalCluster(
        workers, num_ps, shared_process=processes == "shared", bandwidth=bandwidth
    )


def throughput_model(name):
    """`gem_convnet` (`models.gem_mnist_convnet`, 164k parameters) or `mlp`
    (784-2048-1024-10, 3.7M parameters: bandwidth-bound)."""
    import keras

    import tf_asgd

    if name == "gem_convnet":
        return tf_asgd.models.gem_mnist_convnet()
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def synthetic_images(batch=64):
    """One synthetic batch of 28x28 images and labels, repeated forever."""
    import tensorflow as tf

    x = tf.random.stateless_uniform([batch, 28, 28, 1], seed=[1, 2])
    y = tf.random.stateless_uniform([batch], seed=[3, 4], maxval=10, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def compile_classifier(model, optimizer, metrics=None, keras_module=None, steps_per_execution=1):
    """Compiles `model` (logits out) with `optimizer` and sparse categorical cross-entropy,
    the loss of every suite, and returns it. `keras_module`: the Keras that built `model`
    (`tf_keras` for stock PS runs; default Keras 3). Call it under `strategy.scope()` when
    the model and optimizer are built there."""
    if keras_module is None:
        import keras as keras_module

    model.compile(
        optimizer,
        keras_module.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
        steps_per_execution=steps_per_execution,
    )
    return model


def columns(rows):
    """The keys of a list of dicts, in order of first appearance (`write_csv`'s columns)."""
    out = []
    for row in rows:
        out += [k for k in row if k not in out]
    return out


def markdown_table(header, rows):
    """A Markdown table as lines, `["| a | b |", "| --- | --- |", "| 1 | 2 |", ...]`, of
    `header` and `rows` (lists of cells, `str` applied to each)."""

    def line(cells):
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return [line(header), line(["---"] * len(header))] + [line(r) for r in rows]


def write_lines(path, lines):
    """Writes `lines` to `path`, one a line, with a final newline."""
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def cpu_seconds(pid):
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_csv(path, rows, fields=None):
    """Writes a list of dicts as CSV (columns: `fields`, else the union in order)."""
    if fields is None:
        fields = columns(rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: _fmt(row.get(k, "")) for k in fields} for row in rows)
    return path


def _fmt(v):
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return v


def plot_panels(path, panels, ncols=2, title=None, panel_size=(5.0, 3.6)):
    """Saves a grid of panels as a PNG. A panel is a dict: `title`, `xlabel`, `ylabel`,
    `series` (a list of `(label, x, y)`, or `(label, x, y, y_min, y_max)` for a line with a
    shaded min-max band), optional `kind` (`"line"` or `"bar"`), `logx`, `logy`, `ylim`,
    `hline` (`(y, label)`: a dashed reference line)."""
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
        if any(s[0] for s in series) or panel.get("hline"):
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

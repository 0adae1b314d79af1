"""What the tools in tools/ share: one CLI style, the local cluster, compiling, tables.

Every tool is a script, `python tools/NAME.py --flag value`; Python puts
tools/ first on `sys.path` for it, so `import _common` finds this module.
Each tool parses its flags with `parser(__doc__)` (argparse, `--out` for
its output directory, dashes in flag names), writes CSV with
`plots.write_csv`, Markdown tables with `markdown_table` and plots
with `plots.plot_panels`.

TensorFlow, Keras and tf_asgd are imported inside the helpers, not here:
bench.py's stock-PS child must set `TF_USE_LEGACY_KERAS` before TensorFlow
loads, and `--help` needs none of them.
"""

import argparse
import os

# TensorFlow's C++ INFO lines (each freed function's "Ignoring error status ...") are not
# the tools' output; warnings and errors still show. Set before any tool imports TF.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def parser(doc):
    """The argparse parser of a tool: its module docstring as the help text."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def int_list(text):
    """`"1,2,4"` -> `[1, 2, 4]` (an argparse `type`)."""
    return [int(v) for v in text.split(",") if v]


def str_list(text):
    """`"a,b"` -> `["a", "b"]` (an argparse `type`)."""
    return [v for v in text.split(",") if v]


def float_list(text):
    """`"0.05,0.1"` -> `[0.05, 0.1]` (an argparse `type`)."""
    return [float(v) for v in text.split(",") if v]


def sqrt_outer_learning_rate(workers):
    """An outer rate without the default's cap at 1/4 and warm-up, for side-by-side
    runs: `max(1, sqrt(N / 2)) / N`."""
    return max(1.0, (workers / 2) ** 0.5) / workers


def capped_outer_optimizer(workers):
    """A baseline for side-by-side runs: the capped square-root rate
    `max(1/N, min(1/4, 1/sqrt(2N)))`, warmed up from `1 / N` over `4 N` pushes where it
    is above the average. From 8 workers on it is above the stability limit
    (`update_rules.stability_limit`)."""
    from tf_asgd.rules import update_rules as rules

    lr = max(1.0 / workers, min(0.25, (2.0 * workers) ** -0.5))
    if lr > 1.0 / workers:
        return rules.OuterSGD(lr, schedule=((4 * workers, 1.0 / workers),))
    return rules.OuterSGD(lr)


def local_cluster(workers, num_ps=1, bandwidth=None):
    """A `tf_asgd.LocalCluster` on loopback with every task in one child
    process (`shared_process=True`: 32 workers fit in memory), its loopback
    limited to `bandwidth` if given. Use it as a context manager; leaving the
    block stops the process."""
    import tf_asgd

    return tf_asgd.LocalCluster(workers, num_ps, shared_process=True, bandwidth=bandwidth)


def compile_classifier(model, optimizer, metrics=None, keras_module=None, steps_per_execution=1):
    """Compiles `model` (logits out) with `optimizer` and sparse categorical
    cross-entropy, the loss of every tool. Call it under `strategy.scope()`
    when the model is built there, with the optimizer created there too.

    Args:
        model: a Keras model.
        optimizer: a Keras optimizer instance.
        metrics: Keras `compile` metrics, e.g. `["accuracy"]` (None: none).
        keras_module: the Keras that built `model`; `tf_keras` for stock
            ParameterServerStrategy runs (default: Keras 3).
        steps_per_execution: steps per call of the model's `train_function`.

    Returns:
        `model`.
    """
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
    """The keys of a list of dicts, in order of first appearance (the
    columns `plots.write_csv` writes)."""
    out = []
    for row in rows:
        out += [k for k in row if k not in out]
    return out


def markdown_table(header, rows):
    """A Markdown table as a list of lines.

    Args:
        header: column titles.
        rows: one list of cells per row, formatted by the caller (`str` is
            applied to each).

    Returns:
        `["| a | b |", "| --- | --- |", "| 1 | 2 |", ...]`.
    """

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


def cluster(workers, num_ps=1, processes="shared"):
    """A `tf_asgd.LocalCluster` on loopback: every task in one child process
    (`processes="shared"`, as `local_cluster`) or one process per task
    (`"separate"`: what a real cluster of machines looks like to TF's
    runtime, each task with its own threads and gRPC server). Use it as a
    context manager; leaving the block stops every process."""
    import tf_asgd

    if processes not in ("shared", "separate"):
        raise ValueError(f"processes must be 'shared' or 'separate', got {processes!r}.")
    return tf_asgd.LocalCluster(workers, num_ps, shared_process=processes == "shared")

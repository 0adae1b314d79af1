"""Which metric states merge by addition over windows and evaluation shards.

Windows and shards each start the metric variables from one state and return the change;
the chief adds the changes. That sum is what one Keras process would hold exactly when the
variable's `aggregation` is "sum" and every update adds a value that depends on no metric
state (`s <- s + g(batch, weights)`). `unmergeable` reads that from a traced update (it
runs nothing). Training refuses what it finds before any window (`MetricStateError`);
evaluation runs on the chief instead. Why the op type cannot decide: docs/architecture.md.
"""

import tensorflow as tf

from tf_asgd.errors import MetricStateError

SUM = "sum"
# Ops through which a state passes on unchanged in value.
_PASS = {"Identity", "Cast", "Reshape", "EnsureShape"}
_ADD = {"Add", "AddV2"}

FIX = (
    "Compile without it and compute it on the chief instead: in a callback (e.g. "
    "`on_epoch_end` updating the metric from `model.predict`), or with `model.evaluate`, "
    "which runs such a metric on the chief. If its state does add up over batches, write "
    "each update as `v.assign_add(value)` or `v.assign(v + value)` with a value that "
    "reads no metric state, and keep the variable's `aggregation='sum'`."
)


def unmergeable(model, update, arg_specs):
    """The model's metric variables whose state does not merge by addition.

    Args:
        model: a built Keras model with its metrics built.
        update: `update(args, states) -> new states`, one step's update of
            `model.metrics_variables` (values in that order), traced here on
            placeholders: `args` has the structure of `arg_specs`.
        arg_specs: `tf.TensorSpec`s (nested) of `update`'s other arguments
            (a batch, weights...).

    Returns:
        A list of `(metric name, variable path, why)`, empty when every state
        merges by addition.
    """
    variables = list(model.metrics_variables)
    found = [
        (
            v,
            (
                f"has aggregation {v.aggregation!r}: only 'sum' states merge by "
                "addition over windows and evaluation shards"
            ),
        )
        for v in variables
        if getattr(v, "aggregation", SUM) != SUM
    ]
    if len(found) < len(variables):
        found += _nonadditive(variables, update, arg_specs, {id(v) for v, _ in found})
    return [(_owner(model, v), v.path, why) for v, why in found]


def check_training(model, step, element_spec, weights, optimizer_variables):
    """Raises `MetricStateError`, before any window is scheduled, if a metric
    state of `model` does not merge over windows by addition.

    Args:
        model: the model `fit` trains.
        step: a window's local step, `step(batch, weights, optimizer values,
            metric values) -> (weights, optimizer values, metric values)`
            (`window.WindowFunction._step`), traced once here.
        element_spec: the spec of one training batch.
        weights: the central variables a window carries.
        optimizer_variables: the optimizer variables a window carries.

    Raises:
        MetricStateError: naming each such metric, its variable and why.
    """

    def specs(variables):
        return [tf.TensorSpec(v.shape, v.dtype) for v in variables]

    def update(args, states):
        return step(args[0], args[1], args[2], states)[2]

    found = unmergeable(model, update, (element_spec, specs(weights), specs(optimizer_variables)))
    if found:
        raise training_error(model, found)


def training_error(model, found):
    """The `MetricStateError` that refuses to train `model` with `found`
    (from `unmergeable`)."""
    what = "; ".join(
        f"metric {name!r}: the metric variable {path!r} {why}" for name, path, why in found
    )
    return MetricStateError(
        f"tf_asgd cannot train model {model.name!r} with this metric: a window's metric "
        "states are added on the chief, which is exact only for states that every update "
        f"adds to. {what}. {FIX}"
    )


def describe(found):
    """One line for a log: why `found` (from `unmergeable`) cannot be merged."""
    name, path, why = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"metric {name!r}: the metric variable {path!r} {why}{more}"


def _nonadditive(variables, update, arg_specs, skip):
    """`(variable, why)` for each of `variables` (not in `skip`) whose new
    state is not its old state plus a value that reads no metric state."""
    traced = {}

    def fn(args, states):
        traced["in"] = list(states)
        traced["out"] = list(update(args, list(states)))
        return traced["out"]

    specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    tf.function(fn, autograph=False).get_concrete_function(arg_specs, specs)
    states, outs = traced["in"], traced["out"]
    graph = states[0].graph
    tainted = _reads_of(graph, {s.op.name for s in states})
    # A model may list a metric twice (its `metrics` property adding one Keras
    # already tracks): each of the variable's placeholders is its old state.
    names = {}
    for v, state in zip(variables, states):
        names.setdefault(id(v), set()).add(state.op.name)
    found = []
    for v, out in zip(variables, outs):
        if id(v) in skip:
            continue
        why = _why_not_additive(out, names[id(v)], tainted)
        if why is not None:
            found.append((v, why))
    return found


def _reads_of(graph, sources):
    """Names of the ops of `graph` whose value depends on any op in
    `sources` (through data inputs; a function call, `cond` or loop that
    takes one counts as reading it). Creation order is a topological order
    of a traced function's graph."""
    tainted = set(sources)
    for op in graph.get_operations():
        if op.name not in tainted and any(t.op.name in tainted for t in op.inputs):
            tainted.add(op.name)
    return tainted


def _why_not_additive(out, state_names, tainted):
    """None when `out` is the old state (an op named in `state_names`) plus
    values that read no metric state (`tainted` ops read one), else why not,
    in words."""
    if out.op.name not in tainted:
        return (
            "is overwritten by its update (`v.assign(x)`, x not read from v): the "
            "changes of successive parts do not add up"
        )
    t = out
    while True:
        if t.op.name in state_names:
            return None
        op = t.op
        if op.type in _PASS:
            t = op.inputs[0]
            continue
        if op.type in _ADD | {"Sub"}:
            a, b = op.inputs[0], op.inputs[1]
            if b.op.name not in tainted:
                t = a
                continue
            if op.type in _ADD and a.op.name not in tainted:
                t = b
                continue
            return (
                "is incremented by a value that reads a metric state (e.g. "
                "`total.assign_add(x * count)`), and every part starts from the same state"
            )
        return (
            f"is updated with {op.type} of a metric state (`v.assign(max(v, x))` is a "
            "Maximum), not by adding to it"
        )


def _owner(model, variable):
    """The name of the innermost metric of `model` that holds `variable`."""

    def visit(metrics):
        for m in metrics:
            if any(v is variable for v in getattr(m, "variables", ())):
                inner = visit(list(getattr(m, "metrics", None) or ()))
                return inner or m.name
        return None

    return visit(list(model.metrics)) or variable.path

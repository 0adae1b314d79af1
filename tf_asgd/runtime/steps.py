"""One local step of a window, on loop tensors: Keras's step or the model's own.

`window.WindowFunction` calls one of these per local step: `keras_step`, Keras's
`train_step` written with its `stateless_*` API (models that do not override
`train_step`), or `ModelStep.step`, the model's own `train_step` called inside a
`keras.StatelessScope` that maps the model's, every optimizer's and the metrics' variables
to the loop tensors, so a window does what `n_sync` calls of it would. `ModelStep` refuses,
before anything is scheduled, a `train_step` that cannot run inside a window. What is
shared and what is per worker: docs/architecture.md.
"""

import keras
import tensorflow as tf
from keras import StatelessScope
from keras.utils import unpack_x_y_sample_weight

from tf_asgd import internals
from tf_asgd.errors import TrainStepError
from tf_asgd.runtime import optimizer_options

# Ops that read a resource (a variable) without writing it.
_READS = {
    "ReadVariableOp",
    "ResourceGather",
    "ResourceGatherNd",
    "VariableShape",
    "VarIsInitializedOp",
    "Identity",
    "NoOp",
}
_PYTHON_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}
_WRITES = {
    "AssignVariableOp",
    "AssignAddVariableOp",
    "AssignSubVariableOp",
    "ResourceStridedSliceAssign",
    "RngReadAndSkip",
    "RngSkip",
}
FIX = (
    "Write `train_step` as for `model.fit` without `run_eagerly`: TF and Keras ops "
    "only, with every variable it updates held by the model (its layers, its "
    "`metrics`, an optimizer attribute), and build the model before `fit`."
)


def _refuse(model, why):
    return TrainStepError(
        f"tf_asgd cannot run the `train_step` of {type(model).__name__} "
        f"({model.name!r}) inside a window: {why} {FIX}"
    )


def overrides_train_step(model):
    """Whether `model`'s class has its own `train_step` (not Keras's)."""
    return type(model).train_step is not keras.Model.train_step


def keras_step(model, optimizer, batch, weights, opt_values, metric_values):
    """One step of Keras's `train_step` on loop tensors (Keras's `stateless_*`
    API): `(weights, opt_values, metric_values)` after it. `optimizer` is the
    local optimizer (the compiled one, or a push rule's)."""
    n_train = len(model.trainable_variables)
    x, y, sample_weight = unpack_x_y_sample_weight(batch)
    trainable, non_trainable = weights[:n_train], weights[n_train:]
    with tf.GradientTape() as tape:
        tape.watch(trainable)
        # The forward pass's `add_loss` terms and regularizers reach
        # `compute_loss` as Keras's JAX trainer hands them over (each once).
        # As Keras's JAX trainer: `training` only where `call` takes it.
        kwargs = {"training": True} if internals.call_takes_training(model) else {}
        y_pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        with internals.forward_losses(model, losses):
            loss, (_, _, metric_values) = model.stateless_compute_loss(
                trainable,
                non_trainable,
                metric_values,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
        # As Keras's `train_step`: the optimizer scales the loss (its
        # `loss_scale_factor`, or a LossScaleOptimizer's dynamic scale, read
        # from the carried optimizer state); `apply` unscales the gradients.
        with StatelessScope(state_mapping=list(zip(optimizer.variables, opt_values))):
            scaled = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, trainable)
    trainable, opt_values = internals.stateless_apply(optimizer, opt_values, grads, trainable)
    mapping = list(zip(model.metrics_variables, metric_values))
    with StatelessScope(state_mapping=mapping) as scope:
        internals.loss_tracker(model).update_state(
            loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0]
        )
        model.compute_metrics(x, y, y_pred, sample_weight)
    metric_values = [
        scope.get_current_value(v) if scope.get_current_value(v) is not None else m
        for v, m in zip(model.metrics_variables, metric_values)
    ]
    return list(trainable) + list(non_trainable), opt_values, metric_values


def find_optimizers(model):
    """The compiled optimizer, then every other Keras optimizer among the
    model's attributes (in lists, tuples and dicts too) and the optimizers
    they wrap (e.g. a `LossScaleOptimizer`'s inner one), each once."""
    found = []

    def visit(value, depth=0):
        if isinstance(value, keras.optimizers.Optimizer):
            if all(value is not o for o in found):
                found.append(value)
                for attr in list(vars(value).values()):
                    visit(attr, depth + 1)
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict) and depth < 2:
            for item in list(value.values()):
                visit(item, depth + 1)

    visit(model.optimizer)
    for value in list(vars(model).values()):
        visit(value)
    return found


class _RecordingScope(StatelessScope):
    """A `StatelessScope` that remembers which variables were assigned."""

    def __init__(self, state_mapping):
        # Collecting losses, as a layer's `add_loss` outside a scope keeps
        # them: `train_step`'s `compute_loss` reads them from `self.losses`.
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.written = []

    def add_update(self, update):
        self.written.append(update[0])
        super().add_update(update)


class ModelStep:
    """The model's own `train_step` as a window's local step.

    Args:
        model: a compiled Keras model whose class overrides `train_step`.
        central: the model's variables the window pulls and pushes
            (trainable, then non-trainable).
        push_rule: the compiled optimizer's push rule, if any (refused).
    """

    def __init__(self, model, central, push_rule=None):
        self.model = model
        self.central = list(central)
        if push_rule is not None:
            raise _refuse(
                model,
                (
                    "its optimizer has a worker-side push rule (GEM), which runs its own "
                    "local SGD instead of the optimizer `train_step` applies. Compile with "
                    "a plain Keras optimizer."
                ),
            )
        if model.run_eagerly:
            raise _refuse(
                model,
                (
                    "the model is compiled with `run_eagerly=True`, and a window runs "
                    "`train_step` inside a `tf.function` on a worker. Compile with "
                    "`run_eagerly=False`."
                ),
            )
        if model.optimizer is None:
            raise _refuse(
                model,
                "the model has no compiled optimizer. Pass one to `compile()` (it may go unused).",
            )
        self.optimizers = find_optimizers(model)
        optimizer_options.check_own_train_step(model, self.optimizers)
        self.metric_variables = list(model.metrics_variables)
        self.prepared = False

    @property
    def optimizer_variables(self):
        """Every optimizer variable the step carries, each once, in optimizer order."""
        seen, out = set(), []
        for optimizer in self.optimizers:
            for v in optimizer.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    def prepare(self, element_spec, strategy):
        """Builds the optimizers `train_step` applies (their variables made
        under `strategy`'s scope, as Keras builds them on its first trace)
        and checks that a step can run inside a window, by tracing on the
        chief without running anything: first `train_step` itself with every
        optimizer's `apply` only building, then one `step` on placeholders.
        Raises `TrainStepError` for what cannot run. Call eagerly, once,
        before `optimizer_variables` is used and before a window is traced
        (an error raised while a window is traced reaches the user wrapped
        by autograph)."""
        if self.prepared:
            return

        def build_only(optimizer):
            def apply(grads, trainable_variables=None):
                if not optimizer.built and trainable_variables is not None:
                    with tf.init_scope(), strategy.scope():
                        optimizer.build(list(trainable_variables))

            return apply

        for optimizer in self.optimizers:
            optimizer.__dict__["apply"] = build_only(optimizer)
        known = {id(v) for v in self.model.variables}
        try:
            tf.function(
                lambda batch: self._call(self._train_step, batch), autograph=False
            ).get_concrete_function(element_spec)
        finally:
            for optimizer in self.optimizers:
                optimizer.__dict__.pop("apply", None)
        new = [v.path for v in self.model.variables if id(v) not in known]
        if new:
            raise _refuse(
                self.model,
                (
                    f"it creates variables when first called ({', '.join(new[:5])}): a "
                    "layer is built by `train_step`. Build every layer before `fit` (give "
                    "each sub-model a `keras.Input`, or call it once on a batch)."
                ),
            )

        def specs(variables):
            return [tf.TensorSpec(v.shape, v.dtype) for v in variables]

        tf.function(self.step, autograph=False).get_concrete_function(
            element_spec,
            specs(self.central),
            specs(self.optimizer_variables),
            specs(self.metric_variables),
        )
        self.prepared = True

    def _train_step(self, batch):
        # Converted by autograph as Keras's train function converts it.
        return tf.autograph.to_graph(type(self.model).train_step)(self.model, batch)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except TrainStepError:
            raise
        except Exception as e:  # any trace error: name train_step
            raise _refuse(
                self.model,
                (
                    f"tracing it raised {type(e).__name__}: {e}. A window runs "
                    "`train_step` as a `tf.function` on a worker: no `.numpy()`, no "
                    "Python `if`/`for` on tensor values."
                ),
            ) from e

    def step(self, batch, weights, opt_values, metric_values):
        """One call of the model's `train_step` on loop tensors:
        `(weights, opt_values, metric_values)` after it (`opt_values` in
        `optimizer_variables` order)."""
        carried = (
            list(zip(self.central, weights))
            + list(zip(self.optimizer_variables, opt_values))
            + list(zip(self.metric_variables, metric_values))
        )
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        with (
            internals.differentiable_stateless_variables(),
            internals.stateless_optimizers(self.optimizers),
            _RecordingScope(carried) as scope,
        ):
            self._call(self._train_step, batch)
        ids = {id(v) for v, _ in carried}
        stray = list({id(v): v for v in scope.written if id(v) not in ids}.values())
        if stray:
            raise _refuse(
                self.model,
                (
                    "it assigns variables the window does not carry: "
                    f"{', '.join(v.path for v in stray[:5])}. Hold them in the model: a "
                    "layer's weights, a metric listed by the model's `metrics` property, "
                    "or an optimizer attribute."
                ),
            )
        self._check_ops(graph.get_operations()[before:])
        values = [scope.get_current_value(v) for v, _ in carried]
        n, m = len(self.central), len(opt_values)
        return values[:n], values[n : n + m], values[n + m :]

    def _check_ops(self, ops):
        """Refuses ops of `train_step` that call Python or write a resource
        (a TF variable) directly: Keras variables were mapped, so what writes
        here is a variable the window does not carry."""
        for op in ops:
            if op.type in _PYTHON_OPS:
                raise _refuse(
                    self.model,
                    (
                        f"it calls Python ({op.type}: `tf.py_function` or "
                        "`tf.numpy_function`), which would call back into the chief "
                        "from a worker."
                    ),
                )
            if op.type in _READS:
                continue
            functions = [a.func.name for a in op.node_def.attr.values() if a.HasField("func")]
            functions += [f.name for a in op.node_def.attr.values() for f in a.list.func]
            nested = self._nested_writes(op.graph, functions) if functions else None
            if nested or (not functions and any(t.dtype == tf.resource for t in op.inputs)):
                raise _refuse(
                    self.model,
                    (
                        f"it writes a TF variable directly (op {op.name!r}, {nested or op.type}), "
                        "not through a Keras variable the window carries."
                    ),
                )

    @staticmethod
    def _nested_writes(graph, names):
        """The first variable-writing or Python-calling op type in the
        functions `names` of `graph` (cond branches, loop bodies, calls) and
        the functions they call, or None."""
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
        seen, todo = set(), list(names)
        while todo:
            fdef = library.get(todo.pop())
            if fdef is None or fdef.signature.name in seen:
                continue
            seen.add(fdef.signature.name)
            for node in fdef.node_def:
                if (
                    node.op in _PYTHON_OPS
                    or node.op in _WRITES
                    or node.op.startswith(
                        ("ResourceApply", "ResourceSparseApply", "ResourceScatter")
                    )
                ):
                    return node.op
                todo += [a.func.name for a in node.attr.values() if a.HasField("func")]
                todo += [f.name for a in node.attr.values() for f in a.list.func]
        return None

"""The public names resolve to one object each, wherever a user or the package imports
them: every error class from `tf_asgd.errors`, the outer optimizers from
`tf_asgd.optimizers` and the package's top level."""

import inspect

import tf_asgd
from tf_asgd import errors
from tf_asgd.cluster import connect, lost_tasks
from tf_asgd.rules import outer_optimizers
from tf_asgd.runtime import metric_states, optimizer_options, steps


def test_every_error_class_is_exported_once_from_tf_asgd_errors():
    classes = {
        name: value
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, Exception)
        and value.__module__ == "tf_asgd.errors"
    }
    assert len(classes) == 8, sorted(classes)
    for name, cls in classes.items():
        assert getattr(tf_asgd, name) is cls and name in tf_asgd.__all__, name
        assert cls.__doc__, name
    # The raising modules raise the same classes, not copies.
    assert connect.ClusterUnreachableError is errors.ClusterUnreachableError
    assert connect.WorkersLostError is errors.WorkersLostError
    assert lost_tasks.ClusterTaskLostError is errors.ClusterTaskLostError
    assert steps.TrainStepError is errors.TrainStepError
    assert metric_states.MetricStateError is errors.MetricStateError
    assert optimizer_options.UnsupportedFeatureError is errors.UnsupportedFeatureError
    assert tf_asgd.data.MissingDataError is errors.MissingDataError
    assert issubclass(errors.WorkerStalledError, errors.WorkersLostError)  # as documented


def test_the_outer_optimizers_stand_beside_gem():
    assert tf_asgd.optimizers.OuterSGD is tf_asgd.OuterSGD is outer_optimizers.OuterSGD
    assert (
        tf_asgd.optimizers.DelayedNesterov
        is tf_asgd.DelayedNesterov
        is outer_optimizers.DelayedNesterov
    )
    assert tf_asgd.optimizers.GEM.__module__ == "tf_asgd.optimizers.gem"

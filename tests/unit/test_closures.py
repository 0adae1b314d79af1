"""Closures of K windows: each window of a closure keeps its own
pull, ticket, staleness, exactly-once id, GEM state and record; epochs stay
exact; a bad `windows_per_closure` is rejected; a worker killed in the middle
of a closure leaves every window applied exactly once; a slow worker's closure
hands back the windows it did not start."""

import pytest

import tf_asgd
from tf_asgd.cluster.tf_config import make_resolver
from tf_asgd.runtime import scheduling


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4", scheduling.MAX_WINDOWS_PER_CLOSURE + 1])
def test_bad_windows_per_closure_is_rejected(value):
    # Validated before connecting: these addresses are never dialled.
    resolver = make_resolver({"worker": ["localhost:1"], "ps": ["localhost:2"]})
    with pytest.raises(
        ValueError, match="windows_per_closure must be None .* or an integer from 1 to"
    ):
        tf_asgd.AsyncParameterServerStrategy(resolver, windows_per_closure=value)

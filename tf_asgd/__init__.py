"""tf_asgd: asynchronous parameter-server training for Keras 3 on TensorFlow.

GPU A-SGD (Paine et al. 2013): workers train local copies for `n_sync`
minibatches between a pull and a push; the PS scales each push by its
staleness. GEM (Hermans & Louppe 2018): an optimizer wrapper that rescales
each worker's update to match a momentum-SGD proxy's energy.

```python
import keras, tf_asgd
with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    (x, y), _ = tf_asgd.data.load_digits()
    model.fit(x, y, batch_size=32, epochs=3)
```
"""

from tf_asgd import data, gem, models, network, optimizers, update_rules
from tf_asgd.cluster import LocalCluster, parse_tf_config
from tf_asgd.counters import AsyncStats
from tf_asgd.records import WindowRecord
from tf_asgd.steps import TrainStepError
from tf_asgd.strategy import AsyncParameterServerStrategy
from tf_asgd.update_rules import DelayedNesterov, OuterSGD

__version__ = "0.1.0"

__all__ = [
    "AsyncParameterServerStrategy",
    "AsyncStats",
    "DelayedNesterov",
    "LocalCluster",
    "OuterSGD",
    "TrainStepError",
    "WindowRecord",
    "data",
    "gem",
    "models",
    "network",
    "optimizers",
    "parse_tf_config",
    "update_rules",
]

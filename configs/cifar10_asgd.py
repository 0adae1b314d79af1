"""CIFAR-10 with a cuda-convnet-style net (Krizhevsky's layers-18pct) and augmentation.

conv 32x5x5 - maxpool 3/2 - LRN, conv 32x5x5 - avgpool 3/2 - LRN,
conv 64x5x5 - avgpool 3/2, dense 10; random 24x24 crops and horizontal
flips for training, the centre crop for testing (as cuda-convnet did).

Data: `keras.datasets.cifar10` (downloads to ~/.keras/datasets), or a local
copy of the python batches: `--config.data_dir=/path/to/cifar-10-batches-py`.

    python -m tf_asgd.launch --config=configs/cifar10_asgd.py --workdir=/tmp/cifar10
"""

import os
import runpy


def get_config():
    # Start from the default config; change only what this setup needs.
    c = runpy.run_path(os.path.join(os.path.dirname(__file__), "default.py"))["get_config"]()
    c.model = "cuda_convnet_cifar10"
    c.dataset = "cifar10"
    c.augment = True
    c.crop_size = 24
    c.batch_size = 128
    c.epochs = 60
    c.optimizer.learning_rate = 0.01
    c.gem.enabled = False
    # The strategy's default rule: no staleness scaling, the default outer optimizer.
    c.staleness = "none"
    c.num_workers = 4
    c.log_every_secs = 30.0
    return c

"""The GEM paper's MNIST setup (Hermans & Louppe 2018, arXiv:1805.08469).

Its convnet (conv 10x5x5, pool, conv 20x5x5, pool, dense 300, 200, 10), momentum SGD
with eta 0.05 (the paper also runs 0.1, where Downpour diverges and GEM stays
stable), mu 0.9, kappa 1 (the reference code's default; 2 is reported as a
good value), batch 64 per worker, many workers.

Data: `keras.datasets.mnist` (downloads `mnist.npz` to ~/.keras/datasets),
or a local copy: `--config.data_dir=/path/to/mnist.npz`.

    python -m tf_asgd.launch --config=configs/mnist_gem.py --workdir=/tmp/mnist_gem
    python -m tf_asgd.launch --config=configs/mnist_gem.py --config.optimizer.learning_rate=0.1 \
        --config.num_workers=32 --workdir=/tmp/mnist_gem_eta01
"""

import os
import runpy


def get_config():
    # Start from the default config; change only what this setup needs.
    c = runpy.run_path(os.path.join(os.path.dirname(__file__), "default.py"))["get_config"]()
    # The paper's convnet: conv 10x5x5, pool, conv 20x5x5, pool, dense 300, 200, 10.
    c.model = "gem_mnist_convnet"
    c.dataset = "mnist"
    c.batch_size = 64  # the paper's batch
    c.n_sync = 1  # the paper pushes every step
    c.staleness = "none"  # GEM normally uses the plain rule
    c.num_workers = 16
    return c

"""The GEM paper's MNIST setup (Hermans & Louppe 2018, arXiv:1805.08469).

Its convnet (conv 10x5x5, conv 20x5x5, dense 300, 200, 10), momentum SGD
with eta 0.05 (the paper also runs 0.1, where Downpour diverges and GEM stays
stable), mu 0.9, kappa 1 (the reference code's default; 2 is reported as a
good value), batch 64 per worker, many workers.

Data: `keras.datasets.mnist` (downloads `mnist.npz` to ~/.keras/datasets),
or a local copy: `--config.data_dir=/path/to/mnist.npz`.

    python -m tf_asgd.launch --config=configs/mnist_gem.py --workdir=/tmp/mnist_gem
    python -m tf_asgd.launch --config=configs/mnist_gem.py --config.optimizer.learning_rate=0.1 \
        --config.num_workers=32 --workdir=/tmp/mnist_gem_eta01
"""

from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    c.model = "gem_mnist_convnet"
    c.dataset = "mnist"
    c.data_dir = ""  # a keras-format mnist.npz; "" means ~/.keras/datasets/mnist.npz
    c.download = True
    c.augment = False
    c.image_size = 0
    c.crop_size = 0
    c.ten_crop_eval = False
    c.batch_size = 64
    c.epochs = 10
    c.steps_per_epoch = 0
    c.eval_steps = 0
    c.validate_every_epoch = True
    c.seed = 0
    c.n_sync = 1  # GEM's workers push every step
    c.staleness = "none"  # GEM replaces staleness scaling by energy matching
    c.max_staleness = config_dict.placeholder(int)
    c.optimizer = config_dict.ConfigDict()
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.05
    c.optimizer.momentum = 0.9
    c.gem = config_dict.ConfigDict()
    c.gem.enabled = True
    c.gem.kappa = 1.0
    c.num_workers = 16  # the paper goes up to 100
    c.num_ps = 1
    c.shared_process = True
    c.gpus_per_worker = 0
    c.max_checkpoints = 3
    c.log_every_secs = 10.0
    c.verbose = -1
    return c

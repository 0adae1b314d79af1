"""CIFAR-10 with a cuda-convnet-style net (Krizhevsky's layers-18pct) and augmentation.

conv 32x5x5 - maxpool 3/2 - LRN, conv 32x5x5 - avgpool 3/2 - LRN,
conv 64x5x5 - avgpool 3/2, dense 10; random 24x24 crops and horizontal
flips for training, the centre crop for testing (as cuda-convnet did).

Data: `keras.datasets.cifar10` (downloads to ~/.keras/datasets), or a local
copy of the python batches: `--config.data_dir=/path/to/cifar-10-batches-py`.

    python -m tf_asgd.launch --config=configs/cifar10_asgd.py --workdir=/tmp/cifar10
"""

from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    c.model = "cuda_convnet_cifar10"
    c.dataset = "cifar10"
    c.data_dir = ""  # a cifar-10-batches-py directory; "" means keras's cache
    c.download = True
    c.augment = True
    c.image_size = 0
    c.crop_size = 24
    c.ten_crop_eval = False
    c.batch_size = 128
    c.epochs = 60
    c.steps_per_epoch = 0
    c.eval_steps = 0
    c.validate_every_epoch = True
    c.seed = 0
    c.n_sync = 10
    c.staleness = "dynsgd"
    c.max_staleness = config_dict.placeholder(int)
    c.optimizer = config_dict.ConfigDict()
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.01
    c.optimizer.momentum = 0.9
    c.gem = config_dict.ConfigDict()
    c.gem.enabled = False
    c.gem.kappa = 1.0
    c.num_workers = 4
    c.num_ps = 1
    c.shared_process = True
    c.gpus_per_worker = 0
    c.max_checkpoints = 3
    c.log_every_secs = 30.0
    c.verbose = -1
    return c

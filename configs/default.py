"""Default config: the digits convnet on 2 workers and 1 PS with GEM, n_sync 10.

Runs offline (scikit-learn's 8x8 digits, no download) in about a minute on
2 CPU cores:

    python -m tf_asgd.launch --config=configs/default.py --workdir=/tmp/asgd

Every field can be overridden on the command line, e.g.
`--config.epochs=5 --config.gem.enabled=False --config.n_sync=1`.
"""

from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    # Model and data.
    c.model = "digits_convnet"  # a builder in tf_asgd.models
    c.dataset = "digits"  # digits | mnist | cifar10 | imagenet
    c.data_dir = ""  # local data path; "" means the data set's default place
    c.download = True  # let keras.datasets download when data_dir has nothing
    c.augment = False  # random crop/flip (cifar10, imagenet)
    c.image_size = 0  # imagenet: side images are resized to (0: data set default)
    c.crop_size = 0  # imagenet/cifar10: training crop side (0: data set default)
    c.ten_crop_eval = False  # final evaluation averages 10 crops (corners, centre, flips)
    # Training.
    c.batch_size = 32  # per worker step
    c.epochs = 10
    c.steps_per_epoch = 0  # 0: training examples // batch_size
    c.eval_steps = 0  # 0: the whole test split
    c.validate_every_epoch = True  # evaluate the test split after each epoch
    c.seed = 0
    # Asynchrony (tf_asgd.AsyncParameterServerStrategy).
    c.n_sync = 10  # local steps per window between pull and push
    c.staleness = "dynsgd"  # none (Downpour) | dynsgd (scale push by 1/(tau+1))
    c.max_staleness = config_dict.placeholder(int)  # None: keep every push
    # Optimizer; with gem.enabled it is wrapped in tf_asgd.optimizers.GEM.
    c.optimizer = config_dict.ConfigDict()
    c.optimizer.name = "sgd"  # sgd | adam
    c.optimizer.learning_rate = 0.05
    c.optimizer.momentum = 0.9
    c.gem = config_dict.ConfigDict()
    c.gem.enabled = True
    c.gem.kappa = 1.0
    # Local cluster (used when TF_CONFIG is not set).
    c.num_workers = 2
    c.num_ps = 1
    c.shared_process = True  # all local tasks in one child process (forced off with GPUs)
    c.gpus_per_worker = 0  # GPUs per local worker process (CUDA_VISIBLE_DEVICES)
    # Workdir outputs and progress.
    c.max_checkpoints = 3
    c.log_every_secs = 10.0  # periodic progress log line; 0 turns it off
    c.verbose = -1  # Keras fit verbosity; -1: progress bar on a terminal, else one line per epoch
    return c

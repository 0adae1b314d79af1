"""Default config: the digits convnet on 2 workers and 1 PS with GEM, n_sync 10.

Runs offline (scikit-learn's 8x8 digits, no download) in about 30 s on
2 CPU cores:

    python -m tf_asgd.launch --config=configs/default.py --workdir=/tmp/asgd

Every field can be overridden on the command line, e.g.
`--config.epochs=5 --config.gem.enabled=False --config.n_sync=1`.

What each field means is written once, in `tf_asgd.launch.config_fields.CONFIG_FIELDS`;
`python -m tf_asgd.launch --help` prints it. A new field goes in both places
(tests/unit/test_configs.py checks that they name the same fields).
"""

from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    # Model and data.
    c.model = "digits_convnet"
    c.dataset = "digits"
    c.data_dir = ""
    c.download = True
    c.augment = False
    c.image_size = 0
    c.crop_size = 0
    c.ten_crop_eval = False
    # Training.
    c.batch_size = 32
    c.epochs = 10
    c.steps_per_epoch = 0
    c.eval_steps = 0
    c.validate_every_epoch = True
    c.seed = 0
    # Asynchrony (tf_asgd.AsyncParameterServerStrategy).
    c.n_sync = 10
    c.synchronous = False  # rounds of N windows from one start (needs gem off, staleness none)
    # Not the strategy's default ("none", with its outer rate): GEM's pushes get no outer
    # rate, and DynSGD scales the stale ones down (docs/launcher.md).
    c.staleness = "dynsgd"
    c.max_staleness = config_dict.placeholder(int)  # None: keep every push
    c.worker_state = "keep"
    c.windows_per_closure = 0  # automatic
    c.compression = "none"  # pushes: none | bf16 | int8 | topk (1%)
    c.pull_compression = "none"  # pulls: none | bf16
    # A PS lost mid-run is recovered from the newest snapshot (a local run restarts it).
    c.snapshot_every = 60.0  # seconds; 0 = none: a lost PS stops the run (--resume)
    c.connect_timeout = 600.0  # seconds to wait for tasks that do not answer
    # The workers' rate: auto = x N annealed to x 1 (Adam's kin) or x sqrt(N) (others)
    # under the default outer rule (GEM: unchanged).
    c.lr_scaling = "auto"  # auto | none | sqrt | linear | anneal | a factor, e.g. "2"
    c.outer = config_dict.ConfigDict()  # the PS's outer optimizer
    c.outer.name = "default"
    c.outer.learning_rate = 0.0
    c.outer.momentum = 0.9
    # Optimizer; with gem.enabled it is wrapped in tf_asgd.optimizers.GEM.
    c.optimizer = config_dict.ConfigDict()
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.05
    c.optimizer.momentum = 0.9
    c.gem = config_dict.ConfigDict()
    c.gem.enabled = True
    c.gem.kappa = 1.0
    # Local cluster (used when TF_CONFIG is not set).
    c.num_workers = 2
    c.num_ps = 1
    c.shared_process = True
    c.gpus_per_worker = 0
    # Workdir outputs and progress.
    c.max_checkpoints = 3
    c.log_every_secs = 10.0
    c.verbose = -1
    return c

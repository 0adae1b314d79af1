"""The launcher's config fields: their names and meanings, written once.

`python -m tf_asgd.launch --help` prints them (`config_help`), configs/*.py
set their values (tests/unit/test_configs.py checks that both name the same
fields). Standard library only: the launcher reads this before it imports
TensorFlow (see `tf_asgd.launch`).
"""

CHECKPOINT_DIR = "checkpoints"  # under --workdir, with TF's `checkpoint` state file
DATASETS = ("digits", "mnist", "cifar10", "imagenet")
MODELS = (
    "digits_convnet",
    "gem_mnist_convnet",
    "cuda_convnet_cifar10",
    "paine2013_imagenet_convnet",
)
# The defaults the help states that the code computes; tests/unit/test_configs.py checks
# each against the code (this module cannot import it: it loads NumPy and TensorFlow).
# `outer_optimizers.default_outer_learning_rate(N)`, written as its docstring writes it:
OUTER_RATE_FORMULA = "1/N"
OUTER_RATE_AT_8 = "0.125"  # the formula at N = 8
STRATEGY_STALENESS = "none"  # `AsyncParameterServerStrategy(staleness=...)`'s default
DEFAULT_CONFIG_STALENESS = "dynsgd"  # configs/default.py's
# Every field of configs/default.py (tests/unit/test_configs.py checks the keys).
CONFIG_FIELDS = {
    "model": f"a builder in tf_asgd.models: {' | '.join(MODELS)}",
    "dataset": " | ".join(DATASETS),
    "data_dir": "local data path ('' = the data set's default place)",
    "download": "let keras.datasets download missing mnist/cifar10",
    "augment": "random crop + flip (cifar10, imagenet)",
    "image_size": "imagenet: side images are resized to (0 = default, 256)",
    "crop_size": "imagenet/cifar10: training crop side (0 = the data set's default)",
    "ten_crop_eval": "final multi-crop evaluation: softmax averaged over 10 views "
    "(4 corners, centre, and their mirror images)",
    "batch_size": "examples per worker step",
    "epochs": "epochs to train (a resumed run continues up to this)",
    "steps_per_epoch": "steps per epoch (0 = training examples // batch_size)",
    "eval_steps": "test batches to evaluate (0 = all)",
    "validate_every_epoch": "evaluate the test split after each epoch",
    "seed": "random seed (weights, data order)",
    "n_sync": "local steps per window between pull and push",
    "synchronous": "rounds of N windows from the same weights and one outer step on their mean "
    "(its default gain is N; refuses GEM and staleness rules) instead of asynchronous pushes",
    "staleness": "none (Downpour) | dynsgd (push scaled by 1/(staleness+1)); the strategy's "
    f"default is {STRATEGY_STALENESS}, configs/default.py sets {DEFAULT_CONFIG_STALENESS}: it "
    "trains with GEM, whose pushes get no outer rate, and DynSGD scales the stale ones down",
    "max_staleness": "drop pushes staler than this (unset = keep every push)",
    "optimizer.name": "sgd | adam",
    "optimizer.learning_rate": "learning rate of every worker's optimizer",
    "optimizer.momentum": "SGD momentum (sgd only)",
    "outer.name": "the PS's outer optimizer: default (each push of N workers scaled by "
    f"{OUTER_RATE_FORMULA}, the average ({OUTER_RATE_AT_8} at 8 workers), inside the "
    "stability limit 2 sin(pi/(4N-2)); on 3 and 4 workers after a rise and fall over the "
    "first pushes, except under Adam's annealed rate; GEM: added as is) | sgd | nesterov "
    "(DiLoCo) | delayed_nesterov (async DiLoCo)",
    "outer.learning_rate": "outer learning rate (0 = the optimizer's own: sgd 1, nesterov and "
    "delayed_nesterov 0.7)",
    "outer.momentum": "outer momentum (sgd, nesterov, delayed_nesterov)",
    "worker_state": "keep | reset: a worker's own optimizer state (momentum, Adam moments) "
    "at each pull",
    "windows_per_closure": "windows a worker runs per coordinator closure "
    "(0 = automatic, about 200 ms)",
    "compression": "how pushes travel to the PS: none | bf16 | int8 (per-block absmax) | "
    "topk (the largest 1%); lossy codecs keep an error-feedback residual per worker",
    "pull_compression": "how pulls travel to the workers: none | bf16 (the PS keeps float32)",
    "lr_scaling": "the workers' learning rate: auto (where the PS averages the pushes, the "
    "default outer rule: times N falling toward 1 as 1/t for Adam's kin, times sqrt(N) "
    "for others; else unchanged) | none | sqrt | linear (times N) | anneal | a factor, e.g. "
    "2; warmed up over the first quarter of the run (anneal; at most 2 / (1 - beta_2) steps) "
    "or its first 5% (others)",
    "snapshot_every": "seconds between snapshots of the central state: a PS lost mid-run and "
    "back on its address is recovered from the newest (a local run restarts it itself); "
    "0 = none, so a lost PS stops the run and --resume continues from the newest checkpoint",
    "connect_timeout": "seconds the chief waits for cluster tasks that do not answer (at the "
    "start, and for lost workers), naming them, before it stops with one line",
    "gem.enabled": "wrap the optimizer in tf_asgd.optimizers.GEM",
    "gem.kappa": "GEM's kappa (the paper reports 2 as a good value)",
    "num_workers": "local cluster: worker tasks (ignored under TF_CONFIG)",
    "num_ps": "local cluster: parameter servers (ignored under TF_CONFIG)",
    "shared_process": "host all local tasks in one child process (off when gpus_per_worker > 0)",
    "gpus_per_worker": "GPUs per local worker process (CUDA_VISIBLE_DEVICES)",
    "max_checkpoints": "checkpoints kept in WORKDIR/checkpoints",
    "log_every_secs": "seconds between progress log lines (0 = off)",
    "verbose": "Keras fit verbosity (-1 = progress bar on a terminal, else a line per epoch)",
}


def config_help():
    """`CONFIG_FIELDS` as the text `--help` shows under `--config`."""
    lines = [f"{field}: {meaning};" for field, meaning in CONFIG_FIELDS.items()]
    lines[-1] = lines[-1][:-1] + "."
    return "Config fields (override with --config.<field>=<value>):\n" + "\n".join(lines) + "\n"


def used_workdir_message(workdir, latest):
    """Why a run without `--resume` refuses `workdir`, whose newest checkpoint is `latest`."""
    return (
        f"{workdir!r} already holds checkpoints ({latest}); pass --resume to continue from "
        "the newest one, or use a fresh --workdir."
    )

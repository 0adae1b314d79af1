r"""Launcher: `python -m tf_asgd.launch --config=configs/default.py --workdir=DIR`.

Without `TF_CONFIG` it starts a local loopback cluster (`--config.num_workers`
workers, `--config.num_ps` parameter servers), trains, evaluates, writes the
workdir and stops every process. With `TF_CONFIG` the task's role decides:
`chief` trains, `worker`/`ps` serve until SIGTERM, `evaluator` evaluates new
checkpoints. See docs/launcher.md.

Config fields are overridden with `--config.<field>=<value>`, for example
`--config.epochs=5 --config.optimizer.learning_rate=0.1 --config.gem.enabled=False`.
`--help` lists every flag and config field (the fields' meanings are
written once, in `tf_asgd.train_lib.CONFIG_FIELDS`).
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from tf_asgd import data, network, train_lib, training

config_flags.DEFINE_config_file(
    "config", None,
    "Path to a config file with get_config() (e.g. configs/default.py).\n"
    + train_lib.config_help(),
    lock_config=True,
)
flags.DEFINE_string(
    "workdir", None,
    "Output directory: checkpoints/, model.keras, tensorboard/, metrics.csv, results.json. "
    "Needed by the chief, the evaluator and local runs; worker and ps tasks ignore it.",
)
flags.DEFINE_bool(
    "resume", False,
    "Continue from the newest checkpoint in --workdir (central variables, optimizer step, "
    "version counter, epoch count).",
)
flags.DEFINE_integer(
    "gpus_per_worker", None,
    "GPUs per local worker process, each worker seeing its own through CUDA_VISIBLE_DEVICES; "
    "overrides config.gpus_per_worker. PS tasks and the chief never use a GPU.",
)
flags.DEFINE_enum(
    "isolate_network", "auto", ["auto", "yes", "no"],
    "Local runs: run the chief and its tasks in a network namespace whose only interface is "
    "loopback, so that no one outside can reach their ports (TF 2.21 listens on 0.0.0.0 and "
    "has no authentication). auto: when the kernel allows it and no data must be "
    "downloaded, else a warning; yes: or stop; no: listen on every interface. Ignored "
    "under TF_CONFIG.",
)
FLAGS = flags.FLAGS


def isolate_local_run(mode, config):
    """Moves a local run into a loopback-only network namespace (see
    `tf_asgd.network`), or says why not. Returns only inside the namespace,
    or when the run stays outside it."""
    if mode == "no":
        return
    if (mode == "auto" and not network.in_loopback_namespace() and config.download
            and data.needs_download(config.dataset, config.data_dir)):
        logging.warning(
            "Not isolating the local cluster to loopback: %s must be downloaded first "
            "(a loopback-only namespace has no network). Its ports listen on every "
            "interface; once the data is here, runs are isolated.", config.dataset)
        return
    try:
        network.reexec_in_loopback_namespace()  # outside: does not return
    except OSError as e:
        if mode == "yes":
            sys.exit(f"tf_asgd.launch: --isolate_network=yes, but {e}.")
        logging.warning(
            "The local cluster's ports listen on every interface (TF 2.21 binds 0.0.0.0; "
            "its gRPC has no authentication) because %s. Firewall this machine, or "
            "pass --isolate_network=no to accept this.", e)
        return
    logging.info("Isolated: this run has its own network namespace with only loopback; "
                 "no one outside can reach the cluster's ports.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/default.py")
    if FLAGS.gpus_per_worker is not None:
        config.gpus_per_worker = FLAGS.gpus_per_worker
    try:
        role = training.tf_config_role()  # fails at once on a malformed TF_CONFIG
    except ValueError as e:
        sys.exit(f"tf_asgd.launch: bad TF_CONFIG: {e}")
    if FLAGS.workdir is None and (role is None or role[1] in ("chief", "evaluator")):
        raise app.UsageError("--workdir is required for local runs, the chief and the evaluator.")
    if role is None:
        isolate_local_run(FLAGS.isolate_network, config)
    logging.info("config:\n%s", config)
    try:
        training.run(config, FLAGS.workdir and os.path.abspath(FLAGS.workdir), resume=FLAGS.resume)
    except train_lib.ClusterTaskLostError as e:
        logging.error("%s", e)
        sys.exit(f"tf_asgd.launch: {e}")


if __name__ == "__main__":
    app.run(main)

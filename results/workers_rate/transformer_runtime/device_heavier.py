"""The asynchronous default on the small Transformer at plain's samples, as a user's script
drives it (only `n_sync` set; the seeded pipeline given to `fit`), at an emulated device
time long enough that the 2 cores are less of the bottleneck; prints one row.

    PYTHONPATH=. python results/workers_rate/transformer_runtime/device_heavier.py 8 0 250
"""

import json
import sys
import time

import keras

import tf_asgd
from benchmarks import harness, setups

workers, seed, device_ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
recipe = setups.SETUPS["mnist1d_transformer_adam"]
data = setups.load_data(recipe.data)
with harness.local_cluster(workers) as cluster:
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=10,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(device_ms),
    )
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = setups.build_model(recipe.model, data)
        harness.compile_classifier(model, setups.make_optimizer(recipe.optimizer, recipe.steps))
    held_out = setups.HeldOut(recipe.model, data)
    pids = list(cluster.pids().values())

    def cpu():
        return time.process_time() + sum(harness.cpu_seconds(p) for p in pids)

    cpu0, t0 = cpu(), time.time()
    model.fit(
        setups.train_dataset(data, recipe.batch, seed),
        steps_per_epoch=recipe.steps,
        epochs=1,
        verbose=0,
    )
    fit_s, cpu_s = time.time() - t0, cpu() - cpu0
    stats = strategy.model_stats(model)
    row = dict(
        workers=workers,
        seed=seed,
        device_ms=device_ms,
        final=round(float(held_out(model.get_weights())[0]), 4),
        fit_s=round(fit_s, 1),
        cpu_share=round(cpu_s / fit_s / 2, 2),  # of the 2 cores
        device_s_per_worker=round(recipe.steps / workers * device_ms / 1000, 1),
        mean_staleness=round(stats.mean_staleness, 2),
        max_staleness=stats.max_staleness,
        windows=stats.windows,
    )
    print(json.dumps(row), flush=True)

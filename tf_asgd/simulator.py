"""A many-worker asynchronous SGD simulator in one process (NumPy).

It runs 1 to hundreds of simulated workers against one central parameter
vector, with the *same* update rules as the cluster: the PS applies
`update_rules.ps_push` (Downpour: `rule="none"`, DynSGD: `rule="dynsgd"`)
and GEM workers call `update_rules.gem_step`, all with `xp=numpy`. Nothing
here re-implements those formulas; a change to `update_rules` changes the
simulator too.

The model is small and real: a softmax regression or a one-hidden-layer MLP
with hand-written NumPy gradients, trained on real data (the digits set by
default).

Two ways to control staleness:

- `timing=...` (event-driven): each worker's window takes a random duration
  drawn from `"constant"`, `"uniform"`, `"exponential"` or `"lognormal"`;
  pushes happen in order of completion, and staleness (pushes committed
  between a worker's pull and its push) emerges as on a real cluster.
  `"constant"` gives round-robin order (tau = workers - 1 for every push).
- `delay=...` (explicit): every push's staleness is drawn directly, e.g.
  `"fixed"` (tau = workers - 1), `"uniform"` (0 .. 2 (workers - 1)) or
  `"geometric"` (mean workers - 1); the gradient is computed on the central
  parameters of `tau` pushes ago. The worker count then only sets the scale.

Example:

>>> from tf_asgd import simulator
>>> (x, y), _ = simulator.digits_features()
>>> run = simulator.simulate(x, y, method="gem", workers=16, pushes=200,
...                          eta=0.05, seed=0, eval_every=100)
>>> run.records[-1]["loss"] < run.records[0]["loss"]
True
"""

import dataclasses
import heapq

import numpy as np

from tf_asgd import update_rules

METHODS = {
    # method: (PS staleness rule, GEM on the workers)
    "downpour": ("none", False),
    "dynsgd": ("dynsgd", False),
    "gem": ("none", True),
}
INNERS = ("sgd", "adam")
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-7  # Keras's Adam defaults
TIMINGS = ("constant", "uniform", "exponential", "lognormal")
DELAYS = ("fixed", "uniform", "geometric")


# ---- data and model ---------------------------------------------------------


def digits_features(test_fraction=0.2, seed=0):
    """The digits data as flat 64-feature vectors (see `tf_asgd.data.load_digits`)."""
    from tf_asgd import data

    (x, y), (xt, yt) = data.load_digits(test_fraction, seed)
    return (x.reshape(len(x), -1), y), (xt.reshape(len(xt), -1), yt)


class NumpyModel:
    """Softmax regression (`hidden=0`) or a one-hidden-layer ReLU MLP.

    Parameters are a list of float32 arrays, ordered like a Keras model's
    trainable variables: `[W1, b1, W2, b2]` or `[W, b]`.
    """

    def __init__(self, num_features, num_classes=10, hidden=32):
        self.num_features, self.num_classes, self.hidden = num_features, num_classes, hidden

    @property
    def names(self):
        if self.hidden:
            return ["dense_1/kernel", "dense_1/bias", "dense_2/kernel", "dense_2/bias"]
        return ["dense/kernel", "dense/bias"]

    def init(self, rng):
        dims = [self.num_features] + ([self.hidden] if self.hidden else []) + [self.num_classes]
        params = []
        for fan_in, fan_out in zip(dims[:-1], dims[1:]):
            limit = np.sqrt(6.0 / (fan_in + fan_out))  # Glorot uniform, as Keras
            params.append(rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32))
            params.append(np.zeros(fan_out, np.float32))
        return params

    def _forward(self, params, x):
        if self.hidden:
            w1, b1, w2, b2 = params
            h = np.maximum(x @ w1 + b1, 0.0)
            return h, h @ w2 + b2
        w, b = params
        return x, x @ w + b

    def loss_and_accuracy(self, params, x, y):
        """Mean cross-entropy and accuracy; the loss is `inf` once it overflows."""
        with np.errstate(all="ignore"):
            _, logits = self._forward(params, x)
            z = logits - logits.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            loss = float(-logp[np.arange(len(y)), y].mean())
            acc = float((logits.argmax(axis=1) == y).mean())
        if not np.isfinite(loss):
            loss = float("inf")
        return loss, acc

    def gradients(self, params, x, y):
        """Gradients of the mean cross-entropy, same structure as `params`."""
        with np.errstate(all="ignore"):
            h, logits = self._forward(params, x)
            z = logits - logits.max(axis=1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(y)), y] -= 1.0
            dlogits = p / len(y)
            if self.hidden:
                w1, b1, w2, b2 = params
                dh = (dlogits @ w2.T) * (h > 0)
                return [x.T @ dh, dh.sum(0), h.T @ dlogits, dlogits.sum(0)]
            return [x.T @ dlogits, dlogits.sum(0)]


# ---- the simulation ---------------------------------------------------------


@dataclasses.dataclass
class SimulationResult:
    """What one simulated run produced.

    Attributes:
        config: the arguments of the run.
        records: one dict per evaluation point: `push`, `samples`, `time`
            (simulated), `loss`, `accuracy` (central parameters on the
            evaluation set) and `window_loss` (mean training loss of the
            workers' minibatches since the previous record).
        staleness_histogram: pushes counted by staleness.
        pi: for GEM, one dict per evaluation point: `push`, and per tensor
            name the mean and the median of pi over the pushes since the
            previous record.
        diverged: the central loss became non-finite (the run then stops).
    """

    config: dict
    records: list
    staleness_histogram: np.ndarray
    pi: list
    diverged: bool


def _durations(rng, timing, size, spread):
    if timing == "constant":
        return np.ones(size)
    if timing == "uniform":
        return rng.uniform(1.0 - spread, 1.0 + spread, size)
    if timing == "exponential":
        return rng.exponential(1.0, size)
    if timing == "lognormal":
        return rng.lognormal(-0.5 * spread**2, spread, size)
    raise ValueError(f"Unknown timing {timing!r}; expected one of {TIMINGS}.")


def _delay(rng, delay, workers):
    mean = workers - 1
    if delay == "fixed":
        return mean
    if delay == "uniform":
        return int(rng.integers(0, 2 * mean + 1))
    if delay == "geometric":
        # Support 0, 1, 2, ... with mean workers - 1.
        return int(rng.geometric(1.0 / (mean + 1)) - 1)
    raise ValueError(f"Unknown delay {delay!r}; expected one of {DELAYS}.")


def simulate(
    x,
    y,
    method="gem",
    workers=16,
    pushes=2000,
    n_sync=1,
    batch_size=64,
    eta=0.05,
    mu=0.9,
    kappa=1.0,
    hidden=32,
    timing="exponential",
    spread=0.5,
    delay=None,
    eval_every=50,
    eval_data=None,
    seed=0,
    inner="sgd",
    inner_momentum=0.0,
    outer=None,
    worker_state="keep",
):
    """Simulates asynchronous training; returns a `SimulationResult`.

    Args:
        x, y: training features (N x F) and integer labels.
        method: `"downpour"`, `"dynsgd"` or `"gem"` (see `METHODS`).
        workers: simulated workers.
        pushes: total pushes (windows) to simulate.
        n_sync: local SGD steps per window; the push is the accumulated
            update `-eta * sum(grad)` (GPU A-SGD's window).
        batch_size, eta: each local step's minibatch and learning rate.
        mu, kappa: GEM's proxy momentum and amplification (GEM only).
        hidden: MLP hidden units (0: softmax regression).
        timing, spread: the window duration distribution (event-driven mode).
        delay: if given, draw each push's staleness from this distribution
            instead (`"fixed"`, `"uniform"`, `"geometric"`).
        eval_every: pushes between evaluations of the central parameters.
        eval_data: `(x, y)` to evaluate on; the training set by default.
        seed: seeds data order, initialisation and timing.
        inner: the workers' own optimizer for the local steps: `"sgd"`
            (Keras's SGD, momentum `inner_momentum`) or `"adam"` (Keras's
            Adam defaults, learning rate `eta`; its step count is global, read
            at each pull as on the cluster). GEM needs plain `"sgd"`.
        outer: the PS's outer optimizer (`update_rules.OuterSGD` or
            `DelayedNesterov`); default `OuterSGD()`, adding each push as is.
        worker_state: `"keep"` the inner optimizer's state across windows,
            or `"reset"` it at every pull.
    """
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; expected one of {tuple(METHODS)}.")
    if workers < 1 or pushes < 1 or n_sync < 1:
        raise ValueError("workers, pushes and n_sync must be positive.")
    if delay is not None and delay not in DELAYS:
        raise ValueError(f"Unknown delay {delay!r}; expected one of {DELAYS}.")
    if delay is None and timing not in TIMINGS:
        raise ValueError(f"Unknown timing {timing!r}; expected one of {TIMINGS}.")
    if inner not in INNERS:
        raise ValueError(f"Unknown inner optimizer {inner!r}; expected one of {INNERS}.")
    if method == "gem" and (inner != "sgd" or inner_momentum):
        raise ValueError("GEM's workers run plain SGD: inner='sgd', inner_momentum=0.")
    outer = update_rules.validate_outer_optimizer(outer or update_rules.OuterSGD())
    update_rules.validate_worker_state(worker_state)
    config = dict(
        inner=inner,
        inner_momentum=inner_momentum,
        outer=repr(outer),
        worker_state=worker_state,
        method=method,
        workers=workers,
        pushes=pushes,
        n_sync=n_sync,
        batch_size=batch_size,
        eta=eta,
        mu=mu,
        kappa=kappa,
        hidden=hidden,
        timing=timing if delay is None else None,
        spread=spread,
        delay=delay,
        seed=seed,
    )
    rule, use_gem = METHODS[method]
    rng = np.random.default_rng(seed)
    x = np.asarray(x, np.float32)
    y = np.asarray(y)
    ex, ey = eval_data if eval_data is not None else (x, y)
    model = NumpyModel(x.shape[1], int(max(y.max(), ey.max())) + 1, hidden)
    central = model.init(rng)

    def minibatch():
        idx = rng.integers(0, len(x), batch_size)
        return x[idx], y[idx]

    def window(params, opt_state, step):
        """n_sync local steps of the inner optimizer from `params`;
        returns (update, mean loss, new optimizer state)."""
        local = [p.copy() for p in params]
        state = [[s.copy() for s in slots] for slots in opt_state]
        losses = []
        for k in range(n_sync):
            bx, by = minibatch()
            losses.append(model.loss_and_accuracy(local, bx, by)[0])
            for p, g, slots in zip(local, model.gradients(local, bx, by), state):
                p += inner_step(g, slots, step + k)
        return [w - p for w, p in zip(local, params)], float(np.mean(losses)), state

    def inner_step(g, slots, step):
        """The displacement of one Keras SGD / Adam step; updates `slots`."""
        if inner == "adam":
            m, v = slots
            m += (1 - ADAM_B1) * (g - m)
            v += (1 - ADAM_B2) * (g * g - v)
            t = step + 1
            lr = eta * np.sqrt(1 - ADAM_B2**t) / (1 - ADAM_B1**t)
            return -lr * m / (np.sqrt(v) + ADAM_EPS)
        if inner_momentum:
            (v,) = slots
            v *= inner_momentum
            v -= eta * g
            return v.copy()
        return -eta * g

    def fresh_state():
        n = {"adam": 2, "sgd": 1 if inner_momentum else 0}[inner]
        return [[np.zeros_like(p) for _ in range(n)] for p in central]

    # Worker state: what it pulled (params and the version), GEM's momentum.
    version = 0
    pulled = [[p.copy() for p in central] for _ in range(workers)]
    pulled_version = [0] * workers
    momentum = [[np.zeros_like(p) for p in central] for _ in range(workers)]
    opt_states = [fresh_state() for _ in range(workers)]
    outer_state = [{} for _ in central]
    steps_applied = 0  # the global step count (the optimizer's iterations on the PS)
    pulled_steps = [0] * workers
    history = [[p.copy() for p in central]]  # delay mode: central by version
    events = []
    if delay is None:
        for w, d in enumerate(_durations(rng, timing, workers, spread)):
            heapq.heappush(events, (float(d), w))

    hist = np.zeros(max(256, 16 * workers), np.int64)
    records, pis = [], []
    pi_acc = {n: [] for n in model.names}
    window_losses = []
    now = 0.0
    diverged = False

    def record():
        loss, acc = model.loss_and_accuracy(central, ex, ey)
        records.append(
            dict(
                push=version,
                samples=version * n_sync * batch_size,
                time=now,
                loss=loss,
                accuracy=acc,
                window_loss=float(np.mean(window_losses)) if window_losses else float("nan"),
            )
        )
        window_losses.clear()
        if use_gem and version:
            row = {"push": version}
            for n, values in pi_acc.items():
                values = np.concatenate(values) if values else np.array([np.nan])
                row[n + ":mean"] = float(np.mean(values))
                row[n + ":median"] = float(np.median(values))
            pis.append(row)
            for n in pi_acc:
                pi_acc[n] = []
        return np.isfinite(loss)

    record()
    for _ in range(pushes):
        if delay is None:
            now, w = heapq.heappop(events)
            start, start_version = pulled[w], pulled_version[w]
        else:
            w = version % workers
            tau = min(_delay(rng, delay, workers), len(history) - 1)
            start_version = version - tau
            start = history[-1 - tau]
            now = float(version)
        if worker_state == "reset":
            opt_states[w] = fresh_state()
        step = pulled_steps[w] if delay is None else max(0, steps_applied - tau * n_sync)
        update, wloss, new_state = window(start, opt_states[w], step)
        opt_states[w] = new_state
        window_losses.append(wloss)
        tau = version - start_version
        hist[min(tau, len(hist) - 1)] += 1
        if use_gem:
            # GEM: dc is how far the central variable moved since this
            # worker's previous pull; the worker pushes pi * g.
            pushed = []
            for i, (g, c, s) in enumerate(zip(update, central, start)):
                out, momentum[w][i], pi = update_rules.gem_step(
                    g, momentum[w][i], c - s, mu, kappa, xp=np
                )
                pushed.append(out)
                pi_acc[model.names[i]].append(np.asarray(pi, np.float32).ravel()[:4096])
            update = pushed
        for i, (c, u) in enumerate(zip(central, update)):
            central[i], outer_state[i] = update_rules.ps_push(
                c,
                u.astype(c.dtype),
                tau,
                version,
                outer_state[i],
                rule,
                outer=outer,
                num_workers=workers,
                xp=np,
            )
        version += 1
        steps_applied += n_sync
        if delay is None:
            pulled[w] = [p.copy() for p in central]
            pulled_version[w] = version
            pulled_steps[w] = steps_applied
            heapq.heappush(events, (now + float(_durations(rng, timing, 1, spread)[0]), w))
        else:
            history.append([p.copy() for p in central])
            del history[: max(0, len(history) - (8 * workers + 2))]
        if version % eval_every == 0 or version == pushes:
            if not record():
                diverged = True
                break
    last = np.nonzero(hist)[0]
    return SimulationResult(
        config, records, hist[: (last[-1] + 1) if len(last) else 1], pis, diverged
    )

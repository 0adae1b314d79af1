"""A many-worker asynchronous SGD simulator in one process (NumPy).

Hundreds of simulated workers train a small NumPy model against one central parameter
vector with the cluster's own rules (`staleness.ps_push`, `gem_rule.gem_step`).
Staleness comes from random window durations (`timing=...`) or is drawn directly
(`delay=...`): docs/architecture.md.

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
import types

import numpy as np

from tf_asgd.rules import gem_rule, outer_optimizers, staleness

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


def _validate(method, workers, pushes, n_sync, delay, timing, inner, inner_momentum):
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
        outer: the PS's outer optimizer (`outer_optimizers.OuterSGD` or
            `DelayedNesterov`); default `OuterSGD()`, adding each push as is.
        worker_state: `"keep"` the inner optimizer's state across windows,
            or `"reset"` it at every pull.

    Raises:
        ValueError: an unknown method, delay, timing or inner optimizer, a count
            below 1, or GEM with an inner optimizer other than plain SGD.
    """
    _validate(method, workers, pushes, n_sync, delay, timing, inner, inner_momentum)
    outer = outer_optimizers.validate_outer_optimizer(outer or outer_optimizers.OuterSGD())
    outer_optimizers.validate_worker_state(worker_state)
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
    run = _Simulation(x, y, eval_data, config, outer=outer, eval_every=eval_every)
    return run.run()


class _Simulation:
    """One `simulate` run: the central parameters, the PS and every worker's state.

    `config` is `simulate`'s validated configuration; the methods share the one
    random generator in a fixed order, so a seed gives the same run.
    """

    def __init__(self, x, y, eval_data, config, outer, eval_every):
        c = types.SimpleNamespace(**config)
        self.c, self.outer, self.eval_every = c, outer, eval_every
        self.rule, self.use_gem = METHODS[c.method]
        self.rng = np.random.default_rng(c.seed)
        self.config = config
        self.x = np.asarray(x, np.float32)
        self.y = np.asarray(y)
        self.ex, self.ey = eval_data if eval_data is not None else (self.x, self.y)
        self.model = NumpyModel(
            self.x.shape[1], int(max(self.y.max(), self.ey.max())) + 1, c.hidden
        )
        central = self.central = self.model.init(self.rng)
        workers = c.workers
        # Worker state: what it pulled (params and the version), GEM's momentum.
        self.version = 0
        self.pulled = [[p.copy() for p in central] for _ in range(workers)]
        self.pulled_version = [0] * workers
        self.momentum = [[np.zeros_like(p) for p in central] for _ in range(workers)]
        self.opt_states = [self.fresh_state() for _ in range(workers)]
        self.outer_state = [{} for _ in central]
        self.steps_applied = 0  # the global step count (the optimizer's iterations on the PS)
        self.pulled_steps = [0] * workers
        self.history = [[p.copy() for p in central]]  # delay mode: central by version
        self.events = []
        if c.delay is None:
            for w, d in enumerate(_durations(self.rng, c.timing, workers, c.spread)):
                heapq.heappush(self.events, (float(d), w))
        self.hist = np.zeros(max(256, 16 * workers), np.int64)
        self.records, self.pis = [], []
        self.pi_acc = {n: [] for n in self.model.names}
        self.window_losses = []
        self.now = 0.0

    def minibatch(self):
        idx = self.rng.integers(0, len(self.x), self.c.batch_size)
        return self.x[idx], self.y[idx]

    def window(self, params, opt_state, step):
        """n_sync local steps of the inner optimizer from `params`;
        returns (update, mean loss, new optimizer state)."""
        model = self.model
        local = [p.copy() for p in params]
        state = [[s.copy() for s in slots] for slots in opt_state]
        losses = []
        for k in range(self.c.n_sync):
            bx, by = self.minibatch()
            losses.append(model.loss_and_accuracy(local, bx, by)[0])
            for p, g, slots in zip(local, model.gradients(local, bx, by), state):
                p += self.inner_step(g, slots, step + k)
        return [w - p for w, p in zip(local, params)], float(np.mean(losses)), state

    def inner_step(self, g, slots, step):
        """The displacement of one Keras SGD / Adam step; updates `slots`."""
        eta, inner_momentum = self.c.eta, self.c.inner_momentum
        if self.c.inner == "adam":
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

    def fresh_state(self):
        n = {"adam": 2, "sgd": 1 if self.c.inner_momentum else 0}[self.c.inner]
        return [[np.zeros_like(p) for _ in range(n)] for p in self.central]

    def record(self):
        """Evaluates the central parameters; False once the loss is not finite."""
        loss, acc = self.model.loss_and_accuracy(self.central, self.ex, self.ey)
        window_losses = self.window_losses
        self.records.append(
            dict(
                push=self.version,
                samples=self.version * self.c.n_sync * self.c.batch_size,
                time=self.now,
                loss=loss,
                accuracy=acc,
                window_loss=float(np.mean(window_losses)) if window_losses else float("nan"),
            )
        )
        window_losses.clear()
        if self.use_gem and self.version:
            row = {"push": self.version}
            for n, values in self.pi_acc.items():
                values = np.concatenate(values) if values else np.array([np.nan])
                row[n + ":mean"] = float(np.mean(values))
                row[n + ":median"] = float(np.median(values))
            self.pis.append(row)
            for n in self.pi_acc:
                self.pi_acc[n] = []
        return np.isfinite(loss)

    def pull(self):
        """The next pushing worker and what its window starts from.

        Returns:
            (worker, start parameters, start version, the global step count it read).
        """
        c = self.c
        if c.delay is None:
            self.now, w = heapq.heappop(self.events)
            return w, self.pulled[w], self.pulled_version[w], self.pulled_steps[w]
        w = self.version % c.workers
        tau = min(_delay(self.rng, c.delay, c.workers), len(self.history) - 1)
        self.now = float(self.version)
        step = max(0, self.steps_applied - tau * c.n_sync)
        return w, self.history[-1 - tau], self.version - tau, step

    def gem_push(self, w, update, start):
        """GEM: dc is how far the central variable moved since this worker's
        previous pull; the worker pushes pi * g."""
        pushed = []
        for i, (g, c, s) in enumerate(zip(update, self.central, start)):
            out, self.momentum[w][i], pi = gem_rule.gem_step(
                g, self.momentum[w][i], c - s, self.c.mu, self.c.kappa, xp=np
            )
            pushed.append(out)
            self.pi_acc[self.model.names[i]].append(np.asarray(pi, np.float32).ravel()[:4096])
        return pushed

    def apply(self, update, tau):
        """The PS applies one push of staleness `tau` to every tensor."""
        central = self.central
        for i, (c, u) in enumerate(zip(central, update)):
            central[i], self.outer_state[i] = staleness.ps_push(
                c,
                u.astype(c.dtype),
                tau,
                self.version,
                self.outer_state[i],
                self.rule,
                outer=self.outer,
                num_workers=self.c.workers,
                xp=np,
            )
        self.version += 1
        self.steps_applied += self.c.n_sync

    def repull(self, w):
        """After a push: worker `w` pulls and starts its next window (event mode),
        or the central parameters join the history (delay mode)."""
        c = self.c
        if c.delay is None:
            self.pulled[w] = [p.copy() for p in self.central]
            self.pulled_version[w] = self.version
            self.pulled_steps[w] = self.steps_applied
            duration = float(_durations(self.rng, c.timing, 1, c.spread)[0])
            heapq.heappush(self.events, (self.now + duration, w))
        else:
            self.history.append([p.copy() for p in self.central])
            del self.history[: max(0, len(self.history) - (8 * c.workers + 2))]

    def run(self):
        c = self.c
        diverged = False
        self.record()
        for _ in range(c.pushes):
            w, start, start_version, step = self.pull()
            if c.worker_state == "reset":
                self.opt_states[w] = self.fresh_state()
            update, wloss, new_state = self.window(start, self.opt_states[w], step)
            self.opt_states[w] = new_state
            self.window_losses.append(wloss)
            tau = self.version - start_version
            self.hist[min(tau, len(self.hist) - 1)] += 1
            if self.use_gem:
                update = self.gem_push(w, update, start)
            self.apply(update, tau)
            self.repull(w)
            if self.version % self.eval_every == 0 or self.version == c.pushes:
                if not self.record():
                    diverged = True
                    break
        hist = self.hist
        last = np.nonzero(hist)[0]
        return SimulationResult(
            self.config,
            self.records,
            hist[: (last[-1] + 1) if len(last) else 1],
            self.pis,
            diverged,
        )

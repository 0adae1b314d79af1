"""Pure codecs for pushes and pulls: bf16, int8 with per-block scales, top-k; error feedback.

Each codec is one definition over a small backend of array primitives (`xp`: `numpy`, or
`tensorflow` / `tensorflow.experimental.numpy` for TF ops in a `tf.function`), so NumPy and
TF compute the same numbers bit for bit. A payload is a tuple of arrays: exactly what
would cross the network; `payload_bytes(n)` is its size for `n` float32 elements.

Example:
    >>> import numpy as np
    >>> c = Compression("int8", block=4)
    >>> payload = c.encode(np.array([1.0, -2.0, 0.5, 0.0, 3.0], np.float32))
    >>> [p.dtype.name for p in payload], c.payload_bytes(5), c.decode(payload, (5,)).tolist()
    (['int8', 'float32'], 13, [1.0078740119934082, -2.0, 0.5039370059967041, 0.0, 3.0])
"""

import dataclasses
import fractions
import math
import numbers

import numpy as np

CODECS = ("none", "bf16", "int8", "topk")
DEFAULT_BLOCK = 256
DEFAULT_FRACTION = 0.01
INT8_LEVELS = 127  # symmetric: q in [-127, 127], so that -q is always representable
# A block's scale is `absmax * (1 / 127)`: TF's graph optimizer turns a division by a
# constant into this product, so NumPy computes it the same way.
_INT8_STEP = np.float32(1.0 / INT8_LEVELS)


@dataclasses.dataclass(frozen=True)
class Compression:
    """How an update (or a pull) is compressed: a codec and its one parameter.

    - `"none"`: float32 as it is (4 bytes an element).
    - `"bf16"`: bfloat16, rounded to nearest even (2 bytes an element).
    - `"int8"`: int8 with one float32 absmax scale per `block` elements of the
      flattened tensor (`n + 4 * ceil(n / block)` bytes).
    - `"topk"`: the `k = ceil(fraction * n)` entries of largest magnitude of
      each tensor, as float32 values and int32 indices (`8 * k` bytes).

    Args:
        codec: one of `CODECS`.
        block: int8's block size, a positive integer; default 256. Only for
            `"int8"`.
        fraction: top-k's kept fraction, in (0, 1]; default 0.01. Only for
            `"topk"`.

    Raises:
        ValueError: an unknown codec, a bad block or fraction, or a parameter
            given to a codec that does not use it.

    Examples:
        >>> Compression("topk", fraction=0.01).payload_bytes(1000)
        80
        >>> Compression("int8").block
        256
    """

    codec: str = "none"
    block: int | None = None
    fraction: float | None = None

    def __post_init__(self):
        if not isinstance(self.codec, str) or self.codec not in CODECS:
            raise ValueError(
                f"Unknown compression codec {self.codec!r}; expected one of "
                f"{', '.join(repr(c) for c in CODECS)}."
            )
        for name, user in (("block", "int8"), ("fraction", "topk")):
            if getattr(self, name) is not None and self.codec != user:
                raise ValueError(
                    f"Compression({self.codec!r}) takes no {name} (only {user!r} does), "
                    f"got {name}={getattr(self, name)!r}."
                )
        if self.codec == "int8":
            block = DEFAULT_BLOCK if self.block is None else self.block
            if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
                raise ValueError(f"Compression block must be a positive integer, got {block!r}.")
            object.__setattr__(self, "block", int(block))
        if self.codec == "topk":
            fraction = DEFAULT_FRACTION if self.fraction is None else self.fraction
            if (
                isinstance(fraction, bool)
                or not isinstance(fraction, numbers.Real)
                or not 0 < fraction <= 1
            ):
                raise ValueError(
                    f"Compression fraction must be a number in (0, 1], got {fraction!r}."
                )
            object.__setattr__(self, "fraction", float(fraction))

    @property
    def lossy(self):
        """Whether decoding loses information (every codec but `"none"`)."""
        return self.codec != "none"

    def encode(self, x, xp=np):
        """`encode(x, self, xp)`."""
        return encode(x, self, xp)

    def decode(self, payload, shape, xp=np):
        """`decode(payload, shape, self, xp)`."""
        return decode(payload, shape, self, xp)

    def payload_bytes(self, n):
        """`payload_bytes(n, self)`."""
        return payload_bytes(n, self)


def as_compression(value):
    """A `Compression` from a config value: `None`, a codec name, or a `Compression`.

    Args:
        value: `None` (no compression), `"none"`, `"bf16"`, `"int8"`, `"topk"`
            (default parameters), or a `Compression`.

    Returns:
        A `Compression`.

    Raises:
        ValueError: an unknown codec name.
        TypeError: any other kind of value.

    Examples:
        >>> as_compression("int8")
        Compression(codec='int8', block=256, fraction=None)
    """
    if value is None:
        return Compression()
    if isinstance(value, Compression):
        return value
    if isinstance(value, str):
        return Compression(value)
    raise TypeError(
        "compression must be None, a codec name or tf_asgd.rules.compression.Compression(...), "
        f"got {value!r}."
    )


PULL_CODECS = ("none", "bf16")


def as_pull_compression(value):
    """A pull's `Compression` from a config value: `None`, `"none"`, `"bf16"`, or
    a `Compression` of those codecs.

    A pull sends the worker the whole model, not an update, so an error
    feedback residual has nothing to carry into the next pull: only a
    reduced-precision copy of the weights is offered (the PS keeps float32).

    Args:
        value: `None` or `"none"` (float32 as it is), `"bf16"`, or a
            `Compression` of either.

    Returns:
        A `Compression`.

    Raises:
        ValueError: a codec other than `"none"` and `"bf16"`.
        TypeError: any other kind of value.

    Examples:
        >>> as_pull_compression("bf16").codec
        'bf16'
    """
    if value is not None and not isinstance(value, (str, Compression)):
        raise TypeError(f"pull_compression must be None, 'none' or 'bf16', got {value!r}.")
    compression = as_compression(value)
    if compression.codec not in PULL_CODECS:
        raise ValueError(
            f"pull_compression {compression.codec!r} is not supported: a pull sends the "
            "whole model, so only 'none' and 'bf16' (a bfloat16 copy; the PS keeps "
            "float32) are offered."
        )
    return compression


def topk_count(n, fraction):
    """Top-k's `k = ceil(fraction * n)`, in exact decimal arithmetic.

    `fraction` is read as the decimal it prints as, so `0.07` of 100 keeps 7
    entries (in binary floating point `0.07 * 100` is `7.000000000000001`).

    Args:
        n: the tensor's number of elements.
        fraction: the kept fraction, in (0, 1].

    Returns:
        `k`, a Python int (0 only for an empty tensor).

    Examples:
        >>> topk_count(100, 0.07), topk_count(5, 0.01), topk_count(0, 0.5)
        (7, 1, 0)
    """
    return math.ceil(fractions.Fraction(repr(float(fraction))) * int(n))


def payload_bytes(n, compression):
    """The exact bytes of `encode`'s payload for a tensor of `n` float32 elements.

    Args:
        n: the tensor's number of elements.
        compression: a `Compression`.

    Returns:
        The bytes, a Python int.

    Examples:
        >>> payload_bytes(1000, Compression("int8", block=256))
        1016
    """
    n = int(n)
    codec = compression.codec
    if codec == "none":
        return 4 * n
    if codec == "bf16":
        return 2 * n
    if codec == "int8":
        return n + 4 * (-(-n // compression.block))
    return 8 * topk_count(n, compression.fraction)


def encode(x, compression, xp=np):
    """The payload of `x`: the arrays that would cross the network.

    Args:
        x: a float32 array or tensor with a static shape (every variable's is).
        compression: a `Compression`.
        xp: `numpy`, or `tensorflow` / `tensorflow.experimental.numpy` for TF ops
            (graph-friendly: no Python branch on a tensor's value).

    Returns:
        A tuple: `"none"` `(float32[n],)`; `"bf16"` `(bits,)` (NumPy: uint16, the
        bfloat16's bits; TF: a bfloat16 tensor); `"int8"` `(int8[n],
        float32[ceil(n / block)])`; `"topk"` `(float32[k] values, int32[k]
        indices)`, largest magnitude first, ties in index order.

    Raises:
        ValueError: `x` has no static shape.

    Examples:
        >>> encode(np.array([3.0, -4.0, 1.0], np.float32), Compression("topk", fraction=0.5))
        (array([-4.,  3.], dtype=float32), array([1, 0], dtype=int32))
    """
    ops = _backend(xp)
    flat = ops.flat(x)
    n = _num_elements(x)
    codec = compression.codec
    if codec == "none":
        return (flat,)
    if codec == "bf16":
        return (ops.to_bf16(flat),)
    if codec == "int8":
        block = compression.block
        rows = ops.reshape(ops.pad(flat, (-n) % block), (-1, block))
        scale = ops.max_abs_rows(rows) * _INT8_STEP
        divisor = ops.where(scale > 0, scale, ops.ones_like(scale))
        q = ops.clip(ops.round(rows / divisor[:, None]), -INT8_LEVELS, INT8_LEVELS)
        return ops.cast(ops.reshape(q, (-1,))[:n], "int8"), scale
    indices = ops.top_indices(ops.abs(flat), topk_count(n, compression.fraction))
    return ops.gather(flat, indices), indices


def decode(payload, shape, compression, xp=np):
    """The float32 tensor a payload stands for (what the receiver applies).

    Args:
        payload: `encode`'s tuple.
        shape: the original tensor's shape.
        compression: the `Compression` that encoded it.
        xp: the array namespace (see `encode`).

    Returns:
        A float32 array or tensor of `shape`.

    Examples:
        >>> decode(encode(np.float32([1.00390625]), Compression("bf16")), (1,),
        ...        Compression("bf16"))
        array([1.], dtype=float32)
    """
    ops = _backend(xp)
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    codec = compression.codec
    if codec == "none":
        flat = payload[0]
    elif codec == "bf16":
        flat = ops.from_bf16(payload[0])
    elif codec == "int8":
        q, scale = payload
        block = compression.block
        rows = ops.reshape(ops.pad(ops.cast(q, "float32"), (-n) % block), (-1, block))
        flat = ops.reshape(rows * scale[:, None], (-1,))[:n]
    else:
        values, indices = payload
        flat = ops.scatter(indices, values, n)
    return ops.reshape(flat, shape)


def round_trip(x, compression, xp=np):
    """`decode(encode(x))`: what the receiver gets for `x`, in `x`'s shape.

    Args:
        x: a float32 array or tensor with a static shape.
        compression: a `Compression`.
        xp: the array namespace (see `encode`).

    Returns:
        A float32 array or tensor of `x`'s shape.
    """
    return decode(encode(x, compression, xp), tuple(x.shape), compression, xp)


def compress_with_feedback(update, residual, compression, xp=np):
    """One push with error feedback: what is sent, and what is kept back for later.

    `corrected = update + residual`; `sent = decode(encode(corrected))`;
    `new_residual = corrected - sent`. Over pushes, the sum of what was sent
    plus the last residual is the sum of the updates (up to float rounding):
    nothing a lossy codec drops is lost, only delayed.

    Args:
        update: this push's update (float32, static shape).
        residual: the residual kept from the previous push (zeros at first).
        compression: a `Compression`.
        xp: the array namespace (see `encode`).

    Returns:
        `(sent, new_residual)`, both of `update`'s shape.

    Examples:
        >>> c = Compression("topk", fraction=0.5)
        >>> sent, r = compress_with_feedback(np.float32([1, 3]), np.float32([2, 0]), c)
        >>> sent.tolist(), r.tolist()
        ([3.0, 0.0], [0.0, 3.0])
    """
    corrected = update + residual
    sent = round_trip(corrected, compression, xp)
    return sent, corrected - sent


def _num_elements(x):
    shape = getattr(x, "shape", None)
    try:
        dims = [int(d) for d in shape]
    except (TypeError, ValueError):  # no shape, an unknown rank or an unknown dimension
        raise ValueError(
            f"compression needs a tensor with a static shape, got shape {shape!r}."
        ) from None
    return math.prod(dims)


def _backend(xp):
    if xp is np:
        return _NumpyOps
    return _tf_ops()


class _NumpyOps:
    """The NumPy reference of each primitive (bit for bit what `_TFOps` computes)."""

    abs = staticmethod(np.abs)
    round = staticmethod(np.round)  # half to even, like tf.round
    where = staticmethod(np.where)
    ones_like = staticmethod(np.ones_like)
    clip = staticmethod(np.clip)
    reshape = staticmethod(np.reshape)

    @staticmethod
    def flat(x):
        return np.asarray(x, dtype=np.float32).reshape(-1)

    @staticmethod
    def cast(x, dtype):
        return np.asarray(x).astype(dtype)

    @staticmethod
    def pad(x, count):
        return np.pad(x, (0, count))

    @staticmethod
    def max_abs_rows(rows):
        return np.max(np.abs(rows), axis=1) if rows.shape[0] else np.zeros(0, np.float32)

    @staticmethod
    def to_bf16(x):
        # Round to nearest even on the upper 16 bits; NaN stays NaN (quiet).
        bits = x.view(np.uint32)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
        return np.where(np.isnan(x), nan, rounded >> np.uint32(16)).astype(np.uint16)

    @staticmethod
    def from_bf16(bits):
        return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)

    @staticmethod
    def top_indices(magnitude, k):
        # Descending, ties in index order: tf.math.top_k's order.
        return np.argsort(-magnitude, kind="stable")[:k].astype(np.int32)

    @staticmethod
    def gather(x, indices):
        return x[indices]

    @staticmethod
    def scatter(indices, values, n):
        out = np.zeros(n, np.float32)
        np.add.at(out, np.asarray(indices), values)  # as tf.scatter_nd: 0 + (-0.0) is 0.0
        return out


_TF_OPS = []


def _tf_ops():
    """The TF primitives, built on first use (the NumPy path never imports TF)."""
    if _TF_OPS:
        return _TF_OPS[0]
    import tensorflow as tf

    class _TFOps:
        abs = staticmethod(tf.abs)
        round = staticmethod(tf.round)  # half to even
        where = staticmethod(tf.where)
        ones_like = staticmethod(tf.ones_like)
        clip = staticmethod(tf.clip_by_value)
        reshape = staticmethod(tf.reshape)

        @staticmethod
        def flat(x):
            return tf.reshape(tf.cast(x, tf.float32), [-1])

        @staticmethod
        def cast(x, dtype):
            return tf.cast(x, dtype)

        @staticmethod
        def pad(x, count):
            return tf.pad(x, [[0, count]])

        @staticmethod
        def max_abs_rows(rows):
            return tf.reduce_max(tf.abs(rows), axis=1)

        @staticmethod
        def to_bf16(x):
            return tf.cast(x, tf.bfloat16)

        @staticmethod
        def from_bf16(x):
            return tf.cast(x, tf.float32)

        @staticmethod
        def top_indices(magnitude, k):
            return tf.math.top_k(magnitude, k=k, sorted=True).indices

        @staticmethod
        def gather(x, indices):
            return tf.gather(x, indices)

        @staticmethod
        def scatter(indices, values, n):
            return tf.scatter_nd(tf.expand_dims(indices, 1), values, [n])

    _TF_OPS.append(_TFOps)
    return _TFOps

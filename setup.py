"""tf_asgd: asynchronous parameter-server training for Keras 3 on TensorFlow."""

from setuptools import find_packages, setup

setup(
    name="tf_asgd",
    version="0.1.0",
    description=(
        "GPU A-SGD (n_sync windows, staleness-scaled PS updates) and Gradient "
        "Energy Matching for Keras 3 model.fit on TensorFlow's parameter-server runtime."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tf_asgd", "tf_asgd.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.19,<2.22",
        # The Keras trainer hook (tf_asgd/keras_hook.py) and tf_asgd/internals.py
        # support these (internals.SUPPORTED_KERAS / SUPPORTED_TF; tested by
        # tools/compat.py, docs/compat.md).
        "keras>=3.13,<3.16",
        "numpy",
        "absl-py",
        "ml-collections",
        # TensorBoard summaries (launcher logs, GEM's PiMonitor); TF 2.21 does not pull it in.
        "tensorboard>=2.19,<2.22",
    ],
    extras_require={
        "and-cuda": ["tensorflow[and-cuda]>=2.19,<2.22"],
        # Stock ParameterServerStrategy baseline for tools/bench.py.
        # mnist1d: tf_asgd.data.load_mnist1d (tools/time_to_accuracy.py).
        "bench": ["tf-keras>=2.19,<2.22", "matplotlib", "mnist1d"],
        "test": ["pytest", "scikit-learn", "matplotlib", "tf-keras>=2.19,<2.22", "mnist1d"],
    },
)

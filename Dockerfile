# The image that configs/tfjob_mnist_gem.yaml runs: tf_asgd with TensorFlow's CUDA
# wheels, the repo's configs/ at /app/configs, working directory /app.
#
#   docker build -t registry.example.com/tf-asgd:0.1.0 .
#   docker push registry.example.com/tf-asgd:0.1.0
#   kubectl create -f configs/tfjob_mnist_gem.yaml
#
# Every pod of the TFJob runs `python -m tf_asgd.launch --config=configs/mnist_gem.py`
# from /app (the manifest's `command` replaces this image's CMD; there is no
# ENTRYPOINT to get in its way); its role comes from the TF_CONFIG the training
# operator sets (port 2222). Run locally, the image trains the digits convnet on a
# loopback cluster (the README's first command):
#
#   docker run --rm --gpus all registry.example.com/tf-asgd:0.1.0
#
# The GPU libraries come from pip (`tensorflow[and-cuda]`: CUDA 12 and cuDNN 9
# wheels), so the host needs only an NVIDIA driver for CUDA 12 and the NVIDIA
# container toolkit; the CUDA base image supplies the toolkit's environment
# (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES). Versions: docs/compat.md.
ARG BASE_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TF_VERSION=2.21.0
ARG KERAS_VERSION=3.15.1

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# Python 3.12 (Ubuntu 24.04's) in a venv; util-linux (unshare) is in the base
# image, for the launcher's loopback-only local runs. Ubuntu's packages are not
# pinned: the release's own python3 is what the base image is tested with.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app

# The package and its requirements (with the CUDA wheels), pinned to a tested pair;
# scikit-learn ships the digits data of configs/default.py. (DL3013: "." is this
# checkout, not a registry package.)
COPY pyproject.toml README.md LICENSE ./
COPY tf_asgd/ tf_asgd/
# hadolint ignore=DL3013
RUN pip install ".[and-cuda]" "tensorflow[and-cuda]==${TF_VERSION}" "keras==${KERAS_VERSION}" \
        "scikit-learn>=1.3,<2" \
    && python -c "import tf_asgd, tensorflow as tf; print('tf_asgd', tf_asgd.__version__, 'TF', tf.__version__)"

# The launcher's configs, where the manifest's `--config=configs/...` finds them.
COPY configs/ configs/

# TF_CONFIG's port in the TFJob (the training operator's default).
EXPOSE 2222

CMD ["python", "-m", "tf_asgd.launch", "--config=configs/default.py", "--workdir=/tmp/tf_asgd_default"]

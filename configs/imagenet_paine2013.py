"""The GPU A-SGD paper's ImageNet setup (Paine et al. 2013, arXiv:1312.6186).

A Krizhevsky-2012-style large convnet with ReLU and dropout (what the paper
trained with cuda-convnet), 256x256 images with random 224x224 crops and
horizontal flips, n_sync = 100, 8 GPU workers (one GPU each), and multi-crop
testing: the softmax averaged over 10 crops (4 corners + centre, and their
mirror images). The paper reports 42.2% top-1 test error with 8 GPUs.

Data, read from a local directory (every worker must see the same path):
- `DATA_DIR/train/<wnid>/*.JPEG` and `DATA_DIR/val/<wnid>/*.JPEG`
  (keras.utils.image_dataset_from_directory layout), or
- TFRecords `DATA_DIR/train-*-of-*` and `DATA_DIR/validation-*-of-*` with
  `image/encoded` and `image/class/label` (1..1000) features (the layout of
  TF's ImageNet build scripts).

    python -m tf_asgd.launch --config=configs/imagenet_paine2013.py \
        --config.data_dir=/data/imagenet --workdir=/ckpt/paine2013
"""

import os
import runpy


def get_config():
    # Start from the default config; change only what this setup needs.
    c = runpy.run_path(os.path.join(os.path.dirname(__file__), "default.py"))["get_config"]()
    c.model = "paine2013_imagenet_convnet"
    c.dataset = "imagenet"
    c.data_dir = "/data/imagenet"  # class directories or TFRecords; override on the command line
    c.download = False
    c.augment = True  # random 224 crops and flips
    c.image_size = 256
    c.crop_size = 224
    c.ten_crop_eval = True  # multi-crop testing, as in the paper
    c.validate_every_epoch = False
    c.batch_size = 128
    c.epochs = 90
    c.n_sync = 100  # the paper's best
    c.staleness = "none"
    c.optimizer.learning_rate = 0.01
    c.gem.enabled = False
    c.num_workers = 8  # 8 GPU workers
    c.gpus_per_worker = 1
    c.shared_process = False  # one process per GPU worker
    c.log_every_secs = 60.0
    return c

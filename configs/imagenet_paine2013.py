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

from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    c.model = "paine2013_imagenet_convnet"
    c.dataset = "imagenet"
    c.data_dir = "/data/imagenet"
    c.download = False  # ImageNet cannot be downloaded automatically
    c.augment = True
    c.image_size = 256
    c.crop_size = 224
    c.ten_crop_eval = True
    c.batch_size = 128
    c.epochs = 90
    c.steps_per_epoch = 0
    c.eval_steps = 0
    c.validate_every_epoch = False  # 10-crop evaluation once at the end
    c.seed = 0
    c.n_sync = 100
    c.staleness = "none"  # the paper applies pushes unscaled
    c.max_staleness = config_dict.placeholder(int)
    c.optimizer = config_dict.ConfigDict()
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.01
    c.optimizer.momentum = 0.9
    c.gem = config_dict.ConfigDict()
    c.gem.enabled = False
    c.gem.kappa = 1.0
    c.num_workers = 8
    c.num_ps = 1
    c.shared_process = False
    c.gpus_per_worker = 1
    c.max_checkpoints = 3
    c.log_every_secs = 60.0
    c.verbose = -1
    return c

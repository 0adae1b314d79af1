"""Keras glue: the trainer hook that routes `fit`/`evaluate`/`predict`, and
evaluation on the workers."""

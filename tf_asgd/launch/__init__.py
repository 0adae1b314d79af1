"""The absl launcher: `python -m tf_asgd.launch --config=... --workdir=...`."""

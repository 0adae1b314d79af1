"""Pure update rules (NumPy-compatible) and their TensorFlow ops on the PS."""

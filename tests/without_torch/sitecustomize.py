"""Imported first by every Python process the tests launch (conftest puts
this folder on their PYTHONPATH): torch is hidden from it, as on a user's
install. The package never imports torch; the tests install it to write
PyTorch checkpoints in their own process. Wherever torch is installed,
importing mlx-lm (through transformers) imports it too, which costs each
launched process seconds. A None entry in ``sys.modules`` makes
``import torch`` fail and ``importlib.util.find_spec("torch")`` answer
None, which is how transformers asks."""

import sys

sys.modules.setdefault("torch", None)

"""hvdtrain: data-parallel training of PyTorch and TensorFlow/Keras 3 models with Horovod."""

__version__ = "0.1.0"

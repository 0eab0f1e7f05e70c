"""A script whose rank 1 exits with code 3: hvdtrain must exit 3 too, naming rank 1."""

import sys

import horovod.torch as hvd

hvd.init()
sys.exit(3 if hvd.rank() == 1 else 0)

"""A script whose rank 1 exits with code 2, hvdtrain's own code for bad input: hvdtrain must exit 1
(the job failed), naming rank 1 and its code, not 2."""

import sys

import horovod.torch as hvd

hvd.init()
sys.exit(2 if hvd.rank() == 1 else 0)

"""A script whose rank 1 exits with code 2, hvdtrain's own code for bad input: hvdtrain must exit 1
(the job failed), naming rank 1 and its code, not 2. The other ranks wait for the launcher to end
them, so rank 1 is the first to end whatever the timing: a rank 0 ending at the same moment races
its own teardown against rank 1's exit, and under srun it can crash in PMIx's teardown first."""

import sys
import time

import horovod.torch as hvd

hvd.init()
if hvd.rank() == 1:
    sys.exit(2)
time.sleep(300)

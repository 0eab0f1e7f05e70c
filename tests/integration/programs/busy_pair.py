"""Large allreduces on a machine whose every core is busy (a hog process per core, shared out between
the host's ranks): the CPU that this rank's threads other than the main one spend (Horovod's
background thread and gloo's event loop), and whether the sums are exact. Gloo's loop used to spin
while the background thread held the pair to send (patch 0015); HOROVOD_GLOO_BUSY_PAIR_PAUSE_US=0
brings that back."""

import json
import os
import subprocess
import sys
import threading
import time

import horovod.torch as hvd
import psutil
import torch

ROUNDS, MEGABYTES = 8, 64


def other_threads_cpu_s() -> float:
    main = threading.get_native_id()
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id != main)


hvd.init()
tensor = torch.empty(MEGABYTES * 2**20 // 4)
hvd.allreduce_(tensor.fill_(1.0), op=hvd.Sum, name="big")  # warm-up: the name is in the response cache
# a hog per core between this host's ranks: every core busy, none twice over
mine = max(1, (os.cpu_count() or 2) // hvd.local_size())
hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(mine)]
try:
    time.sleep(0.2)
    exact = True
    started_cpu, started = other_threads_cpu_s(), time.monotonic()
    for _ in range(ROUNDS):
        hvd.allreduce_(tensor.fill_(1.0), op=hvd.Sum, name="big")
        exact = exact and bool(torch.all(tensor == hvd.size()))
    cpu, seconds = other_threads_cpu_s() - started_cpu, time.monotonic() - started
finally:
    for hog in hogs:
        hog.kill()
print(json.dumps({"rank": hvd.rank(), "other_threads_cpu_s": cpu, "seconds": seconds, "exact": exact}))

"""Measuring this machine and its Horovod: what the build can do (doctor), `hvdtrain bench`'s
side-by-side runs (bench) and the communication settings they keep per recipe (tuning)."""

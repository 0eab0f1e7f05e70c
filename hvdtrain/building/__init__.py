"""Building what hvdtrain runs on: the patched Horovod wheel (horovod_wheel, its patches/ and the
pins in versions.env) and the CUDA toolkit such a build needs (cuda_toolkit). Shipped in the wheel,
so `hvdtrain setup` builds Horovod where hvdtrain was pip-installed; standard library only, so a
checkout builds it before anything else is installed (containers/build_horovod.py)."""

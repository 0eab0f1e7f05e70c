"""A stand-in for torchvision, for Horovod's pytorch_synthetic_benchmark.py in `make bench` only: the
real torchvision cannot be imported beside the CPU build of torch ("operator torchvision::nms does
not exist"). It has `models` and nothing else; the benchmark runs with benchmarks/peer on PYTHONPATH."""

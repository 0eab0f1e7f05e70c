"""torchrun (torch.distributed.run) as ddp and fsdp start it on each host: torch's own entry point,
imported with the garbage collector off (hvdtrain.runtime.imports), which took a third of the
agent's start (0.6 of 1.8 CPU-s here), once per host and run."""

from __future__ import annotations

from hvdtrain.runtime.imports import collector_off

MODULE = __name__
"""What follows `python -m` in the command: a rank's command line has `-m hvdtrain.worker` too, and
this tells the agent's apart."""


def main() -> None:
    with collector_off():
        from torch.distributed import run
    run.main()  # torchrun's arguments are this module's: sys.argv[1:]


if __name__ == "__main__":
    main()

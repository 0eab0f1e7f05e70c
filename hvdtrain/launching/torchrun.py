"""torchrun (torch.distributed.run) as ddp and fsdp start it on each host: torch's own entry point,
imported with the garbage collector off. Its import makes a few hundred thousand objects that live as
long as the agent and next to no garbage; the collector walked them over and over, a third of the
agent's start (0.6 of 1.8 CPU-s here), once per host and run."""

from __future__ import annotations

import gc

MODULE = __name__
"""What follows `python -m` in the command: a rank's command line has `-m hvdtrain.worker` too, and
this tells the agent's apart."""


def main() -> None:
    gc.disable()
    try:
        from torch.distributed import run
    finally:
        gc.enable()
    gc.freeze()
    run.main()  # torchrun's arguments are this module's: sys.argv[1:]


if __name__ == "__main__":
    main()

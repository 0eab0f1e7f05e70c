"""Where in an epoch a torch run is, as a step checkpoint records it and a resume reads it back: the
steps taken and their loss and gradient norms, and how the epoch's samples were being taken."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hvdtrain.runtime.common import RunLog
from hvdtrain.runtime.torch.backends import TorchBackend
from hvdtrain.runtime.within import SHARDS, carried_on

if TYPE_CHECKING:
    from hvdtrain.runtime.torch.training import Training


def stacked(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The steps' gradient norms as one tensor on `device`: elastic's state is unpickled onto rank
    0's device, and a rank on another GPU moves them back."""
    return torch.stack([norm.to(device) for norm in norms])


@dataclass
class Within:
    """How far into an epoch a run is: the steps taken, their summed loss and gradient norms (the
    epoch's mean needs them) and, elastic, the samples of the order taken and the epoch's progress.
    A step checkpoint keeps it, and a resume taking the epoch's samples the same way starts at the
    next batch; otherwise (another world size for shards, the other loop) the epoch starts again."""

    taken: int = 0
    loss_sum: float = 0.0
    norms: list = field(default_factory=list)
    done: int = 0
    fraction: float = 0.0

    def position(self, t: Training, epoch: int, step: int, order: str) -> dict[str, Any]:
        """Collective: a step checkpoint's position (`epoch` is the epoch under way). The loss sums are
        each rank's own, of its own batches; the norms are of the averaged gradient, every rank's."""
        within = {
            "order": order,
            "world_size": t.backend.size,
            "taken": self.taken,
            "loss_sums": t.backend.allgather_object(self.loss_sum),
            "norms": stacked(self.norms, t.backend.device).detach() if self.norms else None,
            "done": self.done,
            "fraction": self.fraction,
        }
        return {
            "epoch": epoch,
            "step": step,
            **t.amp.state_dict(),
            "watch": t.watch.state_dict(),
            "within": within,
        }

    @classmethod
    def resumed(cls, state: dict | None, order: str, backend: TorchBackend, log: RunLog) -> Within:
        """Where a resumed run starts within the checkpoint's epoch. Elastic worlds share one loss
        sum (hvd.elastic's state is rank 0's), so they start from the ranks' mean."""
        within = carried_on(state, order, backend.size, log.is_chief)
        if within is None:
            return cls()
        norms = [] if within["norms"] is None else list(within["norms"].to(backend.device).unbind())
        sums = within["loss_sums"]
        loss_sum = sums[backend.rank] if order == SHARDS else sum(sums) / len(sums)
        return cls(within["taken"], loss_sum, norms, within["done"], within["fraction"])

"""Where in an epoch a step checkpoint was made, for every framework's loop: the checkpoint's
"within" entry (steps taken, each rank's loss sum, how the epoch's samples were being taken) and
whether a resume here can carry on from it at the next batch."""

from __future__ import annotations

from typing import Any

SHARDS, ELASTIC = "shards", "elastic"
"""How an epoch's samples are taken: each rank its shard of the epoch's permutation (a fixed world;
the shards depend on the world size), or every world pass by pass through one order (elastic)."""


def carried_on(state: dict | None, order: str, world_size: int, is_chief: bool) -> dict[str, Any] | None:
    """The checkpoint's "within" entry where this run takes the epoch's samples the same way, so it
    continues at the next batch; None for a checkpoint at an epoch's end, and where the order or
    (for shards) the world size differs, in which case the epoch under way starts again, and the
    chief says so."""
    within = (state or {}).get("within")
    if not within:
        return None
    if within["order"] == order and (order != SHARDS or within["world_size"] == world_size):
        return within
    if is_chief:
        print(
            f"hvdtrain: the checkpoint is {within['taken']} steps into epoch {state['epoch'] + 1} "
            f"({within['order']} at world size {within['world_size']}); here ({order} at world "
            f"size {world_size}) that epoch starts again",
            flush=True,
        )
    return None


def where(state: dict) -> str:
    """A checkpoint's position in words, for the line a resume prints."""
    if state.get("within"):
        return f"{state['within']['taken']} steps into epoch {state['epoch'] + 1}"
    return f"at epoch {state['epoch']}"

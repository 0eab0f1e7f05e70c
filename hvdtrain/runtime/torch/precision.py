"""Mixed precision for the torch loop: autocast around the forward pass and the loss, and for fp16 a
GradScaler whose steps follow Horovod's order (unscale the averaged gradient, never a rank's own)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def bf16_is_native(device: torch.device) -> bool:
    """Whether this device computes bfloat16 in hardware (on a CPU: AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Precision:
    def __init__(self, precision: str, device: torch.device) -> None:
        self.dtype = DTYPES[precision]
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        """Scales the loss so that small fp16 gradients do not flush to zero; its state is checkpointed."""
        self.computed_in: torch.dtype | None = None
        """The dtype of the model's outputs in the last step: what autocast actually ran in."""

    @property
    def computed(self) -> str | None:
        return None if self.computed_in is None else str(self.computed_in).removeprefix("torch.")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(
        self, optimizer: torch.optim.Optimizer, agree: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """Inside the backend's averaged_gradients: the average, unscaled, for clipping and stepping; a
        non-finite one makes the step a no-op on every rank alike. `agree` makes each found-inf flag
        the same on every rank, where each rank unscaled only its part of the gradient."""
        if self.scaler is None:
            return
        self.scaler.unscale_(optimizer)
        if agree is not None:
            # GradScaler keeps the flags it skips the step by and updates the scale from here
            for found_inf in self.scaler._per_optimizer_states[id(optimizer)][
                "found_inf_per_device"
            ].values():
                agree(found_inf)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The update; returns whether the loss scale skipped it (its gradient overflowed). The flags
        are read where the scaler's own step reads them, so this adds no wait for the device."""
        if self.scaler is None:
            optimizer.step()
            return False
        flags = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        overflowed = any(bool(flag.item()) for flag in flags)
        self.scaler.step(optimizer)
        return overflowed

    def update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

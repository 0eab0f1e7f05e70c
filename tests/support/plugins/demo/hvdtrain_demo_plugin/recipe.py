"""A recipe of this package's own: the shipped digits MLP under another name, with a wider hidden
layer by default, so that its runs tell it from the built-in one."""

from __future__ import annotations

import dataclasses

from hvdtrain.config import bounded
from hvdtrain.recipes import digits_mlp_torch
from hvdtrain.registry import Recipe


@dataclasses.dataclass(kw_only=True)
class Config(digits_mlp_torch.Config):
    hidden: int = bounded(48, minimum=1)


RECIPE: Recipe = dataclasses.replace(
    digits_mlp_torch.RECIPE,
    name="plugin-digits",
    description="the digits MLP from an installed plugin package",
    config=Config,
)

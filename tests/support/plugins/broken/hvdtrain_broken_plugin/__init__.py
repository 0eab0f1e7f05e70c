"""Plugins that cannot be used: hvdtrain names each in one line and leaves it out."""

import dataclasses

from hvdtrain.launchers import gloo

NOT_A_RECIPE = "a string"
TAKEN = dataclasses.replace(gloo.LAUNCHER, description="a launcher whose name a built-in one has")

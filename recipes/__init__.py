"""One module per recipe; each defines RECIPE (see hvdtrain.registry)."""

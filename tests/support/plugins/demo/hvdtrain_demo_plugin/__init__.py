"""hvdtrain plugins from an installed package: a recipe, a strategy and a launcher."""

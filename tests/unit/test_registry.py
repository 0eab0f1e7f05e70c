from __future__ import annotations

import dataclasses

import pytest

from hvdtrain import registry


def test_all_recipes_are_registered_with_debug_variants():
    recipes = registry.all_recipes()
    assert {"digits-mlp-torch", "mnist-cnn-torch", "synthetic-torch", "digits-mlp-tf", "synthetic-tf"} <= set(
        recipes
    )
    for recipe in recipes.values():
        assert recipe.framework in ("torch", "tensorflow")
        assert "debug" in recipe.variants
        for field in dataclasses.fields(recipe.config):
            assert field.kw_only, f"{recipe.name}.{field.name} should be keyword-only"


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ValueError, match="known recipes: digits-mlp-tf, digits-mlp-torch"):
        registry.get("digits")


def test_importing_recipes_does_not_import_frameworks():
    import subprocess
    import sys

    code = (
        "import sys, hvdtrain.registry as r; r.all_recipes(); "
        "print('torch' in sys.modules, 'tensorflow' in sys.modules)"
    )
    assert subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split() == ["False", "False"]

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


def test_a_built_in_recipe_or_strategy_by_name_imports_its_module_alone():
    """What the CLI and every rank do: the other recipe modules (numpy with some) and strategies stay
    unimported; the catalogs, whose errors name what is known, are for names no module spells."""
    import subprocess
    import sys

    from hvdtrain import strategies

    code = (
        "import sys, hvdtrain.registry as r, hvdtrain.strategies as s; recipe = r.get('digits-mlp-torch'); "
        "strategy = s.get('zero', 'torch'); "
        "print(recipe.name, strategy.name, *sorted(m for m in sys.modules if m.startswith("
        "('hvdtrain.recipes.', 'hvdtrain.strategies.'))), 'numpy' in sys.modules)"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name, strategy, *modules, numpy = found.stdout.split()
    assert (name, strategy, numpy) == ("digits-mlp-torch", "zero", "False")
    assert [m for m in modules if m.startswith("hvdtrain.recipes.")] == ["hvdtrain.recipes.digits_mlp_torch"]
    assert "hvdtrain.strategies.zero" in modules  # and horovod's, which zero builds on, but no other
    assert not {"hvdtrain.strategies." + other for other in ("ddp", "fsdp", "dp", "ps")} & set(modules)
    assert registry.get("gpt-torch") is registry.all_recipes()["gpt-torch"]
    assert strategies.get("ps", "tensorflow") is strategies.all_strategies()["ps"]


def test_a_checkout_ahead_of_a_plain_install_finds_its_recipes_folder(tmp_path):
    """`python -m hvdtrain.worker` started in a checkout imports the checkout's hvdtrain/, which has no
    recipes/ beside it; without the editable install's finder, hvdtrain.recipes is still the checkout's."""
    import subprocess
    import sys
    from pathlib import Path

    checkout = Path(registry.__file__).resolve().parents[1]
    code = (
        "import sys; sys.meta_path[:] = "
        "[f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable')]; "
        f"sys.path.insert(0, {str(checkout)!r}); "
        "import hvdtrain.registry as r; names = sorted(r.all_recipes()); "
        "import hvdtrain.recipes.digits_mlp_torch as m; print(m.__file__, 'digits-mlp-torch' in names)"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [str(checkout / "recipes" / "digits_mlp_torch.py"), "True"]

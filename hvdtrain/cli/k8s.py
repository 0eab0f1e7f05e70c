"""`hvdtrain k8s`: a recipe as an MPIJob for Kubeflow's MPI Operator."""

from __future__ import annotations

import click

from hvdtrain import config as config_module
from hvdtrain import registry, strategies
from hvdtrain.errors import UserError


@click.command()
@click.argument("recipe_name", metavar="RECIPE")
@click.option("--np", "num_proc", type=int, required=True, help="Total ranks.")
@click.option("--image", required=True, help="Container image with hvdtrain (make image builds one).")
@click.option("--slots-per-worker", type=int, default=1, show_default=True, help="Ranks per worker pod.")
@click.option("--cpu-per-slot", default="1", show_default=True)
@click.option("--memory-per-worker", default="4Gi", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field.")
@click.option("--name", default=None, help="MPIJob name. [default: hvdtrain-RECIPE]")
def k8s(
    recipe_name, num_proc, image, slots_per_worker, cpu_per_slot, memory_per_worker, overrides, name
) -> None:
    """Print a Kubeflow MPI Operator MPIJob (kubeflow.org/v2beta1) that trains RECIPE on a cluster."""
    import yaml

    from hvdtrain.launching.k8s import MPIJobSpec, mpijob

    try:
        recipe = registry.get(recipe_name)
        strategies.get("horovod", recipe.framework)
        config_module.apply(recipe.make_config(), config_module.parse_overrides(recipe.config, overrides))
        if not cpu_per_slot.isdigit() or int(cpu_per_slot) < 1:
            raise ValueError(f"--cpu-per-slot must be a whole number of CPUs, got {cpu_per_slot!r}")
        job = mpijob(
            MPIJobSpec(
                recipe=recipe.name,
                np=num_proc,
                image=image,
                slots_per_worker=slots_per_worker,
                cpu_per_slot=cpu_per_slot,
                memory_per_worker=memory_per_worker,
                set_overrides=tuple(overrides),
                name=name,
            )
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    click.echo(yaml.safe_dump(job, sort_keys=False), nl=False)

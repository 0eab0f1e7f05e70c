"""The `hvdtrain` command: a thin shell over the Python API. Each command parses, calls the library,
and turns its typed errors into one line and exit code 2. Only this package imports click; a module
holds the commands of one subject."""

from __future__ import annotations

import os

import click

from hvdtrain.cli import data, jobs, k8s, measure, runs, setup, sweep
from hvdtrain.cli.base import Commands


# every option also from an environment variable: HVDTRAIN_RUN_NP=4, HVDTRAIN_RUN_STRATEGY=ddp, ...
@click.group(
    cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "HVDTRAIN"}
)
@click.version_option(package_name="hvdtrain")
@click.option("--verbose", is_flag=True, help="Show the frameworks' start-up logs too.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """Data-parallel training of PyTorch and TensorFlow/Keras 3 models with Horovod."""
    quieted = not verbose and "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    if quieted:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    ctx.obj = {"verbose": verbose, "quieted_tensorflow": quieted}


for command in (
    jobs.list_recipes, jobs.run, jobs.submit, sweep.sweep, runs.list_runs, runs.show, runs.checkpoint,
    measure.doctor, measure.bench, measure.estimate, setup.setup, data.data, k8s.k8s,
):  # fmt: skip
    main.add_command(command)

if __name__ == "__main__":
    main()

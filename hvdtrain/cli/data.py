"""`hvdtrain data pack`: an image folder as tar shards, for data on shared or object-like storage."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def data() -> None:
    """The data recipes read."""


@data.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--samples-per-shard", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option(
    "--shard-mb",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="A shard ends past this size.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="The samples' order across the shards.")
def pack(source: Path, out: Path, samples_per_shard: int, shard_mb: int, seed: int) -> None:
    """Write SOURCE's images as tar shards (WebDataset's layout, with an index) into OUT:
    SOURCE/train and SOURCE/test into OUT/train and OUT/test where SOURCE has them, else
    SOURCE/CLASS/*.jpg into OUT. Recipes that read image folders read OUT as they read SOURCE
    (--set data_dir=OUT)."""
    from hvdtrain.data import shards

    splits = [name for name in ("train", "test") if (source / name).is_dir()]
    pairs = [(source / name, out / name) for name in splits] or [(source, out)]
    for folder, into in pairs:
        counts = shards.pack(folder, into, samples_per_shard, shard_mb << 20, seed)
        click.echo(f"{folder} -> {into}: {counts['samples']:,} samples in {counts['shards']:,} shards")

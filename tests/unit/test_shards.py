"""Tar shards: packed from an image folder with their index, read by offset as the folder reads,
readable by plain tar (and so by WebDataset), indexed from the headers where the index is missing,
and split by rank into equal contiguous runs of shards, the same for every rank and every resume."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hvdtrain.cli import main
from hvdtrain.data import ImageFolder, write_digits_images
from hvdtrain.data.shards import INDEX, TarShards, pack, read_named
from hvdtrain.errors import InputError


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("digits")
    write_digits_images(root)
    assert pack(root / "train", root / "shards", samples_per_shard=200) == {"samples": 1347, "shards": 7}
    return root / "train", root / "shards"


def test_the_shards_hold_every_image_once_with_its_label_and_read_as_the_folder_reads(packed):
    source, out = packed
    folder, shards = ImageFolder.scan(source), TarShards.open(out)
    files = {
        (folder.root / name).read_bytes(): int(label)
        for name, label in zip(folder.files, folder.labels, strict=True)
    }
    assert len(shards) == len(folder) == len(files)
    seen = [shards.read(i) for i in range(len(shards))]
    assert sorted(seen) == sorted(files) and all(files[b] == shards.labels[i] for i, b in enumerate(seen))
    first = seen.index((folder.root / folder.files[0]).read_bytes())
    np.testing.assert_array_equal(shards[first][0], folder[0][0])  # the same decoder, the same pixels
    assert shards.classes == folder.classes and shards.shape() == (1, 8, 8)
    assert read_named(shards.name(first)) == seen[first]  # tf.data's element reads the same bytes
    assert len(np.unique(shards.labels[shards.shard == 0])) == 10, "packed in a shuffled order"


def test_a_shard_is_a_plain_tar_of_key_image_and_key_cls_and_the_headers_give_the_index(packed, tmp_path):
    _, out = packed
    with tarfile.open(out / "shard-000000.tar") as archive:
        names = archive.getnames()
        label = archive.extractfile(names[1]).read()
    assert names[:2] == ["000000000.png", "000000000.cls"] and len(names) == 400 and label.strip().isdigit()
    copy = tmp_path / "copy"
    copy.mkdir()
    for shard in out.glob("*.tar"):
        (copy / shard.name).write_bytes(shard.read_bytes())
    scanned, indexed = TarShards.open(copy), TarShards.open(out)
    for column in ("shard", "offset", "size", "labels"):
        np.testing.assert_array_equal(getattr(scanned, column), getattr(indexed, column))


def test_each_rank_takes_an_equal_contiguous_run_of_the_shuffled_shards(packed):
    shards = TarShards.open(packed[1])
    runs = [shards.rank_indices(rank, 3, epoch=2, seed=7) for rank in range(3)]
    assert [len(run) for run in runs] == [1347 // 3] * 3
    assert len(set(np.concatenate(runs))) == 3 * (1347 // 3)  # disjoint
    for run in runs:  # a run of shards: each shard's samples together, at most 3 shards a rank
        touched = shards.shard[run]
        assert (
            len(np.unique(touched)) <= 3 and np.count_nonzero(np.diff(touched)) == len(np.unique(touched)) - 1
        )
    np.testing.assert_array_equal(runs[1], shards.rank_indices(1, 3, epoch=2, seed=7))  # a resume: the same
    assert not np.array_equal(runs[1], shards.rank_indices(1, 3, epoch=3, seed=7))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda out: (out / INDEX).unlink() or [p.unlink() for p in out.glob("*.tar")], "no tar shards in"),
        (lambda out: (out / "shard-000000.tar").unlink(), "lists other shards than"),
        (lambda out: (out / INDEX).write_bytes(b"not numpy"), "cannot be read as a shard index"),
    ],
)
def test_shards_that_cannot_be_read_are_one_input_error(packed, tmp_path, damage, message):
    out = tmp_path / "shards"
    out.mkdir()
    for path in packed[1].iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    damage(out)
    with pytest.raises(InputError, match=message):
        TarShards.open(out)


def test_a_truncated_shard_names_itself_when_read(packed, tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    for path in packed[1].iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    last = out / "shard-000006.tar"
    last.write_bytes(last.read_bytes()[:2048])
    shards = TarShards.open(out)
    index = int(np.flatnonzero(shards.shard == 6)[-1])
    with pytest.raises(InputError, match=f"{last} is shorter than its index says"):
        shards.read(index)


def test_pack_refuses_a_folder_that_holds_shards_and_a_missing_source_in_one_line(packed, tmp_path):
    source, out = packed
    again = CliRunner().invoke(main, ["data", "pack", str(source), str(out)])
    assert again.exit_code == 2 and again.output.strip() == (
        f"hvdtrain: error: {out} holds tar shards already (shard-000000.tar, ...): pack into an empty folder"
    )
    missing = CliRunner().invoke(main, ["data", "pack", str(tmp_path / "none"), str(tmp_path / "out")])
    assert missing.exit_code == 2 and "no image folder at" in missing.output
    assert not (tmp_path / "out").exists()


def test_a_process_keeps_a_bounded_number_of_shards_open(packed, monkeypatch):
    from hvdtrain.data import shards as shards_module

    shards = TarShards.open(packed[1])
    every_shard = [int(np.flatnonzero(shards.shard == s)[0]) for s in range(len(shards.shards))]
    expected = {index: shards.read(index) for index in every_shard}
    monkeypatch.setattr(shards_module, "OPEN_SHARDS", 2)
    bounded = TarShards.open(packed[1])
    for index in every_shard * 2:
        assert bounded.read(index) == expected[index]
        assert len(bounded._open) <= 2

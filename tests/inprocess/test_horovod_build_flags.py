"""Horovod's build flags as horovodrun reads them (patches 0013 and 0024), in this process: asked of
the torch extension in a child process once, then kept by the extension file's identity."""

from __future__ import annotations

import json

import pytest

util = pytest.importorskip("horovod.common.util")


def test_the_gloo_flag_is_asked_of_the_extension_once_and_then_read_where_it_was_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kept = tmp_path / "horovod" / "built-flags.json"
    assert util._built_flag_without_framework("gloo") is True  # this venv's build has Gloo
    [(key, built)] = json.loads(kept.read_text()).items()
    assert built is True and key.endswith(" gloo") and "mpi_lib_v2" in key
    kept.write_text(json.dumps({key: False}))  # the extension would say True: False is read from here
    assert util._built_flag_without_framework("gloo") is False
    kept.write_text("{not json")  # a damaged file is asked past, and written anew
    assert util._built_flag_without_framework("gloo") is True
    assert json.loads(kept.read_text()) == {key: True}
    path, size, modified, flag = key.rsplit(" ", 3)  # a build of another size at that path: asked again
    kept.write_text(json.dumps({f"{path} {int(size) + 1} {modified} {flag}": False}))
    assert util._built_flag_without_framework("gloo") is True


def test_an_unwritable_cache_leaves_the_answer_to_the_extension(tmp_path, monkeypatch):
    (tmp_path / "horovod").write_text("a file where the folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert util._built_flag_without_framework("gloo") is True
    assert util._built_flag_without_framework("mpi") is True
    assert not list(tmp_path.glob("horovod*.json*"))

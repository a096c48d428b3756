"""``write_once``: the cache directories of the embedded model are written through a per-process temporary directory
and renamed into place, so runs that start together never read or delete each other's half-written copies."""

from __future__ import annotations

import pytest

from qerl.hub import write_once


def fill(directory, text):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(text)


def test_writes_a_missing_directory_once(tmp_path):
    calls = []
    target = tmp_path / "model"

    def write(directory):
        calls.append(directory)
        fill(directory, "mine")

    assert write_once(target, write) == target and write_once(target, write) == target
    assert len(calls) == 1 and calls[0] != target  # written elsewhere, then renamed
    assert (target / "config.json").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_process_that_loses_the_race_keeps_the_winners_copy(tmp_path):
    target = tmp_path / "model"

    def write(directory):
        fill(target, "other process")  # another run renamed its copy into place while this one was writing
        fill(directory, "mine")

    write_once(target, write)
    assert (target / "config.json").read_text() == "other process"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    def write(directory):
        fill(directory, "half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_once(tmp_path / "model", write)
    assert list(tmp_path.iterdir()) == []

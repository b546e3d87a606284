"""Two external tags that name one file are refused before anything is written."""

from __future__ import annotations

import os

import pytest

from ptdstream import LayoutError, StreamingNamedDataStore
from ptdstream.format import ptd as ptd_mod
from ptdstream.format.ptd import check_ptd_file_names
from ptdstream.save import write_data_files
from ptdstream.system.files import case_insensitive


def store_with(*tags: str) -> StreamingNamedDataStore:
    store = StreamingNamedDataStore()
    for i, tag in enumerate(tags):
        store.add_named_data(f"key{i}", bytes([i + 1]) * 64, external_tag=tag)
    return store


def test_tags_w_and_w_ptd_are_refused_naming_both(tmp_path):
    with pytest.raises(LayoutError) as err:
        write_data_files(store_with("w", "w.ptd"), str(tmp_path))
    assert str(err.value) == (
        f"external tags 'w' and 'w.ptd' both name the file w.ptd in {tmp_path}: "
        "one would overwrite the other; rename one tag"
    )
    assert os.listdir(tmp_path) == []


def test_tags_differing_in_case_alone_are_kept_apart_on_a_case_sensitive_folder(tmp_path):
    reports = write_data_files(store_with("W", "w"), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["W.ptd", "w.ptd"]
    assert len(reports) == 2


def test_tags_differing_in_case_alone_are_refused_on_a_case_insensitive_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(ptd_mod, "case_insensitive", lambda folder: True)
    with pytest.raises(LayoutError) as err:
        write_data_files(store_with("W", "w.ptd"), str(tmp_path))
    assert str(err.value) == (
        f"external tags 'W' and 'w.ptd' name the files W.ptd and w.ptd, one file in "
        f"{tmp_path} (its file system ignores case); rename one tag"
    )
    assert os.listdir(tmp_path) == []


def test_the_case_probe_leaves_nothing(tmp_path):
    assert case_insensitive(str(tmp_path)) is False  # tmpfs/ext4 here
    assert os.listdir(tmp_path) == []
    assert case_insensitive(str(tmp_path / "missing")) is False


def test_distinct_names_pass(tmp_path):
    check_ptd_file_names(["a", "b.ptd", "", ".."], str(tmp_path))

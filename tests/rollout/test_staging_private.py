"""The replica's staging folder is private (``rollout.staging.private_stage_dir``): the vLLM worker
applies whatever file a staged path names, so a folder another local user created first (the
default ``/dev/shm/deltasync-stage-<uid>`` is a predictable name) or may write is refused with
what was expected, what was found and the fix; a missing one is made 0700, and each staged file
is created exclusively, mode 0600, and renamed into place."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from rollout.staging import StageDirError, private_stage_dir, write_stage

BITS = {"a.weight": np.arange(12, dtype=np.uint16).reshape(3, 4)}


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_missing_folder_is_made_0700_and_each_staged_file_0600(tmp_path):
    folder = tmp_path / "deep" / "stage"
    write_stage(str(folder / "r-v1.safetensors"), "dense", 1, dense=BITS)
    assert mode(folder) == 0o700 and mode(tmp_path / "deep") == 0o700
    assert mode(folder / "r-v1.safetensors") == 0o600
    assert os.listdir(folder) == ["r-v1.safetensors"]  # no temporary left behind


def test_a_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "stage"
    folder.mkdir()
    os.chmod(folder, 0o777)  # pre-created, open to every local user
    with pytest.raises(StageDirError) as e:
        write_stage(str(folder / "r-v1.safetensors"), "dense", 1, dense=BITS)
    msg = str(e.value)
    assert "expected a folder owned by uid" in msg and "with mode 0700" in msg
    assert "found mode 0777 (group/other may write it)" in msg
    assert "Fix: remove it" in msg and "STAGE_DIR" in msg
    assert os.listdir(folder) == []


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "stage"
    folder.mkdir(mode=0o700)
    if os.getuid() == 0:  # root: really give it to another user
        os.chown(folder, 65534, 65534)
        owner = 65534
    else:  # otherwise: this process pretends to be someone else
        owner = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(StageDirError, match=f"found it owned by uid {owner} \\(mode 0700\\)"):
        private_stage_dir(str(folder))


def test_a_symlink_in_place_of_the_folder_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "stage").symlink_to(target)
    with pytest.raises(StageDirError, match="found a symlink"):
        private_stage_dir(str(tmp_path / "stage"))


def test_our_folder_others_may_only_read_is_closed_and_used(tmp_path):
    """What an older replica left (0755): no one else can have written there."""
    folder = tmp_path / "stage"
    folder.mkdir()
    os.chmod(folder, 0o755)
    assert private_stage_dir(str(folder)) == str(folder)
    assert mode(folder) == 0o700


def test_a_file_planted_at_the_staged_name_is_replaced_not_written_through(tmp_path):
    folder = tmp_path / "stage"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (folder / "r-v2.safetensors").symlink_to(victim)
    write_stage(str(folder / "r-v2.safetensors"), "dense", 2, dense=BITS)
    assert victim.read_bytes() == b"keep"
    assert stat.S_ISREG(os.lstat(folder / "r-v2.safetensors").st_mode)

"""A compile lock left by an interrupted DeepSpeed op build is reported instead of waited on in silence."""

import os
import time

import pytest

from trainers.parallel.host import STALE_LOCK_SECONDS, warn_on_stale_build_locks


def make_lock(root, op: str, age_seconds: float) -> str:
    folder = root / "py311_cpu" / op
    folder.mkdir(parents=True)
    path = folder / "lock"
    path.touch()
    then = time.time() - age_seconds
    os.utime(path, (then, then))
    return str(path)


def test_an_old_lock_is_named_and_a_fresh_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = make_lock(tmp_path, "cpu_adam", STALE_LOCK_SECONDS + 600)
    make_lock(tmp_path, "deepspeed_shm_comm", 30)  # another rank compiling right now: normal
    with pytest.warns(UserWarning, match="cpu_adam/lock is 25 minutes old"):
        assert warn_on_stale_build_locks() == [old]


def test_no_extension_folder_means_nothing_to_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "absent"))
    assert warn_on_stale_build_locks() == []


def test_a_lock_removed_while_scanning_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    make_lock(tmp_path, "cpu_adam", STALE_LOCK_SECONDS + 600)

    def vanished(path):  # the compiling rank removed its lock between the glob and the age check
        raise FileNotFoundError(path)

    monkeypatch.setattr(os.path, "getmtime", vanished)
    assert warn_on_stale_build_locks() == []

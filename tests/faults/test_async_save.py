"""train.async_save (pretrain/training/checkpoint/async_save.py): the reliability tests of test_reliability.py
that concern checkpoints, run again with the files written in the background: a SIGKILL between
the writes and COMPLETE (and at a random moment), pre-emption by SIGTERM and SIGUSR1, a write that
fails with ENOSPC on one rank, a real full disk. Each asserts what it asserts for the synchronous
save: the previous checkpoint stays the newest complete one, a resume reproduces the losses.
"""

from __future__ import annotations

import pytest
import test_reliability as reliability
import train_jobs
from test_reliability import data, reference  # noqa: F401  (fixtures: the same data and reference run)


@pytest.fixture(autouse=True)
def async_save(monkeypatch):
    """Every `grt train` these tests start has train.async_save=true."""

    def with_async_save(*args, **kwargs):
        return train_jobs.train_args(*args, "train.async_save=true", **kwargs)

    monkeypatch.setattr(reliability, "train_args", with_async_save)


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_reproduces_losses(data, reference, tmp_path):  # noqa: F811
    reliability.test_sigkill_anywhere_then_resume_reproduces_losses(data, reference, tmp_path)


@pytest.mark.slow
def test_sigterm_and_sigusr1_checkpoint_and_exit_cleanly(data, reference, tmp_path):  # noqa: F811
    reliability.test_sigterm_and_sigusr1_checkpoint_and_exit_cleanly(data, reference, tmp_path)


@pytest.mark.slow
def test_checkpoint_write_failure_on_one_rank(data, tmp_path):  # noqa: F811
    reliability.test_checkpoint_write_failure_on_one_rank(data, tmp_path)


@pytest.mark.slow
def test_full_disk_keeps_previous_checkpoint(data, tmp_path):  # noqa: F811
    reliability.test_full_disk_keeps_previous_checkpoint(data, tmp_path)


def test_the_files_are_host_copies_taken_at_the_save():
    """What training changes after the save is not in the written files: tensors are copied when the
    save takes them, a view compactly, one view shown by two tensors once."""
    import torch

    from pretrain.training.checkpoint.async_save import host_copy

    flat = torch.arange(6.0, requires_grad=True)
    view = flat[2:4]
    tied = {"wte": flat.detach(), "lm_head": flat.detach()}  # a state_dict's tied weight: two tensors, one view
    state = {"view": view * 1, "w": flat, "again": flat, "tied": tied, "groups": [{"lr": 0.1, "params": (0, 1)}]}
    state["shapes"] = {"w": torch.Size([6])}  # DeepSpeed's param_shapes: read back with .numel()
    copied = host_copy(state, pinned=False)
    with torch.no_grad():
        flat.add_(100)
    state["groups"][0]["lr"] = 1.0
    assert copied["w"].tolist() == list(range(6)) and copied["again"] is copied["w"]
    assert copied["tied"]["wte"] is copied["tied"]["lm_head"]  # saved once, as torch.save saves shared storage
    assert copied["view"].tolist() == [2.0, 3.0] and copied["view"].untyped_storage().size() == 2 * 4
    assert copied["groups"] == [{"lr": 0.1, "params": (0, 1)}] and not copied["w"].requires_grad
    assert type(copied["shapes"]["w"]) is torch.Size

"""OffloadTrainer's checkpoint-N/ as Trainer's own tools see it ([Note: optimizer.pt beside
the engine's checkpoint], [Note: complete Trainer checkpoints]): a plain Trainer resumes
from it with its optimizer and scheduler, a large model's checkpoint goes without
optimizer.pt as Trainer's resume accepts, and the folder pushed to the Hub is complete."""
import concurrent.futures
import os
import types

import pytest
import torch
from transformers import Trainer

import offload.integrations.trainer_checkpoints as trainer_checkpoints
from offload.integrations.transformers import COMPLETE_MARKER, ENGINE_CHECKPOINT_DIR, checkpoint_missing
from support import max_rel_error
from hf_support import REL_TOL, TokenDataset, logged, model_from, nvme, offload_trainer, save_base_model, training_args


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_base_model(tmp_path_factory.mktemp("hf") / "base")


def train_offload_with_checkpoints(base_dir, out, swap, **overrides):
    trainer = offload_trainer(base_dir, training_args(out, save_strategy="steps", save_steps=3, **overrides),
                              nvme(swap), train_dataset=TokenDataset(24, seed=1))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def test_a_plain_trainer_resumes_from_an_offload_checkpoint_with_its_optimizer_and_scheduler(base_dir, tmp_path):
    """Trainer._load_optimizer_and_scheduler loads the scheduler only beside an optimizer.pt:
    with OffloadTrainer's optimizer.pt the plain Trainer's resumed steps log the learning
    rates of the uninterrupted plain run exactly, and its losses within fp32 parity (the
    moments are the engine's)."""
    train_offload_with_checkpoints(base_dir, tmp_path / "out", tmp_path / "swap")
    checkpoint = tmp_path / "out" / "checkpoint-3"
    plain = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "plain"),
                    train_dataset=TokenDataset(24, seed=1))
    plain.train()
    resumed = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "resumed"),
                      train_dataset=TokenDataset(24, seed=1))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "learning_rate") == logged(plain, "learning_rate")
    assert logged(resumed, "loss") == pytest.approx(logged(plain, "loss"), rel=REL_TOL)
    want = plain.optimizer.state_dict()["state"]
    for i, state in resumed.optimizer.state_dict()["state"].items():
        assert torch.equal(state["step"], want[i]["step"])
        assert max_rel_error({"v": state["exp_avg_sq"]}, {"v": want[i]["exp_avg_sq"]}) < REL_TOL, i
    assert checkpoint_missing(str(checkpoint)) == []  # the marker lists optimizer.pt among its files
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert set(saved) == {"state", "param_groups"} and len(saved["state"]) == 21


def test_moments_over_the_bound_leave_optimizer_pt_out_and_both_trainers_still_resume(
        base_dir, tmp_path, monkeypatch):
    """Above OPTIMIZER_PT_MAX_BYTES the checkpoint holds the engine's states only: it is
    complete, OffloadTrainer resumes from it as ever, and a plain Trainer's resume accepts
    the missing optimizer.pt (it loads the weights and restarts optimizer and scheduler)."""
    monkeypatch.setattr(trainer_checkpoints, "OPTIMIZER_PT_MAX_BYTES", 1024)
    whole = train_offload_with_checkpoints(base_dir, tmp_path / "out", tmp_path / "swap")
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert "optimizer.pt" not in os.listdir(checkpoint) and ENGINE_CHECKPOINT_DIR in os.listdir(checkpoint)
    assert checkpoint_missing(str(checkpoint)) == []
    resumed = offload_trainer(base_dir, training_args(tmp_path / "resumed"), nvme(tmp_path / "swap"),
                              train_dataset=TokenDataset(24, seed=1))
    try:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    finally:
        resumed.close()
    assert logged(resumed, "loss") == logged(whole, "loss")
    plain = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "plain"),
                    train_dataset=TokenDataset(24, seed=1))
    plain.train(resume_from_checkpoint=str(checkpoint))
    assert plain.state.global_step == 6


class FakeHub:
    """hf_api()'s two calls the Trainer's push makes, recording what each upload would send."""

    def __init__(self):
        self.uploads = []

    def create_repo(self, repo_name, **kwargs):
        return types.SimpleNamespace(repo_id=f"user/{repo_name}")

    def upload_folder(self, *, folder_path, path_in_repo=None, **kwargs):
        files = sorted(os.path.relpath(os.path.join(root, name), folder_path)
                       for root, _, names in os.walk(folder_path) for name in names)
        self.uploads.append((path_in_repo, files))
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_a_checkpoint_pushed_to_the_hub_is_complete(base_dir, tmp_path, monkeypatch):
    """push_to_hub with hub_strategy="checkpoint": the folder uploaded as last-checkpoint
    holds the marker and every file it lists, so a download of it is a checkpoint
    OffloadTrainer resumes from (the Trainer's push would run before the marker is written)."""
    hub = FakeHub()
    monkeypatch.setattr("transformers.trainer.hf_api", lambda: hub)
    train_offload_with_checkpoints(base_dir, tmp_path / "out", tmp_path / "swap", push_to_hub=True,
                                   hub_strategy="checkpoint", max_steps=3)
    pushed = [files for path_in_repo, files in hub.uploads if path_in_repo == "last-checkpoint"]
    assert len(pushed) == 1
    assert COMPLETE_MARKER in pushed[0] and f"{ENGINE_CHECKPOINT_DIR}/manifest.json" in pushed[0]
    assert "optimizer.pt" in pushed[0]


def test_compact_states_leave_optimizer_pt_out_and_resume_from_the_engines_checkpoint(base_dir, tmp_path):
    """Compact optimizer states (8-bit moments in blocks) have no AdamW layout: the checkpoint
    goes without optimizer.pt (before, reading the compact pieces as exp_avg failed the first
    save), it is complete, OffloadTrainer resumes from it step for step, and
    trainer.optimizer.state_dict() is a ValueError naming the compact states and the way."""
    config = dict(nvme(tmp_path / "swap"), optimizer_states="compact")
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", save_strategy="steps", save_steps=3, bf16=True),
                              config, train_dataset=TokenDataset(24, seed=1))
    try:
        trainer.train()
        with pytest.raises(ValueError, match=r"optimizer_states='compact'.*engine\.save_checkpoint"):
            trainer.optimizer.state_dict()
        with pytest.raises(ValueError, match=r"load_state_dict\(\).*engine\.load_checkpoint"):
            trainer.optimizer.load_state_dict({})
    finally:
        trainer.close()
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert "optimizer.pt" not in os.listdir(checkpoint) and ENGINE_CHECKPOINT_DIR in os.listdir(checkpoint)
    assert checkpoint_missing(str(checkpoint)) == []
    resumed = offload_trainer(base_dir, training_args(tmp_path / "resumed", bf16=True), config,
                              train_dataset=TokenDataset(24, seed=1))
    try:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    finally:
        resumed.close()
    assert logged(resumed, "loss") == logged(trainer, "loss")

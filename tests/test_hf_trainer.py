"""OffloadTrainer ([Note: the Trainer's loop around the engine]): a transformers.Trainer
whose model trains through an offload Engine logs the losses, gradient norms and learning
rates of a plain Trainer with optim="adamw_torch", evaluates and saves like it, resumes
from its own checkpoints, and refuses what it cannot honour before touching anything."""
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainerState

import offload.faults
from offload.integrations.transformers import (COMPLETE_MARKER, ENGINE_CHECKPOINT_DIR, OffloadTrainer,
                                               checkpoint_missing)
from hf_support import (CONFIG, MAX_GRAD_NORM, REL_TOL, REPO, TokenDataset, logged, model_from, nvme,
                        offload_trainer, save_base_model, training_args)
from support import max_rel_error


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_base_model(tmp_path_factory.mktemp("hf") / "base")


@pytest.fixture(scope="module")
def plain_run(base_dir, tmp_path_factory):
    """A plain Trainer over the same data, evaluating every 2 steps; its final weights saved."""
    out = tmp_path_factory.mktemp("plain")
    trainer = Trainer(model=model_from(base_dir), args=training_args(out, eval_strategy="steps", eval_steps=2),
                      train_dataset=TokenDataset(24, seed=1), eval_dataset=TokenDataset(6, seed=2))
    trainer.train()
    trainer.save_model(out / "final")
    return trainer, out / "final"


def assert_weights_close(directory, reference_directory):
    trained = LlamaForCausalLM.from_pretrained(directory).state_dict()
    reference = LlamaForCausalLM.from_pretrained(reference_directory).state_dict()
    assert trained.keys() == reference.keys()
    assert max_rel_error(trained, reference) < REL_TOL


@pytest.mark.parametrize("where", ["host", "nvme", "nvme, meta model + weights="])
def test_losses_grad_norms_eval_losses_and_weights_equal_the_plain_trainer(where, base_dir, plain_run, tmp_path):
    plain, plain_final = plain_run
    config = nvme(tmp_path / "swap") if where.startswith("nvme") else {}
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", eval_strategy="steps", eval_steps=2),
                              config, meta="meta" in where, train_dataset=TokenDataset(24, seed=1),
                              eval_dataset=TokenDataset(6, seed=2))
    try:
        trainer.train()
        trainer.save_model(tmp_path / "final")
    finally:
        trainer.close()
    assert len(logged(trainer, "loss")) == 6
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=REL_TOL)
    # the engine clipped (the norm it measured, logged where the Trainer logs its own)
    assert min(logged(trainer, "grad_norm")) > MAX_GRAD_NORM
    assert logged(trainer, "grad_norm") == pytest.approx(logged(plain, "grad_norm"), rel=REL_TOL)
    assert logged(trainer, "learning_rate") == logged(plain, "learning_rate")
    assert len(logged(trainer, "eval_loss")) == 3
    assert logged(trainer, "eval_loss") == pytest.approx(logged(plain, "eval_loss"), rel=REL_TOL)
    assert_weights_close(tmp_path / "final", plain_final)


class TokenStream(torch.utils.data.IterableDataset):
    """TokenDataset's rows as a stream: no length."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return (self.rows[i] for i in range(len(self.rows)))


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
def test_evaluate_and_predict_give_the_plain_trainers_results_when_the_last_batch_is_short(
        drop_last, base_dir, tmp_path):
    """7 rows, eval batches of 2: the last batch's loss counts once per row it holds, from a
    stream (no length) as from a map-style dataset, and predict() returns every row
    (dataloader_drop_last drops the map-style dataset's short batch; the Trainer does not
    apply it to a stream). The forward is the plain model's computation in fp32 (the
    engine's compute copy holds the same values), so the results are the same bits."""
    rows = TokenDataset(7, seed=2)
    args = dict(dataloader_drop_last=drop_last)
    plain = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "plain", **args))
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", **args), {})
    try:
        for dataset in (TokenStream(rows), rows):
            name = type(dataset).__name__
            assert trainer.evaluate(dataset)["eval_loss"] == plain.evaluate(dataset)["eval_loss"], name
            got, want = trainer.predict(dataset), plain.predict(dataset)
            assert got.metrics["test_loss"] == want.metrics["test_loss"], name
            assert got.predictions.shape == want.predictions.shape, name
            assert (got.predictions == want.predictions).all() and (got.label_ids == want.label_ids).all(), name
    finally:
        trainer.close()


def test_the_decay_groups_and_hyperparameters_are_the_trainers(base_dir, tmp_path):
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", adam_beta2=0.99, adam_epsilon=1e-6), {},
                              train_dataset=TokenDataset(4, seed=1))
    plain = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "plain", adam_beta2=0.99,
                                                                   adam_epsilon=1e-6))
    try:
        expected = plain.create_optimizer()
        groups = trainer.engine.optimizer.param_groups
        assert trainer.optimizer.param_groups is groups  # the scheduler sets what the engine reads
        assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in expected.param_groups]
        for group, reference in zip(groups, expected.param_groups):
            assert {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")} == \
                {k: reference[k] for k in ("lr", "betas", "eps", "weight_decay")}
        assert trainer.engine.layout.accumulation_steps == 2
    finally:
        trainer.close()


def test_an_accumulation_window_cut_short_by_the_epoch_end_is_stepped_like_the_plain_trainer(base_dir, tmp_path):
    """5 micro-batches per epoch with accumulation 2: windows of 2, 2 and 1, two epochs."""
    args = dict(max_steps=-1, num_train_epochs=2, warmup_steps=0)
    plain = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "plain", **args),
                    train_dataset=TokenDataset(10, seed=1))
    plain.train()
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", **args), {},
                              train_dataset=TokenDataset(10, seed=1))
    try:
        trainer.train()
        assert trainer.engine.stats()["micro_steps"] == 12  # 10 micro-batches, 2 closing windows
    finally:
        trainer.close()
    assert len(logged(trainer, "loss")) == 6
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=REL_TOL)


def test_activation_checkpointing_trains_like_the_plain_trainer(base_dir, plain_run, tmp_path):
    plain, _ = plain_run
    from transformers import TrainingArguments
    # the field's name since transformers 5.2x; gradient_checkpointing before
    name = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", **{name: True}),
                              nvme(tmp_path / "swap"), train_dataset=TokenDataset(24, seed=1))
    try:
        trainer.train()
    finally:
        trainer.close()
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=REL_TOL)


def test_resume_from_a_save_steps_checkpoint_gives_the_uninterrupted_losses(base_dir, tmp_path):
    """Exactly: the engine's checkpoint restores every state bit for bit, the Trainer its
    scheduler, RNGs and data position."""
    args = training_args(tmp_path / "out", save_strategy="steps", save_steps=3)
    whole = offload_trainer(base_dir, args, nvme(tmp_path / "swap"), train_dataset=TokenDataset(24, seed=1))
    try:
        whole.train()
    finally:
        whole.close()
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert {"trainer_state.json", "scheduler.pt", "rng_state.pth", "model.safetensors", ENGINE_CHECKPOINT_DIR} \
        <= set(os.listdir(checkpoint))
    assert "optimizer.pt" in os.listdir(checkpoint)  # for Trainer's tools; the resume reads offload/
    resumed = offload_trainer(base_dir, training_args(tmp_path / "resumed", save_strategy="steps", save_steps=3),
                              nvme(tmp_path / "swap"), train_dataset=TokenDataset(24, seed=1))
    try:
        resumed.train(resume_from_checkpoint=str(checkpoint))
        resumed.save_model(tmp_path / "resumed-final")
    finally:
        resumed.close()
    # the first 3 entries come with the checkpoint's trainer state, the last 3 are the resumed run's
    assert logged(resumed, "loss") == logged(whole, "loss")
    assert logged(resumed, "learning_rate") == logged(whole, "learning_rate")
    assert len(logged(resumed, "loss")) == 6
    final = LlamaForCausalLM.from_pretrained(tmp_path / "resumed-final").state_dict()
    for name, value in LlamaForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-6").state_dict().items():
        assert torch.equal(final[name], value), name


def test_a_directory_that_no_save_finished_is_refused_for_resume_naming_what_it_lacks(base_dir, tmp_path):
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out"), {}, train_dataset=TokenDataset(24, seed=1))
    try:
        with pytest.raises(ValueError) as refusal:
            trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
        # Trainer's own words first, then what the directory lacks
        assert str(refusal.value).startswith(f"Can't find a valid checkpoint at {tmp_path / 'out' / 'checkpoint-3'}")
        for part in (f"no {COMPLETE_MARKER}", "no trainer_state.json", f"no {ENGINE_CHECKPOINT_DIR}/manifest.json"):
            assert part in str(refusal.value)
        with pytest.raises(ValueError, match=r"^No valid checkpoint found in output directory \(.*out\): none that "
                           "OffloadTrainer can resume from: .*checkpoint-3"):
            trainer.train(resume_from_checkpoint=True)
    finally:
        trainer.close()


def test_a_folder_without_a_checkpoint_is_refused_in_the_plain_trainers_words_and_its_tools_find_ours(
        base_dir, tmp_path):
    """Resuming from a path that holds no checkpoint raises what a plain Trainer raises
    there, then why; trainer_utils.get_last_checkpoint finds OffloadTrainer's checkpoint-N."""
    from transformers.trainer_utils import get_last_checkpoint

    (tmp_path / "empty").mkdir()
    plain = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "plain"),
                    train_dataset=TokenDataset(24, seed=1))
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", max_steps=2, save_strategy="steps",
                                                      save_steps=2), {}, train_dataset=TokenDataset(24, seed=1))
    try:
        for path in (tmp_path / "missing", tmp_path / "empty"):
            with pytest.raises(ValueError) as theirs:
                plain.train(resume_from_checkpoint=str(path))
            with pytest.raises(ValueError) as ours:
                trainer.train(resume_from_checkpoint=str(path))
            assert str(theirs.value) == f"Can't find a valid checkpoint at {path}"
            assert str(ours.value).startswith(str(theirs.value) + ": ")
        trainer.train()
        assert get_last_checkpoint(str(tmp_path / "out")) == str(tmp_path / "out" / "checkpoint-2")
    finally:
        trainer.close()


def test_a_save_only_model_checkpoint_is_complete_but_refused_for_resume(base_dir, tmp_path):
    args = training_args(tmp_path / "out", save_strategy="steps", save_steps=3, save_only_model=True)
    trainer = offload_trainer(base_dir, args, {}, train_dataset=TokenDataset(24, seed=1))
    try:
        trainer.train()
        assert checkpoint_missing(str(tmp_path / "out" / "checkpoint-6")) == []
        with pytest.raises(ValueError, match="checkpoint-6.*save_only_model=True"):
            trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
    finally:
        trainer.close()


# ------------------------------------------------------------------ a checkpoint save killed part-way
# [Note: complete Trainer checkpoints]: a run with save_steps=3 and save_total_limit=1 dies
# while it saves checkpoint-6. An exception stands for the kill: only the engine's own save
# catches it (to remove its half-written directory, which a kill leaves: the SIGKILL test
# below), so checkpoint-6 holds what a kill at that point leaves.
CRASH_ARGS = dict(save_strategy="steps", save_steps=3, save_total_limit=1)


class InjectedKill(Exception):
    pass


class StepsRun(TrainerCallback):
    """The optimizer steps a run made."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def kill(patch, owner, name, when, after=False):
    """``owner.name`` raises InjectedKill when its last argument (the path it writes or
    removes) satisfies ``when``: before it acts, or ``after`` it did."""
    original = getattr(owner, name)

    def killed(*args, **kwargs):
        if not when(os.fspath(args[-1])):
            return original(*args, **kwargs)
        if after:
            original(*args, **kwargs)
        raise InjectedKill(f"{name}({args[-1]})")

    patch.setattr(owner, name, killed)


def in_checkpoint_6(path):
    return f"{os.sep}checkpoint-6{os.sep}" in path or path.endswith(f"{os.sep}checkpoint-6")


def kill_half_way_removing_checkpoint_3(patch, trainer):
    """save_total_limit=1 removes checkpoint-3 once checkpoint-6 is complete: killed with
    some of checkpoint-3's files gone."""
    original = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if not os.fspath(path).endswith(f"{os.sep}checkpoint-3"):
            return original(path, *args, **kwargs)
        for name in ("trainer_state.json", "rng_state.pth"):
            os.unlink(os.path.join(path, name))
        raise InjectedKill(f"rmtree({path})")

    patch.setattr(shutil, "rmtree", rmtree)


# The points of a save, in the order it reaches them; each arms the kill for checkpoint-6's
# save and returns the context manager that holds it armed, if any.
KILL_POINTS = {
    "before the weights": lambda patch, trainer: kill(patch, trainer.engine, "save_pretrained", in_checkpoint_6),
    # the engine's first save into checkpoint-3/offload hits each point once, checkpoint-6's a second time
    "inside the engine's checkpoint": lambda patch, trainer: offload.faults.inject(
        "checkpoint.save.rename", offload.faults.raising(InjectedKill), at=2),
    "the engine's checkpoint in place": lambda patch, trainer: offload.faults.inject(
        "checkpoint.save.parent_fsync", offload.faults.raising(InjectedKill), at=2),
    "before the RNG states": lambda patch, trainer: kill(patch, trainer, "_save_rng_state", in_checkpoint_6),
    "before the trainer state": lambda patch, trainer: kill(patch, TrainerState, "save_to_json", in_checkpoint_6),
    "after the trainer state": lambda patch, trainer: kill(patch, TrainerState, "save_to_json", in_checkpoint_6,
                                                           after=True),
    "before the marker's rename": lambda patch, trainer: kill(
        patch, os, "replace", lambda path: in_checkpoint_6(path) and path.endswith(COMPLETE_MARKER)),
    "removing the older checkpoint": kill_half_way_removing_checkpoint_3,
}


def run_killed(trainer, point):
    with pytest.MonkeyPatch.context() as patch:
        armed = KILL_POINTS[point](patch, trainer)
        with armed or contextlib.nullcontext(), pytest.raises(InjectedKill):
            trainer.train()


@pytest.fixture(scope="module")
def uninterrupted(base_dir, tmp_path_factory):
    """The run nothing killed: its losses and final weights."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = offload_trainer(base_dir, training_args(out / "out", **CRASH_ARGS), {},
                              train_dataset=TokenDataset(24, seed=1))
    try:
        trainer.train()
        trainer.save_model(out / "final")
    finally:
        trainer.close()
    return logged(trainer, "loss"), load_file(str(out / "final" / "model.safetensors"))


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_save_killed_at_any_point_resumes_from_the_last_complete_checkpoint(point, base_dir, uninterrupted,
                                                                               tmp_path):
    out = tmp_path / "out"
    killed = offload_trainer(base_dir, training_args(out, **CRASH_ARGS), {}, train_dataset=TokenDataset(24, seed=1))
    try:
        run_killed(killed, point)
    finally:
        killed.close()
    assert killed.state.global_step == 6
    checkpoint_3, checkpoint_6 = str(out / "checkpoint-3"), str(out / "checkpoint-6")
    finished = point == "removing the older checkpoint"
    assert checkpoint_missing(checkpoint_6 if finished else checkpoint_3) == []
    assert checkpoint_missing(checkpoint_3 if finished else checkpoint_6)  # incomplete, and not counted

    steps = StepsRun()
    resumed = offload_trainer(base_dir, training_args(out, **CRASH_ARGS), {}, train_dataset=TokenDataset(24, seed=1),
                              callbacks=[steps])
    try:
        if finished:
            with pytest.raises(ValueError, match=f"checkpoint-3.*no {COMPLETE_MARKER}.*no trainer_state.json"):
                resumed.train(resume_from_checkpoint=checkpoint_3)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an older incomplete directory is no skipped checkpoint
                resumed.train(resume_from_checkpoint=True)
        else:
            with pytest.warns(UserWarning, match=r"resuming from .*checkpoint-3'.*skipped the newer "
                                                 rf".*checkpoint-6' \(no {COMPLETE_MARKER}"):
                resumed.train(resume_from_checkpoint=True)
        resumed.save_model(tmp_path / "final")
    finally:
        resumed.close()
    losses, weights = uninterrupted
    assert steps.steps == ([] if finished else [4, 5, 6])
    assert logged(resumed, "loss") == losses
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert final.keys() == weights.keys() and all(torch.equal(final[k], weights[k]) for k in weights)
    # the resumed run's save of checkpoint-6 is complete, and only then removed checkpoint-3;
    # a run resumed at its end saves nothing, so the half-removed checkpoint-3 waits for the next save
    assert sorted(os.listdir(out)) == ["checkpoint-3"] * finished + ["checkpoint-6"]
    assert checkpoint_missing(checkpoint_6) == []


# One worker process imports transformers once and forks a child per point, which trains
# and SIGKILLs itself there: no except or finally of the save runs, and the engine's own
# half-saved .offload.partial-PID-HEX stays in checkpoint-6.
SIGKILL_WORKER = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    import offload.faults
    from transformers import LlamaForCausalLM, TrainerState
    from offload.integrations.transformers import COMPLETE_MARKER, OffloadTrainer

    base_dir, cases = sys.argv[1], json.loads(sys.argv[2])

    def sigkill(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_at(owner, name, suffix):
        original = getattr(owner, name)
        def killed(*args, **kwargs):
            if os.fspath(args[-1]).endswith(suffix):
                sigkill()
            return original(*args, **kwargs)
        setattr(owner, name, killed)

    statuses = []
    for case in cases:
        pid = os.fork()
        if pid == 0:
            signal.alarm(120)  # a child that hangs dies too, and reports SIGALRM
            if case["point"] == "inside the engine's checkpoint":  # its finished partial directory not renamed
                armed = offload.faults.inject("checkpoint.save.rename", sigkill, at=2)  # held: dropped, it disarms
                armed.__enter__()
            elif case["point"] == "before the trainer state":
                kill_at(TrainerState, "save_to_json", "checkpoint-6/trainer_state.json")
            else:
                kill_at(os, "replace", "checkpoint-6/" + COMPLETE_MARKER)
            trainer = OffloadTrainer(model=LlamaForCausalLM.from_pretrained(base_dir),
                                     args=torch.load(case["args"], weights_only=False), offload_config={},
                                     train_dataset=torch.load(case["rows"]))
            trainer.train()
            os._exit(3)  # survived: the point was not reached
        statuses.append(os.waitpid(pid, 0)[1])
    print(json.dumps(statuses))
""")
SIGKILL_POINTS = ["inside the engine's checkpoint", "before the trainer state", "before the marker's rename"]


@pytest.mark.slow  # about 13 s on a busy 2-core machine (a subprocess importing transformers)
def test_a_save_sigkilled_at_a_point_resumes_from_the_last_complete_checkpoint(base_dir, uninterrupted, tmp_path):
    rows = tmp_path / "rows.pt"
    torch.save([TokenDataset(24, seed=1)[i] for i in range(24)], rows)
    cases = []
    for i, point in enumerate(SIGKILL_POINTS):
        torch.save(training_args(tmp_path / f"case-{i}", **CRASH_ARGS), tmp_path / f"args-{i}.bin")
        cases.append(dict(point=point, args=str(tmp_path / f"args-{i}.bin"), rows=str(rows)))
    (tmp_path / "worker.py").write_text(SIGKILL_WORKER)
    worker = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(base_dir), json.dumps(cases)],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert worker.returncode == 0, worker.stderr[-3000:]
    statuses = json.loads(worker.stdout.strip().splitlines()[-1])
    losses, weights = uninterrupted
    for i, (point, status) in enumerate(zip(SIGKILL_POINTS, statuses)):
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, (point, status)
        out = tmp_path / f"case-{i}"
        assert checkpoint_missing(str(out / "checkpoint-3")) == [] and checkpoint_missing(str(out / "checkpoint-6"))
        engine_leftovers = [e for e in os.listdir(out / "checkpoint-6") if e.startswith(f".{ENGINE_CHECKPOINT_DIR}.")]
        assert bool(engine_leftovers) == (point == "inside the engine's checkpoint"), point
        resumed = offload_trainer(base_dir, training_args(out, **CRASH_ARGS), {},
                                  train_dataset=TokenDataset(24, seed=1))
        try:
            with pytest.warns(UserWarning, match=r"resuming from .*checkpoint-3'.*skipped the newer .*checkpoint-6'"):
                resumed.train(resume_from_checkpoint=True)
            resumed.save_model(tmp_path / f"final-{i}")
        finally:
            resumed.close()
        assert logged(resumed, "loss") == losses, point
        final = load_file(str(tmp_path / f"final-{i}" / "model.safetensors"))
        assert all(torch.equal(final[k], weights[k]) for k in weights), point
        # the engine's partial directory of the killed save went with the save of checkpoint-6 again
        assert sorted(os.listdir(out)) == ["checkpoint-6"] and checkpoint_missing(str(out / "checkpoint-6")) == []
        assert not [e for e in os.listdir(out / "checkpoint-6") if e.startswith(".")], point


def test_resume_from_an_incomplete_checkpoint_is_refused_before_anything_changes(base_dir, uninterrupted,
                                                                                  tmp_path):
    out = tmp_path / "out"
    killed = offload_trainer(base_dir, training_args(out, **CRASH_ARGS), {}, train_dataset=TokenDataset(24, seed=1))
    try:
        run_killed(killed, "before the trainer state")
    finally:
        killed.close()
    trainer = offload_trainer(base_dir, training_args(tmp_path / "again", **CRASH_ARGS), {},
                              train_dataset=TokenDataset(24, seed=1))
    try:
        with pytest.raises(ValueError) as refusal:
            trainer.train(resume_from_checkpoint=out / "checkpoint-6")
        for part in (f"Can't find a valid checkpoint at {out / 'checkpoint-6'}", f"no {COMPLETE_MARKER}",
                     "no trainer_state.json"):
            assert part in str(refusal.value)
        assert "no scheduler.pt" not in str(refusal.value)  # what the save wrote is not named
        trainer.train()  # from the start: the refused resume changed nothing
        trainer.save_model(tmp_path / "final")
    finally:
        trainer.close()
    losses, weights = uninterrupted
    assert logged(trainer, "loss") == losses
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert all(torch.equal(final[k], weights[k]) for k in weights)


def test_an_incomplete_directory_never_makes_save_total_limit_remove_a_complete_checkpoint(base_dir, tmp_path):
    """checkpoint-9, left by a killed save of a longer run into the same output_dir, is
    newer than checkpoint-3 both by step and by time; checkpoint-1, an older incomplete one,
    is garbage."""
    out = tmp_path / "out"

    class PlantAfterCheckpoint3(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 3:
                (out / "checkpoint-9").mkdir()
                (out / "checkpoint-9" / "model.safetensors").write_bytes(b"half")
                now = time.time()
                os.utime(out / "checkpoint-3", (now - 100, now - 100))
                os.utime(out / "checkpoint-9", (now - 50, now - 50))

    (out / "checkpoint-1").mkdir(parents=True)
    args = training_args(out, **dict(CRASH_ARGS, save_total_limit=2))
    trainer = offload_trainer(base_dir, args, {}, train_dataset=TokenDataset(24, seed=1),
                              callbacks=[PlantAfterCheckpoint3()])
    try:
        trainer.train()
    finally:
        trainer.close()
    assert sorted(os.listdir(out)) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    assert checkpoint_missing(str(out / "checkpoint-3")) == [] and checkpoint_missing(str(out / "checkpoint-6")) == []
    resumed = offload_trainer(base_dir, args, {}, train_dataset=TokenDataset(24, seed=1))
    try:
        with pytest.warns(UserWarning, match=r"resuming from .*checkpoint-6'.*skipped the newer .*checkpoint-9'"):
            resumed.train(resume_from_checkpoint=True)
    finally:
        resumed.close()
    assert args.save_total_limit == 2  # the caller's arguments are untouched
    assert torch.load(out / "checkpoint-6" / "training_args.bin", weights_only=False).save_total_limit == 2


def test_without_clipping_deferred_steps_train_alike_and_say_why_grad_norm_is_not_logged(base_dir, tmp_path):
    """NVMe states, no clipping: the engine finishes each step during the next forward
    (overlap_step_with_forward), so the norm is not known when the Trainer logs."""
    args = dict(max_grad_norm=0.0)
    plain = Trainer(model=model_from(base_dir), args=training_args(tmp_path / "plain", **args),
                    train_dataset=TokenDataset(24, seed=1))
    plain.train()
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", **args), nvme(tmp_path / "swap"),
                              train_dataset=TokenDataset(24, seed=1))
    try:
        with pytest.warns(RuntimeWarning, match="grad_norm is not logged"):
            trainer.train()
        assert trainer.engine.stats()["deferred_updates"] > 0
    finally:
        trainer.close()
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=REL_TOL)
    assert logged(trainer, "grad_norm") == [] and len(logged(plain, "grad_norm")) == 6


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_load_best_model_at_end_loads_the_best_checkpoints_engine_states(where, base_dir, tmp_path):
    """The best checkpoint's weights, read through the model's and the engine's state_dict,
    and in the model's parameters themselves: the load let go of every unit, and train()
    restores the model ([Note: the model after train()]), so none reads NaN."""
    args = training_args(tmp_path / "out", eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                         load_best_model_at_end=True, metric_for_best_model="eval_loss")
    trainer = offload_trainer(base_dir, args, nvme(tmp_path / "swap") if where == "nvme" else {},
                              train_dataset=TokenDataset(24, seed=1), eval_dataset=TokenDataset(6, seed=2))
    try:
        trainer.train()
        eval_losses = logged(trainer, "eval_loss")
        best = eval_losses.index(min(eval_losses))
        assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / f"checkpoint-{2 * (best + 1)}")
        saved = load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
        for values in (trainer.model.state_dict(), trainer.engine.state_dict()):
            assert values.keys() == saved.keys() and all(torch.equal(values[k], saved[k]) for k in saved)
        parameters = dict(trainer.model.named_parameters())
        assert parameters.keys() == saved.keys()
        for name, p in parameters.items():
            assert p.dtype == torch.float32 and torch.equal(p.detach(), saved[name]), name
        assert trainer.evaluate()["eval_loss"] == eval_losses[best]
        assert all(torch.equal(p.detach(), saved[name]) for name, p in trainer.model.named_parameters())
    finally:
        trainer.close()


def test_a_peft_lora_model_trains_like_the_plain_trainer_and_saves_its_adapters(base_dir, tmp_path):
    def lora_model():
        torch.manual_seed(1)
        return get_peft_model(model_from(base_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                               lora_dropout=0.0))

    plain = Trainer(model=lora_model(), args=training_args(tmp_path / "plain"), train_dataset=TokenDataset(24, seed=1))
    plain.train()
    plain.save_model(tmp_path / "plain-adapter")
    trainer = OffloadTrainer(model=lora_model(), args=training_args(tmp_path / "out"), offload_config=nvme(tmp_path),
                             train_dataset=TokenDataset(24, seed=1))
    try:
        trainer.train()
        trainer.save_model(tmp_path / "adapter")
    finally:
        trainer.close()
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=REL_TOL)
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    reference = load_file(str(tmp_path / "plain-adapter" / "adapter_model.safetensors"))
    assert adapter.keys() == reference.keys() and max_rel_error(adapter, reference) < REL_TOL


def test_a_closed_trainer_refuses_to_train_evaluate_or_save(base_dir, tmp_path):
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", max_steps=1), nvme(tmp_path / "swap"),
                              train_dataset=TokenDataset(4, seed=1), eval_dataset=TokenDataset(2, seed=2))
    trainer.close()
    trainer.close()
    assert os.listdir(tmp_path / "swap") == []
    for call in (trainer.train, trainer.evaluate, lambda: trainer.save_model(tmp_path / "final")):
        with pytest.raises(RuntimeError, match="closed"):
            call()

@pytest.mark.parametrize("arguments, offload_config, names", [
    (dict(optim="adamw_bnb_8bit"), {}, ["optim='adamw_bnb_8bit'"]),
    (dict(optim="adamw_bnb_8bit", fp16=True, torch_compile=True), {},
     ["optim='adamw_bnb_8bit'", "fp16=True", "torch_compile=True"]),
    (dict(fsdp="full_shard"), {}, ["fsdp="]),
    (dict(auto_find_batch_size=True, bf16_full_eval=True), {}, ["auto_find_batch_size=True", "bf16_full_eval=True"]),
    ({}, dict(gradient_accumulation_steps=4, max_grad_norm=2.0),
     ["gradient_accumulation_steps=4", "max_grad_norm=2.0"]),
    ({}, dict(dtype="bf16"), ["dtype='bf16'"]),
    ({}, dict(device="cuda"), ["device='cuda'"]),
    ("lbfgs", {}, ["optimizers=(LBFGS", "closure"]),
])
def test_unsupported_settings_are_refused_with_their_names_before_anything_is_touched(
        arguments, offload_config, names, base_dir, tmp_path):
    model = model_from(base_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizers = (None, None)
    if arguments == "lbfgs":
        arguments, optimizers = {}, (torch.optim.LBFGS(model.parameters(), lr=0.1), None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fsdp given as a string is deprecated
        args = training_args(tmp_path / "out", **arguments)
    with pytest.raises(ValueError, match="cannot honour") as refusal:
        OffloadTrainer(model=model, args=args, offload_config=offload_config, optimizers=optimizers,
                       train_dataset=TokenDataset(4, seed=1))
    for name in names:
        assert name in str(refusal.value)
    assert not (tmp_path / "out").exists()  # the Trainer was not built
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nor the engine


@pytest.mark.parametrize("optim", ["sgd", "adafactor", "user-sgd-momentum"])
def test_other_optimizers_train_as_the_plain_trainer(optim, base_dir, tmp_path):
    """TrainingArguments(optim="sgd") builds torch's SGD (elementwise), optim="adafactor"
    transformers' Adafactor (whole parameters), and optimizers=(SGD(momentum), None) is the
    user's: the engine runs each, and the losses are the plain Trainer's (clipping on every
    step: the engine's coefficient differs from torch's in its last bits)."""
    def run(trainer_cls, out, **kwargs):
        model = model_from(base_dir)
        optimizers = (None, None)
        if optim == "user-sgd-momentum":
            optimizers = (torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), None)
        args = training_args(out, optim="sgd" if optim == "user-sgd-momentum" else optim)
        trainer = trainer_cls(model=model, args=args, optimizers=optimizers, train_dataset=TokenDataset(12, seed=1),
                              **kwargs)
        trainer.train()
        return trainer
    plain = run(Trainer, tmp_path / "plain")
    trainer = run(OffloadTrainer, tmp_path / "out", offload_config=nvme(tmp_path / "swap"))
    try:
        assert len(logged(trainer, "loss")) == 6
        assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=REL_TOL)
        with pytest.raises(ValueError, match=r"optimizer.state_dict\(\): the state of .* read in torch's layout for "
                                             r"Adam/AdamW only; save it with trainer.engine.save_checkpoint\(DIR\)"):
            trainer.optimizer.state_dict()
    finally:
        trainer.close()


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_optimizer_state_dict_is_the_plain_trainers_after_the_same_steps(where, base_dir, plain_run, tmp_path):
    """[Note: the optimizer's state as torch lays it out]: AdamW's param groups (the
    scheduler's learning rates) as they are, its moments within the engine's fp32 parity
    tolerance, its step counts exactly; the temporary checkpoint leaves nothing behind."""
    plain, _ = plain_run
    swap = tmp_path / "swap"
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", eval_strategy="steps", eval_steps=2),
                              nvme(swap) if where == "nvme" else {}, train_dataset=TokenDataset(24, seed=1),
                              eval_dataset=TokenDataset(6, seed=2))
    try:
        trainer.train()
        before = sorted(os.listdir(swap)) if where == "nvme" else None
        got, want = trainer.optimizer.state_dict(), plain.optimizer.state_dict()
        if where == "nvme":
            assert sorted(os.listdir(swap)) == before
    finally:
        trainer.close()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and len(want["state"]) == 21
    for i, state in want["state"].items():
        assert got["state"][i].keys() == state.keys()
        assert torch.equal(got["state"][i]["step"], state["step"]) and got["state"][i]["step"].dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            assert got["state"][i][key].shape == state[key].shape and got["state"][i][key].dtype == state[key].dtype
            assert max_rel_error({key: got["state"][i][key]}, {key: state[key]}) < REL_TOL, (i, key)


def test_optimizer_state_dict_too_big_for_memory_is_refused_naming_the_engines_checkpoint(
        base_dir, tmp_path, monkeypatch):
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", max_steps=1), nvme(tmp_path / "swap"),
                              train_dataset=TokenDataset(4, seed=1))
    try:
        trainer.train()
        before = sorted(os.listdir(tmp_path / "swap"))
        monkeypatch.setattr("offload.memory.layout.available_memory_bytes", lambda: 64 << 10)
        with pytest.raises(ValueError, match=r"optimizer.state_dict\(\): the Adam moments .* more than 0.75 of the "
                                             r"memory available now .*trainer.engine.save_checkpoint\(DIR\)"):
            trainer.optimizer.state_dict()
        assert sorted(os.listdir(tmp_path / "swap")) == before  # nothing written
        monkeypatch.undo()  # room for close() to give the model its values back
    finally:
        trainer.close()


@pytest.mark.parametrize("setting, reason", [
    ("model_init", "wraps one model, at construction"),
    ("auto_find_batch_size", "refusing to train until a checkpoint is loaded"),
    ("torch_compile", "compile each unit's forward yourself"),
    ("fp16", "the Trainer holds the LR schedule only for accelerate's own GradScaler skips"),
])
def test_model_init_auto_find_batch_size_torch_compile_and_fp16_are_refused_with_the_reason(
        setting, reason, tmp_path):
    """Each before anything is built: model_init is never called."""
    def model_init():
        raise AssertionError("model_init was called")

    arguments = {} if setting == "model_init" else {setting: True}
    kwargs = dict(model_init=model_init) if setting == "model_init" else \
        dict(model=LlamaForCausalLM(LlamaConfig(**CONFIG)))
    with pytest.raises(ValueError, match="cannot honour") as refusal:
        OffloadTrainer(args=training_args(tmp_path / "out", **arguments), train_dataset=TokenDataset(4, seed=1),
                       **kwargs)
    assert f"{setting}=" in str(refusal.value) and reason in str(refusal.value)
    assert not (tmp_path / "out").exists()


def test_bf16_trains_with_the_engine_in_bf16(base_dir, plain_run, tmp_path):
    plain, _ = plain_run
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", bf16=True), {},
                              train_dataset=TokenDataset(24, seed=1))
    try:
        assert trainer.engine.compute_dtype == torch.bfloat16
        trainer.train()
        # the fp32 master, in the dtype from before wrap, read through either state_dict
        values, master = trainer.model.state_dict(), trainer.engine.state_dict()
        assert {v.dtype for v in master.values()} == {torch.float32}
        assert any(not torch.equal(v, v.bfloat16().float()) for v in master.values())  # not the bf16 copy
        assert values.keys() == master.keys() and all(torch.equal(values[k], master[k]) for k in master)
        # and the parameters themselves, in their dtype from before wrap ([Note: the model after train()])
        for name, p in trainer.model.named_parameters():
            assert p.dtype == torch.float32 and torch.equal(p.detach(), master[name]), name
        assert trainer.model.dtype == torch.float32
    finally:
        trainer.close()
    # bf16 compute against fp32: the same run, to bf16 precision
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=2e-2)


def test_a_model_handed_to_a_second_trainer_is_refused_while_the_first_is_open_and_goes_on_after_close(
        base_dir, tmp_path):
    """[Note: the model after close]: a second OffloadTrainer on the model of an open one is
    refused before anything is touched, naming close(); once the first is closed the model
    holds its trained values and the second trains from them: the losses of a model
    loaded from the first one's save_model, bit for bit."""
    first = offload_trainer(base_dir, training_args(tmp_path / "first", max_steps=3), nvme(tmp_path / "swap1"),
                            train_dataset=TokenDataset(24, seed=1))
    model = first.model
    try:
        first.train()
        first.save_model(tmp_path / "saved")
        with pytest.raises(ValueError, match=r"wrapped before, by a live engine: .*close that engine first "
                                             r"\(engine.close\(\) or trainer.close\(\)\)"):
            OffloadTrainer(model=model, args=training_args(tmp_path / "refused"), train_dataset=TokenDataset(4, seed=1))
        assert not (tmp_path / "refused").exists()
    finally:
        first.close()
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert all(torch.equal(p.detach(), saved[name]) for name, p in model.named_parameters())
    losses = {}
    for name, m in (("handed over", model), ("loaded", model_from(tmp_path / "saved"))):
        second = OffloadTrainer(model=m, args=training_args(tmp_path / name, max_steps=3), offload_config={},
                                train_dataset=TokenDataset(24, seed=4))
        try:
            second.train()
        finally:
            second.close()
        losses[name] = logged(second, "loss")
    assert len(losses["handed over"]) == 3 and losses["handed over"] == losses["loaded"]


def test_after_train_the_model_generates_like_its_saved_weights_and_to_cpu_keeps_its_values(tmp_path):
    """A tiny GPT-2 (built from its config, nothing downloaded): after train() the model's
    generate() gives the tokens and scores of the same weights loaded from save_model,
    model.to("cpu") (where the restored values are) changes nothing, evaluate() included,
    and to(torch.bfloat16), half() and cuda() are refused at the call naming the engine."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=CONFIG["vocab_size"], n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    trainer = OffloadTrainer(model=model, args=training_args(tmp_path / "out", max_steps=2), offload_config={},
                             train_dataset=TokenDataset(8, seed=1))
    try:
        trainer.train()
        trainer.save_model(tmp_path / "saved")
        reference = GPT2LMHeadModel.from_pretrained(tmp_path / "saved").eval()
        assert model.to("cpu") is model
        assert all(torch.equal(p.detach(), reference.state_dict()[name]) for name, p in model.named_parameters())
        prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True)
        model.eval()
        got, want = model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
        eval_loss = trainer.evaluate(TokenDataset(4, seed=2))["eval_loss"]
        assert model.to("cpu") is model  # the restored values are on the CPU: nothing moves
        assert all(torch.equal(p.detach(), reference.state_dict()[name]) for name, p in model.named_parameters())
        assert trainer.evaluate(TokenDataset(4, seed=2))["eval_loss"] == eval_loss
        # A move or a cast would give the parameters tensors the engine never sees: refused at the call
        for call, method in ((lambda: model.to(torch.bfloat16), "to"), (model.half, "half"), (model.cuda, "cuda")):
            with pytest.raises(ValueError, match=rf"^GPT2LMHeadModel.{method}\(\) on a model wrapped by offload: it "
                                                 r"would replace transformer.wte.weight .*engine.close\(\)"):
                call()
        assert all(torch.equal(p.detach(), reference.state_dict()[name]) for name, p in model.named_parameters())
        assert trainer.evaluate(TokenDataset(4, seed=2))["eval_loss"] == eval_loss
    finally:
        trainer.close()


def test_import_offload_does_not_import_transformers():
    code = "import sys, offload; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})



HF_INSTALL = "python3 -m pip install torch==2.13.0 -e '.[hf]'"


def test_the_readme_installs_the_hf_extra_that_the_example_and_the_trainer_need():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"transformers", "accelerate"} <= {re.match(r"[A-Za-z0-9_-]+", r).group() for r in extras["hf"]}
    readme = (REPO / "README.md").read_text()
    assert readme.count(HF_INSTALL) >= 2  # the weights section and the OffloadTrainer section
    assert "offload[hf]" not in readme  # offload is installed from this tree, not from an index
    assert HF_INSTALL in (REPO / "examples" / "finetune_llama.py").read_text()


@pytest.mark.parametrize("code", [
    "import offload.integrations.transformers",
    "import runpy; runpy.run_path('examples/finetune_llama.py', run_name='__main__')",
], ids=["integration", "example"])
def test_without_transformers_the_trainer_and_the_example_name_the_hf_extra(code):
    result = subprocess.run([sys.executable, "-c", f"import sys; sys.modules['transformers'] = None; {code}"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "hf extra" in result.stderr and HF_INSTALL in result.stderr, result.stderr[-2000:]


@pytest.mark.slow  # about 10 s on an idle 2-core machine, 30-50 s on a busy one (a subprocess importing transformers)
def test_the_finetune_llama_example_runs(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "examples" / "finetune_llama.py"), "--work-dir", str(tmp_path)],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "loaded with from_pretrained" in result.stdout
    assert (tmp_path / "finetuned" / "model.safetensors").exists()


def test_the_body_of_the_gpu_trainer_test_runs_on_the_cpu_device(tmp_path):
    """tests/test_engine_gpu.py's OffloadTrainer test has not run on a GPU yet: its body runs
    here, twice on the CPU device, the same curve bit for bit."""
    from hf_support import trainer_losses

    first, second = trainer_losses(tmp_path / "a", use_cpu=True), trainer_losses(tmp_path / "b", use_cpu=True)
    assert len(first) == 6 and first == second

"""OffloadTrainer under several ranks ([Note: OffloadTrainer with several ranks]): 2 gloo
ranks on the CPU, each with per_device_train_batch_size=1, log the losses and gradient
norms of one process with per_device_train_batch_size=2 on the same rows, save the same
weights (rank 0 writes them), load the best checkpoint at the end, train LoRA adapters and
train in bf16 as one process does, and resume from their own checkpoint as the uninterrupted run; the
settings that cannot work with ranks are refused by name.

Why 2 ranks x 1 row == 1 process x 2 rows: accelerate hands rank r the r-th of each
consecutive pair of the sampler's 1-row batches, so each optimizer step sees the same rows
as the one process's. The tiny Llama takes num_items_in_batch, which the Trainer sums over
the ranks, and it multiplies each rank's loss by the world size; the engine averages the
ranks' gradients ([Note: gradient averaging] in offload/zero/partition.py), so the gradient
is the one process's sum over the same tokens divided by the same count. The logged loss is
the Trainer's mean over ranks of those scaled losses: the same sum over the same count.
Only the order of the fp32 sums differs (two partial sums added by the all-reduce, a
multiplication by 1/2 and by 2, which are exact), a few ulps (6e-8 each) per step; Adam's
normalized updates carry such differences along without growing them much over 6 steps,
so the engine's own parity tolerance (REL_TOL, as tests/test_zero.py's) bounds them.
"""
import copy
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import offload

from hf_support import CONFIG, REL_TOL, TokenDataset, logged, training_args
from support import free_port, max_rel_error

WORLD = 2
STEPS = 6


def _worker(rank, port, base_dir, spec, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo")
    from offload.integrations.transformers import OffloadTrainer
    trainer = None
    try:
        args = training_args(os.path.join(out_dir, "out"), per_device_train_batch_size=1,
                             per_device_eval_batch_size=1, **spec.get("args", {}))
        trainer = OffloadTrainer(model=make_model(base_dir, spec.get("lora")), args=args,
                                 offload_config=spec["config"], train_dataset=TokenDataset(24, seed=1),
                                 eval_dataset=TokenDataset(7, seed=2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=spec.get("resume"))
        result = {"log_history": trainer.state.log_history, "stats": trainer.engine.stats(),
                  "best_model_checkpoint": trainer.state.best_model_checkpoint,
                  "model_wrapped": type(trainer.model_wrapped).__name__,
                  # what trainer.model's parameters read right after train() ([Note: the model after train()])
                  "after_train": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
                  "warnings": [str(w.message) for w in caught]}
        try:  # [Note: copies of a wrapped model]
            result["copied"] = copy.deepcopy(trainer.model).state_dict()
        except ValueError as error:
            result["copied"] = str(error)
        try:
            trainer.optimizer.state_dict()
        except ValueError as error:
            result["optimizer_state_dict"] = str(error)
        if spec.get("evaluate"):
            result["eval"] = trainer.evaluate()
        trainer.save_model(os.path.join(out_dir, "final"))
        result["state"] = trainer.engine.state_dict()
        trainer.close()
        result["after_close"] = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if trainer is not None:
            trainer.close()
        dist.destroy_process_group()


def make_model(base_dir, lora=False):
    """The saved tiny Llama; with ``lora``, LoRA adapters on it (initialized from seed 1)."""
    model = LlamaForCausalLM.from_pretrained(base_dir)
    if not lora:
        return model
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))


def run_ranks(base_dir, spec, out_dir):
    """The OffloadTrainer of ``spec`` on 2 ranks; each rank's results."""
    os.makedirs(out_dir, exist_ok=True)
    # forkserver, as tests/test_zero.py: fresh processes forked from one that imported torch
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), str(base_dir), spec, str(out_dir)), nprocs=WORLD, join=True,
                       start_method="forkserver")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "base"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_process(base_dir, tmp_path_factory):
    """One OffloadTrainer process on the whole batch (2 rows per step); its final weights saved."""
    from offload.integrations.transformers import OffloadTrainer
    out = tmp_path_factory.mktemp("one")
    trainer = OffloadTrainer(model=LlamaForCausalLM.from_pretrained(base_dir), args=training_args(out / "out", per_device_eval_batch_size=1),
                             offload_config={}, train_dataset=TokenDataset(24, seed=1),
                             eval_dataset=TokenDataset(7, seed=2))
    try:
        trainer.train()
        metrics = trainer.evaluate()
        trainer.save_model(out / "final")
    finally:
        trainer.close()
    return trainer.state.log_history, metrics, out / "final"


def _saved(directory):
    return LlamaForCausalLM.from_pretrained(directory).state_dict()


@pytest.mark.parametrize("stage,tier", [(1, "host"), (2, "nvme"), (3, "host"), (0, "host")])
def test_two_ranks_log_and_save_what_one_process_does_on_the_whole_batch(stage, tier, base_dir, one_process,
                                                                          tmp_path):
    log, metrics, final = one_process
    config = dict(stage=stage, param_tier=tier, optimizer_tier=tier)
    if tier == "nvme":
        config["swap_dir"] = str(tmp_path / "swap")  # one for both ranks: each takes rank-N inside
    results = run_ranks(base_dir, dict(config=config, evaluate=True), tmp_path)
    for rank, result in enumerate(results):
        assert result["stats"]["world_size"] == WORLD and result["stats"]["rank"] == rank
        # not DistributedDataParallel: the engine reduces the gradients
        assert result["model_wrapped"] == "LlamaForCausalLM"
        assert "not with several ranks (this run has 2)" in result["optimizer_state_dict"]
        ranks_log = result["log_history"]
        assert len(logged_in(ranks_log, "loss")) == STEPS
        assert logged_in(ranks_log, "loss") == pytest.approx(logged_in(log, "loss"), rel=REL_TOL)
        # the engine's global norm (every step clips: above MAX_GRAD_NORM)
        assert logged_in(ranks_log, "grad_norm") == pytest.approx(logged_in(log, "grad_norm"), rel=REL_TOL)
        assert logged_in(ranks_log, "learning_rate") == logged_in(log, "learning_rate")
        # evaluate: each rank its share of the 7 rows (accelerate pads rank 1's last batch with a
        # copy of row 0, and gather_for_metrics drops it), one row per batch so that the batches'
        # losses are the rows' losses in both runs (the Trainer weights each batch's mean loss
        # by its size: batches of 2 would group other rows with 2 ranks than with one process)
        assert result["eval"]["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=REL_TOL)
        # [Note: the model after train()] at stage 0 every rank reads its own whole replica:
        # trainer.model holds the trained values after train() and after close(); at stage >= 1
        # a shard each, and a warning says why the parameters keep their placeholders
        restore_warnings = [w for w in result["warnings"] if "do not hold their values" in w]
        if stage == 0:
            assert not restore_warnings
            for values in (result["after_train"], result["after_close"]):
                assert values.keys() == result["state"].keys()
                assert all(torch.equal(values[k], result["state"][k]) for k in values)
            assert result["copied"].keys() == result["state"].keys()
            assert all(torch.equal(result["copied"][k], result["state"][k]) for k in result["state"])
        else:
            assert len(restore_warnings) == 1
            assert (f"not with several ranks (this run has 2): at ZeRO stage {stage} each rank holds a shard "
                    "of the states") in restore_warnings[0] and "with stage=0 every rank" in restore_warnings[0]
            assert result["copied"].startswith("copy.deepcopy() or pickle of a model wrapped by offload: not with "
                                               f"several ranks (this run has 2): at ZeRO stage {stage}")
    reference = _saved(final)
    assert max_rel_error(_saved(tmp_path / "final"), reference) < REL_TOL
    assert max_rel_error(results[1]["state"], results[0]["state"]) == 0  # the ranks agree exactly


def logged_in(log_history, key):
    return [entry[key] for entry in log_history if key in entry]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_resume_from_their_checkpoint_as_the_uninterrupted_run(stage, base_dir, tmp_path):
    config = dict(stage=stage, param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"))
    saving = dict(config=config, args=dict(save_strategy="steps", save_steps=3))
    whole = run_ranks(base_dir, saving, tmp_path / "whole")  # 6 steps, checkpoints at 3 and 6
    checkpoint = tmp_path / "whole" / "out" / "checkpoint-3"
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    from offload.integrations.transformers import COMPLETE_MARKER, checkpoint_missing
    assert checkpoint_missing(str(checkpoint)) == []
    # the marker, written once every rank had saved, lists both ranks' RNG states
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(marker["files"])
    # A new pair of processes, from checkpoint-3 alone (their own output_dir)
    resumed = run_ranks(base_dir, dict(saving, resume=str(checkpoint)), tmp_path / "resumed")
    for r in range(WORLD):
        tail = [e for e in whole[r]["log_history"] if e.get("step", 0) > 3 and "loss" in e]
        resumed_tail = [e for e in resumed[r]["log_history"] if e.get("step", 0) > 3 and "loss" in e]
        assert len(tail) == STEPS - 3
        assert [e["loss"] for e in resumed_tail] == [e["loss"] for e in tail]
        assert [e["grad_norm"] for e in resumed_tail] == [e["grad_norm"] for e in tail]
        for name, value in whole[r]["state"].items():
            assert torch.equal(resumed[r]["state"][name], value), (r, name)
    assert max_rel_error(_saved(tmp_path / "resumed" / "final"), _saved(tmp_path / "whole" / "final")) == 0


def test_under_torchrun_as_users_launch_it(base_dir, one_process, tmp_path):
    """`torchrun --nproc-per-node 2` running a user's script (tests/scripts/torchrun_trainer.py):
    accelerate starts the process group from torchrun's environment, the engine finds it."""
    import subprocess
    import sys

    log, _, final = one_process
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(offload.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    config = dict(stage=3, param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"))
    launcher = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), os.path.join(os.path.dirname(__file__), "scripts", "torchrun_trainer.py"),
         str(base_dir), json.dumps(config), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    assert launcher.returncode == 0, launcher.stdout
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["stats"]["world_size"] == WORLD and result["stats"]["rank"] == rank
        assert logged_in(result["log_history"], "loss") == pytest.approx(logged_in(log, "loss"), rel=REL_TOL)
    assert max_rel_error(_saved(tmp_path / "final"), _saved(final)) < REL_TOL
    # one swap_dir served both ranks; close() emptied each rank's subdirectory (which it leaves)
    assert sorted(os.listdir(tmp_path / "swap")) == ["rank-0", "rank-1"]
    assert [os.listdir(tmp_path / "swap" / f"rank-{r}") for r in range(WORLD)] == [[], []]


BEST = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
            metric_for_best_model="eval_loss")


@pytest.mark.parametrize("variant", ["load_best_model_at_end", "lora", "bf16"])
def test_two_ranks_equal_one_process_with_best_model_at_end_lora_adapters_and_bf16(variant, base_dir, tmp_path):
    from offload.integrations.transformers import OffloadTrainer
    lora = variant == "lora"
    arguments = {"load_best_model_at_end": BEST, "lora": {}, "bf16": dict(bf16=True)}[variant]
    config = dict(stage=2, param_tier="nvme", optimizer_tier="nvme")
    one = OffloadTrainer(model=make_model(base_dir, lora),
                         offload_config=dict(config, stage=0, swap_dir=str(tmp_path / "swap1")), args=training_args(tmp_path / "one" / "out", per_device_eval_batch_size=1, **arguments),
                         train_dataset=TokenDataset(24, seed=1), eval_dataset=TokenDataset(7, seed=2))
    try:
        one.train()
        one.save_model(tmp_path / "one" / "final")
    finally:
        one.close()
    results = run_ranks(base_dir, dict(config=dict(config, swap_dir=str(tmp_path / "swap2")), lora=lora,
                                       args=arguments), tmp_path / "ranks")
    for result in results:
        if variant == "bf16":
            # The first step's losses are equal (each row's bf16 forward is the same); then the
            # bf16 gradients of 1 row and of 2 rows round differently (2^-8 relative), and
            # Adam's normalized steps move weights by up to lr * 2^-8 = 4e-5 more or less per
            # step. Measured: 7e-5 relative at most over the 6 losses; bound 1e-3.
            losses = logged_in(result["log_history"], "loss")
            assert losses[0] == logged(one, "loss")[0]
            assert losses == pytest.approx(logged(one, "loss"), rel=1e-3)
            assert {v.dtype for v in result["state"].values()} == {torch.float32}
        else:
            assert logged_in(result["log_history"], "loss") == pytest.approx(logged(one, "loss"), rel=REL_TOL)
    if variant == "bf16":
        assert max_rel_error(results[1]["state"], results[0]["state"]) == 0
        return
    if lora:  # the adapters only, as one process saves them
        adapter = load_file(str(tmp_path / "ranks" / "final" / "adapter_model.safetensors"))
        reference = load_file(str(tmp_path / "one" / "final" / "adapter_model.safetensors"))
        assert adapter.keys() == reference.keys() and max_rel_error(adapter, reference) < REL_TOL
        return
    best = results[0]["best_model_checkpoint"]
    # an earlier step than the last: loading it changes the weights
    assert os.path.basename(best) != f"checkpoint-{STEPS}"
    assert os.path.basename(best) == os.path.basename(one.state.best_model_checkpoint)
    assert all(result["best_model_checkpoint"] == best for result in results)
    saved = load_file(os.path.join(best, "model.safetensors"))
    for result in results:  # the engine holds the best checkpoint's weights on every rank
        assert result["state"].keys() == saved.keys()
        assert all(torch.equal(result["state"][k], saved[k]) for k in saved)
    assert max_rel_error(_saved(tmp_path / "ranks" / "final"), _saved(tmp_path / "one" / "final")) < REL_TOL


@pytest.mark.parametrize("setting", ["save_on_each_node", "n_gpu"])
def test_settings_that_cannot_work_with_ranks_are_refused_by_name(setting, base_dir, tmp_path, monkeypatch):
    """Checked in one process: TrainingArguments told it has 2 ranks (or 2 GPUs)."""
    from offload.integrations.transformers import OffloadTrainer
    args = training_args(tmp_path / "out", save_on_each_node=setting == "save_on_each_node")
    if setting == "save_on_each_node":
        monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
        expected = "save_on_each_node=True: with several ranks"
    else:
        monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
        expected = "n_gpu=2: the Trainer would wrap the model in nn.DataParallel"
    model = LlamaForCausalLM.from_pretrained(base_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=expected):
        OffloadTrainer(model=model, args=args, offload_config={}, train_dataset=TokenDataset(4, seed=1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched

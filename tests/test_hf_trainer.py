"""OffloadTrainer ([Note: the Trainer's loop around the engine]): a transformers.Trainer
whose model trains through an offload Engine logs the losses, gradient norms and learning
rates of a plain Trainer with optim="adamw_torch", evaluates and saves like it, resumes
from its own checkpoints, and refuses what it cannot honour before touching anything."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from offload.integrations.transformers import ENGINE_CHECKPOINT_DIR, OffloadTrainer
from support import max_rel_error

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)
REL_TOL = 1e-5  # the fp32 parity tolerance of the engine's tests
MAX_GRAD_NORM = 0.5  # below the tiny model's gradient norms (about 2): every step clips
REPO = Path(__file__).resolve().parent.parent


class TokenDataset(torch.utils.data.Dataset):
    """Random token rows, labels = inputs (causal LM)."""

    def __init__(self, num_rows, seed, length=12):
        self.rows = torch.randint(0, CONFIG["vocab_size"], (num_rows, length),
                                  generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def training_args(output_dir, **overrides):
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                  gradient_accumulation_steps=2, max_steps=6, learning_rate=1e-2, lr_scheduler_type="linear",
                  warmup_steps=2, weight_decay=0.1, max_grad_norm=MAX_GRAD_NORM, logging_steps=1,
                  save_strategy="no", report_to=[], optim="adamw_torch", seed=3, disable_tqdm=True, use_cpu=True)
    values.update(overrides)
    return TrainingArguments(**values)


def model_from(base_dir, meta=False):
    """The saved tiny Llama: loaded (a normal model), or built on the meta device (its
    weights then come through weights=)."""
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig.from_pretrained(base_dir))
    return LlamaForCausalLM.from_pretrained(base_dir)


def nvme(tmp_path):
    return dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path))


def offload_trainer(base_dir, args, offload_config, meta=False, **kwargs):
    return OffloadTrainer(model=model_from(base_dir, meta), args=args, offload_config=offload_config,
                          weights=base_dir if meta else None, **kwargs)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "base"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    return path


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
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", activation_checkpointing=True),
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
    assert "optimizer.pt" not in os.listdir(checkpoint)
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


def test_a_checkpoint_without_engine_states_is_refused_for_resume(base_dir, tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out"), {}, train_dataset=TokenDataset(24, seed=1))
    try:
        with pytest.raises(ValueError, match="holds no engine checkpoint"):
            trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    finally:
        trainer.close()



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


def test_load_best_model_at_end_loads_the_best_checkpoints_engine_states(base_dir, tmp_path):
    args = training_args(tmp_path / "out", eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                         load_best_model_at_end=True, metric_for_best_model="eval_loss")
    trainer = offload_trainer(base_dir, args, {}, train_dataset=TokenDataset(24, seed=1),
                              eval_dataset=TokenDataset(6, seed=2))
    try:
        trainer.train()
        eval_losses = logged(trainer, "eval_loss")
        best = eval_losses.index(min(eval_losses))
        assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / f"checkpoint-{2 * (best + 1)}")
        assert trainer.evaluate()["eval_loss"] == eval_losses[best]
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
    (dict(optim="sgd"), {}, ["optim='sgd'"]),
    (dict(optim="adafactor", fp16=True, torch_compile=True), {},
     ["optim='adafactor'", "fp16=True", "torch_compile=True"]),
    (dict(fsdp="full_shard"), {}, ["fsdp="]),
    (dict(auto_find_batch_size=True, bf16_full_eval=True), {}, ["auto_find_batch_size=True", "bf16_full_eval=True"]),
    ({}, dict(gradient_accumulation_steps=4, max_grad_norm=2.0),
     ["gradient_accumulation_steps=4", "max_grad_norm=2.0"]),
    ({}, dict(dtype="bf16"), ["dtype='bf16'"]),
    ({}, dict(device="cuda"), ["device='cuda'"]),
    ("sgd", {}, ["optimizers=(SGD"]),
])
def test_unsupported_settings_are_refused_with_their_names_before_anything_is_touched(
        arguments, offload_config, names, base_dir, tmp_path):
    model = model_from(base_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizers = (None, None)
    if arguments == "sgd":
        arguments, optimizers = {}, (torch.optim.SGD(model.parameters(), lr=0.1), None)
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


def test_bf16_trains_with_the_engine_in_bf16(base_dir, plain_run, tmp_path):
    plain, _ = plain_run
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", bf16=True), {},
                              train_dataset=TokenDataset(24, seed=1))
    try:
        assert trainer.engine.compute_dtype == torch.bfloat16
        trainer.train()
    finally:
        trainer.close()
    # bf16 compute against fp32: the same run, to bf16 precision
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=2e-2)


def test_import_offload_does_not_import_transformers():
    code = "import sys, offload; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})



@pytest.mark.slow  # about 10 s on an idle 2-core machine, 30-50 s on a busy one (a subprocess importing transformers)
def test_the_finetune_llama_example_runs(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "examples" / "finetune_llama.py"), "--work-dir", str(tmp_path)],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "loaded with from_pretrained" in result.stdout
    assert (tmp_path / "finetuned" / "model.safetensors").exists()

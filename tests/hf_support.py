"""Helpers shared by the OffloadTrainer tests (tests/test_hf_trainer.py, one process, and
tests/test_hf_trainer_ranks.py, several ranks): a tiny Llama's config, random token rows,
the TrainingArguments both start from, and the logged values."""
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from offload.integrations.transformers import OffloadTrainer

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


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def save_base_model(path):
    """The tiny Llama of CONFIG, seeded, saved at ``path`` (returned)."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    return path


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


def trainer_losses(tmp_path, use_cpu):
    """The logged losses of OffloadTrainer on the tiny Llama, both tiers on NVMe, clipping every
    step, on the CPU (``use_cpu``) or on the Trainer's CUDA device: the body of the gpu-marked
    Trainer test (tests/test_engine_gpu.py), also run on the CPU device (test_hf_trainer.py)."""
    base_dir = save_base_model(tmp_path / "base")
    trainer = offload_trainer(base_dir, training_args(tmp_path / "out", use_cpu=use_cpu), nvme(tmp_path / "swap"),
                              train_dataset=TokenDataset(24, seed=1))
    try:
        assert trainer.engine.device.type == ("cpu" if use_cpu else "cuda")
        trainer.train()
        return logged(trainer, "loss")
    finally:
        trainer.close()

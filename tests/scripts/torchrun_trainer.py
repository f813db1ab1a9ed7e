"""An OffloadTrainer script as a user runs it under `torchrun --nproc-per-node N`: no
process group set up by hand (accelerate starts it from torchrun's environment), the rows
of tests/test_hf_trainer.py's TokenDataset. Writes this rank's log history and engine
stats to OUT_DIR/rank<RANK>.pt and the final weights (rank 0) to OUT_DIR/final. Usage:
torchrun ... torchrun_trainer.py BASE_MODEL_DIR OFFLOAD_CONFIG_JSON OUT_DIR."""
import json
import os
import sys

import torch
from transformers import LlamaForCausalLM, TrainingArguments

from offload.integrations.transformers import OffloadTrainer


class TokenDataset(torch.utils.data.Dataset):
    """Random token rows, labels = inputs (as tests/test_hf_trainer.py's)."""

    def __init__(self, num_rows, seed, vocab_size, length=12):
        self.rows = torch.randint(0, vocab_size, (num_rows, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    base_dir, config_json, out_dir = sys.argv[1:4]
    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(base_dir)
    world = int(os.environ["WORLD_SIZE"])
    # tests/test_hf_trainer.py's training_args, with the batch of 2 rows shared by the ranks
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "out"), per_device_train_batch_size=2 // world, gradient_accumulation_steps=2,
        max_steps=6, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.1,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], optim="adamw_torch", seed=3,
        disable_tqdm=True, use_cpu=True)
    trainer = OffloadTrainer(model=model, args=args, offload_config=json.loads(config_json),
                             train_dataset=TokenDataset(24, seed=1, vocab_size=model.config.vocab_size))
    try:
        trainer.train()
        trainer.save_model(os.path.join(out_dir, "final"))
        torch.save({"log_history": trainer.state.log_history, "stats": trainer.engine.stats()},
                   os.path.join(out_dir, f"rank{trainer.args.process_index}.pt"))
    finally:
        trainer.close()


if __name__ == "__main__":
    main()

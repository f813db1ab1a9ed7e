"""Fine-tune a Llama from its saved weights with OffloadTrainer, parameters and optimizer
states on NVMe, and save it back in the format from_pretrained reads.

Nothing is downloaded: the "pretrained" model is a small Llama built here and saved with
save_pretrained, and the data is the source of a module of Python's standard library, as
bytes. The model is built on the meta device, so its weights go from the safetensors file
straight into the swap files (weights=), a unit at a time.

    python3 examples/finetune_llama.py [--work-dir DIR] [--steps N]

It needs offload's ``hf`` extra (transformers, accelerate, safetensors, peft); from the
repository's root: python3 -m pip install torch==2.13.0 -e '.[hf]'
"""
import argparse
import inspect
import json
import tempfile
from pathlib import Path

import torch

try:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

    from offload.integrations.transformers import OffloadTrainer
except ImportError as error:
    raise SystemExit(f"{error}\nThis example needs offload's hf extra: from the repository's root, "
                     "python3 -m pip install torch==2.13.0 -e '.[hf]'") from None

SEQUENCE_LENGTH = 64


class ByteChunks(torch.utils.data.Dataset):
    """Consecutive chunks of a text's bytes (the tokens), labels = inputs."""

    def __init__(self, text: str, length: int = SEQUENCE_LENGTH) -> None:
        data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.chunks = data[:len(data) // length * length].view(-1, length)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


def save_pretrained_llama(directory: Path) -> None:
    """Stands in for a downloaded checkpoint: a small Llama, saved as Hugging Face weights."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE_LENGTH)
    LlamaForCausalLM(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", help="where the model, run and output go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryDirectory() as swap_dir:
        work = Path(options.work_dir or scratch)
        save_pretrained_llama(work / "pretrained")
        data = ByteChunks(inspect.getsource(json.decoder) + inspect.getsource(json.encoder))
        train_data = torch.utils.data.Subset(data, range(0, len(data) - 8))
        eval_data = torch.utils.data.Subset(data, range(len(data) - 8, len(data)))

        with torch.device("meta"):  # no memory for the weights: they go from the file into the tiers
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(work / "pretrained"))
        trainer = OffloadTrainer(
            model=model,
            args=TrainingArguments(
                output_dir=str(work / "run"), max_steps=options.steps, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
                weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, eval_strategy="steps",
                eval_steps=max(options.steps // 2, 1), save_strategy="no", report_to=[], optim="adamw_torch",
                use_cpu=True, disable_tqdm=True),
            train_dataset=train_data, eval_dataset=eval_data,
            offload_config=dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=swap_dir),
            weights=work / "pretrained")
        try:
            before = trainer.evaluate()["eval_loss"]
            trainer.train()
            after = trainer.evaluate()["eval_loss"]
            stats = trainer.engine.stats()
            trainer.save_model(str(work / "finetuned"))
        finally:
            trainer.close()  # the swap files go
        print(f"eval loss {before:.3f} -> {after:.3f}; {stats['bytes_read_nvme'] / 2**20:.1f} MiB read from "
              f"and {stats['bytes_written_nvme'] / 2**20:.1f} MiB written to the swap files")

        finetuned = AutoModelForCausalLM.from_pretrained(work / "finetuned")
        batch = torch.stack([eval_data[i]["input_ids"] for i in range(len(eval_data))])
        with torch.no_grad():
            loss = finetuned(input_ids=batch, labels=batch).loss.item()
        print(f"{work / 'finetuned'} loaded with from_pretrained: eval loss {loss:.3f}")
        assert abs(loss - after) < 1e-3 * max(1.0, abs(after)), (loss, after)


if __name__ == "__main__":
    main()

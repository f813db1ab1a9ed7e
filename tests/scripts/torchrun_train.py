"""Trains the small GPT on this rank's share of the batches as `torchrun` launches it
(tests/test_zero_groups.py starts two launchers as two nodes); writes this rank's
losses, state and stats to OUT_DIR/rank<RANK>.pt. Usage: torchrun ... torchrun_train.py
CONFIG_JSON DATA_PT OUT_DIR."""
import json
import os
import sys

import torch
import torch.distributed as dist

import offload
from offload.gpt import GPT, GPTConfig


def main() -> None:
    config_path, data_path, out_dir = sys.argv[1:4]
    with open(config_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**spec["model"]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        data = torch.load(data_path)
        losses = []
        with offload.wrap(model, opt, config=spec["config"]) as engine:
            for b in data:
                per_rank = b.shape[0] // world
                mine = b[rank * per_rank:(rank + 1) * per_rank]
                loss = engine(mine[:, :-1], mine[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            result = {"state": engine.state_dict(), "stats": engine.stats(), "losses": losses,
                      "env": {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The DeepSpeed peer rows of tools/bench_train.py: ZeRO-3 with offload_param and
offload_optimizer to cpu (ds-cpu) or nvme (ds-nvme), on one process (DS_ACCELERATOR=cpu,
gloo, world size 1); bf16 via autocast. Setup and known failures: tools/bench_train.py.

Imports train_harness only (see the graph in tools/bench_train.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from train_harness import ADAMW_OPTIONS, build_gpt, free_port, make_batch, timed_loop

DS_ROWS = ("ds-cpu", "ds-nvme")


def deepspeed_importable() -> tuple:
    """(whether deepspeed imports, its version or the import's last error line), asked of a
    fresh process."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                          capture_output=True, text=True, env=env)
    if proc.returncode == 0:
        return True, proc.stdout.strip().splitlines()[-1]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return False, lines[-1] if lines else "import failed"


def run_deepspeed(spec: dict) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ.setdefault(name, value)
    import torch
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    device = "cpu" if spec["row"] == "ds-cpu" else "nvme"
    offload = {"device": device, "pin_memory": False}
    if device == "nvme":
        swap = tempfile.mkdtemp(prefix="ds-", dir=spec["swap_dir"])
        offload["nvme_path"] = swap
    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": dict(ADAMW_OPTIONS)},
        "zero_optimization": {
            "stage": 3,
            "offload_param": dict(offload),
            "offload_optimizer": dict(offload),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False,
                "overlap_events": True, "thread_count": 1},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=device):
        model = build_gpt(spec["model"], meta=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    idx, targets = make_batch(spec["model"], spec["batch"])
    bf16 = spec["dtype"] == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()

    try:
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"])
    finally:
        if device == "nvme":
            shutil.rmtree(swap, ignore_errors=True)
    return {"step_seconds_all": seconds, "note": f"deepspeed {deepspeed.__version__}"}

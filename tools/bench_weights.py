"""Load time and peak RSS of pretrained weights: transformers' ``from_pretrained`` against
``offload.wrap(meta_model, ..., weights=DIR)``, for a Llama-shaped model saved locally with
random weights (nothing is downloaded).

Each row runs in a process of its own (peak RSS is per process, ``ru_maxrss``). The offload
rows do more than load: they also write every unit's homes (the compute copy, and the fp32
master and zeroed Adam moments of the optimizer tier), so their time includes the swap
writes of the optimizer state, which from_pretrained never creates.

    python3 tools/bench_weights.py                 # ~1.1 B parameters (4.4 GB of fp32 weights)
    python3 tools/bench_weights.py --layers 4      # smaller, quicker
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROW = """
import json, resource, sys, time
import torch
args = json.loads(sys.argv[1])
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig.from_pretrained(args["dir"])
start = time.perf_counter()
written = 0  # bytes the row writes to swap (the offload rows on NVMe)
if args["row"].startswith("from_pretrained"):
    model = LlamaForCausalLM.from_pretrained(args["dir"])
    if args["row"].endswith("touched"):  # every value read once: the weights really in RAM
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
    seconds = time.perf_counter() - start
else:
    import offload
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    engine = offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(
        param_tier=args["tier"], optimizer_tier=args["tier"], swap_dir=args["swap"], dtype=args["dtype"],
        device_budget="1GiB"), weights=args["dir"])
    seconds = time.perf_counter() - start
    written = engine.stats()["bytes_written_nvme"]
    engine.close()
print(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "written": written}))
"""

SAVE = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from offload.io.safetensors import SafetensorsWriter
args = json.loads(sys.argv[1])
config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args["layers"],
                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
config.save_pretrained(args["dir"])
with torch.device("meta"):
    model = LlamaForCausalLM(config)
shapes = [(n, torch.float32, tuple(p.shape)) for n, p in model.named_parameters()]
writer = SafetensorsWriter(args["dir"] + "/model.safetensors", shapes, metadata={"format": "pt"})
g = torch.Generator().manual_seed(0)
for name, _, shape in shapes:
    writer.write(name, torch.randn(shape, generator=g) * 0.02)
writer.finish()
print(sum(p.numel() for p in model.parameters()))
"""


def run(code: str, args: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"failed: {args}\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (22: about 1.1 B parameters)")
    parser.add_argument("--dir", help="where the model is saved (default: a temp dir, removed after)")
    parser.add_argument("--swap-dir", help="swap directory of the offload rows (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=1, help="times each row runs, alternated")
    parser.add_argument("--rows", nargs="*", help="names of the rows to run (default: all)")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="bench_weights-")
    model_dir = args.dir or os.path.join(base, "model")
    swap = args.swap_dir or os.path.join(base, "swap")
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(swap, exist_ok=True)
    try:
        start = time.perf_counter()
        params = int(run(SAVE, {"dir": model_dir, "layers": args.layers}))
        file_bytes = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
        print(f"model: {params / 1e9:.2f} B parameters, {file_bytes / 1e9:.2f} GB of fp32 safetensors "
              f"(written in {time.perf_counter() - start:.1f} s)")
        rows = [("from_pretrained", {}), ("from_pretrained touched", {}),
                ("offload host fp32", {"tier": "host", "dtype": "fp32"}),
                ("offload nvme fp32", {"tier": "nvme", "dtype": "fp32"}),
                ("offload nvme bf16", {"tier": "nvme", "dtype": "bf16"})]
        results = {name: [] for name, _ in rows}
        for _ in range(args.rounds):
            for name, extra in rows:
                if extra.get("tier") == "host" and 4 * params * 4 > 0.8 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"):
                    continue  # the host optimizer state would not fit in RAM
                if args.rows and name not in args.rows:
                    continue
                row = name.replace(" touched", "-touched").split()[0]
                results[name].append(json.loads(run(ROW, dict(extra, row=row, dir=model_dir, swap=swap))))
        print(f"{'row':<24} {'seconds':>8} {'GB/s':>6} {'peak RSS GiB':>13} {'swap written GB':>16}")
        for name, got in results.items():
            for r in got:
                print(f"{name:<24} {r['seconds']:8.2f} {file_bytes / 1e9 / r['seconds']:6.2f} "
                      f"{r['peak_rss'] / 2**30:13.2f} {r['written'] / 1e9:16.2f}")
        print("GB/s: bytes of the safetensors file over the row's time (the offload rows also write "
              "the optimizer state's homes); swap written: the NVMe rows' bytes written at wrap "
              "(a count, unlike the times not shared-machine noise)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The checks of a lent GPU in one command (issue #43): parity of offload on CUDA with plain
PyTorch on the same GPU, the device budget as torch's allocator sees it, and a step-time
table. Runs on the CPU too (``--device cpu``), which is how this file is tried before a GPU
is lent.

    python3 tools/gpu_check.py parity --device cuda --swap-dir DIR [--json PATH]
    python3 tools/gpu_check.py bench --device cuda --swap-dir DIR --model gpt166m [--json PATH]

parity: a small GPT and a small Hugging Face Llama, 10 steps of AdamW with clipping at 1.0,
plain PyTorch (fp32, on the device) against offload at its device budget floor plus two
blocks, tiers (host, host), (nvme, nvme) and auto, dtypes fp32 and bf16, and fp32 with
activation_offload="host". fp32 is held to the GPU tests' bounds (losses 1e-4, state 1e-3
relative, CUDA and CPU reductions differ); bf16 to BF16_LOSS_REL_TOL of the fp32 run (the
bound test_low_precision_tracks_fp32 uses). Memory: the engine's arena (allocated at wrap)
must stay within device_budget (+1 MiB of torch's rounding), and the peak over training
within the arena plus the plain run's activation peak (nothing more with activations
offloaded).

bench: each row in a fresh process (its RSS its own): plain PyTorch on the device (fp32
master, autocast bf16, fused AdamW) and offload rows; step time (median of the timed steps),
tokens/s, device peak, host RSS, bytes over PCIe and NVMe per step.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import offload  # noqa: E402
from offload.memory.budget import minimum_device_budget, model_unit_sizes  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
LOSS_TOL_FP32, STATE_TOL_FP32, LOSS_TOL_BF16 = 1e-4, 1e-3, 0.05
ELEMENT = {"fp32": 4, "bf16": 2}

SMALL_GPT = dict(vocab_size=512, seq_len=64, d_model=128, num_heads=4, num_layers=4, qkv_bias=True,
                 tie_embeddings=False)
SMALL_LLAMA = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
BENCH_MODELS = {
    "gptquick": ("gpt", SMALL_GPT, 2, 64),  # tries the rows on a CPU
    # tools/train_harness.py FULL_MODEL: the reference GPT, 166.6M
    "gpt166m": ("gpt", dict(vocab_size=32000, seq_len=256, d_model=1024, num_heads=16, num_layers=8,
                             qkv_bias=True, tie_embeddings=False), 8, 256),
    # Llama-3.2-1B's shape (1.24B, tied embeddings)
    "llama1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                              tie_word_embeddings=True), 4, 1024),
}


# parity's models: two small ones and the reference GPT (10 steps of batch 4 x 64 each)
PARITY_MODELS = {"gpt": ("gpt", SMALL_GPT), "llama": ("llama", SMALL_LLAMA), "gpt166m": BENCH_MODELS["gpt166m"][:2]}


def build(kind, cfg):
    torch.manual_seed(0)
    if kind == "gpt":
        from offload.gpt import GPT, GPTConfig
        return GPT(GPTConfig(**cfg))
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**cfg))


def loss_of(kind, model, b):
    if kind == "gpt":
        return model(b[:, :-1], b[:, 1:])
    return model(input_ids=b, labels=b).loss


def data_for(vocab, n, batch, seq, device):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(n)]


def floor_budget(model, kind, dtype, param_tier):
    """The smallest device_budget wrap accepts plus room for two blocks (as bench_train's
    floor rows)."""
    e = ELEMENT[dtype]
    floor = minimum_device_budget(model_unit_sizes(model, e), param_tier if param_tier != "auto" else "nvme", e)
    blocks = model.blocks if kind == "gpt" else model.model.layers
    return floor + 2 * sum(p.numel() for p in blocks[0].parameters()) * e


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


# ------------------------------------------------------------------------------------ parity
def clip_exactly(params, max_norm):
    """torch's clip_grad_norm_ with the norm summed in float64: the coefficient to 1e-15."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def plain_run(kind, model, data, device, fused=False, exact_norm=False):
    ref = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, **({"fused": True} if fused else
                                                                            {"foreach": False}))
    losses, act_peak = [], 0
    for b in data:
        sync(device)
        base = allocated(device)
        reset_peak(device)
        loss = loss_of(kind, ref, b)
        loss.backward()
        sync(device)
        act_peak = max(act_peak, peak(device) - base)
        if exact_norm:
            clip_exactly(list(ref.parameters()), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if len(losses) == 1:
            first = {k: v.detach().float().cpu().clone() for k, v in ref.state_dict().items()}  # not the live tensors
    state = {k: v.detach().float().cpu() for k, v in ref.state_dict().items()}
    del ref, opt
    return losses, state, act_peak, first


def plain_reference(kind, model, data, device):
    """plain_run's (losses, state, activation peak), the spread of correct steps (the
    largest loss and state errors against it of the same steps with torch's fused AdamW, and
    with the clipping norm summed in float64) and the state after the first step.
    [Note: the spread of two torch steps] Correct implementations of one step round
    differently and drift apart on this model by this much. The clipping norm matters most:
    torch's fp32 vector_norm on the CPU is off by up to 1.7e-3 on the reference GPT's
    gradients (offload's, taken in chunks and summed in float64, by up to 6e-4), and Adam
    turns a coefficient that differs by that into updates that differ by a good part of the
    learning rate wherever a parameter's gradients cancel from step to step (docs/gpu.md)."""
    losses, state, act_peak, first = plain_run(kind, model, data, device)
    spread = [0.0, 0.0]
    for other in (dict(fused=True), dict(exact_norm=True)):
        other_losses, other_state, _, _ = plain_run(kind, model, data, device, **other)
        spread[0] = max(spread[0], max(abs(a - b) / abs(b) for a, b in zip(other_losses, losses)))
        spread[1] = max(spread[1], max_rel_error(other_state, state))
    return losses, state, act_peak, tuple(spread), first


def max_rel_error(state, ref_state):
    worst = 0.0
    for k, ref in ref_state.items():
        scale = ref.abs().max().clamp_min(1e-12)
        worst = max(worst, ((state[k].float() - ref).abs().max() / scale).item())
    return worst


def parity_case(kind, cfg, dtype, tiers, activation_offload, device, swap_root, plain):
    model = build(kind, cfg)
    param_tier, optimizer_tier = tiers
    swap_dir = os.path.join(swap_root, f"{kind}-{dtype}-{param_tier}-{optimizer_tier}-{activation_offload}")
    os.makedirs(swap_dir, exist_ok=True)
    budget = floor_budget(model, kind, dtype, param_tier)
    if activation_offload:
        budget *= 2  # the budget holds the saved activations kept on the device too
    config = dict(device=str(device), dtype=dtype, param_tier=param_tier, optimizer_tier=optimizer_tier,
                  swap_dir=swap_dir, device_budget=budget, max_grad_norm=1.0,
                  activation_offload=activation_offload)
    ref_losses, ref_state, act_peak, spread, ref_first = plain
    data = data_for(cfg["vocab_size"], 10, 4, 64, device)
    gc.collect()  # the previous case's engine is gone before the baseline is read
    sync(device)
    before = allocated(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    row = dict(model=kind, dtype=dtype, tiers=f"{param_tier},{optimizer_tier}", act=activation_offload or "-",
               budget=budget, plain_act_peak=act_peak, spread_loss=spread[0], spread_state=spread[1])
    with offload.wrap(model, opt, config=config) as engine:
        sync(device)
        row["arena"] = allocated(device) - before
        reset_peak(device)
        losses = []
        for b in data:
            loss = loss_of(kind, engine, b)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if len(losses) == 1:  # where a difference starts: the first step's state
                row["state_err_step1"] = max_rel_error(
                    {k: v.detach().float().cpu() for k, v in engine.state_dict().items()}, ref_first)
        sync(device)
        row["peak"] = peak(device) - before
        stats = engine.stats()
        row["placement"] = str(engine.placement()) if param_tier == "auto" else ""
        row["pinned"] = engine.debug.host.pinned_bytes
        row["host_used"] = engine.debug.host.used_bytes
        row["h2d"] = stats.get("bytes_host_to_device", 0)
        row["device_peak_stat"] = stats.get("device_peak_bytes")
        state = {k: v.detach().float().cpu() for k, v in engine.state_dict().items()}
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    row["loss_err"] = loss_err
    row["loss_errs"] = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    row["state_err"] = max_rel_error(state, ref_state)
    ok = [all(l == l for l in losses)]
    if dtype == "fp32":
        # the bounds: 1e-4 and 1e-3, or twice the spread of correct steps where that is larger
        # (a bigger model drifts further: [Note: the spread of two torch steps])
        ok += [loss_err < max(LOSS_TOL_FP32, 2 * spread[0]), row["state_err"] < max(STATE_TOL_FP32, 2 * spread[1])]
    else:
        ok += [loss_err < LOSS_TOL_BF16]
    ok.append(row["arena"] <= budget + MiB or device.type != "cuda")
    # with activations offloaded the peak may exceed the arena only by what a unit's forward
    # holds before its saved tensors leave; without, by the plain run's activations
    row["peak_over_arena"] = row["peak"] - row["arena"]
    ok.append(device.type != "cuda" or row["peak_over_arena"] <= act_peak + MiB)
    row["ok"] = all(ok)
    return row


def parity(args):
    device = torch.device(args.device)
    rows = []
    for name in args.models:
        kind, cfg = PARITY_MODELS[name]
        model = build(kind, cfg)
        plain = plain_reference(kind, model, data_for(cfg["vocab_size"], 10, 4, 64, device), device)
        print(f"SPREAD {name}: loss {plain[3][0]:.2e} state {plain[3][1]:.2e}", flush=True)
        if name == "gpt166m":  # the reference GPT: one case per tier and dtype pair that matters most
            cases = [("fp32", ("host", "host"), None), ("bf16", ("nvme", "nvme"), None),
                     ("bf16", ("auto", "auto"), None), ("bf16", ("host", "host"), "host"),
                     ("bf16", ("host", "host"), "nvme")]
        else:
            cases = [(d, t, None) for d in ("fp32", "bf16")
                     for t in (("host", "host"), ("nvme", "nvme"), ("auto", "auto"))]
            cases += [("fp32", ("host", "host"), "host"), ("bf16", ("host", "host"), "host")]
        for dtype, tiers, act in [c for c in cases if c[0] in args.dtypes]:
            try:
                row = parity_case(kind, cfg, dtype, tiers, act, device, args.swap_dir, plain)
            except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                traceback.print_exc()
                row = dict(model=kind, dtype=dtype, tiers=",".join(tiers), act=act or "-", ok=False,
                           error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print("PARITY", json.dumps(row), flush=True)
    print(f"\n{'model':6} {'dtype':5} {'tiers':10} {'act':4} {'loss err':>9} {'state err':>9} {'budget MiB':>10} "
          f"{'arena MiB':>9} {'peak-arena':>10} {'plain act':>9} {'pinned MiB':>10} {'spread':>9} ok")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:6} {r['dtype']:5} {r['tiers']:10} {r['act']:4} ERROR {r['error']}")
            continue
        print(f"{r['model']:6} {r['dtype']:5} {r['tiers']:10} {r['act']:4} {r['loss_err']:9.2e} {r['state_err']:9.2e} "
              f"{r['budget'] / MiB:10.2f} {r['arena'] / MiB:9.2f} {r['peak_over_arena'] / MiB:10.2f} "
              f"{r['plain_act_peak'] / MiB:9.2f} {r['pinned'] / MiB:10.2f} {r['spread_state']:9.2e} {'ok' if r['ok'] else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


# ------------------------------------------------------------------------------------- bench
ROWS = {
    "plain": None,
    "device-host": dict(param_tier="device", optimizer_tier="host"),
    "host-floor": dict(param_tier="host", optimizer_tier="host", floor=True),
    "nvme-floor": dict(param_tier="nvme", optimizer_tier="nvme", floor=True),
    "auto": dict(param_tier="auto", optimizer_tier="auto"),
}


def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_row(args):
    device = torch.device(args.device)
    kind, cfg, batch, seq = BENCH_MODELS[args.model]
    spec = ROWS[args.row]
    model = build(kind, cfg)
    n = sum(p.numel() for p in model.parameters())
    data = data_for(cfg["vocab_size"], args.warmup + args.steps, batch, seq, device)
    out = dict(row=args.row, model=args.model, params=n, tokens=batch * seq)
    times = []
    if spec is None:
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
        for i, b in enumerate(data):
            sync(device)
            t = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_of(kind, model, b)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        out.update(device_peak=peak(device))
    else:
        spec = dict(spec)
        floor = spec.pop("floor", False)
        budget = floor_budget(model, kind, "bf16", spec["param_tier"]) if floor else None
        config = dict(device=str(device), dtype="bf16", swap_dir=args.swap_dir, device_budget=budget,
                      max_grad_norm=1.0, **spec)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        t0 = time.perf_counter()
        with offload.wrap(model, opt, config=config) as engine:
            out["wrap_s"] = time.perf_counter() - t0
            before = None
            for i, b in enumerate(data):
                if i == args.warmup:
                    before = engine.stats()
                sync(device)
                t = time.perf_counter()
                loss = loss_of(kind, engine, b)
                engine.backward(loss)
                engine.step()
                loss.item()
                sync(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t)
            after = engine.stats()
            per = {k: (after[k] - before[k]) / args.steps for k in after
                   if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float))
                   and k.startswith("bytes_")}
            out.update(budget=budget, device_peak=peak(device), pinned=engine.debug.host.pinned_bytes,
                       per_step=per, placement=str(engine.placement()),
                       stats={k: v for k, v in after.items() if isinstance(v, (int, float))})
    out["step_s"] = statistics.median(times)
    out["steps_s"] = times
    out["tok_s"] = out["tokens"] / out["step_s"]
    out["rss"] = rss()
    print("BENCH_ROW " + json.dumps(out), flush=True)


def bench(args):
    rows = []
    for name in args.rows:
        cmd = [sys.executable, os.path.abspath(__file__), "row", "--row", name, "--device", args.device,
               "--model", args.model, "--swap-dir", args.swap_dir, "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout)
            line = [l for l in p.stdout.splitlines() if l.startswith("BENCH_ROW ")]
            if line:
                rows.append(json.loads(line[-1][len("BENCH_ROW "):]))
            else:
                rows.append(dict(row=name, error=(p.stderr or p.stdout)[-800:]))
        except subprocess.TimeoutExpired:
            rows.append(dict(row=name, error=f"timed out after {args.row_timeout} s"))
        rows[-1]["wall_s"] = time.perf_counter() - t
        print(json.dumps(rows[-1])[:3000], flush=True)
    base = next((r for r in rows if r["row"] == "plain" and "step_s" in r), None)
    print(f"\n{args.model} bf16, AdamW, clip 1.0, {args.steps} timed steps after {args.warmup}; "
          f"device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}")
    print(f"{'row':16} {'step s':>7} {'x plain':>7} {'tok/s':>8} {'dev peak GiB':>12} {'budget GiB':>10} "
          f"{'RSS GiB':>7} {'H2D GB/step':>11} {'D2H GB/step':>11} {'NVMe rd GB':>10} {'NVMe wr GB':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['row']:16} ERROR {r['error'][-300:]!r}")
            continue
        per = r.get("per_step", {})
        ratio = r["step_s"] / base["step_s"] if base else float("nan")
        budget = r.get("budget")
        print(f"{r['row']:16} {r['step_s']:7.3f} {ratio:7.2f} {r['tok_s']:8.0f} {r['device_peak'] / GiB:12.2f} "
              f"{(budget / GiB if budget else float('nan')):10.2f} {r['rss'] / GiB:7.2f} "
              f"{(per.get('bytes_host_to_device', 0) + per.get('bytes_nvme_to_device', 0)) / 1e9:11.2f} {per.get('bytes_device_to_host', 0) / 1e9:11.2f} "
              f"{per.get('bytes_read_nvme', 0) / 1e9:10.2f} {per.get('bytes_written_nvme', 0) / 1e9:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("parity", "bench", "row"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--swap-dir", required=True)
    p.add_argument("--json", default=None)
    p.add_argument("--model", choices=tuple(BENCH_MODELS), default="gpt166m")
    p.add_argument("--models", nargs="+", choices=tuple(PARITY_MODELS), default=["gpt", "llama"],
                   help="parity's models")
    p.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                   help="parity's compute dtypes")
    p.add_argument("--rows", nargs="+", choices=tuple(ROWS), default=list(ROWS))
    p.add_argument("--row", choices=tuple(ROWS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--row-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.what == "parity":
        return parity(args)
    if args.what == "bench":
        return bench(args)
    bench_row(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

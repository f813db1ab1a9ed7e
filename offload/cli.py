"""The ``offload`` command: demo | profile | plan | doctor | export.

Each subcommand lives in its own module (offload/demo.py, profile.py, plan.py, doctor.py);
this file only parses arguments and maps errors to exit codes: 0 success, 1 a failed check
or a run error (one line, naming what is wrong), 2 bad flags (argparse), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from offload.config import parse_size


def _size(text: str) -> int:
    try:
        value = parse_size(text, "size")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 2GiB, 512MB or 1048576, got {text!r}") from None
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _param_count(text: str) -> int:
    """1.3e9, 1300000000, 1.3B, 350M, 7b."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    t = text.strip().lower().replace("_", "").replace(",", "")
    factor = 1.0
    if t and t[-1] in scale:
        factor, t = scale[t[-1]], t[:-1]
    try:
        value = int(float(t) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 1.3e9 or 350M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive parameter count, got {text!r}")
    return value


def _version() -> str:
    """offload's version, with torch's (the build decides which kernels and devices exist)."""
    import torch

    from offload import __version__
    return f"offload {__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload", description="Train PyTorch models whose state does not fit on the device.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="train a small GPT with its state in swap files",
                          description="Train a byte-level GPT on the Python standard library's source "
                          "with a device budget smaller than the model; params, master weights and "
                          "Adam moments live in swap files. Ctrl-C stops cleanly.")
    from offload.demo import DemoSettings as D  # defaults live in one place

    demo.add_argument("--steps", type=_positive_int, default=D.steps, help=f"optimizer steps (default {D.steps})")
    demo.add_argument("--d-model", type=_positive_int, default=D.d_model, help=f"model width (default {D.d_model})")
    demo.add_argument("--layers", type=_positive_int, default=D.num_layers,
                      help=f"transformer blocks (default {D.num_layers})")
    demo.add_argument("--heads", type=_positive_int, default=D.num_heads, help=f"attention heads (default {D.num_heads})")
    demo.add_argument("--seq-len", type=_positive_int, default=D.seq_len,
                      help=f"tokens (bytes) per sequence (default {D.seq_len})")
    demo.add_argument("--batch-size", type=_positive_int, default=D.batch_size,
                      help=f"sequences per step (default {D.batch_size})")
    demo.add_argument("--lr", type=float, default=D.lr, help=f"peak learning rate (default {D.lr:g})")
    demo.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="compute dtype (default fp32)")
    demo.add_argument("--data-bytes", type=_size, default="4MiB", help="bytes of stdlib source to train on (default 4MiB)")
    demo.add_argument("--device-budget", type=_size, default=None,
                      help="device budget (default: the smallest the engine accepts + two blocks)")
    demo.add_argument("--swap-dir", default=None, help="directory for swap files (default: a temporary one)")
    demo.add_argument("--trace", metavar="PATH", default=None, help="write a Chrome/Perfetto timeline here")
    demo.add_argument("--seed", type=int, default=0)

    prof = sub.add_parser("profile", help="measure tier bandwidths and CPU Adam on this machine",
                          description="Measure host memcpy, host<->device copies (CUDA), NVMe "
                          "sequential read/write over backend x block size x queue depth, and CPU Adam; "
                          "print a table and the recommended I/O settings.")
    prof.add_argument("--swap-dir", required=True, help="directory on the drive to measure")
    prof.add_argument("--json", metavar="PATH", default=None, help="write the profile (for `offload plan --profile`)")
    prof.add_argument("--plot", metavar="PATH.png", default=None, help="bar charts (needs matplotlib)")
    prof.add_argument("--quick", action="store_true", help="small sizes and few settings (under a minute)")

    plan = sub.add_parser("plan", help="where each state goes, whether it fits, predicted step time",
                          description="For a model size and machine budgets, print the bytes of each "
                          "training state, its tier under each (param_tier, optimizer_tier), whether it "
                          "fits, and a predicted step time from a profile.")
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_param_count, help="parameter count, e.g. 1.3e9 or 350M")
    what.add_argument("--model", metavar="MODULE:FACTORY", help="factory building the model (run on the meta device)")
    plan.add_argument("--num-units", type=_positive_int, default=24,
                      help="with --params: units the model is cut into (default 24)")
    plan.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="compute dtype (default bf16)")
    plan.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="the compute device the run will use (default auto: what wrap resolves device='auto' "
                           "to here, CUDA where torch sees a GPU); cuda plans a GPU run on any machine: pinned "
                           "fetch staging buffers for reads from NVMe and fp32 gradients on the host")
    plan.add_argument("--device-budget", type=_size, default=None,
                      help="default: the GPU's memory where --device is cuda and this machine has one, else no limit")
    plan.add_argument("--host-budget", type=_size, default=None,
                      help="default: 3/4 of the memory available now (wrap's default)")
    plan.add_argument("--nvme-budget", type=_size, default=None, help="default: free space of --swap-dir, else no limit")
    plan.add_argument("--swap-dir", default=None, help="directory whose free space bounds the nvme tier")
    plan.add_argument("--profile", metavar="PATH", default=None,
                      help="profile JSON from `offload profile --json` (default: documented round numbers)")
    plan.add_argument("--json", metavar="PATH", default=None, help="also write the plan as JSON")
    plan.add_argument("--optimizer-state-tensors", type=int, choices=(0, 1, 2), default=None,
                      help="fp32 optimizer state tensors per parameter: 2 Adam/AdamW/NAdam (default), "
                           "1 SGD with momentum/Adagrad, 0 plain SGD")
    plan.add_argument("--optimizer-states", choices=("exact", "compact"), default="exact",
                      help="the run's optimizer_states: exact (default) fp32 master and moments; compact an "
                           "int8 master low part and 8-bit moments beside the bf16 compute copy (bf16, Adam)")
    plan.add_argument("--optimizer", default=None, metavar="NAME",
                      help="plan for this optimizer, built over the model and probed as wrap probes it "
                           "(its state tensors, and whether it steps whole parameters): adamw, sgd, "
                           "sgd-momentum, adagrad, rmsprop, adafactor (transformers'), muon (Muon for the "
                           "blocks' matrices, AdamW for the rest); see offload/plan_optimizers.py")
    plan.add_argument("--ranks", type=_positive_int, default=None,
                      help="also plan each of N ZeRO ranks (torchrun's world size) and the node's sum")
    plan.add_argument("--stage", type=int, default=3, help="with --ranks: the ZeRO stage (default 3)")
    plan.add_argument("--shard-group-size", type=_positive_int, default=None,
                      help="with --ranks: ranks per sharding group (default: the ranks of a node)")
    plan.add_argument("--ranks-per-node", type=_positive_int, default=None,
                      help="with --ranks: torchrun's --nproc-per-node (default: every rank on one node)")
    plan.add_argument("--pipeline-depth", type=_positive_int, default=3, help="optimizer_pipeline_depth (default 3)")
    plan.add_argument("--flops-per-second", type=float, default=None, help="model compute as 6 x params x tokens / this")
    plan.add_argument("--tokens-per-step", type=_positive_int, default=2048, help="with --flops-per-second (default 2048)")
    plan.add_argument("--compute-seconds", type=float, default=None,
                      help="a step's time with every state in RAM, for the auto placement's predicted step "
                           "(with --delayed-update: a delayed run's)")
    plan.add_argument("--max-grad-norm", type=float, default=None,
                      help="the run's max_grad_norm (auto placement counts the spare homes of speculative updates)")
    plan.add_argument("--delayed-update", action="store_true",
                      help="the run's delayed_update=True: auto placement and --ranks' rows count its spare "
                           "homes, and the predicted step hides its update I/O under compute")

    plan.add_argument("--seq-len", type=_positive_int, default=None,
                      help="with --model: also predict the activations of one forward of --batch sequences of "
                           "this many tokens, per unit, and where --activation-offload puts them (the model is "
                           "built and run without memory, under torch's FakeTensorMode; a Hugging Face model is "
                           "called with input_ids= and labels=, another with (tokens, targets) when its forward "
                           "takes two arguments, else (tokens))")
    plan.add_argument("--batch", type=_positive_int, default=1, help="with --seq-len: sequences per batch (default 1)")
    plan.add_argument("--activation-offload", choices=("host", "nvme", "auto"), default="auto",
                      help="with --seq-len: the run's activation_offload (default auto)")
    plan.add_argument("--activation-host-bytes", type=_size, default=None,
                      help="with --seq-len: the run's activation_host_bytes, the host_budget kept for activations "
                           "(default: what the predicted forward needs, as far as host_budget holds it; the "
                           "auto placement above is then made beside it)")
    plan.add_argument("--param-tier", choices=("auto", "device", "host", "nvme"), default="auto",
                      help="with --seq-len: the run's param_tier, which sets the compute copies that 'auto' "
                           "keeps room for (default auto)")

    doctor = sub.add_parser("doctor", help="check the native build, I/O backends, O_DIRECT, limits, CUDA",
                            description="Exit code 1 when something required is missing, with the fix.")
    doctor.add_argument("--swap-dir", default=None, help="directory to check (default: the temp directory)")

    export = sub.add_parser("export", help="export a checkpoint's weights (a state-dict file or a model directory)",
                            description="Write the full-precision weights of checkpoint CKPT to OUT: a torch.save "
                                        "file, one .safetensors file (OUT ending in .safetensors), or with "
                                        "--format safetensors and any other OUT a Hugging Face model directory "
                                        "(model.safetensors, or shards and model.safetensors.index.json) that "
                                        "from_pretrained loads once the model's config.json is beside it.")
    export.add_argument("ckpt", metavar="CKPT")
    export.add_argument("out", metavar="OUT")
    export.add_argument("--format", choices=["torch", "safetensors"], default=None,
                        help="default: safetensors when OUT ends in .safetensors, else torch")
    export.add_argument("--max-shard-size", default="5GB", help="largest shard of a model directory (default 5GB)")
    return parser


def _error(message: str) -> int:
    print(f"offload: error: {message}", file=sys.stderr)
    return 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from offload.demo import DemoSettings, run_demo

    if args.d_model % args.heads:
        return _error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    settings = DemoSettings(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                            seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                            lr=args.lr, dtype=args.dtype, data_bytes=args.data_bytes,
                            device_budget=args.device_budget, swap_dir=args.swap_dir,
                            trace=args.trace, seed=args.seed)
    return run_demo(settings)


def _cmd_profile(args: argparse.Namespace) -> int:
    from offload import profile as prof

    if not os.path.isdir(args.swap_dir):
        return _error(f"--swap-dir {args.swap_dir!r} is not a directory")
    print(f"offload profile{' --quick' if args.quick else ''}: measuring this machine", flush=True)
    profile = prof.Profiler(args.swap_dir, args.quick).run()
    print()
    print(prof.summary_table(profile))
    if args.json:
        prof.write_json(profile, args.json)
        print(f"profile written to {args.json} (load it with `offload plan --profile {args.json}`)")
    if args.plot:
        try:
            prof.plot(profile, args.plot)
            print(f"plot written to {args.plot}")
        except ImportError:
            return _error("--plot needs matplotlib, which is not installed: "
                          "python3 -m pip install matplotlib (the measurements above are complete)")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from offload import plan

    profile = plan.load_profile(args.profile)
    if args.seq_len is not None and args.model is None:
        return _error("--seq-len: needs --model (the activations come from a forward of the model)")
    if args.optimizer is not None and args.optimizer_state_tensors is not None:
        return _error("--optimizer and --optimizer-state-tensors both say what the optimizer keeps: give one")
    if args.params is not None:
        shape = plan.shape_from_count(args.params, args.num_units, args.optimizer)
    else:
        sys.path.insert(0, os.getcwd())  # factories in the user's current project
        shape = plan.shape_from_model(args.model, optimizer=args.optimizer)
    # fp32 state tensors per element: the optimizer's, as wrap learns them, or as given
    state_slots = shape.optimizer.state_slots if shape.optimizer is not None else \
        2 if args.optimizer_state_tensors is None else args.optimizer_state_tensors
    try:
        device = plan.plan_device(args.device)
    except ValueError as e:
        return _error(str(e))
    device_budget = args.device_budget
    if device_budget is None and device.type == "cuda":
        import torch
        if torch.cuda.is_available():
            device_budget = torch.cuda.get_device_properties(0).total_memory
    # One host budget for the whole report: the table's and the auto placement's
    host_budget, host_budget_default = args.host_budget, False
    ranks = None
    if args.ranks is not None:
        from offload import plan_ranks
        try:
            ranks = plan_ranks.check_ranks(args.ranks, args.stage, args.shard_group_size, args.ranks_per_node)
        except ValueError as e:
            return _error(str(e))
    elif args.shard_group_size is not None or args.ranks_per_node is not None:
        return _error("--shard-group-size and --ranks-per-node plan several ranks: give --ranks too")
    try:
        if args.optimizer_states == "compact" and args.optimizer not in (None, "adamw"):
            raise ValueError(f"--optimizer-states compact: keeps Adam's states only, not --optimizer {args.optimizer}'s "
                             "(use --optimizer-states exact)")
        plan.check_optimizer_states(args.optimizer_states, args.dtype, state_slots,
                                    args.delayed_update, args.stage if args.ranks is not None else 0)
    except ValueError as e:
        return _error(str(e))
    if host_budget is None:
        from offload.memory.layout import available_memory_bytes, default_host_budget, host_budget_share
        host_budget = default_host_budget()  # what wrap takes without one
        if ranks is not None and available_memory_bytes() is not None:  # the node's ranks share it
            host_budget = host_budget_share(available_memory_bytes(), ranks[1])
        host_budget_default = host_budget is not None
    nvme_budget = args.nvme_budget
    if nvme_budget is None and args.swap_dir:
        import shutil
        nvme_budget = shutil.disk_usage(args.swap_dir).free
    text, any_fits = plan.report(shape, args.dtype, profile, device_budget, host_budget, nvme_budget,
                                 args.pipeline_depth, args.flops_per_second, args.tokens_per_step,
                                 host_budget_default=host_budget_default, state_slots=state_slots,
                                 optimizer_states=args.optimizer_states, device=device)
    compute = args.compute_seconds
    if compute is None and args.flops_per_second:
        compute = 6.0 * shape.num_params * args.tokens_per_step / args.flops_per_second
    auto_config = dict(device="cpu", dtype=args.dtype, param_tier="auto", optimizer_tier="auto",
                       host_budget=host_budget, device_budget=device_budget, swap_dir=args.swap_dir or plan.NO_SWAP_DIR,
                       max_grad_norm=args.max_grad_norm, delayed_update=args.delayed_update, machine_profile=args.profile,
                       optimizer_pipeline_depth=max(2, args.pipeline_depth), optimizer_states=args.optimizer_states)
    activations = None
    if args.seq_len is not None:
        # [Note: activation host room] the activations' share of host_budget first (the
        # forward's need, as far as the budget holds it), then every placement beside it
        from offload.plan_activations import activation_host_share, activation_report, plan_activations
        activation_config = dict(auto_config, param_tier=args.param_tier, activation_offload=args.activation_offload)
        share = args.activation_host_bytes
        if share is None:
            share = activation_host_share(args.model, activation_config, args.seq_len, args.batch, device=device)
        auto_config.update(activation_offload=args.activation_offload, activation_host_bytes=share)
        activations = plan_activations(args.model, dict(activation_config, activation_host_bytes=share),
                                       args.seq_len, args.batch, device=device)
    auto = plan.auto_plan(shape, auto_config, profile, compute, state_slots, device)
    text += "\n\n" + "\n".join(plan.auto_report(auto, host_budget_default))
    rank_plan = None
    if ranks is not None:
        rank_plan = plan_ranks.plan_ranks(shape, args.dtype, args.ranks, args.stage, *ranks, args.pipeline_depth,
                                          args.optimizer_states, args.delayed_update, device)
        text += "\n\n" + "\n".join(plan_ranks.ranks_report(rank_plan, args.ranks, args.stage, *ranks,
                                                            host_budget, host_budget_default))
    if activations is not None:
        text += "\n\n" + "\n".join(activation_report(activations))
    print(text)
    if args.json:
        import json
        with open(args.json, "w") as f:
            report = plan.as_json(shape, args.dtype, profile, device_budget, host_budget, nvme_budget,
                                  args.pipeline_depth, args.flops_per_second, args.tokens_per_step, auto,
                                  host_budget_default=host_budget_default,
                                  state_slots=state_slots, optimizer_states=args.optimizer_states, device=device)
            report["activations"] = None if activations is None else activations.as_json()
            if rank_plan is not None:
                report["ranks"] = {"world_size": args.ranks, "stage": args.stage, "shard_group_size": ranks[0],
                                   "ranks_per_node": ranks[1], "configurations": rank_plan}
            json.dump(report, f, indent=2)
        print(f"plan written to {args.json}")
    return 0 if any_fits else 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    from offload.doctor import run_doctor
    return run_doctor(args.swap_dir)


def _cmd_export(args: argparse.Namespace) -> int:
    from offload.checkpoint import export_checkpoint, export_pretrained
    from offload.errors import CheckpointError

    try:
        if args.format == "safetensors" and not args.out.endswith(".safetensors"):
            export_pretrained(args.ckpt, args.out, args.max_shard_size)
        elif args.format == "torch" and args.out.endswith(".safetensors"):
            return _error("--format torch: OUT ends in .safetensors; name it otherwise")
        else:
            export_checkpoint(args.ckpt, args.out)
    except (CheckpointError, ValueError, OSError) as e:
        return _error(str(e))
    print(f"exported {args.ckpt} to {args.out}")
    return 0


_COMMANDS = {"demo": _cmd_demo, "profile": _cmd_profile, "plan": _cmd_plan,
             "doctor": _cmd_doctor, "export": _cmd_export}


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:
        return _error(str(e))


if __name__ == "__main__":
    sys.exit(main())

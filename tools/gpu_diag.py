"""Issue #43: where the first CUDA run crashed (a segfault in the native Adam on the optimizer
worker, every CUDA configuration). One small case per child process, each changing one thing.

    python3 tools/gpu_diag.py            # every case, a line each
    python3 tools/gpu_diag.py CASE       # one case (run by the parent)
"""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ["cpu", "cuda", "cuda-unpinned", "cuda-scalar", "cuda-heap", "cuda-checked", "cuda-fp32-device-host"]


def one(case):
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    import tempfile

    import torch
    import offload
    from offload.gpt import GPT
    from support import CFG, batches, budget_for, make_opt, train_offload

    if case == "cuda-unpinned":
        from offload.tiers.streams import CudaStreams
        CudaStreams.pin = lambda self, t: None
        CudaStreams.unpin = lambda self, t: None
    if case == "cuda-heap":
        import offload.tiers.host as host
        host.mapped_empty = lambda n, dtype: torch.empty(n // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
    if case == "cuda-checked":
        import offload.optim.adam_ranges as ar
        real = ar.adam_step_flat
        maps = []
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                maps.append((lo, hi, line.strip()))

        def checked(*args, **kw):
            names = ("param", "grad", "exp_avg", "exp_avg_sq")
            for name, t in list(zip(names, args)) + [("copy_out", kw.get("copy_out"))]:
                if t is None:
                    continue
                lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
                with open("/proc/self/maps") as f:
                    inside = [l.split()[0] + " " + " ".join(l.split()[1:2] + l.split()[5:]) for l in f
                              if int(l.split()[0].split("-")[0], 16) <= lo and hi <= int(l.split()[0].split("-")[1], 16)]
                print(f"  {name}: {t.dtype} {t.device} n={t.numel()} ptr={lo:#x} contig={t.is_contiguous()} "
                      f"pinned={t.is_pinned()} map={inside[:1]}", flush=True)
                float(t.float().sum())  # touched from Python first
            print("  -> native", flush=True)
            return real(*args, **kw)
        ar.adam_step_flat = checked
    device = "cpu" if case == "cpu" else os.environ.get("DIAG_DEVICE", "cuda")
    param_tier, optimizer_tier = ("device", "host") if case == "cuda-fp32-device-host" else ("host", "host")
    torch.manual_seed(0)
    m = GPT(CFG)
    with tempfile.TemporaryDirectory() as d:
        config = dict(device=device, param_tier=param_tier, optimizer_tier=optimizer_tier, swap_dir=d,
                      device_budget=None if param_tier == "device" else budget_for(m, 0.6))
        with offload.wrap(m, make_opt(m.parameters()), config=config) as e:
            losses = train_offload(e, [b.to(device) for b in batches(2)])
    print("OK", case, losses, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
        sys.exit(0)
    sys.path.insert(0, REPO)
    import offload._info
    print(offload._info.native_info(), flush=True)
    for case in CASES:
        env = dict(os.environ, **({"OFFLOAD_FORCE_ISA": "scalar"} if case == "cuda-scalar" else {}))
        p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, case], capture_output=True, text=True,
                           timeout=60, env=env)
        tail = (p.stdout + p.stderr).strip().splitlines()
        print(f"== {case}: rc={p.returncode}", flush=True)
        print("\n".join(tail[-40:] if case == "cuda-checked" else tail[-8:]), flush=True)

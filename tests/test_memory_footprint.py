"""A model whose fp32 state is 4 GiB trains with both tiers on NVMe while the process's
peak RSS stays under 40% of that state (issue 4)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import json, resource, sys
    import torch
    from torch import nn
    import offload

    class Wide(nn.Module):
        def __init__(self, width, num_blocks):
            super().__init__()
            self.inp = nn.Linear(64, width)          # so the first block's input needs grad
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(num_blocks))
            self.out = nn.Linear(width, 1)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = h + torch.tanh(block(h))
            return self.out(h).pow(2).mean()

    width, num_blocks, swap_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch's own, before any model
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Wide(width, num_blocks)   # never materialized whole
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    unit_bytes = (width * width + width) * 4
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=swap_dir,
                  device_budget=4 * unit_bytes)
    losses = []
    with offload.wrap(model, opt, config=config) as engine:
        for step in range(2):
            x = torch.randn(2, 64)
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        stats = engine.stats()
    print(json.dumps({"num_params": num_params, "losses": losses,
                      "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "import_rss_bytes": import_rss,
                      "nvme_read": stats["bytes_read_nvme"], "host_peak": stats["host_peak_bytes"]}))
''')


@pytest.mark.slow  # writes and reads ~20 GB of swap: a minute or more on this machine
def test_4gib_state_trains_on_nvme_with_peak_rss_under_40_percent(tmp_path):
    width, num_blocks = 4096, 16                  # 16 x 16.8M + small = 268.7M parameters
    swap_dir = tmp_path / "swap"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(width), str(num_blocks), str(swap_dir)],
                            capture_output=True, text=True, timeout=1200,
                            env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    state_bytes = report["num_params"] * 16       # params + fp32 master + two moments
    assert state_bytes >= 4 * 2**30
    assert all(l == l for l in report["losses"])
    assert report["nvme_read"] > state_bytes // 2, "the states must really have come from swap"
    assert report["max_rss_bytes"] < 0.4 * state_bytes, (
        f"peak RSS {report['max_rss_bytes'] / 2**30:.2f} GiB is not under 40% of the "
        f"{state_bytes / 2**30:.2f} GiB state ({report['import_rss_bytes'] / 2**30:.2f} GiB of it torch's own "
        "before any model: on the H200's torch with CUDA the test failed at 1.79 GiB)")
    assert not os.listdir(swap_dir)


def _mapping_of(address):
    """(start, end, path) of the mapping of this process that contains ``address``, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return start, end, fields[5] if len(fields) > 5 else ""
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_host_buffers_are_mappings_of_their_own_given_back_when_dropped():
    # [Note: host buffers outside the heap] A 12 MiB staging buffer from malloc would land in
    # its heap once malloc's mmap threshold has grown (it does as activations are freed).
    import torch
    from offload.io import HUGE_PAGE_BYTES
    from offload.tiers import HostTier

    if torch.cuda.is_available():
        pytest.skip("with CUDA host buffers are pinned by the CUDA host allocator")
    host = HostTier(budget_bytes=None)
    num_bytes = 12 << 20
    buf = host.allocate(num_bytes // 4, torch.float32)
    address = buf.data_ptr()
    assert address % HUGE_PAGE_BYTES == 0  # [Note: huge-page buffers]: swap I/O at full speed
    start, end, path = _mapping_of(address)
    assert path != "[heap]" and end - address >= num_bytes  # (the kernel may merge neighbours)
    assert host.used_bytes == host.peak_bytes == num_bytes
    host.release(buf)
    del buf
    assert host.used_bytes == 0 and host.peak_bytes == num_bytes
    assert _mapping_of(address) is None, "the pages must go back to the kernel"


WRAP_SCRIPT = textwrap.dedent('''
    import json, resource, sys
    import torch
    from torch import nn
    import offload

    class TwoBig(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(2))
            self.scale = nn.Parameter(torch.ones(width))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return (x * self.scale).sum()

    width, swap_dir, dtype = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with torch.device("meta"):
        model = TwoBig(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    unit_bytes = width * width * 4
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=swap_dir, dtype=dtype,
                  device_budget=2 * unit_bytes + 8 * width)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    def init_fn(module):  # scale's value; the Linears have reset_parameters
        if isinstance(module, TwoBig):
            module.scale.fill_(1.0)

    with offload.wrap(model, opt, config=config, init_fn=init_fn) as engine:
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        host = engine.stats()["host_bytes"]
    print(json.dumps({"unit_bytes": unit_bytes, "wrap_peak_bytes": after - before, "host_bytes": host}))
''')


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_wrap_of_a_meta_model_holds_one_unit_twice_at_most(dtype, tmp_path):
    # Materializing a unit takes its parameters' storage (one fp32 unit); writing it home
    # takes buffers for its compute copy and, in bf16, its fp32 master (page aligned: no
    # bounce copy), and nothing for the zero moments (written from a small zero buffer). On
    # a CPU device those buffers are carved from the device arena, RAM that wrap has touched
    # already and no unit uses yet ([Note: wrap scratch in the arena]): the arena (the
    # budget less the largest gradient's room: one fp32 unit here) and the host tier come on
    # top of the parameters alone. In bf16 the master's low halves are split from each
    # parameter in turn, with no fp32 master buffer ([Note: split master]). Measured: fp32
    # 2.07 units, bf16 2.57 (one of its two buffers did not fit the arena beside the other);
    # 3.07 and 5.07 with the buffers on the heap and a whole fp32 master in bf16 (fp32: 8.0
    # before that).
    width = 8192                                   # two 268 MB units
    result = subprocess.run([sys.executable, "-c", WRAP_SCRIPT, str(width), str(tmp_path), dtype],
                            capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    unit = report["unit_bytes"]
    expected = unit + unit + report["host_bytes"]  # the parameters, the arena, the host tier
    assert report["wrap_peak_bytes"] < expected + unit // 2, (
        f"wrap peaked {report['wrap_peak_bytes'] / 2**20:.0f} MiB over its start, expected "
        f"about {expected / 2**20:.0f} MiB")


def test_views_of_a_huge_page_cpu_arena_map_back_to_their_arena_offsets():
    # The 2 MiB-aligned arena starts inside its mapping, so a view's storage offset is not
    # its arena offset; saved parameters are recorded and rebuilt by arena offsets.
    import torch
    from offload.tiers import DeviceTier

    arena = DeviceTier(torch.device("cpu"), torch.float32, capacity_numel=3 << 20, budget_bytes=12 << 20)
    slot = 1 << 20
    weight = arena.view(slot, 4096).view(64, 64)
    saved = weight.t()  # as autograd saves it for a Linear's backward
    offset = arena.offset_of(saved)
    assert offset == slot
    rebuilt = arena.strided_view(saved.size(), saved.stride(), offset)
    assert rebuilt.data_ptr() == saved.data_ptr() and torch.equal(rebuilt, saved)
    assert arena.offset_of(torch.zeros(4)) is None

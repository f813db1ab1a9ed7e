"""Observability: the engine's phases are labelled for torch.profiler."""
import torch

import offload
from offload.gpt import GPT, GPTConfig


def test_profiler_trace_shows_fetch_release_adam_and_swap_io_per_unit(tmp_path):
    """A user's torch.profiler trace names the engine's work as offload::PHASE::UNIT. With
    clipping, no speculative updates and no overlap with the next forward, the updates run
    on the main thread, where the profiler records them (updates on the optimizer worker
    show in export_trace's timeline instead)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path), device_budget=90000,
                  max_grad_norm=1.0, speculative_updates=False, overlap_step_with_forward=False)
    data = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with offload.wrap(model, opt, config=config) as engine:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                engine.backward(engine(data[:, :-1], data[:, 1:]))
                engine.step()
            engine.zero_grad()
        names = {event.name for event in prof.events()}
    for phase in ("fetch", "release", "adam", "swap_read", "swap_write"):
        for unit in ("blocks.0", "blocks.1"):
            assert f"offload::{phase}::{unit}" in names, (phase, unit, sorted(n for n in names if "offload" in n))

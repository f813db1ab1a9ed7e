"""[Note: gradient buckets in the device budget] Issue 38: at stage >= 2 the fp32 gradient
buckets of the reduce-scatters and their output count in device_budget. wrap keeps room for
two buckets (the root unit's and the largest other unit's) and one output (the largest
unit's shard) beside the arena; the device tier counts them; a backward that needs more at
once stops naming device_budget instead of passing it. 2 gloo ranks, the small GPT."""
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import offload
from offload.gpt import GPT
from offload.tiers.streams import COPY_DELAY_ENV, STANDIN_ENV

from support import CFG, batches, free_port, make_opt

WORLD = 2
STEPS = 2


def gpt(unused_in_block=False):
    torch.manual_seed(0)
    model = GPT(CFG)
    if unused_in_block:  # trainable, never used: blocks.1's bucket stays open to the end of backward
        model.blocks[1].unused = nn.Parameter(torch.zeros(8))
    return model


def bucket_numel(trainable_numel):
    """A unit's bucket by hand: its trainable prefix cut into WORLD shards of equal length."""
    return -(-trainable_numel // WORLD) * WORLD


def trainable_numels(unused_in_block=False):
    """(the root unit's, a block's, the largest block's) trainable elements."""
    model = gpt(unused_in_block)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    largest = sum(p.numel() for p in model.blocks[1].parameters())
    root = sum(p.numel() for p in model.parameters()) - (CFG.num_layers - 1) * block - largest  # the head is tied
    return root, block, largest


def buckets_by_hand(unused_in_block=False):
    """The root unit's bucket and the largest block's, fp32."""
    root, _, largest = trainable_numels(unused_in_block)
    return 4 * (bucket_numel(root) + bucket_numel(largest))


def output_by_hand(unused_in_block=False):
    """The reduce-scatter's output: the largest unit's shard (its bucket over WORLD), fp32."""
    root, _, largest = trainable_numels(unused_in_block)
    return 4 * max(bucket_numel(root), bucket_numel(largest)) // WORLD


def room_by_hand(unused_in_block=False):
    """The room device_budget keeps for the buckets and the output."""
    return buckets_by_hand(unused_in_block) + output_by_hand(unused_in_block)


def minimum_budget(config, model):
    """The smallest device_budget wrap accepts, read from its refusal of 4 KiB."""
    with pytest.raises(ValueError) as refused:
        offload.wrap(model, make_opt(model.parameters()), config=dict(config, device_budget=4096))
    return int(re.search(r"at least (\d+) bytes", str(refused.value)).group(1)), str(refused.value)


def train(config, data, rank, unused_in_block=False):
    model = gpt(unused_in_block)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for b in data:
            mine = b[rank:rank + 1]
            engine.backward(engine(mine[:, :-1], mine[:, 1:]))
            engine.step()
        return engine.stats()


def _worker(rank, port, swap_root, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        data = batches(STEPS, batch=WORLD)
        result = {}
        for name, config in (("stage1", dict(stage=1, dtype="fp32", param_tier="host", optimizer_tier="host")),
                             ("stage2", dict(stage=2, dtype="fp32", param_tier="host", optimizer_tier="host")),
                             ("stage3", dict(stage=3, dtype="bf16", param_tier="nvme", optimizer_tier="nvme"))):
            swap = os.path.join(swap_root, f"{name}-rank{rank}")
            os.makedirs(swap)
            config = dict(config, device="cpu", swap_dir=swap, prefetch=False)
            minimum, refusal = minimum_budget(config, gpt())
            stats = train(dict(config, device_budget=minimum), data, rank)
            result[name] = {"minimum": minimum, "refusal": refusal, "stats": stats}
            if name == "stage2":
                minimum, _ = minimum_budget(config, gpt(unused_in_block=True))
                try:  # three buckets at once: the root's, blocks.1's (never complete) and the block in backward
                    train(dict(config, device_budget=minimum), data, rank, unused_in_block=True)
                    result["too_many"] = None
                except ValueError as e:
                    result["too_many"] = str(e)
                # one block's bucket more of device_budget: the third bucket takes it from the arena
                _, block, _ = trainable_numels(unused_in_block=True)
                result["roomier"] = train(dict(config, device_budget=minimum + 4 * bucket_numel(block)), data, rank,
                                          unused_in_block=True)
                result["unbounded"] = train(config, data, rank, unused_in_block=True)  # no device_budget
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("buckets")
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), str(out / "swap"), str(out)), nprocs=WORLD, join=True,
                       start_method="forkserver")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_device_budget_keeps_room_for_two_gradient_buckets_and_their_output_and_they_stay_in_it(results):
    """At stage 2 the smallest device_budget is stage 1's plus exactly the room of two
    buckets (the root unit's and a block's) and the reduce-scatter's output (the largest
    unit's shard), fp32, worked out from element counts, and the refusal names them; trained
    at that budget (stages 2 and 3) the buckets peak at exactly their part of that room, the
    output takes the rest, and the device tier, which counts them, stays within device_budget."""
    room = room_by_hand()
    for rank, res in enumerate(results):
        assert res["stage2"]["minimum"] - res["stage1"]["minimum"] == room, rank
        assert "gradient buckets" in res["stage2"]["refusal"] and "gradient buckets" not in res["stage1"]["refusal"]
        assert "their output" in res["stage2"]["refusal"]
        assert res["stage1"]["stats"]["gradient_bucket_peak_bytes"] == 0
        assert res["stage1"]["stats"]["reduce_scatter_output_bytes"] == 0
        for stage in ("stage2", "stage3"):
            stats = res[stage]["stats"]
            assert stats["gradient_bucket_peak_bytes"] == buckets_by_hand(), (rank, stage)
            assert stats["reduce_scatter_output_bytes"] == output_by_hand(), (rank, stage)
            assert stats["device_budget_bytes"] == res[stage]["minimum"]
            assert room <= stats["device_peak_bytes"] <= stats["device_budget_bytes"], (rank, stage)


def test_a_backward_that_needs_more_buckets_than_their_room_takes_arena_or_stops_naming_device_budget(results):
    """A block parameter that gets no gradient keeps that block's bucket open until the
    end of backward, so three buckets are needed at once: at the smallest budget (no arena
    to spare) each rank stops naming device_budget, the units and the bytes to add (a
    block's bucket), not past the budget; with that many bytes more of device_budget the
    third bucket holds arena capacity and the run trains within the budget; without a
    device_budget it trains, its buckets bound by nothing (they peak at the three)."""
    room = room_by_hand(unused_in_block=True)
    _, block, _ = trainable_numels(unused_in_block=True)
    for rank, res in enumerate(results):
        message = res["too_many"]
        assert message is not None and message.startswith("device_budget:"), rank
        assert "('<root>', 'blocks.1':" in message and "unit 'blocks.0'" in message, message
        assert f"more than the {room} bytes" in message, message
        assert f"{4 * bucket_numel(block)} bytes short: raise device_budget" in message, message
        roomier = res["roomier"]
        buckets = buckets_by_hand(unused_in_block=True)
        assert roomier["gradient_bucket_peak_bytes"] == buckets + 4 * bucket_numel(block)
        assert roomier["device_peak_bytes"] <= roomier["device_budget_bytes"]
        assert res["unbounded"]["gradient_bucket_peak_bytes"] == buckets + 4 * bucket_numel(block)


def train_values(config, data, rank):
    """(losses, state_dict, stats) of ``config`` trained on this rank's rows of ``data``."""
    model = gpt()
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        losses = []
        for b in data:
            mine = b[rank:rank + 1]
            loss = engine(mine[:, :-1], mine[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, engine.state_dict(), engine.stats()


def _standin_worker(rank, port, out_dir):
    """Stages 2 and 3 at the smallest device_budget on the CPU device as users run it, and on
    its CUDA stand-in with every copy held back (the shard's copy out runs behind the next
    reduce-scatter's turn)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        data = batches(STEPS, batch=WORLD)
        result = {}
        for stage in (2, 3):
            config = dict(stage=stage, dtype="fp32", param_tier="host", optimizer_tier="host", device="cpu",
                          prefetch=False)
            for device in ("host", "standin"):  # whatever this test runs under (tests/test_device_standin.py)
                os.environ.pop(STANDIN_ENV, None)
                os.environ.pop(COPY_DELAY_ENV, None)
                if device == "standin":
                    os.environ.update({STANDIN_ENV: "cuda", COPY_DELAY_ENV: "0.02"})
                minimum, _ = minimum_budget(config, gpt())
                result[(stage, device)] = train_values(dict(config, device_budget=minimum), data, rank)
        torch.save(result, os.path.join(out_dir, f"standin-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_reduce_scatter_output_is_one_counted_buffer_written_after_its_copy_out(tmp_path):
    """[Note: gradient buckets in the device budget] Where the shard's copy to the host runs
    behind (the CUDA stand-in, each copy held back), the reduce-scatters still write into
    one output, the largest unit's shard, counted in the device tier: each waits for the copy
    out of the shard before (the stand-in's hazard checker raises on a write that does not,
    and a shard overwritten before its copy ran would change the numbers). The runs equal
    those on the CPU device bit for bit, move the same gradient bytes off the device, and
    stay within device_budget."""
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_standin_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="forkserver")
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"standin-rank{rank}.pt", weights_only=False)
        for stage in (2, 3):
            (host_losses, host_state, host), (losses, state, stats) = result[(stage, "host")], result[(stage, "standin")]
            assert losses == host_losses, (rank, stage)
            assert all(torch.equal(state[k], v) for k, v in host_state.items()), (rank, stage)
            for s in (host, stats):
                assert s["reduce_scatter_output_bytes"] == output_by_hand(), (rank, stage)
                assert s["gradient_bucket_peak_bytes"] == buckets_by_hand(), (rank, stage)
                assert s["device_peak_bytes"] <= s["device_budget_bytes"], (rank, stage)
            assert stats["bytes_device_to_host"] == host["bytes_device_to_host"], (rank, stage)

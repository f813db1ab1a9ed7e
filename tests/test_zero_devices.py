"""[Note: one GPU per rank] (offload/zero/partition.py): two ranks on one CUDA device are
refused at wrap, on every rank alike, naming the ranks and the device, before any NCCL group
is made; on the H200 (one GPU) every multi-rank test whose processes saw it had failed deep
inside NCCL ("Duplicate GPU detected"). The check runs here on 2 gloo ranks: the function
itself, and Partition.from_environment with a CUDA device, whose NCCL groups are recorded
(and made with gloo: this build may have no NCCL) to show which come first."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offload.zero import partition
from offload.zero.partition import Partition, check_one_device_per_rank

from support import free_port

WORLD = 2


def _refusal(call):
    """The ValueError ``call()`` raises, as text (None: it returned)."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    made = []  # the backends of the groups from_environment asks for, in order
    new_group = dist.new_group

    def recording_new_group(*args, backend=None, **kwargs):
        made.append(backend)
        return new_group(*args, backend="gloo", **kwargs)  # gloo stands in for NCCL

    partition.dist.new_group = recording_new_group
    try:
        group = new_group(backend="gloo")
        cuda = lambda index: torch.device("cuda", index)  # noqa: E731 (no GPU needed to name one)
        out = {
            "own GPUs": _refusal(lambda: check_one_device_per_rank(group, rank, WORLD, cuda(rank))),
            "two hosts": _refusal(lambda: check_one_device_per_rank(group, rank, WORLD, cuda(0), host=f"node{rank}")),
            "one GPU": _refusal(lambda: check_one_device_per_rank(group, rank, WORLD, cuda(0), environ={})),
            # a launcher that gives each rank its own GPU through CUDA_VISIBLE_DEVICES: cuda:0 each
            "own visible GPUs": _refusal(lambda: check_one_device_per_rank(
                group, rank, WORLD, cuda(0), environ={"CUDA_VISIBLE_DEVICES": f"{rank + 2},7"})),
            "one visible GPU": _refusal(lambda: check_one_device_per_rank(
                group, rank, WORLD, cuda(rank), environ={"CUDA_VISIBLE_DEVICES": "3,3"})),
            "wrap, one GPU": _refusal(lambda: Partition.from_environment(2, 30.0, None, cuda(0))),
            "groups before the refusal": list(made),
        }
        made.clear()
        out["wrap, own GPUs"] = _refusal(lambda: Partition.from_environment(2, 30.0, None, cuda(rank)))
        out["groups"] = list(made)
        made.clear()
        out["wrap, CPU"] = _refusal(lambda: Partition.from_environment(2, 30.0, None, torch.device("cpu")))
        out["groups on the CPU"] = list(made)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        partition.dist.new_group = new_group
        dist.destroy_process_group()


def test_two_ranks_on_one_gpu_are_refused_before_nccl_naming_ranks_and_device(tmp_path):
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for rank, out in enumerate(results):
        assert out["own GPUs"] is None and out["two hosts"] is None and out["own visible GPUs"] is None, out
        for refused in (out["one GPU"], out["wrap, one GPU"]):
            assert refused is not None, out
            assert refused.startswith("device: ranks 0 and 1 would both compute on cuda:0 "), out
            assert f"this is rank {rank}" in refused
            assert "LOCAL_RANK" in refused and "torch.cuda.set_device" in refused and "device='cuda:N'" in refused
        # two indices, one physical GPU: named by both and by what CUDA_VISIBLE_DEVICES says it is
        assert out["one visible GPU"].startswith("device: ranks 0 and 1 would both compute on cuda:0 / cuda:1 (GPU 3)")
        # refused on the first gloo group, before a second group or any NCCL one
        assert out["groups before the refusal"] == ["gloo"], out
        # one GPU each: on to the device groups (NCCL on CUDA), after the check; the third gloo
        # group is close()'s ([Note: closing with several ranks])
        assert out["wrap, own GPUs"] is None and out["groups"] == ["gloo", "gloo", "gloo", "nccl", "nccl"], out
        # a CPU device exchanges nothing and makes no NCCL group
        assert out["wrap, CPU"] is None and out["groups on the CPU"] == ["gloo", "gloo", "gloo"], out

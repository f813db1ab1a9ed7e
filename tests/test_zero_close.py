"""[Note: closing with several ranks] close() with 2 gloo ranks: no rank tears down (stops
its threads, deletes its swap files, returns and ends its process) before every rank has
reached close() and finished what it had in flight; a rank that never gets there is named
by the others' close(), after they have released everything, within
collective_timeout_seconds; and where an exception leaves a rank's ``with`` block, it is
that exception that goes on, not the barrier's."""
import json
import os
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload.gpt import GPT

from support import CFG, free_port, gpt_loss, make_opt, train_offload
from support import batches as _batches

WORLD = 2
GLOBAL_BATCH = 4
# How long the slow rank takes to reach close() after training: far longer than the other
# rank's close() takes with nothing to wait for, so a close() that does not wait for it
# returns while it sleeps.
SLOW_SECONDS = 3.0
# How long rank 0 waits before the collective rank 1 left, so that its timeout (3 s) ends
# after that of rank 1's barrier: rank 1 enters the barrier one forward after rank 0 starts
# waiting, and the test needs that forward to take less than this.
LATE_SECONDS = 3.0
# A guard against a hang of the ranks (not a measure of speed): far above what they take.
HANG_GUARD_SECONDS = 180


def _init(rank, port):
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


def _mine(data, rank):
    per_rank = GLOBAL_BATCH // WORLD
    return [b[rank * per_rank:(rank + 1) * per_rank] for b in data]


def _wrap(config):
    torch.manual_seed(0)
    model = GPT(CFG)
    return offload.wrap(model, make_opt(model.parameters()), config=config)


def run_ranks(worker, *args):
    """``worker(rank, port, *args)`` on WORLD ranks; the test fails (instead of hanging)
    where they are not done within HANG_GUARD_SECONDS."""
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    context = mp.start_processes(worker, args=(free_port(),) + args, nprocs=WORLD, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not end within {HANG_GUARD_SECONDS} s: a close() hangs")


def _result(out_dir, rank):
    with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
        return json.load(f)


def _save(out_dir, rank, result):
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _slow_close_worker(rank, port, config, data, out_dir):
    _init(rank, port)
    try:
        swap = config["swap_dir"]
        engine = _wrap(config)
        train_offload(engine, _mine(data, rank))
        result = {"pending": engine.stats()["delayed_updates"]}
        closing = os.path.join(out_dir, "rank1-closing")
        if rank == 1:
            time.sleep(SLOW_SECONDS)
            # rank 0 is in its close() by now; its swap files are still there
            result["peer_files_before_my_close"] = os.listdir(os.path.join(swap, "rank-0"))
            open(closing, "w").close()
            engine.close()
        else:
            engine.close()
            result["peer_closing_when_i_returned"] = os.path.exists(closing)
        result["my_files_after_close"] = os.listdir(os.path.join(swap, f"rank-{rank}"))
        _save(out_dir, rank, result)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage,tiers,delayed", [
    (1, ("nvme", "nvme"), True),   # the last step's delayed updates (their all-gathers) pending at close
    (3, ("nvme", "host"), False),  # the next forward's fetches (their all-gathers) in flight at close
])
def test_no_rank_tears_down_before_every_rank_has_reached_close(stage, tiers, delayed, tmp_path):
    """Rank 1 reaches close() SLOW_SECONDS after rank 0: rank 0's close() returns only after
    rank 1 has reached its own, its swap files are there until then, and both ranks'
    swap files are gone after close()."""
    config = dict(stage=stage, param_tier=tiers[0], optimizer_tier=tiers[1], swap_dir=str(tmp_path / "swap"),
                  delayed_update=delayed, delayed_update_warmup_steps=1, collective_timeout_seconds=60)
    run_ranks(_slow_close_worker, config, _batches(3, batch=GLOBAL_BATCH), str(tmp_path))
    rank0, rank1 = _result(tmp_path, 0), _result(tmp_path, 1)
    if delayed:
        assert rank0["pending"] > 0 and rank1["pending"] > 0
    assert rank0["peer_closing_when_i_returned"], "rank 0's close() returned before rank 1 reached close()"
    assert rank1["peer_files_before_my_close"], "rank 0 deleted its swap files before rank 1 reached close()"
    assert rank0["my_files_after_close"] == [] and rank1["my_files_after_close"] == []


def _missing_rank_worker(rank, port, how, data, out_dir):
    _init(rank, port)
    config = dict(stage=2, param_tier="nvme", optimizer_tier="nvme", collective_timeout_seconds=2,
                  swap_dir=os.path.join(out_dir, "swap"))
    engine = _wrap(config)
    batch = _mine(data, rank)
    train_offload(engine, batch)
    if rank == 1:
        if how == "exits":
            os._exit(0)  # dies without a word before close()
        time.sleep(8)  # alive, but never reaches close() within rank 0's timeout
        os._exit(0)
    result = {}
    try:
        engine.close()
        result["close"] = "no error"
    except Exception as exc:
        result["close"] = f"{type(exc).__name__}: {exc}"
    result["files_after_close"] = os.listdir(os.path.join(config["swap_dir"], "rank-0"))
    try:
        gpt_loss(engine, batch[0])
        result["after"] = "no error"
    except Exception as exc:
        result["after"] = f"{type(exc).__name__}: {exc}"
    _save(out_dir, rank, result)
    os._exit(0)  # the process group is broken; skip its teardown


@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_a_rank_that_never_reaches_close_is_named_after_everything_is_released(how, tmp_path):
    """Rank 1 exits, or hangs, after training, without close(): rank 0's close() releases
    everything (its swap files are gone, the engine is closed) and then raises naming rank
    1, at once where it exited and after collective_timeout_seconds where it hangs."""
    run_ranks(_missing_rank_worker, how, _batches(2, batch=GLOBAL_BATCH), str(tmp_path))
    result = _result(tmp_path, 0)
    message = result["close"]
    assert message.startswith("RuntimeError") and "close() barrier" in message, message
    assert "rank 1" in message and "never reached" in message, message
    if how == "hangs":
        assert "collective_timeout_seconds=2" in message, message
    assert result["files_after_close"] == []
    assert result["after"].startswith("RuntimeError") and "the engine is closed" in result["after"], result


def _raising_worker(rank, port, data, out_dir):
    _init(rank, port)
    config = dict(stage=2, param_tier="nvme", optimizer_tier="nvme", collective_timeout_seconds=3,
                  swap_dir=os.path.join(out_dir, "swap"))
    batch = _mine(data, rank)
    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _wrap(config) as engine:
                train_offload(engine, batch[:1])
                if rank == 1:
                    gpt_loss(engine, batch[1])
                    raise ValueError("the user's code failed on rank 1")
                # rank 1's barrier times out before this rank's reduce-scatter does, and this
                # rank reaches the barrier after rank 1 has left it: both barriers fail
                time.sleep(LATE_SECONDS)
                train_offload(engine, batch[1:])
            result["error"] = "no error"
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        except BaseException:
            result["error"] = traceback.format_exc()
    result["warnings"] = [str(w.message) for w in caught if "close()" in str(w.message)]
    result["files_after_close"] = os.listdir(os.path.join(config["swap_dir"], f"rank-{rank}"))
    _save(out_dir, rank, result)
    os._exit(0)  # the process group is broken; skip its teardown


def test_an_exception_leaving_a_with_block_goes_on_whatever_the_barrier_says(tmp_path):
    """Rank 1's code raises inside its ``with engine:`` block while rank 0 goes on into a
    backward (LATE_SECONDS later): rank 1's close() waits at the barrier while rank 0 waits
    in the reduce-scatter rank 1 left, until its timeout names rank 1; rank 1's barrier has
    timed out by then, naming rank 0, and rank 0's fails when rank 1 ends. Each rank's own
    exception leaves its with block, the barrier's failure a warning beside it, and both
    ranks' swap files are gone."""
    run_ranks(_raising_worker, _batches(2, batch=GLOBAL_BATCH), str(tmp_path))
    rank0, rank1 = _result(tmp_path, 0), _result(tmp_path, 1)
    assert rank1["error"] == "ValueError: the user's code failed on rank 1", rank1
    message = rank0["error"]
    assert message.startswith("RuntimeError") and "reduce-scatter" in message, message
    assert "rank 1" in message and "never reached" in message, message
    for rank, result in enumerate((rank0, rank1)):
        other = 1 - rank
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "close() barrier" in result["warnings"][0] and f"rank {other}" in result["warnings"][0], result
        assert result["files_after_close"] == []

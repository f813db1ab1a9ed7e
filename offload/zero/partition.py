"""[zero] ZeRO across ranks: this rank's place among them (``Partition``) and the
collectives that keep the ranks in step. What each rank keeps is worked out in
offload.zero.shards; which stages shard what, see the package docstring.

[Note: parameter all-gathers] Stage 3 fetches run on the engine's copy worker thread, so
their all-gathers overlap compute. They use a process group of their own (``param_group``):
collectives on one group must be issued in the same order on every rank, and the main
thread issues the gradient and norm collectives meanwhile. The copy worker runs fetches in
the order the main thread submits them, which is the same on every rank as long as every
rank runs the same forward and backward (and so needs, prefetches and evicts the same units
in the same order: the prefetch plan depends only on the trace and the device budget).
Below stage 3 the copy worker gathers nothing, and the lane ("param") is the optimizer
worker's: the all-gathers of stage 1-2 delayed updates ([Note: delayed updates across
ranks] in offload/optim/delayed.py), which it runs in the same order on every rank.

[Note: gradient averaging] Gradients are averaged over ranks like DDP: each rank scales its
local sum by 1 / world_size before the sum-reduction (exact for a power-of-two world size).
With the loss a mean over equal per-rank batches this equals one process on the whole batch.

[Note: no gradient across ranks] A parameter counts as having a gradient in a step when it
has one on any rank (the flags are all-reduced with MAX once per step); a rank on which it
got none contributes zeros. A parameter without a gradient on every rank is left alone.

[Note: collective order] Collectives must be issued in the same order on every rank. The
per-unit reduce-scatters of stage 2 run in the order units complete in backward, so every
rank must use the same parameters in each backward (the usual data-parallel contract).
Units not complete when backward ends are reduced then, in unit order.

[Note: sharding groups] Ranks form groups of ``shard_size`` consecutive ranks (a node's
ranks, as torchrun numbers them): what a stage shards, it shards inside a group, and the
groups hold replicas. A rank's shard is its place in its group (``shard_rank``); the
groups' copies of one shard are all-reduced across groups (``replica_group``: the ranks
with the same shard_rank) once per optimizer step, in ``finish_gradients``, after the
in-group reduce-scatters of every micro-step. Flags, broadcasts and checks stay on the
whole world; the norm's squares are summed inside a group (every group holds them all).
Only the first group writes a checkpoint's states. With one group (the default on one
node) the groups are the world and nothing else changes.

[Note: collectives on the device] At stage >= 2 a unit's gradients are summed into a
bucket on the compute device as autograd makes them (``gradient_bucket``), reduce-scattered
there inside the group (``device_group``: NCCL on CUDA, gloo on a CPU device) into the
output buffer on the device (``_reduce_output``: one for every unit, written again once the
copy out of the last shard has run), and only that shard leaves the device, into the
unit's host buffer (``GradientShards.land_shard``: queued on the device-to-host stream where
the host does not address the device). So a rank moves 1/shard_size of each gradient
device -> host. At
stage 3 a fetch copies only this rank's chunks of the unit into their place in its device
slot and all-gathers the rest there (``gather_params_on_device``, on the copy worker, over
``device_param_group``). The buckets (fp32, the size of a unit's trainable prefix: one per
unit whose gradients are arriving, at most two spare) and the output (the largest unit's
shard) count in the device tier and, with a device_budget, stay within the room it keeps
for them ([Note: gradient buckets in the device budget] in memory/budget.py); the buckets'
peak is ``stats()["gradient_bucket_peak_bytes"]``, the output's bytes
``stats()["reduce_scatter_output_bytes"]``. Collectives on host buffers (flags, norm
squares, stage 0/1 gradients, the sum across groups, the main thread's parameter gathers
for state_dict and checkpoints) stay on gloo.

[Note: early updates across ranks] With early updates (stage 3; stage 2 where every
compute copy is homed on the host) a unit's update may start on the optimizer worker in the
backward before a step once its gradient is final on this rank: its reduce-scatter of that
backward is done, the groups' sum of its shard taken and its has-gradient flags agreed
(``settle_in_backward``: both right after the reduce-scatter, on the thread and in the
order the reduce-scatters run, so in the same order on every rank; ``settled`` says which
units are). Which units a rank updates early depends on its own timing, so the update
itself issues no collective: at stage 3 the next fetch gathers the chunks; at stage 2 the
all-gather of the updated shards is owed to step(), which gathers every unit with a
gradient in unit order, Adam first for those not updated early (``ShardedStep.run``'s
``updated_early``), so every rank issues the same gathers in the same order; a zero_grad()
in place of that step runs the owed gathers (``UpdateScheduler.gathers_owed``; gathering
a unit not updated changes nothing). The update's squares for the norm are this rank's
terms of ``local_grad_squares``, summed in unit order in step() exactly as for a unit
updated there. Under clipping, fp16 or skips the early updates are speculative ([Note:
speculative updates]): the norm is all-reduced, so every rank takes the same commit-or-redo
decision, and a redo (or a speculation that failed on one rank, redone there alone) is an
update of step(), gathered in its place. Whether a backward settles its units (with
``Layout.early_allowed``, and whether updates speculate by default) follows from the config
alone, never from a rank's own placement, so it is alike on every rank. A read of the
weights between such a backward and its step() agrees across ranks whether any updated a
unit early (``UpdateScheduler.updated_early``): every rank refuses it alike. Not at stage 1
(its gradients are reduced in step()) nor at stage 2 with a compute copy on NVMe or the
device (the owed gather would read and write it again).

[Note: one GPU per rank] NCCL runs one rank per GPU: two ranks whose buffers are on one
device fail deep inside it ("Duplicate GPU detected: rank 0 and rank 1 both on CUDA
device"), once the first device collective runs, well after wrap. So where the device is
CUDA, ``from_environment`` first exchanges each rank's (host name, device) over the gloo
group it has just made, and every rank raises the same ValueError naming the ranks that
share a device and what to do (``check_one_device_per_rank``), before any NCCL group is
made and before wrap changes anything. A device is the physical GPU its index names: the
index-th entry of the rank's CUDA_VISIBLE_DEVICES where that is set (launchers that give
each rank one GPU that way make every rank's device cuda:0), else the index. A CPU device
(its stand-in of CUDA included) has no NCCL groups, and its ranks may share the host.

[Note: failures] Before every collective a rank writes its sequence number and the name of
the collective to the process group's store. A collective that fails (a peer exited: the
connection closes) or times out (``collective_timeout_seconds``: a peer hangs) raises a
RuntimeError naming the ranks that never reached it (behind it, or at its number in
another collective), read back from the store.

[Note: closing with several ranks] close() is collective, like state_dict(): every rank
calls it. A rank's close() first finishes what it has in flight (its deferred and delayed
updates with their all-gathers, stage 3's fetches with theirs), then waits at a barrier
(``close_barrier``) for every rank to have done the same, and only then stops its threads,
removes its hooks and deletes its swap files. So no rank tears down while another still
runs a collective (a group's gathers may go on after the other group is done), and no
rank returns from close(), and ends its process, while another still marks its
collectives in the store (which lives in rank 0's process). The barrier runs on a process
group of its own (``close_group``), so that it is never matched with a collective that a
failed rank left unfinished on another group. It counts on the main lane, so a rank that
does not reach it is named as for any collective ([Note: failures]), within
``collective_timeout_seconds`` (at once where its process has exited); a rank still in the
collective another left for its close() is at the barrier's number with another name, and
named too. Such a failure does not stop the teardown: the engine releases everything,
then raises it; from the exit of a ``with`` block that an exception is leaving, it warns
instead and the exception goes on (the rank that failed first reaches the barrier on its
way out while the others may still wait in the collective it left, until the timeout).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from offload.zero.shards import FP32_BYTES, StageShards, UnitShards, even_range

# torch >= 2.10 names them *_single; the older names warn there.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Fields that may differ between ranks: where things are, not what is computed.
_RANK_LOCAL_FIELDS = ("device", "swap_dir", "io_backend", "io_block_bytes", "io_queue_depth",
                      "host_budget")


class GradientShards(Protocol):
    """What the partition needs of the gradients (offload.optim.gradients.Gradients)."""

    def host_buffer(self, u: Any) -> torch.Tensor:
        """u's host gradient buffer (``grad_numel`` elements), every copy into it landed."""

    def land_shard(self, u: Any, shard: torch.Tensor, add: bool) -> Optional[Any]:
        """u's reduce-scattered shard, on the device, into (or added to) its host buffer;
        the event of a copy that may still read ``shard`` (None: it has been read)."""


class Partition(StageShards):
    """This rank's place among ``world_size`` ranks and the collectives of one engine.

    The engine calls it at a few marked places ("[zero]" in engine.py): unit buffer sizes
    (``assign``), initial state (``broadcast_initial``), buffers before each training
    forward (``broadcast_buffers``), backward (``gradient_bucket`` /
    ``gradient_arrived``, stage >= 2), fetches (``gather_params``, stage 3), the optimizer
    step (``finish_gradients``, ``sum_grad_squares``, ``all_gather_shards``) and
    ``zero_grad``.
    """

    def __init__(self, group: Any, store: Any, rank: int, world_size: int, stage: int,
                 shard_size: Optional[int] = None, device: torch.device = torch.device("cpu")) -> None:
        assert stage in (0, 1, 2, 3)
        self.group = group
        self.param_group: Any = None  # [Note: parameter all-gathers]
        self.rank = rank
        self.world_size = world_size
        self.stage = stage
        # [Note: sharding groups] this rank's group (all ranks by default) and its replicas
        self.shard_size = shard_size or world_size
        assert world_size % self.shard_size == 0
        self.shard_rank = rank % self.shard_size
        self.replica_index = rank // self.shard_size
        self.shard_group: Any = group
        self.param_shard_group: Any = None  # the param lane's, set with param_group
        self.replica_group: Any = None  # None with one group
        # [Note: collectives on the device] where the gradient buckets live, and their group
        self.device = device
        self.device_group: Any = group
        self.device_param_group: Any = None  # the param lane's ([Note: parameter all-gathers])
        self.close_group: Any = group  # [Note: closing with several ranks] its own from from_environment
        self.num_cross_group_reduces = 0  # all-reduces across groups (one per unit and step)
        self._store = store
        self._seq: Dict[str, int] = {"main": 0, "param": 0}
        self._units: List[Any] = []
        self._scratch: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}
        # Stage 2 state: full-size buckets of units whose gradients are arriving in this
        # backward, units reduced in this backward, units reduced since the last step.
        self._buckets: Dict[int, torch.Tensor] = {}
        self._arrived: Dict[int, int] = {}
        self._free_buckets: List[torch.Tensor] = []
        self._reduced_this_backward: set = set()
        self._reduced_this_window: set = set()
        self._flush_queued = False
        # [Note: early updates across ranks] set by the engine for the backward before an
        # update that may update units early; the units settled in it
        self.settle_in_backward = False
        self._settled: set = set()
        self.timeout_seconds: Optional[float] = None
        self.bucket_bytes = 0
        self.bucket_peak_bytes = 0
        # [Note: gradient buckets in the device budget] the reduce-scatters' output, made at
        # the first, and the event of the copy out that may still read it
        self._output: Optional[torch.Tensor] = None
        self._output_copied: Optional[Any] = None
        self.output_bytes = 0
        self._gradients: Optional[GradientShards] = None  # bind_gradients
        self._device_tier: Any = None  # count_buckets_in
        self._mark("wrap")

    # ------------------------------------------------------------------ setup
    @classmethod
    def from_environment(cls, stage: int, timeout_seconds: float, shard_group_size: Optional[int] = None,
                         device: torch.device = torch.device("cpu")) -> Optional["Partition"]:
        """The Partition of this process, or None on a single process. Uses the initialized
        default process group, or initializes one from torchrun's environment (RANK,
        WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Collectives run on a gloo group of our own
        (the states they move are on the host) with ``timeout_seconds``. ``shard_group_size``:
        the config's ([Note: sharding groups]; None: LOCAL_WORLD_SIZE, else every rank);
        ``device``: the compute device ([Note: collectives on the device])."""
        timeout = timedelta(seconds=timeout_seconds)
        if not (dist.is_available() and dist.is_initialized()):
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
                dist.init_process_group(backend="gloo", timeout=timeout)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            if stage != 0:
                warnings.warn(f"stage={stage} is ignored: this is a single process "
                              "(no process group with more than one rank)")
            return None
        # A group of our own: gloo whatever the default backend is (NCCL for the user's
        # device tensors, say), and our timeout ([Note: failures]). A second one for the
        # stage 3 parameter all-gathers ([Note: parameter all-gathers]); made whatever the
        # stage, since making a group is itself collective and the stages may disagree
        # until check_consistent has run.
        world_size = dist.get_world_size()
        shard_size = resolve_shard_group_size(shard_group_size, world_size, os.environ)
        group = dist.new_group(backend="gloo", timeout=timeout)
        if device.type == "cuda":  # [Note: one GPU per rank] before any NCCL group
            check_one_device_per_rank(group, dist.get_rank(), world_size, device)
        param_group = dist.new_group(backend="gloo", timeout=timeout)
        close_group = dist.new_group(backend="gloo", timeout=timeout)  # [Note: closing with several ranks]
        store = dist.PrefixStore("offload/", dist.distributed_c10d._get_default_store())
        partition = cls(group, store, dist.get_rank(), world_size, stage, shard_size, device)
        partition.param_group = partition.param_shard_group = param_group
        partition.close_group = close_group
        partition.timeout_seconds = timeout_seconds
        groups = [list(range(g * shard_size, (g + 1) * shard_size)) for g in range(world_size // shard_size)]
        if shard_size < world_size:  # every rank creates every group, in one order
            replicas = [list(range(r, world_size, shard_size)) for r in range(shard_size)]
            partition.shard_group = _subgroup(groups, timeout)
            partition.param_shard_group = _subgroup(groups, timeout)
            partition.replica_group = _subgroup(replicas, timeout)
        partition.device_group, partition.device_param_group = partition.shard_group, partition.param_shard_group
        if device.type == "cuda":  # the device's own backend for device buffers
            partition.device_group = _subgroup(groups, timeout, backend="nccl")
            partition.device_param_group = _subgroup(groups, timeout, backend="nccl")
        return partition

    def assign(self, u: Any, home_element_bytes: int) -> Optional[UnitShards]:
        """What this rank keeps of unit ``u`` (None at stage 0: everything), for the engine
        to set on u; u joins the units this partition reduces at the end of a backward
        ([Note: collective order]). ``home_element_bytes``: the element size of the
        compute copy's home buffer."""
        self._units.append(u)
        return UnitShards.of(u.spec.trainable_numel, u.spec.frozen_start, u.spec.total_numel,
                             self.shard_rank, self.shard_size, self.stage, home_element_bytes)

    def bind_gradients(self, gradients: GradientShards) -> None:
        """The gradients, once they are built: u's host buffers (taken from the engine's
        pool when u has none: buffers are lazy, released after updates) and where a
        reduce-scattered shard lands."""
        self._gradients = gradients

    def count_buckets_in(self, device_tier: Any) -> None:
        """The device tier (tiers.DeviceTier) the gradient buckets count in and whose room
        bounds them ([Note: gradient buckets in the device budget]); unbound, they bound
        nothing."""
        self._device_tier = device_tier

    def check_consistent(self, config: Any, units: Sequence[Any], optimizer: Any) -> None:
        """All-gather a digest of the config and unit layout; a ValueError on every rank
        naming the first rank and field that differ from rank 0."""
        summary = dict(self._layout_summary(config, units, optimizer), shard_group_size=self.shard_size)
        digest = hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode()).digest()
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        everyone = torch.empty(self.world_size * mine.numel(), dtype=torch.uint8)
        self._collective("config digest all-gather", lambda: _all_gather_into(
            everyone, mine, group=self.group))
        rows = everyone.view(self.world_size, -1)
        if all(torch.equal(rows[0], rows[r]) for r in range(self.world_size)):
            return
        summaries: List[Any] = [None] * self.world_size
        self._collective("config summary all-gather", lambda: dist.all_gather_object(
            summaries, summary, group=self.group))
        for r in range(1, self.world_size):
            for key in summaries[0]:
                if summaries[r][key] != summaries[0][key]:
                    detail = _first_difference(summaries[0][key], summaries[r][key], r)
                    raise ValueError(
                        f"stage: ranks disagree at wrap time: rank {r} differs from rank 0 in "
                        f"{key}: {detail}; every rank must wrap the same model with the same config")
        raise ValueError("stage: ranks disagree at wrap time (config or unit layout digest)")

    @staticmethod
    def _layout_summary(config: Any, units: Sequence[Any], optimizer: Any) -> Dict[str, Any]:
        fields = {k: v for k, v in config.to_dict().items() if k not in _RANK_LOCAL_FIELDS}
        layout = [[u.name, u.spec.trainable_numel, u.spec.total_numel,
                   [[e.fqn, list(e.shape), e.group_index] for e in u.spec.entries]] for u in units]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return {"config": fields, "unit layout": layout,
                "optimizer": [type(optimizer).__name__, groups]}

    # ------------------------------------------------------------------ collectives
    def all_gather_object(self, what: str, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        out: List[Any] = [None] * self.world_size
        self._collective(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def close_barrier(self) -> None:
        """[Note: closing with several ranks] Wait until every rank has reached close() and
        finished what it had in flight; a RuntimeError naming the ranks that did not within
        collective_timeout_seconds."""
        self._collective("close() barrier", lambda: dist.barrier(group=self.close_group))

    def _mark(self, what: str, lane: str = "main") -> None:
        """Count a collective of ``lane`` ("main": the main thread on ``group``; "param":
        the copy worker on ``param_group``, or below stage 3 the optimizer worker's delayed
        updates: [Note: parameter all-gathers]) in the store, for _diagnose."""
        self._seq[lane] += 1
        self._store.set(f"seq/{lane}/{self.rank}", f"{self._seq[lane]}:{what}")

    def _collective(self, what: str, call: Callable[[], Any], lane: str = "main") -> Any:
        """Run one collective; [Note: failures] turns a failure into a RuntimeError naming
        the ranks that did not get there."""
        try:
            self._mark(what, lane)  # inside: a store that is gone (rank 0 exited) is diagnosed too
            return call()
        except Exception as exc:  # gloo raises RuntimeError / DistBackendError
            raise RuntimeError(self._diagnose(what, exc, lane)) from exc

    def _diagnose(self, what: str, exc: BaseException, lane: str) -> str:
        mine = self._seq[lane]
        head = f"rank {self.rank}: collective #{mine} ({what}) failed"
        try:
            behind = []
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                raw = self._store.get(f"seq/{lane}/{r}").decode() \
                    if self._store.check([f"seq/{lane}/{r}"]) else "0:none yet"
                seq, _, last = raw.partition(":")
                # behind, or at this number in another collective (a close() barrier in place of
                # this one: [Note: closing with several ranks])
                if int(seq) < mine or (int(seq) == mine and last != what):
                    behind.append(f"rank {r} (its last collective was #{seq}: {last})")
        except Exception as store_exc:  # the store lives in rank 0's process (MASTER_ADDR)
            return (f"{head}: lost contact with the other ranks and with the store on rank 0 "
                    f"({store_exc}); rank 0 has probably failed. Cause: {exc}")
        if behind:
            return (f"{head}: {', '.join(behind)} never reached it; that rank failed or hung "
                    f"(collective_timeout_seconds={self.timeout_seconds}). Cause: {exc}")
        return f"{head}: every rank reached it. Cause: {exc}"

    def _scratch_of(self, dtype: torch.dtype, numel: int, lane: str = "main") -> torch.Tensor:
        """A scratch tensor of ``lane``'s thread (one per lane and dtype: [Note: delayed updates
        across ranks] the optimizer worker gathers while the main thread reduces)."""
        buf = self._scratch.get((lane, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._scratch[(lane, dtype)] = buf
        return buf[:numel]

    @torch.no_grad()
    def broadcast_initial(self, *tensors: torch.Tensor) -> None:
        """Every rank starts from rank 0's initial values (as DDP does)."""
        for t in tensors:
            self._collective("initial state broadcast",
                             lambda t=t: dist.broadcast(t, src=0, group=self.group))

    @torch.no_grad()
    def broadcast_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Rank 0's buffers (BatchNorm running statistics, say) on every rank, as
        DistributedDataParallel does before each training forward: one broadcast per dtype."""
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for dtype, group in by_dtype.items():
            flat = torch.cat([b.detach().reshape(-1).to("cpu") for b in group])
            self._collective("buffer broadcast", lambda: dist.broadcast(flat, src=0, group=self.group))
            offset = 0
            for b in group:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def finish_gradients(self, units: Sequence[Any]) -> None:
        """At the optimizer step: agree on which parameters have a gradient ([Note: no
        gradient across ranks]), then average the gradients of stage 0/1 (all-reduce /
        reduce-scatter per unit; stage 2 did its reduce-scatters in backward), and with
        several groups all-reduce each shard across them ([Note: sharding groups])."""
        trainable = [u for u in units if u.trainable]
        local = [list(u.has_grad) for u in trainable]
        flags = torch.tensor([int(f) for row in local for f in row], dtype=torch.int32)
        if flags.numel():
            self._collective("has-gradient flags all-reduce", lambda: dist.all_reduce(
                flags, op=dist.ReduceOp.MAX, group=self.group))
        i = 0
        for u, row in zip(trainable, local):
            u.has_grad = [bool(f) for f in flags[i:i + len(row)].tolist()]
            i += len(row)
            if not any(u.has_grad):
                continue
            if u.index in self._settled:  # [Note: early updates across ranks] summed in backward
                continue
            if self.shards_gradients:  # reduce-scattered in each backward; the groups' sum now
                self._sum_replicas(u, self._gradients.host_buffer(u)[:u.shard.numel])
                continue
            grad = self._gradients.host_buffer(u)  # none yet where this rank got no gradient of u
            for k, e in enumerate(u.trainable):
                if u.has_grad[k] and not row[k]:
                    grad[e.offset:e.offset + e.numel].zero_()
            t = u.spec.trainable_numel
            grad[:t].mul_(1.0 / self.world_size)  # [Note: gradient averaging]
            if self.stage == 0:
                self._collective(f"gradient all-reduce of unit {u.name!r}",
                                 lambda grad=grad, t=t: dist.all_reduce(grad[:t], group=self.group))
            else:
                s = u.shard
                grad[t:].zero_()
                out = self._scratch_of(torch.float32, s.shard_numel)
                self._collective(f"gradient reduce-scatter of unit {u.name!r}",
                                 lambda grad=grad, out=out: _reduce_scatter_into(
                                     out, grad, group=self.shard_group))
                self._sum_replicas(u, out[:s.numel])
                grad[s.lo:s.hi].copy_(out[:s.numel])

    def _sum_replicas(self, u: Any, shard: torch.Tensor) -> None:
        """[Note: sharding groups] ``shard`` (this rank's part of u's gradient, summed inside
        its group) summed across the groups, in place; nothing with one group."""
        if self.replica_group is not None:
            self.num_cross_group_reduces += 1
            self._collective(f"gradient all-reduce across groups of unit {u.name!r}",
                             lambda: dist.all_reduce(shard, group=self.replica_group))

    @torch.no_grad()
    def local_grad_squares(self, u: Any) -> List[torch.Tensor]:
        """This rank's terms of the norm's squares for u (float64, 0-d, in the order
        ``sum_grad_squares`` adds them): one per parameter with a gradient that reaches
        into this rank's even part of u's averaged gradient."""
        terms: List[torch.Tensor] = []
        if not u.trainable:
            return terms
        own = even_range(u.spec.trainable_numel, self.shard_rank, self.shard_size)
        grad = None
        for k, e in enumerate(u.trainable):
            a, b = max(e.offset, own.lo), min(e.offset + e.numel, own.hi)
            if u.has_grad[k] and a < b:
                if grad is None:  # [Note: collectives on the device] the shard copied out has landed
                    grad = self._gradients.host_buffer(u)
                g = grad[a - u.grad_base:b - u.grad_base]
                terms.append(torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2)
        return terms

    @torch.no_grad()
    def sum_grad_squares(self, terms: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """Sum of squares of the averaged gradients of all ranks: each rank adds its terms
        of every unit (``local_grad_squares``, in unit order), summed inside its group
        (which holds all of them); one all-reduce per step."""
        local = torch.zeros((), dtype=torch.float64)
        for unit_terms in terms:
            for term in unit_terms:
                local += term
        squares = local.reshape(1)
        self._collective("gradient norm all-reduce",
                         lambda: dist.all_reduce(squares, group=self.shard_group))
        return squares[0]

    def gradient_bucket(self, u: Any) -> torch.Tensor:
        """Stage >= 2: the full-size fp32 buffer on the device that u's gradients of this
        backward go into ([Note: collectives on the device])."""
        bucket = self._buckets.get(u.index)
        if bucket is None:
            if not self._flush_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
                self._flush_queued = True
            bucket = self._take_bucket(u)
            bucket.zero_()
            self._buckets[u.index] = bucket
            self._arrived[u.index] = 0
        return bucket

    def gradient_arrived(self, u: Any) -> None:
        """Stage 2: one more of u's gradients is in its bucket; reduce when all are."""
        self._arrived[u.index] += 1
        if self._arrived[u.index] == len(u.trainable):
            self._reduce_bucket(u)

    def _take_bucket(self, u: Any) -> torch.Tensor:
        """A bucket for u's gradients: a spare one of its size, else a new one within the
        room device_budget keeps ([Note: gradient buckets in the device budget])."""
        numel = u.bucket_numel
        for i, b in enumerate(self._free_buckets):
            if b.numel() == numel:
                return self._free_buckets.pop(i)
        num_bytes = numel * FP32_BYTES
        self._hold_on_device(num_bytes, f"that of unit {u.name!r}")
        self.bucket_bytes += num_bytes
        self.bucket_peak_bytes = max(self.bucket_peak_bytes, self.bucket_bytes)
        return torch.empty(numel, dtype=torch.float32, device=self.device)

    def _hold_on_device(self, num_bytes: int, what: str) -> None:
        """Count ``num_bytes`` more of the reduce-scatters' buffers (``what``: a unit's
        bucket, or the output) in the device tier, within the room device_budget keeps for
        them ([Note: gradient buckets in the device budget]): spare buckets go first; a
        ValueError naming device_budget when the buffers still in use leave too little."""
        tier = self._device_tier
        if tier is None:
            return
        while self._free_buckets and not tier.buckets_fit(num_bytes):
            self._drop_bucket(self._free_buckets.pop(0))
        if not tier.buckets_fit(num_bytes):
            names = {v.index: v.name for v in self._units}
            arriving = ", ".join(repr(names[i]) for i in sorted(self._buckets))
            output = f", the reduce-scatter's output ({self.output_bytes} bytes)" if self.output_bytes else ""
            needed = self.bucket_bytes + self.output_bytes + num_bytes
            free = tier.capacity_bytes - tier.slot_bytes - tier._held_bytes()
            raise ValueError(
                f"device_budget: the fp32 gradient buckets of the units whose gradients are arriving in this "
                f"backward ({arriving}: {self.bucket_bytes} bytes){output} and {what} ({num_bytes} bytes) "
                f"need {needed} bytes, more than the {tier.bucket_room_bytes} bytes device_budget keeps for them (the "
                "root unit's bucket, the largest other unit's and the output, the largest unit's shard: [Note: "
                f"gradient buckets in the device budget]) and the {max(free, 0)} bytes of the arena the slots in use "
                f"leave, {needed - tier.bucket_room_bytes - max(free, 0)} bytes short: raise device_budget by at least "
                "that (a unit's bucket stays open while a parameter of it has not had its gradient: one that gets "
                "none, or two uses far apart), or device_budget=None lets the buckets grow unbounded")
        tier.hold_buckets(num_bytes)

    def _reduce_output(self, numel: int) -> torch.Tensor:
        """[Note: gradient buckets in the device budget] ``numel`` elements of the
        reduce-scatters' output: one fp32 buffer on the device for every unit, as long as the
        largest unit's shard, made (and counted in the device tier) at the first
        reduce-scatter. It is written again only after the copy out of what it held has run
        (where that copy runs behind, on CUDA and its stand-in, the compute stream waits for
        it, and the collective's stream for the compute stream)."""
        if self._output is None:
            longest = max(v.shard.shard_numel for v in self._units if v.bucket_numel)
            self._hold_on_device(longest * FP32_BYTES, "the reduce-scatter's output (the largest unit's shard)")
            self.output_bytes = longest * FP32_BYTES
            self._output = torch.empty(longest, dtype=torch.float32, device=self.device)
        out = self._output[:numel]
        streams = self._device_tier.streams if self._device_tier is not None else None
        if self._output_copied is not None:
            if streams is not None:
                streams.compute_wait(self._output_copied)
            else:
                self._output_copied.synchronize()
            self._output_copied = None
        if streams is not None:  # the stand-in checks that no copy out reads it still
            streams.compute_access(out, write=True, what="the reduce-scatter's output")
        return out

    def _drop_bucket(self, bucket: torch.Tensor) -> None:
        num_bytes = bucket.numel() * FP32_BYTES
        self.bucket_bytes -= num_bytes
        if self._device_tier is not None:
            self._device_tier.drop_buckets(num_bytes)

    @torch.no_grad()
    def _reduce_bucket(self, u: Any) -> None:
        bucket = self._buckets.pop(u.index, None)
        self._arrived.pop(u.index, None)
        if bucket is None:  # no gradient of u on this rank in this backward: contribute zeros
            bucket = self._take_bucket(u)
            bucket.zero_()
        bucket.mul_(1.0 / self.world_size)  # [Note: gradient averaging]
        s = u.shard
        out = self._reduce_output(s.shard_numel)  # [Note: collectives on the device]
        self._collective(f"gradient reduce-scatter of unit {u.name!r}",
                         lambda: _reduce_scatter_into(out, bucket, group=self.device_group))
        self._output_copied = self._gradients.land_shard(u, out[:s.numel], add=u.index in self._reduced_this_window)
        self._reduced_this_window.add(u.index)
        self._reduced_this_backward.add(u.index)
        if self.settle_in_backward:  # [Note: early updates across ranks]
            self._settle(u)
        self._free_buckets.append(bucket)
        # Free buckets beyond the ones a unit may still need: keep at most two spare.
        while len(self._free_buckets) > 2:
            self._drop_bucket(self._free_buckets.pop(0))

    def _settle(self, u: Any) -> None:
        """[Note: early updates across ranks] u's gradient is final: its flags agreed
        ([Note: no gradient across ranks]) and its shard summed across the groups now,
        right after its reduce-scatter, instead of in finish_gradients."""
        flags = torch.tensor([int(f) for f in u.has_grad], dtype=torch.int32)
        if flags.numel():
            self._collective(f"has-gradient flags all-reduce of unit {u.name!r}", lambda: dist.all_reduce(
                flags, op=dist.ReduceOp.MAX, group=self.group))
        u.has_grad = [bool(f) for f in flags.tolist()]
        if any(u.has_grad) and self.replica_group is not None:
            self._sum_replicas(u, self._gradients.host_buffer(u)[:u.shard.numel])
        self._settled.add(u.index)

    @property
    def settled_any(self) -> bool:
        """[Note: early updates across ranks] The last backward settled its units and no
        step or zero_grad came since (alike on every rank: each settles every unit)."""
        return bool(self._settled)

    def settled(self, u: Any) -> bool:
        """[Note: early updates across ranks] u's gradient of this step is final and agreed
        on by every rank: its update may start."""
        return u.index in self._settled

    def _after_backward(self) -> None:
        """End of a backward (stage 2): reduce every unit not reduced yet, in unit order
        ([Note: collective order])."""
        self._flush_queued = False
        for u in self._units:
            if u.trainable and u.index not in self._reduced_this_backward:
                self._reduce_bucket(u)
        self._reduced_this_backward.clear()

    def zero_grad(self) -> None:
        self._reduced_this_window.clear()
        self._settled.clear()

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def all_gather_shards(self, u: Any, buf: torch.Tensor, in_full_coordinates: bool,
                          lane: str = "main") -> torch.Tensor:
        """After Adam: every rank's updated part of u's trainable prefix. With
        ``in_full_coordinates`` ``buf`` covers the whole prefix (this rank's part at
        ``[lo, hi)``); the others' parts are gathered into it and it is returned. Otherwise
        ``buf`` holds only this rank's part (``lo`` at index 0) and a scratch tensor in full
        coordinates is returned (valid until the next call). ``lane`` "param": a delayed
        update's gather on the optimizer worker ([Note: delayed updates across ranks])."""
        s = u.shard
        t = u.spec.trainable_numel
        base = 0 if in_full_coordinates else s.lo
        chunk = self._scratch_of(buf.dtype, s.shard_numel * (self.shard_size + 1), lane)
        mine, everyone = chunk[:s.shard_numel], chunk[s.shard_numel:]
        mine[:s.numel].copy_(buf[s.lo - base:s.hi - base])
        mine[s.numel:].zero_()
        group = self.param_shard_group if lane == "param" else self.shard_group
        self._collective(f"parameter all-gather of unit {u.name!r}",
                         lambda: _all_gather_into(everyone, mine, group=group), lane)
        if in_full_coordinates:
            buf[:t].copy_(everyone[:t])
            return buf
        return everyone[:t]

    @torch.no_grad()
    def gather_params(self, u: Any, home: torch.Tensor, out: torch.Tensor, lane: str) -> None:
        """Stage 3: every rank's chunks of u's compute copy into ``out`` (``u.compute_numel``
        elements in the unit's flat layout) from this rank's home chunks ``home``. Lane
        "param" on the copy worker ([Note: parameter all-gathers]), "main" on the main
        thread (state_dict, checkpoints)."""
        group = self.param_shard_group if lane == "param" else self.shard_group
        w = self.shard_size
        for start, shard, home_offset, which in _regions(u.param_shard):
            n = shard.shard_numel
            self._collective(
                f"parameter all-gather of unit {u.name!r} ({which})",
                lambda: _all_gather_into(out[start:start + w * n], home[home_offset:home_offset + n],
                                         group=group), lane)

    def own_chunk_numel(self, u: Any) -> int:
        """Stage 3: elements of u's compute copy this rank keeps (its chunks, unpadded)."""
        return sum(shard.shard_numel for _, shard, _, _ in _regions(u.param_shard))

    @torch.no_grad()
    def gather_params_on_device(self, u: Any, home: torch.Tensor, slot: torch.Tensor,
                                copy_in: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        """Stage 3, on the copy worker ([Note: collectives on the device]): this rank's home
        chunks ``home`` to their place in u's device ``slot`` (``copy_in(dst, src)``: the
        device's copy, returning its event), then every rank's chunks gathered in place
        there over the device's backend. Returns the last copy's event (waited for here)."""
        w, r = self.shard_size, self.shard_rank
        regions = _regions(u.param_shard)
        copied = None
        for start, shard, home_offset, _ in regions:
            n = shard.shard_numel
            copied = copy_in(slot[start + r * n:start + (r + 1) * n], home[home_offset:home_offset + n])
        if copied is not None:
            copied.synchronize()
        for start, shard, _, which in regions:
            n = shard.shard_numel
            self._collective(
                f"parameter all-gather of unit {u.name!r} ({which})",
                lambda: _all_gather_into(slot[start:start + w * n], slot[start + r * n:start + (r + 1) * n],
                                         group=self.device_param_group), "param")
        return copied


def resolve_shard_group_size(configured: Optional[int], world_size: int, environ: Mapping[str, str]) -> int:
    """[Note: sharding groups] The ranks per sharding group: ``configured``, else the ranks
    of one node (``LOCAL_WORLD_SIZE``, as torchrun sets it), else every rank. A ValueError
    naming shard_group_size where it does not divide ``world_size``."""
    size = configured if configured is not None else \
        int(environ["LOCAL_WORLD_SIZE"]) if environ.get("LOCAL_WORLD_SIZE") else world_size
    if size > world_size or world_size % size:
        where = "" if configured is not None else f" (LOCAL_WORLD_SIZE={size}, the default)"
        raise ValueError(f"shard_group_size: {size}{where} does not divide the world size {world_size}; groups of "
                         "that many ranks cannot cover every rank once (set it to a divisor of the world size)")
    return size


def check_one_device_per_rank(group: Any, rank: int, world_size: int, device: torch.device,
                              host: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> None:
    """[Note: one GPU per rank] A ValueError, on every rank of ``group`` alike, where two
    ranks would compute on the same GPU of one host: ``device`` is this rank's (with its
    index, as ``OffloadConfig.resolved_device`` gives it), ``host`` its host name (default:
    this machine's), ``environ`` its environment (CUDA_VISIBLE_DEVICES). A collective over
    ``group`` (gloo: host objects)."""
    assert device.index is not None, "the resolved device has its index"
    visible = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    physical = visible[device.index] if device.index < len(visible) else str(device.index)
    mine = (host if host is not None else socket.gethostname(), physical)
    everyone: List[Any] = [None] * world_size
    dist.all_gather_object(everyone, (mine, str(device)), group=group)
    ranks_of: Dict[Any, List[int]] = {}
    for r, (where, _) in enumerate(everyone):
        ranks_of.setdefault(tuple(where), []).append(r)
    shared = [(where, ranks) for where, ranks in ranks_of.items() if len(ranks) > 1]
    if not shared:
        return
    (host_name, physical), ranks = shared[0]
    names = ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    devices = sorted({everyone[r][1] for r in ranks})
    more = f" (and {len(shared) - 1} more GPU(s) shared likewise)" if len(shared) > 1 else ""
    raise ValueError(
        f"device: ranks {names} would {'both' if len(ranks) == 2 else 'all'} compute on {' / '.join(devices)} "
        f"(GPU {physical}) of host {host_name!r}{more}, and NCCL "
        f"runs one rank per GPU (it fails with 'Duplicate GPU detected'); this is rank {rank}. Give each rank "
        "its own GPU: launch with torchrun (it sets LOCAL_RANK, and device 'auto' or 'cuda' then takes "
        "cuda:LOCAL_RANK), or call torch.cuda.set_device(local_rank) before wrap, or set device='cuda:N' in each "
        "rank's config; and start at most as many ranks on a host as it has GPUs")


def _subgroup(members: List[List[int]], timeout: timedelta, backend: str = "gloo") -> Any:
    """This rank's group among ``members`` (each rank in exactly one list)."""
    if len(members) == 1:
        return dist.new_group(backend=backend, timeout=timeout)
    mine, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout, backend=backend)
    return mine


def _regions(p: Any) -> List[Tuple[int, Any, int, str]]:
    """Stage 3: (slot start, shard range, home offset, name) of a unit's trainable prefix and
    frozen tail, trainable first (see ParamShard); the regions without elements left out."""
    regions = ((0, p.trainable, 0, "trainable"), (p.frozen_start, p.frozen, p.trainable_chunk_numel, "frozen"))
    return [r for r in regions if r[1].shard_numel]


def _first_difference(a: Any, b: Any, rank: int, path: str = "") -> str:
    """Where two JSON-like values first differ, for the wrap-time mismatch message."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), rank,
                                         f"{path}.{key}" if path else str(key))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, rank, f"{path}[{i}]")
    return f"{path or 'value'}: rank 0 has {a!r}, rank {rank} has {b!r}"

"""Adam over a range of one unit's trainable elements: the one place where the optimizer's
param groups, a unit's gradients and the native kernel meet.

Every update path calls it: the staged piece ring (optim/step.py), the [zero] sharded step
(optim/sharded.py) and the in-place update of host-homed states (``update_in_place``, which the
update scheduler runs). The kernel's exact order of operations is [Note: Adam numerics] in
native/adam/adam.h.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from offload import faults
from offload.memory.compact_codec import CompactPiece, NonFiniteStateError, compact_pieces
from offload.memory.layout import Layout, UnitState, slot_views
from offload.memory.state_slots import PackedHome, PackedSlot, home_views
from offload.optim import compact as compact_kernel, native_kernels
from offload.optim.cpu_adam import adam_step_flat
from offload.optim.generic import ParamStep
from offload.optim.several import GroupRule
from offload.optim.gradients import Gradients
from offload.stats import Timeline, profiled
from offload.tiers import DeviceTier
from offload.units import piece_ranges

__all__ = ["OutOfPlace", "UnitAdam", "moment_views", "step_elementwise"]


class OutOfPlace(NamedTuple):
    """Where an update that must leave a unit's homes as they are writes ([Note: speculative
    updates], [Note: delayed updates]): the spare homes' master and moments, each starting
    at the range's first element as the inputs do; an entry that is its input is updated in
    place (a staged piece). ``compute_in``: the compute copy that the update's
    ``compute_out`` replaces, or None. The kernel reads the homes and writes these in one
    pass ([Note: out-of-place Adam] in native/adam/adam.h), and every element it does not
    update (a parameter without a gradient, padding) is copied over, so that the outputs
    hold the whole range."""
    master: torch.Tensor
    exp_avg: Optional[torch.Tensor]     # None: a state slot the optimizer does not have
    exp_avg_sq: Optional[torch.Tensor]
    compute_in: Optional[torch.Tensor] = None


def _sliced(tensors: Tuple[Optional[torch.Tensor], ...], r: slice) -> Tuple[Optional[torch.Tensor], ...]:
    return tuple(None if t is None else t[r] for t in tensors)


def _own_slots(u: UnitState, k: int, moments: Tuple[Any, Any]) -> Tuple[Any, Any]:
    """The moments of u's trainable parameter k: [Note: per-entry state slots] in a per-entry
    home only the slots its optimizer keeps (None for the others, which hold none of it)."""
    if u.state_pages is None:
        return moments
    return tuple(m if i in u.entry_slots[k] else None for i, m in enumerate(moments))  # type: ignore[return-value]


def moment_views(home: Any, u: UnitState, lo: int, hi: int) -> Tuple[Any, Any]:
    """Slots 0 and 1 of elements [lo, hi) of u's host moments home (plain, or PackedSlots of
    a per-entry one: [Note: per-entry state slots]), each indexed from lo."""
    if isinstance(home, PackedHome):
        return home_views(home, lo, hi)
    return slot_views(home, u.state_slots, u.master_numel, lo, hi)


def step_elementwise(rule: GroupRule, shape: torch.Size, group: Dict[str, Any], step: int, grad: torch.Tensor,
                     grad_factor: float, master: torch.Tensor, slots: Tuple[Optional[torch.Tensor], ...],
                     compute_out: Optional[torch.Tensor], out: Optional[Tuple[Optional[torch.Tensor], ...]],
                     native: bool = True) -> None:
    """One parameter's elements through its optimizer's rule (``shape``: the parameter's;
    ``step``: its ParamStep of this update, settled unless the rule steps whole parameters);
    UnitAdam.adam_range runs it, tools/bench_optim.py times it. A native kernel steps the
    range where one is routed ([Note: native elementwise kernels] in optim/native_kernels.py;
    ``native=False``: never, for the benchmark's baseline), else the rule runs the optimizer's
    own step. Around the update it does what the Adam kernel does: the gradient times
    ``grad_factor`` in fp32 (as the kernel, and as clip_grad_norm_'s in-place multiply),
    out-of-place writes ([Note: out-of-place Adam]: the inputs are copied to ``out`` and
    stepped there), and the new compute copy rounded to nearest even into ``compute_out``."""
    if out is not None:
        for src, dst in zip((master,) + slots, out):
            if src is not None and src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        master, slots = out[0], (out[1], out[2])
    # A kernel reads the engine's gradient in place (its dtype, times grad_factor) and never
    # writes it.
    kernel = native_kernels.kernel_for(rule.rule, rule.local_index, group) if native else None
    if kernel is None or not kernel(step, master, grad, grad_factor, slots):
        # A copy always: the engine's gradient may be read again (a speculative update taken
        # back), and a user's step() may write p.grad.
        grad = grad.float() * grad_factor if grad_factor != 1.0 else grad.to(torch.float32, copy=True)
        if rule.rule.whole:  # [Note: whole-parameter optimizers] the range is the parameter
            rule.rule.step_whole(rule.local_index, group, step, shape, master, grad, slots)
        else:
            rule.rule.step_range(rule.local_index, group, step, master, grad, slots)
    if compute_out is not None:
        compute_out.copy_(master)


class UnitAdam:
    """Adam/AdamW over ranges of units' trainable prefixes, with the optimizer's param
    groups (or the hyperparameters taken when an update was queued). Holds no state of its
    own between calls; any thread may call it for a unit that thread owns ([Note: threads]
    in memory/layout.py)."""

    def __init__(self, optimizer: Any, group_rules: List[GroupRule], *,
                 layout: Layout, device: DeviceTier, gradients: Gradients, timeline: Timeline,
                 piece_numel: int) -> None:
        """``optimizer``: has the param groups (an OptimizerSet, [Note: several optimizers]).
        ``group_rules[g]``: how group g's parameters are updated: the Adam kernel (with
        decoupled decay or not) or another elementwise optimizer's rule ([Note: elementwise
        optimizers] in optim/generic.py), whose state slots 0 and 1 are where Adam's exp_avg
        and exp_avg_sq are. ``piece_numel``: the staged step's piece size
        (offload.units.OPTIMIZER_PIECE_NUMEL, passed by the engine)."""
        self._optimizer = optimizer
        self._group_rules = group_rules
        self._layout = layout
        self._device = device
        self._gradients = gradients
        self._timeline = timeline
        self._piece_numel = piece_numel

    def hyperparameters(self) -> List[Dict[str, Any]]:
        """The optimizer's per-group settings now, for an update that runs later (an LR
        scheduler may change the groups meanwhile): every key but the parameters, which an
        elementwise optimizer's step reads ([Note: elementwise optimizers])."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self._optimizer.param_groups]

    def next_steps(self, u: UnitState) -> List[int]:
        """Step counts after this update: +1 where the parameter has a gradient (with an
        elementwise rule, ParamSteps whose scalars the update's first range settles)."""
        rules = self._group_rules
        return [s if not g else s + 1 if rules[e.group_index].rule is None else ParamStep.after(s)
                for e, s, g in zip(u.trainable, u.steps, u.has_grad)]

    def pieces(self, u: UnitState) -> List[Tuple[int, int]]:
        """u's pieces of the staged step: ranges [lo, hi) of its trainable prefix, the last
        one ending at u.master_numel; with compact states, those of compact_pieces."""
        n, size = u.master_numel, self._piece_numel
        if self._layout.compact_states:  # [Note: compact pieces]
            pieces = self.compact_pieces(u)
            return [(p.compute_lo, n if j == len(pieces) - 1 else p.compute_hi) for j, p in enumerate(pieces)]
        # [Note: whole-parameter optimizers] never a piece that cuts a parameter
        return piece_ranges(n, size, u.whole_step)

    def compact_pieces(self, u: UnitState) -> List[CompactPiece]:
        """[Note: compact pieces] u's pieces of the compact step, in order."""
        return compact_pieces([e.numel for e in u.trainable], [e.offset for e in u.trainable], self._piece_numel)

    @profiled("adam")
    def adam_range(self, u: UnitState, lo: int, hi: int, steps: List[int], master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, compute_out: Optional[torch.Tensor],
                   compute_is_staging: bool, grad_factor: float, copy_to_device: bool = True,
                   groups: Optional[List[Dict[str, Any]]] = None, out: Optional[OutOfPlace] = None) -> None:
        """Adam over elements [lo, hi) of u's trainable prefix. ``master``, the moments and
        ``compute_out`` (the new compute copy, when it is a separate buffer) start at lo.
        ``groups``: the hyperparameters taken when the update was queued (default: the
        optimizer's param groups now). ``out``: the update leaves ``master`` and the moments
        as they are and writes there instead (see OutOfPlace)."""
        faults.hit("optim.adam_range", unit=u.name, lo=lo, hi=hi)
        groups = self._optimizer.param_groups if groups is None else groups
        rules = self._group_rules
        for k, e in enumerate(u.trainable):  # [Note: elementwise optimizers] once per parameter, whichever range comes first
            step = steps[k]
            rule = rules[e.group_index]
            if isinstance(step, ParamStep) and step.pending and not rule.rule.whole:  # a whole one: at its step
                rule.rule.settle(step, rule.local_index, groups[e.group_index])
        updated: List[Tuple[int, int]] = []  # what the kernel wrote, relative to lo
        for k, e in enumerate(u.trainable):
            a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
            if a >= b:
                continue
            r = slice(a - lo, b - lo)
            if not u.has_grad[k]:
                if compute_is_staging:  # the piece is written back whole: keep this one as is
                    compute_out[r].copy_(master[r])
                continue
            group = groups[e.group_index]
            faults.hit("optim.adam", unit=u.name, lo=a, hi=b)
            rule = rules[e.group_index]
            if rule.rule is not None:
                assert not rule.rule.whole or (a, b) == (e.offset, e.offset + e.numel), \
                    f"a piece cuts {e.fqn!r}, whose optimizer steps whole parameters"
                step_elementwise(rule, e.shape, group, steps[k], self._gradients.grad_range(u, k, a, b),
                                 grad_factor, master[r], _sliced(_own_slots(u, k, (exp_avg, exp_avg_sq)), r),
                                 None if compute_out is None else compute_out[r],
                                 None if out is None else
                                 _sliced((out.master,) + _own_slots(u, k, (out.exp_avg, out.exp_avg_sq)), r))
                updated.append((r.start, r.stop))
                continue
            beta1, beta2 = group["betas"]
            adam_step_flat(
                master[r], self._gradients.grad_range(u, k, a, b), exp_avg[r], exp_avg_sq[r], step=steps[k],
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw=rule.adamw, grad_scale=grad_factor,
                copy_out=None if compute_out is None else compute_out[r],
                out=None if out is None else (out.master[r], out.exp_avg[r], out.exp_avg_sq[r]))
            updated.append((r.start, r.stop))
        if out is not None:
            self._carry_over(hi - lo, updated, [(master, out.master), (exp_avg, out.exp_avg),
                                                (exp_avg_sq, out.exp_avg_sq), (out.compute_in, compute_out)])
            master = out.master
        layout = self._layout
        if copy_to_device and layout.param_tier == "device" and (compute_out is None or not layout.device_is_host):
            end = min(hi, u.spec.trainable_numel)
            if end > lo:
                src = compute_out if compute_out is not None else master
                dst = self._device.view(u.device_offset + lo, end - lo)
                # src is reused once this returns ([Note: streams])
                self._device.copy_in(dst, src[:end - lo], what=f"the update of unit {u.name!r}").synchronize()

    @staticmethod
    def _carry_over(n: int, updated: List[Tuple[int, int]],
                    pairs: List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]) -> None:
        """[Note: out-of-place Adam] Copy elements [0, n) that the kernel did not write
        (outside ``updated``) from each (source, destination) pair, where the two differ."""
        gaps, start = [], 0
        for a, b in sorted(updated):
            if a > start:
                gaps.append((start, a))
            start = max(start, b)
        if start < n:
            gaps.append((start, n))
        for src, dst in pairs:
            if src is None or dst is None or src.data_ptr() == dst.data_ptr():
                continue
            for a, b in gaps:
                if isinstance(dst, PackedSlot):  # [Note: per-entry state slots] what the slot holds
                    dst.copy_owned(src, a, b)
                else:
                    dst[a:b].copy_(src[a:b])

    def compute_target(self, u: UnitState) -> Optional[torch.Tensor]:
        """Where Adam writes the new compute copy when it is a separate 16-bit buffer that
        is not staged: the host home, or the device slot on a CPU "device"."""
        layout = self._layout
        if layout.merged or layout.compute_dtype == torch.float32:
            return None
        if u.compute_home is not None and isinstance(u.compute_home, torch.Tensor):  # a host home
            return u.compute_home
        if layout.param_tier == "device" and layout.device_is_host:
            return self._device.view(u.device_offset, u.compute_numel)
        return None

    def update_in_place(self, u: UnitState, grad_factor: float, groups: Optional[List[Dict[str, Any]]] = None,
                        speculative: bool = False) -> None:
        """Adam on a unit whose master and moments live on the host. ``speculative``
        ([Note: speculative updates]): the update reads u's homes and writes its spare ones
        ([Note: out-of-place Adam]), u's own states and its gradients are kept."""
        if u.compact is not None:  # [Note: compact optimizer states]
            states = u.compact
            if speculative:  # the spare homes take a copy of the homes and are stepped in place
                states = u.spare.compact
                u.spare.compact_home.copy_(u.compact_home)
                t = u.spec.trainable_numel
                u.spare.compute_home[:t].copy_(u.compute_home[:t])
            steps = self.compact_step(u, states, grad_factor, groups)
            (u.spare if speculative else u).steps = steps
            if not speculative:
                self._gradients.release(u)
            return
        steps = self.next_steps(u)
        target = self.compute_target(u)
        n = u.master_numel
        master = u.compute_home if self._layout.merged else u.master_home
        moments = u.moments_home
        out = None
        if speculative:
            spare = u.spare
            assert target is None or target is u.compute_home, "a speculative update never writes the device copy"
            spare_master = spare.compute_home if self._layout.merged else spare.master_home
            out = OutOfPlace(spare_master[:n], *moment_views(spare.moments_home, u, 0, n),
                             None if target is None else target[:n])
            target = None if target is None else spare.compute_home
        start = time.perf_counter()
        self.adam_range(u, 0, n, steps, master[:n], *moment_views(moments, u, 0, n), target, False,
                        grad_factor, groups=groups, out=out)
        self._timeline.span("adam", f"adam {u.name}", start, time.perf_counter())
        (u.spare if speculative else u).steps = steps
        if not speculative:
            self._gradients.release(u)

    def compact_piece_step(self, u: UnitState, piece: CompactPiece, states: Any, high: torch.Tensor,
                           steps: List[int], grad_factor: float, groups: Optional[List[Dict[str, Any]]]) -> None:
        """[Note: compact pieces] One step of u's compact elements in ``piece``: ``states``
        (a CompactRange of its compact elements, over a home or a staging slot) and ``high``
        (the compute copy from element piece.compute_lo on), with u's gradients, ``steps``
        the step counts after the update (next_steps). The same bits as compact_step of the
        whole unit: each parameter's blocks are updated alone."""
        faults.hit("optim.adam_range", unit=u.name, lo=piece.compute_lo, hi=piece.compute_hi)
        groups = self._optimizer.param_groups if groups is None else groups
        rules = {self._group_rules[e.group_index] for e in u.trainable}
        assert all(r.rule is None for r in rules) and len({r.adamw for r in rules}) == 1, \
            "compact states are Adam's/AdamW's alone (wrap refuses the rest)"
        adamw = next(iter(rules)).adamw
        start = time.perf_counter()
        for k, a, b, at in piece.params:
            if not u.has_grad[k]:  # left alone, as torch's AdamW leaves it
                continue
            e = u.trainable[k]
            view = states.range(at, at + b - a)
            view.high = high[e.offset + a - piece.compute_lo:e.offset + b - piece.compute_lo]
            group = groups[e.group_index]
            beta1, beta2 = group["betas"]
            try:
                compact_kernel.compact_adam_step(
                    view, self._gradients.grad_range(u, k, e.offset + a, e.offset + b), step=steps[k],
                    lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), adamw=adamw, grad_scale=grad_factor)
            except NonFiniteStateError as error:  # its elements counted from the parameter's first
                raise NonFiniteStateError(f"{e.fqn}, elements {a}..{b - 1}: {error}") from None
        self._timeline.span("adam", f"adam {u.name}[{piece.compute_lo}:{piece.compute_hi}]", start, time.perf_counter())

    def compact_step(self, u: UnitState, compact: Any, grad_factor: float,
                     groups: Optional[List[Dict[str, Any]]]) -> List[int]:
        """[Note: compact optimizer states] ``compact`` (u's CompactUnit: over its homes, its
        spare homes, or a staging slot's copies of them) stepped from u's step counts with u's
        gradients, which stay u's; the new high parts are written into the compute copy it
        holds views of. Returns the step counts after it (u's are left alone)."""
        faults.hit("optim.adam_range", unit=u.name, lo=0, hi=u.master_numel)
        groups = self._optimizer.param_groups if groups is None else groups
        grads = [self._gradients.grad_range(u, k, e.offset, e.offset + e.numel) if u.has_grad[k] else None
                 for k, e in enumerate(u.trainable)]
        start = time.perf_counter()
        rules = {self._group_rules[e.group_index] for e in u.trainable}
        assert all(r.rule is None for r in rules) and len({r.adamw for r in rules}) == 1, \
            "compact states are Adam's/AdamW's alone (wrap refuses the rest)"
        steps = compact.step(grads, u.steps, [groups[e.group_index] for e in u.trainable],
                             adamw=next(iter(rules)).adamw, grad_scale=grad_factor)
        self._timeline.span("adam", f"adam {u.name}", start, time.perf_counter())
        return steps

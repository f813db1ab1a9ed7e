"""The optimizers ``offload plan --optimizer NAME`` plans for and ``tools/bench_train.py
--optimizer NAME`` trains with, built over a model, and the layout of their state as wrap
learns it.

The layout is not a table per class: ``state_layout`` builds the named optimizers over the
model and probes each one as wrap does (``optim.whole.probe_rule``: [Note: elementwise
optimizers], [Note: whole-parameter optimizers]; Adam's kernel keeps two slots), and every
unit's state home has ``OptimizerSet.state_slots`` of them, the number wrap gives it ([Note:
several optimizers]), each parameter's moments only the slots its own optimizer keeps for it
(``param_slots``, [Note: per-entry state slots]). So the plan counts the bytes wrap allocates
and moves for that optimizer; ``tests/test_plan_optimizers.py`` checks the two against a run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Set, Tuple

import torch
from torch import nn

from offload.memory.state_slots import slot_indices
from offload.optim.several import OptimizerSet
from offload.optim.whole import probe_rule

__all__ = ["OPTIMIZERS", "OptimizerLayout", "build_optimizers", "describe", "muon_matrices", "state_layout"]


Params = List[nn.Parameter]
Builder = Callable[[Params, Set[nn.Parameter]], List[torch.optim.Optimizer]]


def muon_matrices(model: nn.Module) -> Set[nn.Parameter]:
    """Muon's users' split: the 2-D weights inside the model's nn.ModuleLists (the blocks'
    matrices), which Muon takes; AdamW takes the rest (embeddings, the head, norms, biases)."""
    return {p for m in model.modules() if isinstance(m, nn.ModuleList) for p in m.parameters()
            if p.dim() == 2 and p.requires_grad}


def _muon_adamw(params: Params, matrices: Set[nn.Parameter]) -> List[torch.optim.Optimizer]:
    if not any(p in matrices for p in params):
        raise ValueError("--optimizer muon: the model has no 2-D weights inside an nn.ModuleList for Muon")
    return [torch.optim.Muon([p for p in params if p in matrices], lr=0.02, weight_decay=0.1),
            torch.optim.AdamW([p for p in params if p not in matrices], lr=3e-4, weight_decay=0.1)]


def _adafactor(params: Params, matrices: Set[nn.Parameter]) -> List[torch.optim.Optimizer]:
    try:
        from transformers.optimization import Adafactor
    except ImportError as e:
        raise ValueError(f"--optimizer adafactor: transformers' Adafactor is not importable ({e})") from None
    # what TrainingArguments(optim="adafactor") builds
    return [Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)]


def _one(make: Callable[..., torch.optim.Optimizer], **options) -> Builder:
    return lambda params, matrices: [make(params, **options)]


# name -> (what it builds, in words; the builder over the trainable parameters and Muon's matrices)
OPTIMIZERS: Dict[str, Tuple[str, Builder]] = {
    "adamw": ("torch.optim.AdamW(lr=3e-4, weight_decay=0.1)", _one(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)),
    "sgd": ("torch.optim.SGD(lr=1e-2), no momentum", _one(torch.optim.SGD, lr=1e-2)),
    "sgd-momentum": ("torch.optim.SGD(lr=1e-2, momentum=0.9)", _one(torch.optim.SGD, lr=1e-2, momentum=0.9)),
    "adagrad": ("torch.optim.Adagrad(lr=1e-2)", _one(torch.optim.Adagrad, lr=1e-2)),
    "rmsprop": ("torch.optim.RMSprop(lr=1e-3)", _one(torch.optim.RMSprop, lr=1e-3)),
    "adafactor": ("transformers' Adafactor(lr=1e-3, scale_parameter=False, relative_step=False), as "
                  "TrainingArguments(optim='adafactor') builds it", _adafactor),
    "muon": ("torch.optim.Muon(lr=0.02, weight_decay=0.1) for the 2-D weights inside nn.ModuleLists, "
             "torch.optim.AdamW(lr=3e-4, weight_decay=0.1) for the rest", _muon_adamw),
}


def _check_name(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {name!r}")


def build_optimizers(name: str, model: nn.Module) -> List[torch.optim.Optimizer]:
    """The optimizers of ``name`` over ``model``'s trainable parameters (a list: one
    optimizer, or Muon's two)."""
    _check_name(name)
    return OPTIMIZERS[name][1]([p for p in model.parameters() if p.requires_grad], muon_matrices(model))


def describe(name: str) -> str:
    _check_name(name)
    return OPTIMIZERS[name][0]


@dataclass(frozen=True)
class OptimizerLayout:
    """What wrap will keep for a model's optimizers, learned by probing them."""

    name: str
    state_slots: int                 # fp32 tensors per trainable element in every unit's state home
    slots: Tuple[Tuple[str, ...], ...]  # per optimizer: the names of its per-element state tensors
    side: Tuple[Tuple[str, ...], ...]   # per optimizer: its other tensors, kept per parameter in host RAM
    whole_params: FrozenSet[nn.Parameter]  # the model's parameters stepped whole ([Note: whole-parameter optimizers])
    # [Note: per-entry state slots] per model parameter: its param group's index in wrap's one
    # sequence of groups (which orders a unit's parameters) and the slots its optimizer keeps
    group_of: Dict[nn.Parameter, int] = field(default_factory=dict)
    param_slots: Dict[nn.Parameter, Tuple[int, ...]] = field(default_factory=dict)
    classes: Tuple[str, ...] = ()         # per optimizer: its class's name
    adam_kernel: Tuple[bool, ...] = ()    # per optimizer: stepped by the Adam kernel (a torch.optim.Adam)

    def state_name(self) -> str:
        """The plan's name for the state homes' contents: "Adam moments" where every optimizer
        runs on the Adam kernel, else each optimizer's class and the per-element tensors it
        keeps, as probed (Muon beside AdamW: "optimizer state (Muon momentum_buffer; AdamW
        exp_avg, exp_avg_sq)")."""
        if all(self.adam_kernel):
            return "Adam moments"
        kept = "; ".join(f"{cls} {', '.join(names) or 'none'}" for cls, names in zip(self.classes, self.slots))
        return f"optimizer state ({kept})"

    def state_bytes_per_param(self) -> float:
        """fp32 state bytes per trainable parameter of the model, before page padding: what
        torch keeps per parameter in tensors shaped like it."""
        numel = sum(p.numel() for p in self.param_slots)
        return sum(len(k) * p.numel() for p, k in self.param_slots.items()) * 4 / numel if numel else 0.0

    @property
    def whole(self) -> bool:
        return bool(self.whole_params)


def state_layout(name: str, model: nn.Module) -> OptimizerLayout:
    """The layout of ``name``'s optimizers over ``model`` (meta or real); ValueError where
    wrap would refuse them. The optimizers are built over one-element stand-ins of the
    model's trainable parameters (each of the same dimensionality, which is all the probes
    read of them; a meta model's Adagrad could not step its meta state) and probed as wrap
    probes them; the model is not touched."""
    _check_name(name)
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = muon_matrices(model)
    with torch.device("cpu"):  # the probes' tensors too, inside a caller's torch.device("meta")
        stand_ins = [nn.Parameter(torch.zeros((1,) * p.dim())) for p in params]
        of_stand_in = dict(zip(stand_ins, params))
        optimizers = OPTIMIZERS[name][1](stand_ins, {s for s, p in of_stand_in.items() if p in matrices})
        rules = [None if isinstance(opt, torch.optim.Adam) else probe_rule(opt) for opt in optimizers]
    whole = frozenset(of_stand_in[s] for opt, rule in zip(optimizers, rules) if rule is not None and rule.whole
                      for group in opt.param_groups for s in group["params"])
    group_of: Dict[nn.Parameter, int] = {}
    param_slots: Dict[nn.Parameter, Tuple[int, ...]] = {}
    first = 0
    for opt, rule in zip(optimizers, rules):
        for gi, group in enumerate(opt.param_groups):
            for s in group["params"]:
                group_of[of_stand_in[s]] = first + gi
                param_slots[of_stand_in[s]] = slot_indices(rule, gi, s.dim())
        first += len(opt.param_groups)
    return OptimizerLayout(
        name, OptimizerSet.state_slots(rules),
        tuple(("exp_avg", "exp_avg_sq") if rule is None else rule.slots for rule in rules),
        tuple(() if rule is None else getattr(rule, "side_names", ()) for rule in rules), whole,
        group_of, param_slots, tuple(type(opt).__name__ for opt in optimizers), tuple(rule is None for rule in rules))

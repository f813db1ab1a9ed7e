"""Several optimizers over one model: ``wrap(model, [muon, adamw])``.

[Note: several optimizers]
The optimizers' parameters partition the model's trainable parameters: a parameter in two
optimizers, or a trainable one in none, is a ValueError naming it, raised at wrap before
anything is touched. The engine sees one sequence of param groups, the optimizers' own group
dicts one after the other (``OptimizerSet.param_groups``, made afresh at each read, so that a
scheduler built on the user's own optimizer object, which edits its group dicts, changes the
engine's rates, and the checkpoint's ``param_groups`` are the concatenation). A unit's
parameter knows its group by its index in that sequence (``ParamEntry.group_index``);
``GroupRule`` of each index says which optimizer's rule updates it: the native Adam kernel
(with AdamW's or Adam's decay) or the optimizer's ElementwiseRule with the group's index
inside that optimizer ([Note: elementwise optimizers]). Every unit has the largest number of
state slots any of the optimizers needs; a parameter uses the ones its own optimizer names,
and its elements are kept only in those ([Note: per-entry state slots]).
A single optimizer is the set of one, and behaves exactly as before.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch
from torch import nn

__all__ = ["GroupRule", "OptimizerSet", "as_optimizer_list"]


class GroupRule(NamedTuple):
    """How the parameters of one param group (an index into OptimizerSet.param_groups)
    are updated: ``rule`` None is the native Adam kernel (``adamw``: decoupled decay),
    otherwise ``rule`` steps them with its optimizer's group ``local_index``."""
    rule: Optional[Any]          # an ElementwiseRule
    local_index: int
    adamw: bool


def as_optimizer_list(optimizer_or_list: Any) -> List[torch.optim.Optimizer]:
    """The optimizers wrap was given: one ``torch.optim.Optimizer`` or a non-empty list or
    tuple of them (a ValueError naming the entry otherwise)."""
    if isinstance(optimizer_or_list, torch.optim.Optimizer):
        return [optimizer_or_list]
    if isinstance(optimizer_or_list, (list, tuple)):
        if not optimizer_or_list:
            raise ValueError("optimizer: an empty list; pass a torch.optim.Optimizer or a list of them")
        for i, opt in enumerate(optimizer_or_list):
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"optimizer: entry {i} of the list is a {type(opt).__name__}, not a "
                                 "torch.optim.Optimizer")
        if len({id(opt) for opt in optimizer_or_list}) != len(optimizer_or_list):
            raise ValueError("optimizer: the same optimizer object is in the list twice")
        return list(optimizer_or_list)
    raise ValueError(f"optimizer: expected a torch.optim.Optimizer or a list of them, got "
                     f"{type(optimizer_or_list).__name__}")


class OptimizerSet:
    """The optimizers of one engine seen as one sequence of param groups ([Note: several
    optimizers]). Has what the engine's collaborators read of an optimizer:
    ``param_groups``."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = tuple(optimizers)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def check_partition(self, model: nn.Module) -> None:
        """A ValueError naming the first parameter that is in two of the optimizers (or twice
        in one), or trainable in none, when there are several optimizers."""
        if len(self.optimizers) == 1:
            return  # one optimizer: split_into_units names a trainable parameter it lacks
        name_of = {p: n for n, p in model.named_parameters(remove_duplicate=True)}
        owner: Dict[nn.Parameter, int] = {}
        for i, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p in owner:
                        raise ValueError(
                            f"optimizer: parameter {name_of.get(p, tuple(p.shape))!r} is in optimizer {owner[p]} "
                            f"({type(self.optimizers[owner[p]]).__name__}) and in optimizer {i} "
                            f"({type(opt).__name__}) of the list; each parameter must be in exactly one")
                    owner[p] = i
        for p, name in name_of.items():
            if p.requires_grad and p not in owner:
                raise ValueError(f"optimizer: trainable parameter {name!r} is in none of the {len(self.optimizers)} "
                                 "optimizers of the list; add it to one or set requires_grad=False")

    @staticmethod
    def state_slots(rules: Sequence[Optional[Any]]) -> int:
        """The fp32 state slots of every unit's state home: the most any optimizer needs
        (each parameter's elements kept in its own optimizer's only: [Note: per-entry state slots]),
        Adam's kernel two, a rule its own (``rules``: one per optimizer, None for Adam's)."""
        return max(2 if rule is None else len(rule.slots) for rule in rules)

    def layout(self, rules: Sequence[Optional[Any]]) -> Optional[Dict[str, Any]]:
        """What a checkpoint records of the optimizers' state, so that a load into other
        optimizers is refused: None for one Adam (the default), one ElementwiseRule's layout,
        or for a list each optimizer's in order."""
        if len(self.optimizers) == 1:
            return None if rules[0] is None else rules[0].layout()
        # every optimizer on the Adam kernel keeps the same state (as one alone: None for all)
        layouts = [{"class": "Adam", "slots": ["exp_avg", "exp_avg_sq"], "scalars": []}
                   if rule is None else rule.layout() for opt, rule in zip(self.optimizers, rules)]
        return {"class": " + ".join(layout["class"] for layout in layouts),
                "slots": [s for layout in layouts for s in layout["slots"]], "optimizers": layouts}

    def forget_state(self, params: Sequence[nn.Parameter]) -> None:
        """Drop what the optimizers held for ``params``: the engine's homes hold it now."""
        for opt in self.optimizers:
            for p in params:
                opt.state.pop(p, None)

"""A model's shape as ``offload plan`` sees it: its units as the engine would cut them (from
a module, a factory spec, or a bare parameter count with an assumed transformer layout),
with what an optimizer given by name keeps per parameter. offload.plan places and prices
these shapes."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from offload._sizes import FP32_BYTES
from offload.memory.budget import UnitSizes
from offload.memory.compact_codec import compact_padded_numel
from offload.memory.state_slots import StateSlots
from offload.plan_optimizers import OptimizerLayout, state_layout
from offload import units as unit_split
from offload.units import padded_numel


@dataclass(frozen=True)
class UnitShape:
    name: str
    total_numel: int
    trainable_numel: int
    largest_param_numel: int
    shared_numel: int = 0  # trainable elements of tied parameters ([Note: shared parameter gradients])
    compact_numel: Optional[int] = None  # [Note: compact optimizer states] None: parameter sizes unknown
    whole_step: bool = False  # it holds a parameter stepped whole ([Note: whole-parameter optimizers])
    # [Note: per-entry state slots] its moments home's fp32 elements where its parameters keep
    # different slots (None: every one keeps all of them, or parameter sizes unknown), and the
    # most of them one piece of the staged step moves (UnitSizes.moments_piece_numel)
    moments_numel: Optional[int] = None
    moments_piece_numel: Optional[int] = None

    def sizes(self, element_bytes: int) -> UnitSizes:
        """The unit's sizes as wrap has them on one process."""
        sizes = UnitSizes.unsharded(self.name, self.total_numel, self.trainable_numel, self.largest_param_numel,
                                    element_bytes, self.shared_numel, self.compact_numel)
        return dataclasses.replace(sizes, whole_step=self.whole_step, moments_numel=self.moments_numel,
                                   moments_piece_numel=self.moments_piece_numel)


@dataclass(frozen=True)
class ModelShape:
    """Units as the engine would cut them, root first."""

    description: str
    units: Tuple[UnitShape, ...]
    exact: bool                  # False when synthesized from a parameter count
    optimizer: Optional[OptimizerLayout] = None  # --optimizer: its state, learned as wrap learns it
    # synthesized with --optimizer: the fp32 state elements its assumed parameters keep, before
    # page padding ([Note: per-entry state slots]; None: exact, or no optimizer given)
    kept_state_numel: Optional[int] = None

    @property
    def num_params(self) -> int:
        return sum(u.total_numel for u in self.units)

    @property
    def num_trainable(self) -> int:
        return sum(u.trainable_numel for u in self.units)


def shape_from_count(num_params: int, num_units: int, optimizer: Optional[str] = None) -> ModelShape:
    """A transformer-like shape for a bare parameter count: ``num_units`` equal blocks plus a
    root unit of the same size (embeddings, head), the largest parameter a third of a unit
    (a block's MLP matrix is 4d^2 of its 12d^2). Without ``optimizer`` every parameter keeps
    the optimizer's every state tensor. ``optimizer``: a name of plan_optimizers.OPTIMIZERS,
    probed over a stand-in of such a model (``_StandIn``); each parameter of the units'
    assumed composition (``_assumed_params``: the reference GPT's, offload/gpt.py) then keeps
    the slots its own optimizer keeps for a parameter of its kind, and a unit holds a
    whole-stepped parameter where one of its kinds is stepped whole ([Note: per-entry state
    slots], as wrap counts each unit's entries)."""
    if num_params < 1:
        raise ValueError(f"--params: expected a positive parameter count, got {num_params}")
    if num_units < 1:
        raise ValueError(f"--num-units: expected an int >= 1, got {num_units}")
    stand_in = _StandIn()
    layout = None if optimizer is None else state_layout(optimizer, stand_in)
    per_unit, rest = divmod(num_params, num_units + 1)
    width = _block_width(per_unit)
    units, kept = [], 0
    for i in range(num_units + 1):
        numel = per_unit + (rest if i == 0 else 0)
        whole_step, pages = False, None
        if layout is not None:
            params = _assumed_params(numel, width, root=i == 0, stand_in=stand_in)
            whole_step = any(p in layout.whole_params for p, _ in params)
            pages = _state_pages(layout, params)
            kept += sum(len(layout.param_slots[p]) * n for p, n in params)
        units.append(UnitShape("<root>" if i == 0 else f"unit{i}", numel, numel, max(1, numel // 3),
                               whole_step=whole_step, **_moments_fields(pages, whole_step)))
    if layout is None:
        state = "every parameter keeps every optimizer state tensor"
    else:
        state = (f"each parameter keeps what {optimizer} keeps for its kind: a block is the reference GPT's of "
                 f"width {width} (LayerNorm, qkv and proj, LayerNorm, fc and out: 12 d^2 in matrices inside an "
                 "nn.ModuleList, 10 d in norms and biases, the rest of the unit in fc), the root unit embeddings "
                 "and a final LayerNorm")
    return ModelShape(f"{num_params:,} parameters (assumed: {num_units} equal units plus a root unit of the "
                      f"same size; largest parameter a third of a unit; {state})",
                      tuple(units), exact=False, optimizer=layout, kept_state_numel=None if layout is None else kept)


def _block_width(numel: int) -> int:
    """The largest width d whose reference GPT block (12 d^2 + 10 d elements) fits ``numel``."""
    d = int((numel / 12) ** 0.5) + 1
    while d > 0 and 12 * d * d + 10 * d > numel:
        d -= 1
    return d


def _assumed_params(numel: int, width: int, root: bool, stand_in: "_StandIn"
                    ) -> List[Tuple[torch.nn.Parameter, int]]:
    """The parameters shape_from_count assumes a unit of ``numel`` elements holds, in model
    order, each as (the stand-in parameter of its kind, its element count): a block is the
    reference GPT's (offload/gpt.py, qkv without bias) of ``width``, its remainder in the fc
    matrix; the root unit is the tied embeddings followed by the final LayerNorm."""
    d = width
    norm, matrix, bias = stand_in.blocks[0][0].weight, stand_in.blocks[0][1].weight, stand_in.blocks[0][1].bias
    if root:
        return [(stand_in.wte.weight, numel - 2 * d), (stand_in.ln_f.weight, d), (stand_in.ln_f.bias, d)]
    rest = numel - (12 * d * d + 10 * d)
    return [(norm, d), (norm, d), (matrix, 3 * d * d), (matrix, d * d), (bias, d), (norm, d), (norm, d),
            (matrix, 4 * d * d + rest), (bias, 4 * d), (matrix, 4 * d * d), (bias, d)]


def _state_pages(layout: OptimizerLayout, params: List[Tuple[torch.nn.Parameter, int]]) -> Optional[StateSlots]:
    """[Note: per-entry state slots] The StateSlots of a unit of ``params`` (stand-ins of
    layout's model with their counts) as UnitState makes them: ordered by param group as
    split_into_units orders them; None where every parameter keeps every slot."""
    if not layout.state_slots:
        return None
    ordered = sorted(params, key=lambda pn: layout.group_of[pn[0]])  # stable: model order inside a group
    entries, offset = [], 0
    for p, n in ordered:
        entries.append((offset, n, layout.param_slots[p]))
        offset += n
    return StateSlots.of(layout.state_slots, padded_numel(offset, FP32_BYTES), entries)


def _moments_fields(pages: Optional[StateSlots], whole_step: bool) -> Dict[str, Optional[int]]:
    """UnitShape's moments_numel and moments_piece_numel of a unit whose StateSlots are
    ``pages`` (None: the plain layout), as UnitSizes.of gives them."""
    if pages is None:
        return {"moments_numel": None, "moments_piece_numel": None}
    return {"moments_numel": pages.numel,
            "moments_piece_numel": pages.largest_piece_numel(unit_split.OPTIMIZER_PIECE_NUMEL, whole_step)}


class _StandIn(torch.nn.Module):
    """One parameter of each kind a transformer has, to probe an optimizer over when the
    plan has only a parameter count: an embedding, a block in a ModuleList (a norm, a matrix,
    a bias), a final norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(4, 2)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.LayerNorm(2), torch.nn.Linear(2, 2))])
        self.ln_f = torch.nn.LayerNorm(2)
        self.head = torch.nn.Linear(2, 4, bias=False)


def shape_from_model(spec: str, unit_classes: Sequence[str] = (), optimizer: Optional[str] = None) -> ModelShape:
    """Build ``module:factory`` on the meta device and cut it into units as the engine does
    (every parameter trainable; ``optimizer``: a name of plan_optimizers.OPTIMIZERS, built over
    it and probed as wrap probes it, else Adam's two slots). The factory is called with no
    arguments (``offload.gpt:GPT`` builds the default GPTConfig); one that needs some is a
    ValueError naming them, before it is called."""
    import torch

    if ":" not in spec:
        raise ValueError(f"--model: expected module:factory (e.g. mypkg.models:build), got {spec!r}")
    module_name, factory_name = spec.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model: cannot load {spec!r}: {e}") from None
    required = _required_arguments(factory)
    if required:
        raise ValueError(f"--model: {spec} needs arguments ({', '.join(required)}) and --model calls it with none: "
                         "name a function that builds the model with its arguments, e.g. in my_models.py "
                         "'def build(): return GPT(GPTConfig(d_model=1024, num_layers=24))', then "
                         "--model my_models:build")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # the user's code: report it as a bad --model, not a crash
        raise ValueError(f"--model: calling {spec}() failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model: {spec} returned {type(model).__name__}, not an nn.Module")
    return shape_from_module(model, spec, unit_classes, optimizer)


def _required_arguments(factory) -> List[str]:
    """The parameters ``factory()`` would be missing ([] when it cannot be told)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: let the call say
        return []
    return [name for name, p in signature.parameters.items()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def shape_from_module(model, name: str, unit_classes: Sequence[str] = (), optimizer: Optional[str] = None
                      ) -> ModelShape:
    """Units of ``model`` (meta or real) as the engine cuts them, every parameter trainable;
    ``optimizer``: as shape_from_model's."""
    from offload.units import split_into_units

    layout = None if optimizer is None else state_layout(optimizer, model)
    whole = frozenset() if layout is None else layout.whole_params
    # wrap orders a unit's trainable parameters by param group: the trainable prefix's offsets
    # (the master's and the moments') are the same with any compute element size
    group_of = {p: 0 for p in model.parameters() if p.requires_grad} if layout is None else layout.group_of
    specs = split_into_units(model, group_of, 4, unit_classes)

    def state_pages(spec) -> Optional[StateSlots]:  # [Note: per-entry state slots] as UnitState makes them
        if layout is None or not layout.state_slots:
            return None
        return StateSlots.of(layout.state_slots, padded_numel(spec.trainable_numel, FP32_BYTES),
                             [(e.offset, e.numel, layout.param_slots[e.param]) for e in spec.trainable_entries])

    units = []
    for s in specs:
        whole_step = any(e.param in whole for e in s.entries if e.trainable)
        units.append(UnitShape(s.name, s.total_numel, s.trainable_numel,
                               max((e.numel for e in s.entries if e.trainable), default=0),
                               s.shared_numel, compact_padded_numel([e.numel for e in s.entries if e.trainable]),
                               whole_step=whole_step, **_moments_fields(state_pages(s), whole_step)))
    units = tuple(units)
    return ModelShape(f"{name} ({sum(u.total_numel for u in units):,} parameters, {len(units)} units)",
                      units, exact=True, optimizer=layout)

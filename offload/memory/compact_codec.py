"""[Note: compact optimizer states] The codec of optimizer_states="compact": Adam's two
moments in 8 bits each, companded and quantized in blocks, and the fp32 master as the bf16
compute copy plus an 8-bit low part. In torch ops here (loading, export, the reference
step); the training step runs the same rule fused in native/compact, with the same bits on
every ISA ([Note: compact step numerics] in native/compact/compact.h).

The rule (every constant rounded to fp32 first, every operation one IEEE fp32 rounding, so
the same bits on every machine; rounding half to even (torch.round), no
fused multiply-add, square roots correctly rounded: ``ieee_sqrt``):
- A flat range is cut into blocks of BLOCK_NUMEL elements (the last one may be shorter),
  each with one fp32 scale: the largest |value| of the block (0 for an all-zero block,
  whose codes are all 0).
- exp_avg (m), int8, signed square-root companding: code = round(sign(m) *
  sqrt(|m| / s) * 127); m = sign(c) * (|c| / 127)^2 * s. Bound, in the companded domain:
  |sqrt(|m'|/s) - sqrt(|m|/s)| <= 0.5/127 (plus a few fp32 ulps), so near the block's
  largest value the error is about 1.6% of it, and values down to s/64516 are kept nonzero
  (a linear map zeroes everything below s/254: those elements' momentum would never grow
  past the rounding and they would stop training).
- exp_avg_sq (v), uint8, fourth-root companding: code = round((v / s)^(1/4) * 255), at
  least 1 where v > 0; v = (c/255)^4 * s. Bound: |(v'/s)^(1/4) - (v/s)^(1/4)| <= 0.5/255
  (plus a few fp32 ulps) where (v/s)^(1/4) >= 0.5/255; below that, v' = s/255^4 exactly. The
  fourth root is the square root of the RMS sqrt(v) that Adam divides by, so m and sqrt(v)
  keep the same dynamic range (about 65000); a nonzero v never decodes to 0 (which would
  divide the update by eps alone).
- master x, bf16 high + int8 low: high = x rounded to nearest even bf16 (the compute copy),
  low = round((x - high) / ulp(high) * 254), x' = high + low * ulp(high) / 254, where
  ulp(high) is the spacing of bf16 values at high's exponent (2^-133 for zero and
  subnormals). Bound: |x' - x| <= ulp(high) / 508 (plus one fp32 rounding), about 2^-16
  of |x|: an update smaller than that is lost, as one below 2^-24 of |x| is with fp32.
Why these maps (tools/measure_compact_codec.py; its table in docs/architecture.md,
"Numerics"): on heavy-tailed blocks a linear map zeroes most of each block's momentum (and
those updates); a v decoded to 0 divides its update by eps alone, which the square-root
map of v and the plain fourth root both do (cosine with the exact update 0.26 and 0.02 at
4 decades, 0.80 with the level kept >= 1); rounding v up instead biases every update down.
Non-finite values are never encoded: a NaN or Inf in any state raises
NonFiniteStateError naming the state and the first element, before anything is written
(the native step: before anything is written for a non-finite gradient; an update that
overflows leaves the block holding such a value as it was, others updated: compact_adam_step).
Bytes per parameter: 1 (m) + 1 (v) + 1 (low) + 8/BLOCK_NUMEL (two scales) beside the bf16
compute copy: ``compact_state_bytes``.
Where they live (docs/architecture.md, "Numerics"): a unit's codes, scales and low parts are
one buffer on its state tier (host, or a swap extent), laid out by ``compact_home_layout``,
its high parts the compute copy; placement never changes the bits. The staged step moves a
unit in pieces ([Note: compact pieces]). A checkpoint keeps those
bytes as they are, never fp32 states: re-encoding a decoded master may flip the high/low
split at a tie."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Protocol, Sequence, Tuple

import numpy as np
import torch

from offload._sizes import PAGE_BYTES

if TYPE_CHECKING:
    from offload.memory.layout import UnitState

__all__ = ["BLOCK_NUMEL", "COMPACT_ARRAYS", "CompactHomeLayout", "CompactPiece", "CompactStates",
           "NonFiniteStateError", "SCALE_PAGE_NUMEL", "compact_home_layout", "compact_padded_numel",
           "compact_piece_bytes", "compact_piece_numel", "compact_piece_regions", "compact_pieces",
           "compact_range_parts", "compact_state_bytes", "decode_exp_avg", "decode_exp_avg_sq",
           "decode_master", "encode_exp_avg", "encode_exp_avg_sq", "encode_master", "ieee_sqrt", "num_blocks",
           "ulp_of_bf16"]

# 256: the scales cost 8/256 = 0.03 B per parameter for both moments; one outlier flattens
# only its own 256 neighbours' resolution, as bitsandbytes' blockwise 8-bit Adam does
BLOCK_NUMEL = 256

_F32 = torch.float32
_M_LEVELS = torch.tensor(127.0, dtype=_F32)
_V_LEVELS = torch.tensor(255.0, dtype=_F32)
_LOW_LEVELS = torch.tensor(254.0, dtype=_F32)


def ieee_sqrt(values: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root, as IEEE 754 defines it: numpy's (the
    instruction SQRTPS/SQRTSS or the C library's sqrtf). torch's CPU sqrt calls MKL's vsSqrt,
    which is not correctly rounded and misses on different elements on different CPUs
    (tests/support.py, correctly_rounded_sqrt)."""
    assert values.dtype == _F32
    return torch.from_numpy(np.sqrt(values.contiguous().numpy()))


class NonFiniteStateError(FloatingPointError):
    """A NaN or Inf reached an optimizer state that compact states cannot hold."""


def num_blocks(numel: int) -> int:
    return (numel + BLOCK_NUMEL - 1) // BLOCK_NUMEL


def compact_padded_numel(numels: Sequence[int]) -> int:
    """Elements of the compact states of parameters of ``numels`` elements, each starting on
    a block boundary (offload/optim/compact.py's CompactUnit): each padded to whole blocks."""
    return sum(num_blocks(n) * BLOCK_NUMEL for n in numels)


def compact_state_bytes(numel: int) -> int:
    """Bytes of compact state for ``numel`` parameters besides the bf16 compute copy: the
    int8 master low part, the two 8-bit moments and their fp32 scales."""
    return 3 * numel + 2 * 4 * num_blocks(numel)


# [Note: compact pieces] The staged step (optim/step.py) moves and updates a compact unit in
# pieces of compact_piece_numel compact elements (the exact step's piece rounded up to
# SCALE_PAGE_NUMEL; 1 Mi elements by default), so that a staging slot holds a piece, not the
# largest unit (budget._compact_slot_shape):
# - A piece is whole blocks of parameters (each parameter starts on a block, CompactUnit), and
#   the kernel updates each block alone ([Note: compact step numerics]): a unit stepped piece
#   by piece has the bits of the unit stepped whole (UnitAdam.compact_piece_step).
# - A home of more than SCALE_PAGE_NUMEL elements is paged (compact_home_layout): each of its
#   five arrays starts on a page, so a piece's part of each is whole pages (its scales start at
#   lo / 64 bytes, lo a multiple of SCALE_PAGE_NUMEL): five aligned requests a piece. A smaller
#   home is packed and is one piece, moved whole.
# - The high parts are the compute copy, whose parameters are packed without blocks: a
#   piece's elements [compute_lo, compute_hi) start and end anywhere in a page. The piece
#   reads the pages from the one holding compute_lo to the one after the page holding
#   compute_hi (PipelinedStep._compact_window), updates its own elements, and writes back
#   its pages up to the one holding compute_hi, which the next piece writes: the elements of
#   it that this piece updated are carried to the next piece (PipelinedStep._compact_carry),
#   which puts them in its slot before its update. So every page is written once a step, by
#   one piece, holding every update of its elements; the pages read twice (one a boundary)
#   are counted by placement.predict_step.

# Elements whose fp32 scales fill one page (1024 blocks)
SCALE_PAGE_NUMEL = PAGE_BYTES // 4 * BLOCK_NUMEL


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class CompactHomeLayout(NamedTuple):
    """Where a compact home's five arrays start (bytes), for ``numel`` elements (padded to
    blocks): exp_avg's scales, exp_avg_sq's scales, the int8 low parts, exp_avg's and
    exp_avg_sq's codes, then ``nbytes`` in all. ``paged``: each array starts on a page and
    is padded to whole pages, so that a piece of each moves in page-aligned requests
    ([Note: compact pieces]); else they are packed (compact_state_bytes)."""
    numel: int
    paged: bool
    exp_avg_scales: int
    exp_avg_sq_scales: int
    low: int
    exp_avg: int
    exp_avg_sq: int
    nbytes: int

    def region_end(self, name: str) -> int:
        """Where array ``name``'s region ends (its page padding included when paged)."""
        order = ("exp_avg_scales", "exp_avg_sq_scales", "low", "exp_avg", "exp_avg_sq")
        i = order.index(name)
        return getattr(self, order[i + 1]) if i + 1 < len(order) else self.nbytes


def compact_home_layout(numel: int) -> CompactHomeLayout:
    """The layout of a compact home of ``numel`` elements (a multiple of BLOCK_NUMEL): packed
    up to SCALE_PAGE_NUMEL elements (a home the staged step moves whole), paged beyond."""
    assert numel % BLOCK_NUMEL == 0
    scale_bytes = 4 * num_blocks(numel)
    paged = numel > SCALE_PAGE_NUMEL
    sizes = [scale_bytes, scale_bytes, numel, numel, numel]
    if paged:
        sizes = [_round_up(n, PAGE_BYTES) for n in sizes]
    starts = [sum(sizes[:i]) for i in range(5)]
    return CompactHomeLayout(numel, paged, *starts, sum(sizes))


# a compact home's arrays in order: (name, dtype, whether it holds a value per block)
COMPACT_ARRAYS = (("exp_avg_scales", torch.float32, True), ("exp_avg_sq_scales", torch.float32, True),
                  ("low", torch.int8, False), ("exp_avg", torch.int8, False), ("exp_avg_sq", torch.uint8, False))


def compact_range_parts(layout: CompactHomeLayout, lo: int, hi: int) -> Dict[str, Tuple[int, int]]:
    """Compact elements [lo, hi) (``lo`` on a block) of a home laid out by ``layout``: per
    array, (start in the home, bytes); a per-block array's part is the scales of the blocks
    that hold [lo, hi)."""
    assert lo % BLOCK_NUMEL == 0 and lo <= hi <= layout.numel
    return {name: (getattr(layout, name) + (lo // BLOCK_NUMEL * 4 if per_block else lo),
                   4 * num_blocks(hi - lo) if per_block else hi - lo)
            for name, _, per_block in COMPACT_ARRAYS}


def compact_piece_regions(layout: CompactHomeLayout, lo: int, hi: int) -> Dict[str, Tuple[int, int, int]]:
    """[Note: compact pieces] Per array of a paged home, piece [lo, hi)'s part: (start in a
    staging slot, start in the home, bytes), each whole pages (the last piece runs on to
    the array's padded end); the slot's parts follow one another in array order."""
    assert layout.paged and lo % SCALE_PAGE_NUMEL == 0
    out, at = {}, 0
    for name, _, per_block in COMPACT_ARRAYS:
        start = getattr(layout, name) + (lo // BLOCK_NUMEL * 4 if per_block else lo)
        end = layout.region_end(name) if hi == layout.numel else \
            getattr(layout, name) + (hi // BLOCK_NUMEL * 4 if per_block else hi)
        out[name] = (at, start, end - start)
        at += end - start
    return out


def compact_piece_numel(piece_numel: int) -> int:
    """Compact elements of one piece of the staged step: the exact step's ``piece_numel``
    rounded up to a multiple of SCALE_PAGE_NUMEL (the default, 1 Mi elements, is one)."""
    return _round_up(max(piece_numel, 1), SCALE_PAGE_NUMEL)


def compact_piece_bytes(size: int) -> int:
    """[Note: compact pieces] Staging bytes of a full piece of ``size`` (a
    compact_piece_numel) elements of a paged home: each array's part, whole pages."""
    return 2 * (size // BLOCK_NUMEL * 4) + 3 * size


class CompactPiece(NamedTuple):
    """[Note: compact pieces] One piece of a unit's compact step: compact elements [lo, hi)
    of the unit (whole blocks), which hold elements [compute_lo, compute_hi) of its
    trainable prefix; ``params``: (k, a, b, at) for each trainable parameter k it holds
    elements [a, b) of (a on a block of k), at compact element lo + at."""
    lo: int
    hi: int
    compute_lo: int
    compute_hi: int
    params: Tuple[Tuple[int, int, int, int], ...]


def compact_pieces(numels: Sequence[int], offsets: Sequence[int], piece_numel: int) -> List[CompactPiece]:
    """[Note: compact pieces] The pieces of a unit whose trainable parameters have ``numels``
    elements at ``offsets`` of its trainable prefix (packed, in order), for the staged
    step's ``piece_numel``: one piece when its compact states are at most
    compact_piece_numel(piece_numel) elements, else pieces of that many compact elements
    (the last shorter)."""
    padded = [num_blocks(n) * BLOCK_NUMEL for n in numels]
    starts = [sum(padded[:k]) for k in range(len(padded))]
    total = sum(padded)
    size = compact_piece_numel(piece_numel)
    pieces = []
    for lo in range(0, total, size):
        hi = min(lo + size, total)
        params = []
        for k, (n, start) in enumerate(zip(numels, starts)):
            a, b = max(lo, start) - start, min(hi, start + n) - start
            if a < b:
                params.append((k, a, b, start + a - lo))
        first, last = params[0], params[-1]
        pieces.append(CompactPiece(lo, hi, offsets[first[0]] + first[1], offsets[last[0]] + last[2], tuple(params)))
    return pieces


class CompactStates(Protocol):
    """The port through which the homes (memory/homes.py), the staged step (optim/step.py)
    and the checkpoint code see a unit's compact states: one object over bytes and a
    compute copy that the caller holds. Implemented above memory, beside the step that
    runs on it (optim/compact.py, ``UnitCompactStates``); the engine builds the one
    instance and hands it to Homes, which the others reach it through (``Homes.compact``)."""

    def over(self, u: "UnitState", buffer: torch.Tensor, compute: torch.Tensor) -> Any:
        """u's CompactUnit over ``buffer`` (u's compact home, or a copy of its bytes: at
        least compact_state_bytes, uint8, not touched here) and ``compute`` (u's compute
        copy from element 0, or its trainable prefix), whose views are the high parts."""


def _check_finite(name: str, values: torch.Tensor) -> None:
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = (~finite).nonzero()
        first = int(bad[0, 0])
        raise NonFiniteStateError(
            f"{name}: {bad.shape[0]} non-finite value(s) (NaN/Inf), the first at element {first} "
            f"({float(values[first])}); compact optimizer states cannot hold them")


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """``values`` (flat fp32) as rows of BLOCK_NUMEL, the last padded with zeros (which
    change no block's largest value)."""
    pad = num_blocks(values.numel()) * BLOCK_NUMEL - values.numel()
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return values.view(-1, BLOCK_NUMEL)


def _safe(scales: torch.Tensor) -> torch.Tensor:
    # an all-zero block divides by 1: its values are 0, so are its codes
    return torch.where(scales == 0, torch.ones_like(scales), scales)


def encode_exp_avg(m: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 exp_avg -> (int8 codes, fp32 scale per block); see the Note."""
    assert m.dtype == _F32 and m.dim() == 1
    _check_finite("exp_avg", m)
    blocks = _blocks(m)
    scales = blocks.abs().amax(dim=1)
    unit = ieee_sqrt(torch.abs(blocks) / _safe(scales)[:, None])  # in [0, 1]
    codes = torch.round(torch.sign(blocks) * (unit * _M_LEVELS))
    return codes.to(torch.int8).view(-1)[: m.numel()], scales


def decode_exp_avg(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes and block scales -> flat fp32 exp_avg."""
    c = _blocks(codes.to(_F32))
    unit = torch.abs(c) / _M_LEVELS
    return (torch.sign(c) * ((unit * unit) * scales[:, None])).view(-1)[: codes.numel()]


def encode_exp_avg_sq(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 exp_avg_sq (>= 0) -> (uint8 codes, fp32 scale per block); see the Note."""
    assert v.dtype == _F32 and v.dim() == 1
    _check_finite("exp_avg_sq", v)
    if bool((v < 0).any()):
        first = int((v < 0).nonzero()[0, 0])
        raise NonFiniteStateError(f"exp_avg_sq: negative value {float(v[first])} at element {first}; "
                                  "a second moment is never below 0")
    blocks = _blocks(v)
    scales = blocks.amax(dim=1)
    unit = ieee_sqrt(ieee_sqrt(blocks / _safe(scales)[:, None]))  # in [0, 1]
    codes = torch.round(unit * _V_LEVELS)
    codes = torch.where(blocks > 0, torch.clamp(codes, min=1.0), codes)  # never 0 for v > 0
    return codes.to(torch.uint8).view(-1)[: v.numel()], scales


def decode_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 codes and block scales -> flat fp32 exp_avg_sq."""
    unit = _blocks(codes.to(_F32)) / _V_LEVELS
    square = unit * unit
    return ((square * square) * scales[:, None]).view(-1)[: codes.numel()]


def ulp_of_bf16(high: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at each element's exponent, as fp32: 2^(e - 7) for a
    normal value of exponent e, 2^-133 for zero and subnormals (exact powers of two, made
    from the bits)."""
    biased = (high.to(_F32).view(torch.int32) >> 23) & 0xFF
    normal_bits = (biased - 7) << 23                     # 2^(biased - 134), a normal fp32
    subnormal_bits = torch.ones_like(biased) << (torch.clamp(biased, min=1) + 15)  # 2^-133 .. 2^-127
    return torch.where(biased >= 8, normal_bits, subnormal_bits).view(_F32)


def encode_master(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 master -> (bf16 high, the compute copy; int8 low); see the Note."""
    assert x.dtype == _F32 and x.dim() == 1
    _check_finite("master", x)
    high = x.to(torch.bfloat16)
    _check_finite("master (rounded to bf16: beyond bf16's largest value)", high.to(_F32))
    rest = x - high.to(_F32)  # exact: at most half a bf16 ulp, within fp32's 24 bits
    low = torch.round((rest / ulp_of_bf16(high)) * _LOW_LEVELS)
    return high, low.to(torch.int8)


def decode_master(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """bf16 high and int8 low -> flat fp32 master."""
    return high.to(_F32) + (low.to(_F32) * ulp_of_bf16(high)) / _LOW_LEVELS

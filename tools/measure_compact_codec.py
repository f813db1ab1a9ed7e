"""Which companding for the 8-bit Adam moments of optimizer_states="compact"
([Note: compact optimizer states], offload/memory/compact_codec.py).

Runs Adam (fp64 arithmetic) for --steps steps on heavy-tailed gradients (Student-t with 2
degrees of freedom, per-element scales log-uniform over --range decades, so one block of
256 holds both large and small gradients, as a layer's rows do) once with exact moments
and once per candidate codec, the moments passed through the codec after every step (the
candidate's own trajectory, exact master). The table compares each candidate's last update
with the exact run's, elementwise:
  * "dead": elements whose update is 0 where the exact one is not (they stopped training);
  * "sign": elements whose update has the other sign;
  * "err med" / "err p99": median and 99th percentile of |u - u_exact|, in units of lr
    (an exact Adam update is at most about 1 in these units; "|u| mean" says its size);
  * "cos": cosine similarity of the two update vectors.
Candidates: linear (round) for both moments; square root for both; square root for m and
fourth root for v, rounded to nearest, with a nonzero v kept at level >= 1 (the codec's
rule), or rounded up.

    python tools/measure_compact_codec.py --numel 65536 --steps 100
"""
from __future__ import annotations

import argparse

import torch

BLOCK = 256


def quantize(x: torch.Tensor, signed: bool, root: int, levels: int, up: bool) -> torch.Tensor:
    """Round trip of ``x`` (fp64, numel a multiple of BLOCK) through one block codec."""
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    unit = (blocks.abs() / safe) ** (1.0 / root)
    codes = torch.ceil(unit * levels) if up == "ceil" else torch.round(unit * levels)
    if up == "round, >= 1":
        codes = torch.where(blocks != 0, torch.clamp(codes, min=1), codes)
    back = (codes / levels) ** root * scale
    return (torch.sign(blocks) * back if signed else back).view(-1)


CANDIDATES = {
    "linear m, linear v": (1, 1, "round"),
    "sqrt m, sqrt v": (2, 2, "round"),
    "sqrt m, 4th-root v": (2, 4, "round"),
    "sqrt m, 4th-root v (>= 1)": (2, 4, "round, >= 1"),
    "sqrt m, 4th-root v (ceil)": (2, 4, "ceil"),
}


def run(grads: torch.Tensor, codec, beta1=0.9, beta2=0.999, eps=1e-8) -> torch.Tensor:
    m = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    update = m
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        if codec is not None:
            m_root, v_root, v_up = codec
            m = quantize(m, True, m_root, 127, False)
            v = quantize(v, False, v_root, 255, v_up)
        update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps)
    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--range", type=float, default=4.0, help="decades of per-element gradient scale")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)  # StudentT samples from the global generator
    numel = (args.numel + BLOCK - 1) // BLOCK * BLOCK
    scales = 10.0 ** (-args.range * torch.rand(numel, generator=gen, dtype=torch.float64))
    noise = torch.distributions.StudentT(2.0).sample((args.steps, numel)).double()
    grads = (noise + 0.3) * scales  # a drift, so the exact updates have a direction
    exact = run(grads, None)
    print(f"{numel} elements, {args.steps} steps, gradient scales over {args.range:g} decades, "
          f"|u| mean of the exact update {exact.abs().mean().item():.3f}")
    print(f"{'codec':28s} {'dead':>8s} {'sign':>8s} {'err med':>9s} {'err p99':>9s} {'cos':>8s}")
    live = exact != 0
    for name, codec in CANDIDATES.items():
        u = run(grads, codec)
        dead = ((u == 0) & live).double().mean().item()
        sign = ((torch.sign(u) != torch.sign(exact)) & live & (u != 0)).double().mean().item()
        rel = (u - exact).abs()
        cos = torch.nn.functional.cosine_similarity(u, exact, dim=0).item()
        print(f"{name:28s} {dead:8.2%} {sign:8.2%} {rel.median().item():9.3f} "
              f"{rel.quantile(0.99).item():9.3f} {cos:8.4f}")


if __name__ == "__main__":
    main()

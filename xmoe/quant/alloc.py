"""The bit allocator: K per group of expert tensors, minimising the measured output error under an average
bits-per-weight budget that is never exceeded.

A group is what the serving kernels need to share one K: gate and up of all experts of a layer, or down of
all experts of a layer. Its cost at K is its layer's weight (how loud the layer's routed experts are against
the residual stream, measured during capture; 1 uncalibrated) times the sum over its tensors of their
relative output error, estimated from a sample of its experts (ldlq.error_curve). The choice is exact: a
multiple-choice knapsack, solved over the Pareto front of (bits used, cost).
"""
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

from ..format.trellis import HALF_K
from .experts import ExpertProj

MAX_UNITS = 1 << 18  # the knapsack's budget resolution; coarser units round every item up (never over budget)


@dataclass
class Group:
    name: str  # a regex over module keys that matches exactly its tensors
    layer: int
    roles: tuple[str, ...]
    members: list[ExpertProj] = field(default_factory=list)
    numel: int = 0  # weights of all its tensors


def groups_of(experts: list[ExpertProj], shapes: dict[str, tuple[int, int]]) -> list[Group]:
    """Gate+up and down groups per layer, in layer order."""
    out: dict[tuple, Group] = {}
    for p in experts:
        roles = ("down",) if p.role == "down" else ("gate", "up")
        g = out.get((p.layer, roles))
        if g is None:
            base = re.escape(p.key.rsplit(".", 2)[0])  # ...experts
            leaves = sorted({q.key.rsplit(".", 1)[1] for q in experts if q.layer == p.layer and q.role in roles})
            g = out[(p.layer, roles)] = Group(f"^{base}\\.\\d+\\.({'|'.join(map(re.escape, leaves))})$", p.layer, roles)
        g.members.append(p)
        out_f, in_f = shapes[p.key]
        g.numel += out_f * in_f
    return [out[k] for k in sorted(out, key=lambda k: (k[0], k[1] != ("gate", "up")))]


def sample(group: Group, n: int) -> list[ExpertProj]:
    """The members of up to n experts, spread evenly over the group's experts."""
    experts = sorted({p.expert for p in group.members})
    pick = {experts[round(i * (len(experts) - 1) / max(n - 1, 1))] for i in range(min(n, len(experts)))}
    return [p for p in group.members if p.expert in pick]


def group_cost(group: Group, curves: dict[str, dict[float, float]], weight: float) -> dict[float, float]:
    """{K: cost}: weight x (members in the group) x mean measured error of its sampled members, per role."""
    cost: dict[float, float] = {}
    for role in group.roles:
        measured = [curves[p.key] for p in group.members if p.role == role and p.key in curves]
        if not measured:
            raise ValueError(f"{group.name}: no error curve measured for its {role} tensors")
        count = sum(p.role == role for p in group.members)
        for K in measured[0]:
            cost[K] = cost.get(K, 0.0) + weight * count * sum(c[K] for c in measured) / len(measured)
    return cost


def allocate(costs: list[dict[float, float]], numels: list[int], bits: float, fixed_bits: int = 0,
             fixed_numel: int = 0) -> list[float]:
    """K per item minimising the summed cost with sum(numel x K) <= bits x (sum(numel) + fixed_numel)
    - fixed_bits (fixed_*: tensors whose K is set by a rule). Raises when even the lowest K is over budget."""
    budget = Fraction(str(bits)) * (sum(numels) + fixed_numel) - fixed_bits
    unit = Fraction(math.gcd(*numels), 2)  # every numel x K is a whole number of half-bit units
    scale = max(1, math.ceil(budget / unit / MAX_UNITS))
    unit *= scale
    cap = math.floor(budget / unit)
    front = {0: (0.0, ())}  # units used -> (cost, choice per item so far)
    for c, n in zip(costs, numels):
        nxt: dict[int, tuple] = {}
        for used, (cost, picks) in front.items():
            for K, e in sorted(c.items()):
                u = used + math.ceil(Fraction(n) * Fraction(str(K)) / unit)
                if u <= cap and (u not in nxt or cost + e < nxt[u][0]):
                    nxt[u] = (cost + e, picks + (K,))
        front, best = {}, math.inf
        for u in sorted(nxt):  # keep the Pareto front: more bits only where they buy a lower cost
            if nxt[u][0] < best:
                best = nxt[u][0]
                front[u] = nxt[u]
        if not front:
            lowest = min(min(c) for c in costs)
            raise ValueError(f"--bits {bits}: below what the lowest K ({lowest:g}) of every tensor needs")
    return list(min(front.values(), key=lambda v: v[0])[1])


def candidates(bits: float, codebook: str) -> list[float]:
    """The K the allocator may pick for an average of `bits`: the whole K on either side of a fractional
    budget (at a whole K, that K and the next), and the half-integer K mul1 has in between. The cost adds
    relative errors as if they were small, which they are not two steps apart: on the demo, K=1 in a
    2.5-bit mix, or K=4 in a 2.75-bit one, bought its rich layers less than it cost the poor ones."""
    lo = max(1, math.floor(bits))
    hi = min(8, math.ceil(bits) if bits > lo else lo + 1)
    ks = [float(k) for k in range(lo, hi + 1)]
    if codebook == "mul1":
        ks += [k for k in HALF_K if lo < k < hi]
    return sorted(ks)

"""exllamav3 1.6.5's routed experts ("stock") over xmoe's expert tensors, driven the way its BlockSparseMLP drives
itself (exllamav3/modules/block_sparse_mlp.py and moe_batch_recon.py in the 1.6.5 wheel; benchmarks/STOCK_API.md):

- up to 8 tokens, the cooperative decode kernels (exl3_moe_coop);
- beyond, its defaults: the fused exl3_moe kernel for experts of up to 128 rows (256 at mul1, in row tiers of 16,
  32 and 64 rows, one launch each), experts above that in the batched reconstruct tier (reconstruct_had_batch +
  hgemm_batched, groups of about 11 experts at V4.1 shapes, padded to the group's most rows), every slot written to
  one fp32 scratch and summed per token in k order by exl3_moe_gather (EXL3_MOE_FUSED_DET=1: deterministic, no
  atomics). When no expert can exceed the fused kernel's rows (tokens x top-k <= 128 or 256), the counts are not
  read back and the slot tables are made on the device.

`forward` is one eager call as exllamav3 makes it, its host work (argsort, bincount, the counts read back, the slot
tables built in numpy and copied) included. `prepared` does that host work once and returns the kernels alone, to
replay from a CUDA graph as a server that captures would: counts and order precomputed outside.
"""
import copy

import numpy as np
import torch

FUSED_ROWS, FUSED_ROWS_MUL1 = 128, 256  # the fused kernel's rows an expert (backend.MOE_FUSED_ROWS, FUSED_ROWS_WIDE)
TIER_ROWS = (16, 32)  # mul1's row tiers: counts in [1, 16] at m_tile 16, (16, 32] at 32, beyond at 64
GRAPH_ROWS = 32  # TEMP_ROWS_GRAPH: the batched tier takes experts above max(fused rows, this)
RECON_BATCH, RECON_ROWS, RECON_MB, PAD_MAX = 16, 16384, 256, 1.1  # moe_batch_recon's defaults


def recon_cap(hidden: int, intermediate: int) -> int:
    """Experts a batched-reconstruct group holds: its weight scratch (gate and up live together, down reuses gate's)
    within RECON_MB."""
    per = 2 * (max(hidden * intermediate, intermediate * hidden) + hidden * intermediate)
    return max(1, min(RECON_BATCH, (RECON_MB << 20) // per))


def recon_groups(experts: list, count: list, cap: int) -> list:
    """The batched tier's groups, most rows first, each closed when it is full, would pad past RECON_ROWS rows, or
    would pad more than PAD_MAX times its real rows."""
    groups, group, most, real = [], [], 0, 0
    for e in sorted(experts, key=lambda e: -count[e]):
        n = len(group) + 1
        if group and (n > cap or n * most > RECON_ROWS or n * most > PAD_MAX * (real + count[e])):
            groups.append(group)
            group = []
        if not group:
            most, real = count[e], 0
        group.append(e)
        real += count[e]
    return groups + ([group] if group else [])


def tier_plan(count: list, experts: int, fused_rows: int, mul1: bool, cap: int) -> dict:
    """The host's plan of a call from its expert counts (count[:experts]): the fused launches (num_active, lowest
    and highest count, m_tile), the batched groups, and the slot tables (base, start, kind: 1 fused, 2 batched)."""
    counts = count[:experts]
    fused = [e for e in range(experts) if 0 < counts[e] <= fused_rows]
    heavy = [e for e in range(experts) if max(fused_rows, GRAPH_ROWS) < counts[e] <= RECON_ROWS]
    if any(c > RECON_ROWS for c in counts):
        raise ValueError("an expert above the batched tier's rows: exllamav3 would take its per-expert loop")
    sizes = [counts[e] for e in fused]
    t1 = sum(TIER_ROWS[0] < c <= TIER_ROWS[1] for c in sizes)
    t2 = sum(c > TIER_ROWS[1] for c in sizes)
    if mul1 and (t1 or t2):
        tiers = [(t2, TIER_ROWS[1] + 1, fused_rows, 64), (t1, TIER_ROWS[0] + 1, TIER_ROWS[1], 32),
                 (len(sizes) - t1 - t2, 1, TIER_ROWS[0], 16)]
        launches = [t for t in tiers if t[0]]
    else:
        launches = [(len(sizes), 1, fused_rows, 16)]
    groups = recon_groups(heavy, counts, cap)
    base, kind, slots = [0] * len(count), [0] * len(count), 0
    for e in fused:
        base[e], kind[e], slots = slots, 1, slots + counts[e]
    for group in groups:
        most = max(counts[e] for e in group)
        for b, e in enumerate(group):
            base[e], kind[e] = slots + b * most, 2
        slots += len(group) * most
    start = np.cumsum([0] + list(count[:-1])).tolist()
    return dict(launches=launches, groups=groups, base=base, start=start, kind=kind, slots=slots)


class Stock:
    """exllamav3's MoE paths over one set of experts (pointer tables into xmoe's stacked tensors)."""

    def __init__(self, ext, experts, K: float, codebook: str, dev, top_k: int = 6):
        self.ext, self.dev, self.K, self.experts = ext, dev, float(K), experts
        self.E, self.H, self.I = experts.count, experts.hidden, experts.intermediate
        self.mcg, self.mul1 = codebook == "mcg", codebook == "mul1"  # exllamav3's flags (both off: 3INST)
        self.fused_rows = FUSED_ROWS_MUL1 if self.mul1 else FUSED_ROWS
        self.cap = recon_cap(self.H, self.I)
        self.tables = self._tables(experts)
        h = lambda *s, dt=torch.half: torch.empty(s, dtype=dt, device=dev)  # noqa: E731
        S = 8 * top_k  # the decode kernels' scratch slots: 8 tokens
        self.coop = (h(S, self.H), h(S, self.H), h(S, self.I), h(S, self.I), h(S, self.I), h(S, self.H, dt=torch.float))
        self.coop_out = h(8, self.H, dt=torch.float)
        self.ctr = torch.zeros(S * (self.I // 128) + 8 * (self.H // 128) + 2 + (S + 1) + S, dtype=torch.int, device=dev)
        C = ext.exl3_moe_max_concurrency(torch.device(dev).index or 0)
        R = self.fused_rows
        self.temp = (h(C, R, self.H), h(C, R, self.H), h(C, R, self.I), h(C, R, self.I))

    def _tables(self, experts) -> list:
        """Per projection: trellis, suh and svh pointer tables (int64, on the device)."""
        def ptrs(t):
            return torch.tensor([x.data_ptr() for x in t], dtype=torch.long, device=self.dev)
        return [ptrs(t) for w in (experts.gate, experts.up, experts.down) for t in (w.trellis, w.suh, w.svh)]

    def over(self, experts) -> "Stock":
        """The same buffers over another set of experts."""
        other = copy.copy(self)
        other.experts, other.tables = experts, self._tables(experts)
        return other

    def decode(self, x, sel, rw):
        """Up to 8 tokens: the cooperative decode kernels, fp32 (T, H)."""
        self.ext.exl3_moe_coop(x, sel, rw, -1, -1, self.H, *self.tables, None, None, None, self.K, self.K, self.K,
                               self.mcg, self.mul1, 0, 0.0, True, *self.coop, self.ctr, self.coop_out, None, None)
        return self.coop_out[:x.shape[0]]

    def path(self, sel) -> str:
        """Which of its paths exllamav3 takes for a call of more than 8 tokens, in words (for the results)."""
        T, top_k = sel.shape
        if T * top_k <= self.fused_rows:
            return "exl3_moe, one launch (counts not read back), deterministic scratch + exl3_moe_gather"
        plan = tier_plan(torch.bincount(sel.reshape(-1), minlength=self.E + 1).tolist(), self.E, self.fused_rows,
                         self.mul1, self.cap)
        tiers = "/".join(str(m) for *_, m in plan["launches"])
        groups = [len(g) for g in plan["groups"]]
        return (f"exl3_moe in row tiles {tiers}" + (f", reconstruct_had_batch + hgemm_batched for "
                f"{sum(groups)} experts in groups of {'/'.join(map(str, groups))}" if groups else "") +
                ", deterministic scratch + exl3_moe_gather")

    def forward(self, x, sel, rw):
        """One call as exllamav3 makes it, host work included: fp32 (T, H)."""
        return self.prepared(x, sel, rw)()

    def prepared(self, x, sel, rw):
        """The call's host work done now (order, counts, tier plan, slot tables, the batched groups' gathers); returns
        its launches, which capture in a CUDA graph."""
        T, top_k = sel.shape
        flat = sel.reshape(-1)
        order = flat.argsort()
        token = torch.arange(T, device=self.dev).repeat_interleave(top_k)[order]
        weight = rw.reshape(-1)[order]
        count = torch.bincount(flat, minlength=self.E + 1)
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=self.dev))
        if T * top_k <= self.fused_rows:  # no expert can exceed the fused kernel's rows: no read-back
            start = torch.cumsum(count, 0) - count
            tables = torch.stack([start, start, (count > 0).long()])
            plan = dict(launches=[(-1, 1, self.fused_rows, 16)], groups=[], slots=T * top_k)
        else:
            plan = tier_plan(count.tolist(), self.E, self.fused_rows, self.mul1, self.cap)
            tables = torch.from_numpy(np.stack([plan["base"], plan["start"], plan["kind"]])).to(self.dev)
        scratch = torch.empty(max(plan["slots"], 1), self.H, dtype=torch.float, device=self.dev)
        groups = self._groups(x, token, plan, count) if plan["groups"] else []
        out = torch.zeros(T + 1, self.H, dtype=torch.float, device=self.dev)

        def launches():
            out.zero_()
            for num_active, lo, hi, m_tile in plan["launches"]:
                self.ext.exl3_moe(x, out[:T], count, token, weight, *self.temp, 0, self.K, self.K, self.K,
                                  *self.tables, *(self.mcg, self.mul1) * 3, 0.0, num_active, scratch, tables[0],
                                  lo, hi, m_tile)
            if groups:  # one zero row past the end, which the groups' padding rows read
                padded = torch.cat([x, torch.zeros(1, self.H, dtype=x.dtype, device=x.device)])
                for group in groups:
                    self._recon(padded, scratch, *group)
            self.ext.exl3_moe_gather(out[:T], scratch, flat, inv, tables[1, :self.E], tables[0, :self.E],
                                     tables[2, :self.E], weight)
            return out[:T]
        return launches

    def _groups(self, x, token, plan, count) -> list:
        """Per batched group, what its launches read: expert ids, gathered row indices, pointer tables, its slots."""
        counts, out = count.tolist(), []
        slot = sum(counts[e] for e in range(self.E) if plan["kind"][e] == 1)  # after the fused experts' slots
        T = x.shape[0]
        ends = torch.cat([token, torch.full((1,), T, dtype=token.dtype, device=self.dev)])
        for group in plan["groups"]:
            most = max(counts[e] for e in group)
            ids = torch.tensor(group, dtype=torch.long, device=self.dev)
            first = torch.tensor([plan["start"][e] for e in group], device=self.dev)
            rows = torch.tensor([counts[e] for e in group], device=self.dev)
            at = torch.arange(most, device=self.dev)
            src = torch.where(at[None, :] < rows[:, None], first[:, None] + at[None, :], token.numel()).reshape(-1)
            pointers = [t.index_select(0, ids) for t in self.tables]
            out.append((ends.index_select(0, src), pointers, len(group), most, slot))
            slot += len(group) * most
        return out

    def _recon(self, padded, scratch, tok, pointers, B: int, most: int, slot: int) -> None:
        """One batched-reconstruct group: each projection's weights reconstructed with their Hadamards and scales
        folded in (reconstruct_had_batch), one batched fp16 GEMM each, the activation over the slab, and down's
        output written unweighted into the group's slots (the gather weights them)."""
        ext, H, I, cb = self.ext, self.H, self.I, (self.mcg, self.mul1)
        x = padded
        y = padded.index_select(0, tok).view(B, most, H)
        (tg, sg, vg), (tu, su, vu), (td, sd, vd) = (pointers[i:i + 3] for i in (0, 3, 6))
        weights = torch.empty(B, H, I, dtype=torch.half, device=x.device)
        ext.reconstruct_had_batch(weights, tu, su, vu, self.K, *cb)
        u = torch.empty(B, most, I, dtype=torch.half, device=x.device)
        ext.hgemm_batched(y, weights, u)
        ext.reconstruct_had_batch(weights, tg, sg, vg, self.K, *cb)
        g = torch.empty_like(u)
        ext.hgemm_batched(y, weights, g)
        ext.silu_mul(g.view(B * most, I), u.view(B * most, I), u.view(B * most, I), 0.0)
        down = weights.view(-1)[:B * I * H].view(B, I, H)
        ext.reconstruct_had_batch(down, td, sd, vd, self.K, *cb)
        ext.hgemm_batched(u, down, scratch[slot:slot + B * most].view(B, most, H))

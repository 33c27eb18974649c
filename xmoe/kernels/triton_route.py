"""One-launch routing for decode sizes: the slots (token, k) sorted by local expert and cut into chunks, as
routing.route does with a dozen torch kernels. A few microseconds of launch each are a large share of a decode
step, so for up to routing.ROUTE_SLOTS slots one program compares every slot with every other instead."""
import triton
import triton.language as tl


@triton.jit
def _slot_keys(ids_ptr, emap_ptr, p, live, E, HAS_MAP: tl.constexpr):
    """The local expert of slots p (E for other ranks' slots, E + 1 past the end: those sort last)."""
    e = tl.load(ids_ptr + p, mask=live, other=0).to(tl.int32)
    if HAS_MAP:
        e = tl.load(emap_ptr + e, mask=live, other=-1).to(tl.int32)
    return tl.where(live, tl.where(e >= 0, e, E), E + 1)


@triton.jit
def route_small(ids_ptr, emap_ptr, rows_ptr, sorted_expert_ptr, slot_pos_ptr, slot_expert_ptr, table_ptr,
                count_ptr, P, E, stride_table, TOPK: tl.constexpr, BM: tl.constexpr, PB: tl.constexpr,
                HAS_MAP: tl.constexpr):
    """Slot i (token i // TOPK) of local expert key_i (E: another rank's) goes to sorted position rank_i, stable
    in i; runs of one expert are cut every BM positions into chunks (pos, len, expert) in sorted order."""
    i = tl.arange(0, PB)
    valid = i < P
    key = _slot_keys(ids_ptr, emap_ptr, i, valid, E, HAS_MAP)
    same = key[None, :] == key[:, None]  # [i, j]
    earlier = i[None, :] < i[:, None]
    lt = tl.sum((key[None, :] < key[:, None]).to(tl.int32), axis=1)
    before = tl.sum((same & earlier).to(tl.int32), axis=1)  # slots of the same expert ahead of i
    run = tl.sum(same.to(tl.int32), axis=1)
    rank = lt + before
    ours = valid & (key < E)
    tl.store(slot_pos_ptr + i, rank, mask=valid)
    tl.store(slot_expert_ptr + i, tl.where(key < E, key, -1), mask=valid)
    tl.store(rows_ptr + rank, i // TOPK, mask=valid)
    tl.store(sorted_expert_ptr + rank, key, mask=valid)
    leader = ours & (before % BM == 0)
    chunk = tl.sum((leader[None, :] & (rank[None, :] < rank[:, None])).to(tl.int32), axis=1)
    tl.store(table_ptr + chunk, rank, mask=leader)
    tl.store(table_ptr + stride_table + chunk, tl.minimum(run - before, BM), mask=leader)
    tl.store(table_ptr + 2 * stride_table + chunk, key, mask=leader)
    tl.store(count_ptr, tl.sum(leader.to(tl.int32), axis=0))


@triton.jit
def slot_ranks(ids_ptr, emap_ptr, slot, P, E, PB: tl.constexpr, HAS_MAP: tl.constexpr):
    """The sorted positions (route_small's ranks: by key, then slot) and keys of slots `slot`, without its stores:
    each slot's key PB + slot against those of all P slots. Slots past P get key E + 1."""
    i = tl.arange(0, PB)
    key = _slot_keys(ids_ptr, emap_ptr, i, i < P, E, HAS_MAP)
    mine = _slot_keys(ids_ptr, emap_ptr, slot, slot < P, E, HAS_MAP)
    return tl.sum(((key * PB + i)[None, :] < (mine * PB + slot)[:, None]).to(tl.int32), axis=1), mine


@triton.jit
def route_counts(ids_ptr, emap_ptr, hist_ptr, P, E, HAS_MAP: tl.constexpr, BP: tl.constexpr, EB: tl.constexpr):
    """hist[b, key]: how many of block b's BP slots go to each key (local expert, E for other ranks)."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    key = _slot_keys(ids_ptr, emap_ptr, p, p < P, E, HAS_MAP)
    tl.store(hist_ptr + tl.program_id(0) * EB + tl.arange(0, EB), tl.histogram(key, EB, mask=p < P))


@triton.jit
def route_scatter(ids_ptr, emap_ptr, hist_ptr, rows_ptr, sorted_expert_ptr, slot_pos_ptr, slot_expert_ptr,
                  table_ptr, runs_ptr, count_ptr, P, E, blocks, stride_table, TOPK: tl.constexpr, BM: tl.constexpr,
                  HAS_MAP: tl.constexpr, BP: tl.constexpr, EB: tl.constexpr):
    """A counting sort of the slots by key, stable in the slot: block b's slot of key k goes to k's first
    position, plus its slots in earlier blocks, plus its rank among k's slots in block b (a sort of the block).
    Writes each position's token (rows) and key, each slot's position and local expert (-1: another rank's),
    the chunks (pos, len, expert) at the positions that start one, each local expert's run [start, end) (runs)
    and the number of chunks (count)."""
    b = tl.program_id(0)
    keys = tl.arange(0, EB)
    before, total = tl.zeros([EB], tl.int32), tl.zeros([EB], tl.int32)
    for other in range(0, blocks):
        h = tl.load(hist_ptr + other * EB + keys)
        before += tl.where(other < b, h, 0)
        total += h
    start = tl.cumsum(total, 0) - total
    ours = keys < E
    per = tl.where(ours, (total + BM - 1) // BM, 0)
    first = tl.cumsum(per, 0) - per
    mine = tl.load(hist_ptr + b * EB + keys)
    base = start + before - (tl.cumsum(mine, 0) - mine)  # + the slot's index in the block's sorted slots
    if b == 0:
        tl.store(runs_ptr + keys, start, mask=ours)
        tl.store(runs_ptr + E + keys, start + total, mask=ours)
        tl.store(count_ptr, tl.sum(per, 0))
    i = tl.arange(0, BP)
    p = b * BP + i
    order = tl.sort(_slot_keys(ids_ptr, emap_ptr, p, p < P, E, HAS_MAP) * BP + i)  # by key, then slot
    key = order // BP
    slot = b * BP + order % BP
    live = key <= E
    k = tl.minimum(key, E)  # a key to gather by for every slot (E + 1, past the end, is masked)
    pos = tl.gather(base, k, 0) + i
    tl.store(rows_ptr + pos, slot // TOPK, mask=live)
    tl.store(sorted_expert_ptr + pos, key, mask=live)
    tl.store(slot_pos_ptr + slot, pos, mask=live)
    tl.store(slot_expert_ptr + slot, tl.where(key < E, key, -1), mask=live)
    offset = pos - tl.gather(start, k, 0)
    lead = live & (key < E) & (offset % BM == 0)
    chunk = tl.gather(first, k, 0) + offset // BM
    tl.store(table_ptr + chunk, pos, mask=lead)
    tl.store(table_ptr + stride_table + chunk, tl.minimum(tl.gather(total, k, 0) - offset, BM), mask=lead)
    tl.store(table_ptr + 2 * stride_table + chunk, key, mask=lead)


@triton.jit
def hot_experts(runs_ptr, flags_ptr, ids_ptr, table_ptr, counts_ptr, E, rows, rest, stride_runs, stride_table,
                BM: tl.constexpr, G: tl.constexpr, EB: tl.constexpr, GB: tl.constexpr):
    """The call's dense experts from their runs (runs_ptr: first and end sorted position a local expert): those
    of at least `rows` rows, or every expert with rows where at most `rest` others are left. flags (E + 1: the
    last, other ranks' slots, 0); ids, the dense experts ascending, cut into groups of G; table (pos, length,
    slot): each one's chunks of at most BM rows, in order, slot its index in its group, so that each group's
    chunks are one contiguous run; counts: (dense experts, all dense, chunks of each of GB groups)."""
    e = tl.arange(0, EB)
    ours = e < E
    start = tl.load(runs_ptr + e, mask=ours, other=0)
    length = tl.load(runs_ptr + stride_runs + e, mask=ours, other=0) - start
    hot = (length >= rows) & (length > 0)
    left = (length > 0) & ~hot
    every = tl.sum(left.to(tl.int32), 0) <= rest
    dense = tl.where(hot | (left & every), 1, 0)
    hot = dense != 0
    rank = tl.cumsum(dense, 0) - dense
    chunks = tl.where(hot, (length + BM - 1) // BM, 0)
    first = tl.cumsum(chunks, 0) - chunks
    tl.store(flags_ptr + e, dense, mask=e <= E)
    tl.store(ids_ptr + rank, e, mask=hot)
    for j in range(0, tl.max(chunks, 0)):
        live = j < chunks
        tl.store(table_ptr + first + j, start + j * BM, mask=live)
        tl.store(table_ptr + stride_table + first + j, tl.minimum(length - j * BM, BM), mask=live)
        tl.store(table_ptr + 2 * stride_table + first + j, rank % G, mask=live)
    group = tl.arange(0, GB)
    mine = ((rank // G)[None, :] == group[:, None]) & hot[None, :]
    tl.store(counts_ptr + 2 + group, tl.sum(tl.where(mine, chunks[None, :], 0), 1))
    tl.store(counts_ptr, tl.sum(dense, 0))
    tl.store(counts_ptr + 1, every.to(tl.int32))

"""One-launch routing for decode sizes: the slots (token, k) sorted by local expert and cut into chunks, as
routing.route does with a dozen torch kernels. A few microseconds of launch each are a large share of a decode
step, so for up to routing.ROUTE_SLOTS slots one program compares every slot with every other instead."""
import triton
import triton.language as tl


@triton.jit
def route_small(ids_ptr, emap_ptr, rows_ptr, sorted_expert_ptr, slot_pos_ptr, slot_expert_ptr, table_ptr,
                count_ptr, P, E, stride_table, TOPK: tl.constexpr, BM: tl.constexpr, PB: tl.constexpr,
                HAS_MAP: tl.constexpr):
    """Slot i (token i // TOPK) of local expert key_i (E: another rank's) goes to sorted position rank_i, stable
    in i; runs of one expert are cut every BM positions into chunks (pos, len, expert) in sorted order."""
    i = tl.arange(0, PB)
    valid = i < P
    e = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    if HAS_MAP:
        e = tl.load(emap_ptr + e, mask=valid, other=-1).to(tl.int32)
    key = tl.where(valid, tl.where(e >= 0, e, E), E + 1)  # padding sorts last
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

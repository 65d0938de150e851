"""Oracle for DeepSeek's EPLB (deepseek-ai/EPLB ``eplb.py``, d52c72d), written from its semantics.

Readable loops over torch tensors. The two places where the result depends on the torch build are
kept as torch calls, exactly as upstream makes them:

- descending orders come from ``tensor.float().sort(-1, descending=True).indices`` (non-stable sort,
  called on the whole ``[rows, n]`` tensor);
- group loads come from ``weight.unflatten(-1, (num_groups, group_size)).sum(-1)``.

Everything else (greedy choices, float32 accumulation, index arithmetic) is spelled out.

``tie_break="stable"`` is trainfast's torch-independent mode: a stable descending sort (ties keep
the lower index first) and group loads summed in float32 in index order.
"""

from __future__ import annotations

import torch


def _descending_order(values: torch.Tensor, stable: bool) -> torch.Tensor:
    if stable:
        return values.float().sort(dim=-1, descending=True, stable=True).indices.cpu()
    return values.float().sort(-1, descending=True).indices.cpu()


def _group_loads(weight: torch.Tensor, num_groups: int, stable: bool) -> torch.Tensor:
    group_size = weight.shape[1] // num_groups
    if not stable:
        return weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    loads = torch.zeros(weight.shape[0], num_groups, dtype=weight.dtype)
    for member in range(group_size):  # float32 adds in index order
        loads += weight[:, member::group_size]
    return loads


def balanced_packing(weight: torch.Tensor, num_packs: int, stable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's items, heaviest first, go to the non-full pack with the smallest load.

    Returns ``(pack_index, rank_in_pack)``, int64 ``[rows, n]``; rank = arrival order in the pack.
    """
    num_rows, num_items = weight.shape
    assert num_items % num_packs == 0
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(weight.shape)
        return pack_index, torch.zeros(weight.shape, dtype=torch.int64)

    order = _descending_order(weight, stable)
    pack_index = torch.full(weight.shape, -1, dtype=torch.int64)
    rank_in_pack = torch.full(weight.shape, -1, dtype=torch.int64)
    for row in range(num_rows):
        # Loads are 0-d tensors of weight's dtype, so sums round like upstream's.
        loads = [0] * num_packs
        counts = [0] * num_packs
        for item in order[row].tolist():
            best = None
            for pack in range(num_packs):
                if counts[pack] == items_per_pack:
                    continue
                if best is None or loads[pack] < loads[best]:  # strict: ties keep the lower pack
                    best = pack
            pack_index[row, item] = best
            rank_in_pack[row, item] = counts[best]
            loads[best] = loads[best] + weight[row, item]
            counts[best] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each extra slot replicates the expert with the largest load per replica (first index on ties).

    Returns ``(phy2log [rows, num_phy], rank [rows, num_phy], logcnt [rows, num_log])``, int64.
    """
    num_rows, num_log = weight.shape
    assert num_phy >= num_log
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(num_rows, 1)
    rank = torch.zeros(num_rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(num_rows, num_log, dtype=torch.int64)
    for row in range(num_rows):
        for slot in range(num_log, num_phy):
            per_replica = (weight[row] / logcnt[row]).tolist()  # torch division: the dtype's rounding
            best = max(range(num_log), key=per_replica.__getitem__)  # first of equal maxima
            phy2log[row, slot] = best
            rank[row, slot] = logcnt[row, best]
            logcnt[row, best] += 1
    return phy2log, rank, logcnt


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int,
    tie_break: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups -> nodes, replicas within each node, replicas -> GPUs of the node.

    Returns ``(phy2log, phyrank, logcnt)``: ``[layers, num_physical_experts]`` twice and
    ``[layers, num_logical_experts]``, int64.
    """
    num_layers, num_logical = weight.shape
    assert num_logical % num_groups == 0
    group_size = num_logical // num_groups
    assert num_groups % num_nodes == 0
    groups_per_node = num_groups // num_nodes
    assert num_gpus % num_nodes == 0
    assert num_physical_experts % num_gpus == 0
    slots_per_gpu = num_physical_experts // num_gpus
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical_experts // num_nodes

    # Step 1: groups to nodes. Node-major ("mlog") numbering: node, then arrival rank, then member.
    stable = tie_break == "stable"
    group_loads = _group_loads(weight, num_groups, stable)
    group_node, group_rank = balanced_packing(group_loads, num_nodes, stable)
    log2mlog = torch.empty(num_layers, num_logical, dtype=torch.int64)
    for layer in range(num_layers):
        for expert in range(num_logical):
            group, member = divmod(expert, group_size)
            position = int(group_node[layer, group]) * groups_per_node + int(group_rank[layer, group])
            log2mlog[layer, expert] = position * group_size + member
    mlog2log = torch.empty_like(log2mlog)
    for layer in range(num_layers):
        for expert in range(num_logical):
            mlog2log[layer, log2mlog[layer, expert]] = expert

    # Step 2: replicas within each node; rows are (layer, node).
    mlog_loads = torch.stack([weight[layer, mlog2log[layer]] for layer in range(num_layers)])
    mlog_loads = mlog_loads.reshape(num_layers * num_nodes, logical_per_node)
    phy2mlog, phy_rank, mlog_count = replicate_experts(mlog_loads, physical_per_node)

    # Step 3: the node's replicas onto its GPUs; slot = gpu * slots_per_gpu + arrival rank.
    per_replica = mlog_loads / mlog_count
    replica_loads = torch.stack([per_replica[row, phy2mlog[row]] for row in range(per_replica.shape[0])])
    gpu, rank_on_gpu = balanced_packing(replica_loads, num_gpus // num_nodes, stable)
    phy2log = torch.empty(num_layers, num_physical_experts, dtype=torch.int64)
    phyrank = torch.empty(num_layers, num_physical_experts, dtype=torch.int64)
    for layer in range(num_layers):
        for node in range(num_nodes):
            row = layer * num_nodes + node
            for replica in range(physical_per_node):
                slot = node * physical_per_node + int(gpu[row, replica]) * slots_per_gpu + int(
                    rank_on_gpu[row, replica]
                )
                mlog = node * logical_per_node + int(phy2mlog[row, replica])
                phy2log[layer, slot] = mlog2log[layer, mlog]
                phyrank[layer, slot] = phy_rank[row, replica]
    flat_count = mlog_count.reshape(num_layers, num_logical)
    logcnt = torch.stack([flat_count[layer, log2mlog[layer]] for layer in range(num_layers)])
    return phy2log, phyrank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, tie_break: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entry point: ``(phy2log, log2phy, logcnt)``; log2phy is -1 padded to the largest count."""
    num_layers, num_logical = weight.shape
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus, tie_break)
    else:  # global policy: one group, one node
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus, tie_break)
    max_count = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical, max_count), -1, dtype=torch.int64)
    for layer in range(num_layers):
        for slot in range(num_replicas):
            log2phy[layer, phy2log[layer, slot], phyrank[layer, slot]] = slot
    return phy2log, log2phy, logcnt


# ------------------------------------------------------------------------------------------------
# Minimal migration (trainfast's own option): GPU matching by the Hungarian method


def max_weight_assignment(weight: list[list[int]]) -> list[int]:
    """Column of each row maximising the total weight of a square matrix: the Hungarian method with
    potentials (rows added one by one, each by a shortest augmenting path); among equal reduced costs
    the lowest column is taken first, as the native code does."""
    n = len(weight)
    top = max([0] + [w for row in weight for w in row])
    cost = [[top - w for w in row] for row in weight]
    inf = float("inf")
    u, v = [0] * (n + 1), [0] * (n + 1)  # row / column potentials, 1-based
    owner, way = [0] * (n + 1), [0] * (n + 1)  # owner[j]: row on column j (0: none)
    for row in range(1, n + 1):
        owner[0], col = row, 0
        slack, visited = [inf] * (n + 1), [False] * (n + 1)
        while owner[col] != 0:
            visited[col] = True
            i = owner[col]
            delta, next_col = inf, 0
            for j in range(1, n + 1):
                if visited[j]:
                    continue
                reduced = cost[i - 1][j - 1] - u[i] - v[j]
                if reduced < slack[j]:
                    slack[j], way[j] = reduced, col
                if slack[j] < delta:
                    delta, next_col = slack[j], j
            for j in range(n + 1):
                if visited[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    slack[j] -= delta
            col = next_col
        while col != 0:
            owner[col] = owner[way[col]]
            col = way[col]
    assignment = [0] * n
    for j in range(1, n + 1):
        assignment[owner[j] - 1] = j - 1
    return assignment


def order_slots(previous: list[list[int]], phy2log: list[list[int]], phyrank: list[list[int]],
                targets: list[list[int]], slots_per_gpu: int) -> tuple[list[list[int]], list[list[int]]]:
    """Minimal migration's slot order: new GPU g's (expert, rank) entries go to GPU targets[layer][g];
    there, in slot order, each entry takes the first free slot whose previous expert is its own, and
    the entries left fill the free slots in order."""
    out_phy2log = [[0] * len(row) for row in phy2log]
    out_rank = [[0] * len(row) for row in phy2log]
    for layer, target in enumerate(targets):
        for new_gpu, gpu in enumerate(target):
            new = range(new_gpu * slots_per_gpu, (new_gpu + 1) * slots_per_gpu)
            entries = [(phy2log[layer][k], phyrank[layer][k]) for k in new]
            old = previous[layer][gpu * slots_per_gpu:(gpu + 1) * slots_per_gpu]
            placed: list[tuple[int, int] | None] = [None] * slots_per_gpu
            left = []
            for entry in entries:
                for k, old_expert in enumerate(old):
                    if placed[k] is None and old_expert == entry[0]:
                        placed[k] = entry
                        break
                else:
                    left.append(entry)
            free = [k for k in range(slots_per_gpu) if placed[k] is None]
            for entry, k in zip(left, free):
                placed[k] = entry
            for k, (expert, rank) in enumerate(placed):
                out_phy2log[layer][gpu * slots_per_gpu + k] = expert
                out_rank[layer][gpu * slots_per_gpu + k] = rank
    return out_phy2log, out_rank

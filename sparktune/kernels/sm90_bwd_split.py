"""The Hopper backward's group split: how many blocks share one kv head's group of query heads.

A ``bwd_sm90_*`` block walks every query head of its kv head's group for one key block, so a
GQA problem with few (kv head, batch) pairs launches few blocks, each carrying the group's
work: Llama-style 16 query heads on 4 kv heads at 4k tokens and batch 1 is 4 pairs x 32 key
blocks = 128 blocks for 132 SMs, where the heaviest causal block does 4 heads x 64 row blocks
and the grid's time is that block's. With a split S (a divisor of the group), S blocks take
group / S heads each and write fp32 partial sums of dK and dV, which a last kernel adds in a
fixed order (BwdParams::group_split in ``csrc/include/sparktune/params.h``).

:func:`group_split` picks S from a model of the launch: the blocks in the order the launch
issues them (``csrc/include/sparktune/sm90_bwd_order.h``: causal and windowed grids in sections,
heaviest key blocks first), each SM taking the next block when its last one ends, a block's
time its steps (query heads x row blocks it sees) plus a fixed cost, and the partials' extra
memory traffic at a nominal bandwidth. It splits only where that predicts at least
:data:`MIN_GAIN` and the split grid stays small (at most four waves), dense problems only.
``SPARKTUNE_SM90_BWD_GROUP_SPLIT`` (read at each call) sets S instead: ``1`` (or ``0``) turns it
off, a value that does not divide the group gives its largest divisor below the value, and
``rule`` asks for the rule's choice. Unset, the rule decides where :data:`RULE_ON` is true.
"""

from __future__ import annotations

import functools
import heapq
import os
from collections.abc import Mapping

__all__ = ["MIN_GAIN", "RULE_ON", "group_split", "modelled_time", "split_from_env"]

#: Whether a call with the variable unset takes the rule's split. False until the split's first
#: run on a GPU (``tests/test_spark_bwd.py::test_sm90_backward_group_split_gives_the_same_gradients``
#: and the A/B of ``bench/gqa_bwd.py``): the kernels and the rule are built and checked on the
#: CPU (ptxas: no spill), but no split has run yet; until then a split runs only where the
#: variable asks for one, which is how the device check tests it.
RULE_ON = False

#: the modelled gain a split must promise before it is taken (the partials cost memory and a
#: launch; the model is rough)
MIN_GAIN = 1.10
#: a block's fixed cost in steps: K and V loaded, the pipeline filled, dK and dV written
BLOCK_COST = 2.0
#: nominal rates of the model: one SM's tensor throughput in the backward (FLOP/s) and the
#: memory bandwidth the partials move at (B/s); only their ratio matters
SM_FLOPS = 4.0e12
MEM_BYTES = 3.0e12
#: the sum kernel's launch and tail, seconds
SUM_LAUNCH_S = 4e-6
_L2_BUDGET_DEFAULT = 8 << 20


def _section_pairs(pairs: int, key_blocks: int, pair_bytes: int, sms: int,
                   budget_mb: int) -> int:
    """sm90_bwd_section_pairs of csrc/include/sparktune/sm90_bwd_order.h, in Python."""
    env_set = budget_mb >= 0
    budget = (min(budget_mb, 1 << 30) << 20) if env_set else _L2_BUDGET_DEFAULT
    per = budget // pair_bytes if pair_bytes > 0 else 1
    per = max(1, min(pairs, per))
    if not env_set and per < pairs:
        blocks = pairs * key_blocks
        if blocks <= 2 * sms or (blocks <= 4 * sms and 2 * key_blocks <= sms):
            per = pairs
    return per


def _row_blocks_seen(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool,
                     window: tuple[int, int] | None) -> list[int]:
    """Per key block, the query row blocks whose rows see one of its keys (BwdWalk)."""
    diag = seqlen_k - seqlen_q
    left, right = window if window is not None else (-1, -1)
    band_left = left if 0 <= left < seqlen_k else seqlen_k
    band_right = 0 if causal else (right if 0 <= right < seqlen_q else seqlen_q)
    m_total = -(-seqlen_q // block_m)
    out = []
    for n in range(-(-seqlen_k // block_n)):
        key0 = n * block_n
        key_last = min(key0 + block_n, seqlen_k) - 1
        first_row = key0 - diag - band_right
        last_row = key_last - diag + band_left
        m_begin = 0 if first_row <= 0 else first_row // block_m
        m_end = 0 if last_row < 0 else min(m_total, last_row // block_m + 1)
        out.append(max(0, m_end - m_begin))
    return out


def modelled_time(split: int, batch: int, heads_kv: int, group: int, seqlen_q: int,
                  seqlen_k: int, block_m: int, block_n: int, head_dim: int, elem_bytes: int,
                  causal: bool, window: tuple[int, int] | None, sms: int,
                  budget_mb: int = -1) -> float:
    """The model's time of one backward launch with the group in ``split`` parts, in seconds
    (the module's docstring says what it counts)."""
    heads = group // split
    seen = _row_blocks_seen(seqlen_q, seqlen_k, block_m, block_n, causal, window)
    key_blocks = len(seen)
    pairs = batch * heads_kv * split
    limited_right = causal or (window is not None and window[1] >= 0)
    step_s = 2.0 * 5 * block_m * block_n * head_dim / SM_FLOPS
    work = [(heads * m + BLOCK_COST) * step_s for m in seen]
    # the launch order: sections of pairs, each section's key blocks heaviest first across its
    # pairs (causal, windowed); else one pair after another (its key blocks weigh the same)
    if limited_right:
        pair_bytes = heads * seqlen_q * head_dim * (2 * elem_bytes + 4)
        per = _section_pairs(pairs, key_blocks, pair_bytes, sms, budget_mb)
        order = []
        for first in range(0, pairs, per):
            size = min(per, pairs - first)
            for n in range(key_blocks):
                order.extend([work[n]] * size)
    else:
        order = work * pairs
    free = [0.0] * min(sms, len(order))
    heapq.heapify(free)
    end = 0.0
    for w in order:
        t = heapq.heappop(free) + w
        end = max(end, t)
        heapq.heappush(free, t)
    if split > 1:
        # the partials: written as fp32 (in place of the 16-bit result) and read back once
        elems = batch * heads_kv * seqlen_k * head_dim * 2
        extra = elems * (split * 4 * 2 - elem_bytes)
        end += extra / MEM_BYTES + SUM_LAUNCH_S
    return end


def split_from_env(environ: Mapping[str, str], group: int) -> int | None:
    """``SPARKTUNE_SM90_BWD_GROUP_SPLIT`` for a group of ``group``: None where it is unset,
    empty or ``rule`` (the rule decides), else the largest divisor of the group not above it
    (at least 1)."""
    raw = environ.get("SPARKTUNE_SM90_BWD_GROUP_SPLIT", "").strip()
    if not raw or raw == "rule":
        return None
    try:
        want = int(raw)
    except ValueError as exc:
        raise ValueError(
            f"SPARKTUNE_SM90_BWD_GROUP_SPLIT must be an integer (1 or 0: no split) or 'rule', "
            f"got {raw!r}"
        ) from exc
    want = max(1, min(want, group))
    while group % want:
        want -= 1
    return want


def _budget_mb(environ: Mapping[str, str]) -> int:
    raw = environ.get("SPARKTUNE_SM90_BWD_L2_MB", "").strip()
    if not raw:
        return -1
    try:
        return max(0, int(raw))
    except ValueError:
        return -1


def group_split(batch: int, heads_kv: int, group: int, seqlen_q: int, seqlen_k: int,
                block_m: int, block_n: int, head_dim: int, elem_bytes: int, causal: bool,
                window: tuple[int, int] | None, sms: int, packed: bool = False,
                environ: Mapping[str, str] | None = None) -> int:
    """The group split of one dense Hopper backward launch (1: none). Packed sequences and
    MHA (group 1) never split."""
    if packed or group <= 1 or sms <= 0 or seqlen_q <= 0 or seqlen_k <= 0:
        return 1
    env = os.environ if environ is None else environ
    forced = split_from_env(env, group)
    if forced is not None:
        return forced
    if not RULE_ON and env.get("SPARKTUNE_SM90_BWD_GROUP_SPLIT", "").strip() != "rule":
        return 1
    return _chosen(batch, heads_kv, group, seqlen_q, seqlen_k, block_m, block_n, head_dim,
                   elem_bytes, bool(causal), tuple(window) if window is not None else None, sms,
                   _budget_mb(env))


@functools.lru_cache(maxsize=1024)
def _chosen(batch: int, heads_kv: int, group: int, seqlen_q: int, seqlen_k: int, block_m: int,
            block_n: int, head_dim: int, elem_bytes: int, causal: bool,
            window: tuple[int, int] | None, sms: int, budget: int) -> int:
    key_blocks = -(-seqlen_k // block_n)
    args = (batch, heads_kv, group, seqlen_q, seqlen_k, block_m, block_n, head_dim, elem_bytes,
            causal, window, sms, budget)
    base = modelled_time(1, *args)
    best, best_time = 1, base
    for s in range(2, group + 1):
        if group % s or batch * heads_kv * s * key_blocks > 4 * sms:
            continue
        t = modelled_time(s, *args)
        if t < best_time:
            best, best_time = s, t
    return best if best > 1 and base >= MIN_GAIN * best_time else 1

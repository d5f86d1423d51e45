"""Expert parallelism over torch.distributed: dispatch, expert compute, combine.

Rank r of N owns global experts [r*E/N, (r+1)*E/N). Every (token, slot) pair
travels to the rank that owns its expert, is computed there, and its bf16
slot output travels back to the source rank, which combines the slots in
ascending slot order exactly as the single-rank forward does. Because each
slot output depends only on its own token row, weight and expert, and the
owning rank sees the received rows in global token order (source rank, token,
slot), the result does not depend on the number of ranks: the reference
backend is bitwise equal at any EP size.

The transport is two `all_to_all_single` exchanges (rows out, slot outputs
back) plus one for the counts; it runs on gloo (CPU) and NCCL (GPU) alike.
DeepGEMM's mega kernels do this over NVLink inside one kernel; this module is
the portable path for the reference and triton backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import MegaMoEError

# (rows bf16 [N, H], weights f32 [N], global expert ids [N]) -> slot outputs bf16 [N, H]
PairCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DispatchPlan:
    """Where each valid (token, slot) pair of this rank goes, and how many come back."""

    pair_token: torch.Tensor  # [P] token index of each sent pair, in send order
    pair_slot: torch.Tensor  # [P] slot index of each sent pair
    send_counts: list[int]
    recv_counts: list[int]


def _host_staged(group) -> bool:
    """gloo moves CPU tensors only: CUDA tensors are staged through host memory
    (the portable fallback, e.g. several processes sharing one GPU; NCCL
    exchanges device tensors directly)."""
    return dist.get_backend(group) == "gloo"


def _exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    if _host_staged(group):
        send_counts = send_counts.cpu()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv


def plan_dispatch(topk_ids: torch.Tensor, experts_per_rank: int, world_size: int, group=None) -> DispatchPlan:
    """Order this rank's valid pairs by owning rank (stable: token-major, slot-minor)."""
    if topk_ids.dim() != 2:
        raise MegaMoEError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    num_experts = experts_per_rank * world_size
    ids = topk_ids.to(torch.int64)
    bad = (ids < -1) | (ids >= num_experts)
    if bool(bad.any()):
        first = tuple(int(v) for v in bad.nonzero()[0])
        raise MegaMoEError(
            f"topk_ids{list(first)} = {int(ids[first])} is not a global expert id in [0, {num_experts}) or -1 (masked)"
        )
    flat = ids.reshape(-1)
    valid = (flat >= 0).nonzero().squeeze(1)
    dest = torch.div(flat[valid], experts_per_rank, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    chosen = valid[order]
    k = ids.shape[1]
    send = torch.bincount(dest, minlength=world_size).to(torch.int64)
    recv = _exchange_counts(send.to(topk_ids.device), group).cpu()
    return DispatchPlan(
        pair_token=torch.div(chosen, k, rounding_mode="floor"),
        pair_slot=chosen % k,
        send_counts=send.tolist(),
        recv_counts=recv.tolist(),
    )


def _all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    device = send.device
    if _host_staged(group):
        send = send.cpu()
    out = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out.to(device)


def _ep_slots(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    experts_per_rank: int,
    compute: PairCompute,
    group=None,
    recv_stats: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every valid (token, slot) pair on its owning rank; return this rank's
    slot outputs bf16 [T, K, H] and the valid mask [T, K] (masked slots are zero).

    `recv_stats`, when given, is the int32 [E_l] `cumulative_local_expert_recv_stats`
    of this rank: entry i grows by the number of pairs routed to local expert i
    from all ranks in this call (docs/KERNELS.md#expert-parallelism; never reset).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    t, k = topk_ids.shape
    h = hidden_states.shape[1]
    plan = plan_dispatch(topk_ids, experts_per_rank, world, group)
    dev = hidden_states.device

    rows = hidden_states.index_select(0, plan.pair_token.to(dev))
    weights = topk_weights[plan.pair_token.to(dev), plan.pair_slot.to(dev)].to(torch.float32)
    ids = topk_ids[plan.pair_token.to(dev), plan.pair_slot.to(dev)].to(torch.int64)

    recv_rows = _all_to_all(rows, plan.send_counts, plan.recv_counts, group)
    recv_weights = _all_to_all(weights, plan.send_counts, plan.recv_counts, group)
    recv_ids = _all_to_all(ids, plan.send_counts, plan.recv_counts, group)

    local = recv_ids - rank * experts_per_rank
    if bool(((local < 0) | (local >= experts_per_rank)).any()):
        raise MegaMoEError(f"rank {rank} received a pair for an expert it does not own")
    if recv_stats is not None:
        if recv_stats.dtype != torch.int32 or recv_stats.numel() != experts_per_rank:
            raise MegaMoEError(
                f"cumulative_local_expert_recv_stats must be int32 with {experts_per_rank} entries, "
                f"got {recv_stats.dtype} with {recv_stats.numel()}"
            )
        recv_stats.add_(torch.bincount(local, minlength=experts_per_rank).to(recv_stats.device, torch.int32))

    if recv_rows.shape[0]:
        outputs = compute(recv_rows, recv_weights, recv_ids)
    else:
        outputs = recv_rows.new_empty((0, h), dtype=torch.bfloat16)
    back = _all_to_all(outputs.to(torch.bfloat16), plan.recv_counts, plan.send_counts, group)

    slots = torch.zeros(t, k, h, dtype=torch.bfloat16, device=dev)
    valid = torch.zeros(t, k, dtype=torch.bool, device=dev)
    slots[plan.pair_token.to(dev), plan.pair_slot.to(dev)] = back
    valid[plan.pair_token.to(dev), plan.pair_slot.to(dev)] = True
    return slots, valid


def ep_forward(
    layer,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    group=None,
    shared_experts: Optional[torch.nn.Module] = None,
    recv_stats: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The MoE output of this rank's tokens, with experts spread over the group.

    ``layer`` is this rank's `DeepGemmMegaMoEExperts` (its spec's ep_rank and
    ep_size must match the group); ``topk_ids`` hold GLOBAL expert ids. The
    backend computes the pairs this rank owns (``backend.pairs``) and the
    fused shared expert of this rank's own tokens (``backend.shared_slot``);
    the row's combine rule (`reference.combine_slots`) then sums the slots in
    ascending order, shared last, exactly as the single-rank forward does.
    Every rank must call this collectively, also with zero tokens.
    """
    from ..backends.reference import combine_slots

    spec = layer.spec
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if (spec.ep_size, spec.ep_rank) != (world, rank):
        raise MegaMoEError(
            f"layer was built for EP rank {spec.ep_rank} of {spec.ep_size}, "
            f"but this process is rank {rank} of a group of {world}"
        )
    if shared_experts is not None and layer.shared_fused:
        raise MegaMoEError("the shared expert is fused into this layer; do not pass shared_experts as well")
    backend = layer.backend
    if getattr(backend, "pairs", None) is None:
        raise MegaMoEError(f"backend {backend.name!r} has no expert-parallel pair compute")

    def compute(rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return backend.pairs(layer, rows, weights, ids)

    slots, valid = _ep_slots(
        hidden_states, topk_weights, topk_ids,
        experts_per_rank=spec.experts_per_rank, compute=compute, group=group, recv_stats=recv_stats,
    )
    if layer.shared_fused:
        shared = backend.shared_slot(layer, hidden_states)
        slots = torch.cat([slots, shared.unsqueeze(1)], dim=1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
    y = combine_slots(spec, slots, valid)
    extra = shared_experts if shared_experts is not None else layer.shared_mlp
    if extra is not None:
        y = (y.to(torch.float32) + extra(hidden_states).to(torch.float32)).to(torch.bfloat16)
    return y

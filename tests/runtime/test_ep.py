"""Expert parallelism on CPU processes (gloo): the multi-rank forward equals
the single-rank forward bitwise, stats count what each rank received, and a
rank only ever opens its own files."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megamoe_runtime as mr
from megamoe_runtime.errors import MegaMoEError
from megamoe_runtime.layer.ep import plan_dispatch

NUM_EXPERTS = 8
TOP_K = 3
# one source format per row; nvfp4 and mxfp4 carry a fused shared expert
CASES = {
    "mxfp4": dict(fmt="modelopt-mxfp4", shared=1),
    "mxfp8": dict(fmt="modelopt-mxfp8", shared=0),
    "nvfp4": dict(fmt="modelopt-nvfp4", shared=1),
    "bf16": dict(fmt="bf16", shared=1),
}
TOKENS_PER_RANK = {2: [5, 7], 4: [4, 0, 6, 3]}  # rank 1 of 4 has no tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routing(total: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(total, 128, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(total)])
    ids[torch.rand(total, TOP_K, generator=g) < 0.2] = -1  # masked slots
    if total > 2:
        ids[1] = -1  # one fully masked token
    w = torch.rand(total, TOP_K, generator=g)
    w[ids < 0] = float("nan")  # a masked slot's weight must never be read
    return x, w, ids


@pytest.fixture(scope="module")
def converted(ckpts) -> dict[str, dict[int, Path]]:
    return {
        row: {
            n: ckpts.converted(case["fmt"], ep_size=n, num_layers=1, hidden=128, intermediate=128,
                               num_experts=NUM_EXPERTS, top_k=TOP_K, shared=case["shared"], seed=3)[1]
            for n in (1, 2, 4)
        }
        for row, case in CASES.items()
    }


#: NVLink multicast stays off on shared multi-GPU hosts (the device docs' rule)
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _worker(rank: int, world: int, port: int, dirs: dict[str, str], result_dir: str,
            backend: str = "reference", device: str = "cpu", transport: str = "gloo") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if device == "cuda":
        os.environ.update(_NCCL_ENV)
        gpu = rank if transport == "nccl" else 0  # gloo: every rank on the one GPU
        torch.cuda.set_device(gpu)
        dev = torch.device("cuda", gpu)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(transport, rank=rank, world_size=world)
    try:
        counts = TOKENS_PER_RANK[world]
        lo = sum(counts[:rank])
        results = {}
        for row, d in dirs.items():
            x, w, ids = _routing(sum(counts), seed=11)
            x, w, ids = (t[lo:lo + counts[rank]].to(dev) for t in (x, w, ids))
            ckpt = mr.open_checkpoint(d)
            info = ckpt.layers[0]
            layer = ckpt.build_layer(info.index, device=dev, backend=backend, ep_rank=rank, ep_size=world)
            stats = layer.track_expert_recv_stats()
            ys = [layer(x, w, ids) for _ in range(2)]  # ep_size > 1: the layer goes through ep_forward
            results[row] = dict(y=ys[0].cpu(), y_again=ys[1].cpu(), stats=stats.cpu(),
                                files=list(ckpt.last_opened_files))
        torch.save(results, Path(result_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ep_equals_single_rank_bitwise(converted, tmp_path, world):
    dirs = {row: str(paths[world]) for row, paths in converted.items()}
    mp.spawn(_worker, args=(world, _free_port(), dirs, str(tmp_path)), nprocs=world, join=True)
    counts = TOKENS_PER_RANK[world]
    x, w, ids = _routing(sum(counts), seed=11)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for row, paths in converted.items():
        ckpt = mr.open_checkpoint(paths[1])
        single = ckpt.build_layer(ckpt.layers[0].index, device="cpu", backend="reference")
        y_ref = single(x, w, ids)
        got = torch.cat([res[row]["y"] for res in results])
        assert got.shape == y_ref.shape
        assert torch.equal(got.view(torch.int16), y_ref.view(torch.int16)), f"{row}: EP{world} != EP1"
        e_l = NUM_EXPERTS // world
        for r, res in enumerate(results):
            assert torch.equal(res[row]["y"], res[row]["y_again"])
            # stats: incremented by the pairs routed to each local expert from all ranks, per call
            expect = torch.stack([(ids == r * e_l + i).sum() for i in range(e_l)]).to(torch.int32) * 2
            assert torch.equal(res[row]["stats"], expect), (row, r)
            # a rank opens only its own files
            assert res[row]["files"], row
            assert all(f"rank{r:03d}-of-{world:03d}" in f for f in res[row]["files"]), res[row]["files"]


def test_ep_result_is_sensitive_to_a_lost_slot(converted):
    """Negative control: dropping one routed pair changes the output, so the
    equality above cannot pass by accident."""
    x, w, ids = _routing(12, seed=11)
    ckpt = mr.open_checkpoint(converted["mxfp4"][1])
    layer = ckpt.build_layer(ckpt.layers[0].index, device="cpu", backend="reference")
    y = layer(x, w, ids)
    t, k = (ids >= 0).nonzero()[0].tolist()
    ids2 = ids.clone()
    ids2[t, k] = -1
    assert not torch.equal(layer(x, w, ids2), y)


def test_plan_dispatch_refuses_out_of_range_ids():
    ids = torch.tensor([[0, 9]])
    with pytest.raises(MegaMoEError, match=r"topk_ids\[0, 1\] = 9"):
        plan_dispatch(ids, experts_per_rank=4, world_size=2, group=None)


def test_wrong_rank_files_fail_clearly(converted, tmp_path):
    """Rank 0 handed rank 1's expert file (same tensor names, other experts)."""
    src = converted["nvfp4"][2]
    bad = tmp_path / "swapped"
    shutil.copytree(src, bad)
    r0 = sorted(bad.glob("megamoe-experts-rank000-*.safetensors"))
    r1 = sorted(bad.glob("megamoe-experts-rank001-*.safetensors"))
    assert len(r0) == len(r1) == 1
    shutil.copyfile(r1[0], r0[0])
    ckpt = mr.open_checkpoint(bad)
    with pytest.raises(MegaMoEError, match=r"rank"):
        ckpt.build_layer(ckpt.layers[0].index, device="cpu", backend="reference", ep_rank=0, ep_size=2)


def test_single_rank_recv_stats(converted):
    """ep_size 1: the same counter semantics without any process group."""
    x, w, ids = _routing(12, seed=4)
    ckpt = mr.open_checkpoint(converted["bf16"][1])
    layer = ckpt.build_layer(ckpt.layers[0].index, device="cpu", backend="reference")
    stats = layer.track_expert_recv_stats()
    start = torch.arange(NUM_EXPERTS, dtype=torch.int32)
    stats.copy_(start)  # cumulative: never reset by a forward
    for _ in range(3):
        layer(x, w, ids)
    expect = torch.stack([(ids == e).sum() for e in range(NUM_EXPERTS)]).to(torch.int32) * 3 + start
    assert torch.equal(layer.expert_recv_stats, expect)


def test_ep_layer_without_process_group_is_refused(converted):
    x, w, ids = _routing(4, seed=4)
    ckpt = mr.open_checkpoint(converted["bf16"][2])
    layer = ckpt.build_layer(ckpt.layers[0].index, device="cpu", backend="reference", ep_rank=0, ep_size=2)
    with pytest.raises(MegaMoEError, match="torch.distributed"):
        layer(x, w, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ep_nccl_triton_equals_single_gpu(converted, tmp_path, world):
    """The same equality over NCCL, one GPU per rank, with the triton backend
    against the single-GPU triton forward (needs `world` GPUs)."""
    pytest.importorskip("triton")
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    dirs = {row: str(paths[world]) for row, paths in converted.items()}
    mp.spawn(_worker, args=(world, _free_port(), dirs, str(tmp_path), "triton", "cuda", "nccl"), nprocs=world,
             join=True)
    _check_triton_ep(converted, tmp_path, world)


@pytest.mark.gpu
def test_ep_triton_processes_sharing_one_gpu(converted, tmp_path):
    """Two processes on ONE GPU, triton backend, pairs exchanged over gloo
    (staged through host memory): the real multi-process EP path of the
    triton backend where only one GPU is available."""
    pytest.importorskip("triton")
    world = 2
    dirs = {row: str(paths[world]) for row, paths in converted.items()}
    mp.spawn(_worker, args=(world, _free_port(), dirs, str(tmp_path), "triton", "cuda", "gloo"), nprocs=world,
             join=True)
    _check_triton_ep(converted, tmp_path, world)


def _check_triton_ep(converted, tmp_path, world):
    counts = TOKENS_PER_RANK[world]
    x, w, ids = _routing(sum(counts), seed=11)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for row, paths in converted.items():
        ckpt = mr.open_checkpoint(paths[1])
        single = ckpt.build_layer(ckpt.layers[0].index, device="cuda", backend="triton")
        y_ref = single(x.cuda(), w.cuda(), ids.cuda()).cpu()
        got = torch.cat([res[row]["y"] for res in results])
        assert mr.calc_diff(got, y_ref) < 1e-6, row
        assert torch.equal(got.view(torch.int16), y_ref.view(torch.int16)), f"{row}: EP{world} != single GPU"

"""The product's CUDA paths (skipped without a CUDA device; benchmarks/real_job.py runs them on a GPU machine).

- a HOC training task on the GPU: pinned-memory input workers, bf16 autocast, the closed-form d-Simplex head at a
  large K, the old model's features; the stage reports its peak GPU memory, first-step time and input stall;
- the same task on the CPU in fp32 and on the GPU in fp32 give the same features up to float rounding;
- DistributedDataParallel over NCCL with SyncBatchNorm (one rank: the wrapper and the collective path run).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compat_core.models.compat_model import create_model, frozen_copy
from compat_core.simplex import dsimplex
from pipelines.methods import get_method
from pipelines.training.loop import train_task

sys.path.insert(0, str(Path(__file__).parent))
from test_training import config, source, task_data  # noqa: E402,F401

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _vit(num_slots: int, seed: int, in_chans: int = 3, img_size: int = 32):
    torch.manual_seed(seed)
    return create_model("dinov3_vitb16", num_slots, backbone_config={"img_size": img_size, "depth": 2, "embed_dim": 64,
                                                                      "num_heads": 2, "in_chans": in_chans})


def test_hoc_task_on_the_gpu_with_pinned_input_workers_and_bf16(source):
    data = task_data(source, "simplex")
    K = 16
    old = frozen_copy(_vit(K, 1, in_chans=1, img_size=16))  # the source's grey 16 x 16 images
    result = train_task(_vit(K, 0, in_chans=1, img_size=16), old, get_method("dsimplex-hoc"), data,
                        config(device="cuda", autocast="bf16", input_workers=1, epochs=2))
    assert next(result.model.parameters()).device.type == "cuda"
    assert all(np.isfinite(record.loss) for record in result.records)
    assert result.peak_device_memory_bytes and result.peak_device_memory_bytes > 0
    assert result.first_step_seconds is not None and result.first_step_seconds > 0
    assert 0.0 <= result.input_stall_seconds <= result.seconds


def test_gpu_fp32_training_matches_the_cpu():
    """One fp32 step of the closed-form head at K = 22,000 on both devices: same loss, same junction gradient."""
    K = 22000
    model = _vit(K, 0)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, K, (8,), generator=torch.Generator().manual_seed(1))
    results = []
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides
    for device in ("cpu", "cuda"):
        copy = _vit(K, 0).to(device)
        copy.load_state_dict(model.state_dict())
        output = copy(images.to(device))
        loss = torch.nn.functional.cross_entropy(output.logits, labels.to(device))
        loss.backward()
        results.append((float(loss), copy.junction.weight.grad.double().cpu(), output.logits.double().cpu(),
                        output.projection.double().cpu()))
    (cpu_loss, cpu_grad, cpu_logits, _), (gpu_loss, gpu_grad, gpu_logits, gpu_projection) = results
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-3)
    assert torch.allclose(gpu_grad, cpu_grad, rtol=1e-2, atol=1e-6)
    # the closed form on the GPU equals the explicit fp64 product of the same projection
    expected = gpu_projection @ dsimplex(K, dtype=torch.float64).T
    assert (gpu_logits - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_ddp_over_nccl_with_sync_batch_norm(tmp_path):
    import torch.distributed as dist

    from pipelines.training import distributed

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}")
    try:
        model = create_model("resnet18_cifar", 8).cuda()
        wrapped = distributed.wrap_model(model, torch.device("cuda"))
        assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in wrapped.modules())
        output = wrapped(torch.randn(4, 3, 32, 32, device="cuda"))
        output.logits.float().logsumexp(dim=1).mean().backward()
        assert all(p.grad is not None for p in wrapped.parameters() if p.requires_grad)
    finally:
        dist.destroy_process_group()


def _fp64_recall_at_1(query, query_labels, gallery, gallery_labels) -> float:
    """fp64 cosine Recall@1 of the rows compute_entry searches (normalised in fp32), einsum without BLAS so equal
    rows score bit-identically; the lowest gallery index wins exact ties."""
    q = torch.nn.functional.normalize(torch.from_numpy(query), dim=1).numpy().astype(np.float64)
    g = torch.nn.functional.normalize(torch.from_numpy(gallery), dim=1).numpy().astype(np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    first = np.argsort(-np.einsum("qd,gd->qg", q, g, optimize=False), axis=1, kind="stable")[:, 0]
    return float(np.mean(gallery_labels[first] == query_labels))


def test_matrix_entries_search_on_the_gpu_equal_to_fp64():
    """compute_entry with device="cuda" (what an entry stage with a GPU does) gives the fp64 brute force's Recall@1,
    on exact ties and one-ulp near-ties planted across labels, and the CPU's mAP."""
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_scenario_helpers as tiny

    from pipelines.config.load import validate_config
    from pipelines.stages.entry_metrics import compute_entry

    tiny.register()
    config = validate_config(tiny.scenario("er"))
    rng = np.random.default_rng(5)
    labels = np.arange(3000) % 50
    centres = rng.normal(size=(50, 1023))
    gallery = (centres[labels] + 0.8 * rng.normal(size=(3000, 1023))).astype(np.float32)
    query = (centres[labels[:1000]] + 0.8 * rng.normal(size=(1000, 1023))).astype(np.float32)
    # gallery row 2i+1 (another label) is row 2i with its largest component moved by one fp32 unit; query i sits
    # next to the pair (0.01 noise), so the two cosines differ in the first order (~1e-12), well above fp64's unit
    pairs = np.arange(0, 200, 2)
    gallery[pairs + 1] = gallery[pairs]
    largest = np.abs(gallery[pairs]).argmax(axis=1)
    moved = gallery[pairs, largest]
    gallery[pairs + 1, largest] = np.nextafter(moved, np.float32(np.inf) * np.sign(moved), dtype=np.float32)
    query[:100] = gallery[pairs] + np.float32(0.01) * rng.normal(size=(100, 1023)).astype(np.float32)
    # exact ties: rows 2i+201 copy rows 2i+200 (another label); the lower index wins
    gallery[201:400:2] = gallery[200:400:2]
    query[100:200] = gallery[200:400:2] + np.float32(0.01) * rng.normal(size=(100, 1023)).astype(np.float32)
    # each planted query carries the label of the row that must win: any other pick is a miss
    query_labels = labels[:1000].copy()
    query_labels[:100], query_labels[100:200] = labels[pairs], labels[200:400:2]
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine", "far": 0.01,
                "verification_pairs": 100}
    on_gpu = compute_entry((query, query_labels, None), (gallery, labels, None), protocol, config, device="cuda")
    assert on_gpu == _fp64_recall_at_1(query, query_labels, gallery, labels)
    for variant in ({"metric": "map"}, {"gallery": "class_means"}):
        cpu = compute_entry((query, query_labels, None), (gallery, labels, None), {**protocol, **variant}, config)
        gpu = compute_entry((query, query_labels, None), (gallery, labels, None), {**protocol, **variant}, config,
                            device="cuda")
        assert gpu == pytest.approx(cpu, abs=1e-12), variant

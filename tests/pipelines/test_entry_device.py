"""Matrix entries searched where the entry stage runs: stored rows cross to the device once, as stored, and are
widened and normalised there; on the CPU the entry is the fp32 path it always was, exact against fp64."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.stages.entry_metrics import _to_device, compute_entry

PROTOCOL = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine", "far": 0.01,
            "verification_pairs": 100}


@pytest.fixture(scope="module")
def config():
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_scenario_helpers as tiny

    from pipelines.config.load import validate_config

    tiny.register()
    return validate_config(tiny.scenario("er"))


def fp16_rows_with_ties():
    """fp16 gallery (as extracts store it) with exact duplicate rows under other labels: the lowest index must win."""
    rng = np.random.default_rng(7)
    labels = np.arange(600) % 20
    centres = rng.normal(size=(20, 255))
    gallery = (centres[labels] + 0.9 * rng.normal(size=(600, 255))).astype(np.float16)
    gallery[1:100:2] = gallery[0:100:2]
    gallery_labels = labels.copy()
    gallery_labels[1:100:2] = (labels[0:100:2] + 1) % 20
    query = (centres[labels[:200]] + 0.9 * rng.normal(size=(200, 255))).astype(np.float16)
    query[:50] = gallery[0:100:2]
    return query, labels[:200], gallery, gallery_labels


def fp64_recall_at_1(query, query_labels, gallery, gallery_labels) -> float:
    q = query.astype(np.float64)
    g = gallery.astype(np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    first = np.argsort(-np.einsum("qd,gd->qg", q, g, optimize=False), axis=1, kind="stable")[:, 0]
    return float(np.mean(gallery_labels[first] == query_labels))


def test_rows_on_the_cpu_are_exactly_the_host_fp32_rows():
    query, _, gallery, _ = fp16_rows_with_ties()
    for rows in (query, gallery, gallery.astype(np.float32), gallery.astype(np.float64)):
        moved = _to_device(rows, torch.device("cpu"))
        assert moved.dtype == torch.float32 and torch.equal(moved, torch.from_numpy(rows.astype(np.float32)))


def test_fp16_entry_on_the_cpu_is_exact_against_fp64(config):
    query, query_labels, gallery, gallery_labels = fp16_rows_with_ties()
    value = compute_entry((query, query_labels, None), (gallery, gallery_labels, None), PROTOCOL, config)
    assert value == fp64_recall_at_1(query, query_labels, gallery, gallery_labels)
    assert 0.0 < value < 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp16_entry_on_the_gpu_equals_the_cpu_entry(config):
    query, query_labels, gallery, gallery_labels = fp16_rows_with_ties()
    assert _to_device(gallery, torch.device("cuda")).device.type == "cuda"
    for variant in ({}, {"metric": "map"}, {"gallery": "class_means"}):
        protocol = {**PROTOCOL, **variant}
        cpu = compute_entry((query, query_labels, None), (gallery, gallery_labels, None), protocol, config)
        gpu = compute_entry((query, query_labels, None), (gallery, gallery_labels, None), protocol, config,
                            device="cuda")
        assert gpu == pytest.approx(cpu, abs=1e-12), variant

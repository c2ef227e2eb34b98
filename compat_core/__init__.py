"""compat_core: the pure algorithms of compatible representation learning (no cluster, tracking or storage SDKs).

Modules: ``simplex`` (fixed d-Simplex prototypes and class slots), ``losses`` (simplex cross-entropy, HOC,
InfoNCE, distillation), ``features`` (training-free PSP/LSP), ``retrieval`` (chunked Recall@k, mAP, verification,
the exact linear-head bridge), ``metrics`` (compatibility matrices: AC, AA, ACA, BC/FC), ``theory`` (Theorem 1
Monte Carlo), ``data`` (dataset readers, glyph set, task sequences, replay), ``models`` (backbones, CompatModel,
weight loading), ``io`` (local paths and ``s3://`` through pyarrow.fs), ``registry``, ``device`` and
``validation`` (shared input checks). Metrics are fractions in [0, 1]; indices are 0-based.
This package never imports ray, mlflow, boto3 or botocore (enforced by tests/test_core_purity.py).
"""

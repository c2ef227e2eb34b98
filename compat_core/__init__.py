"""compat_core: the pure algorithms of compatible representation learning (no cluster, tracking or storage SDKs).

Modules: ``simplex`` (fixed d-Simplex prototypes and class slots), ``losses`` (simplex cross-entropy, HOC,
InfoNCE, distillation), ``retrieval/`` (the exact top-k kernel, Recall@k, mAP, the exact linear-head bridge),
``evaluation/`` (compatibility metrics AC, AA, ACA, BC/FC; verification; training-free PSP/LSP; the Theorem 1 Monte
Carlo check), ``upgrades/`` (adapters, partial backfilling), ``hardware/`` (device capabilities, measured
calibration, scoped torch settings), ``data/`` (dataset readers, glyph set, task sequences, replay), ``models/``
(backbones, CompatModel, weight loading), ``io`` (local paths and ``s3://`` through pyarrow.fs), ``registry`` and
``validation`` (shared input checks). Metrics are fractions in [0, 1]; indices are 0-based.
This package never imports ray, mlflow, boto3 or botocore (enforced by tests/test_core_purity.py).
"""

__version__ = "0.1.0"  # the distribution's version (pyproject reads it from here)

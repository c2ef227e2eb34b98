"""CoReS (Biondi et al., TPAMI 2023): retrain from the same initial weights at every step, d-Simplex SCE
(objective: pipelines.methods.cores)."""
from __future__ import annotations

from pipelines.methods.card import MethodCard, MethodParams, register_method

CORES = register_method(MethodCard(
    name="cores", Params=MethodParams, classifier="simplex", retrain_from_scratch=True, requires_initial_state=True,
    objective="pipelines.methods.cores:CoReS"))

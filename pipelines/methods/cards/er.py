"""ER: experience-replay fine-tuning with a learnable, growing classifier (objective: pipelines.methods.er)."""
from __future__ import annotations

from pipelines.methods.card import MethodCard, MethodParams, register_method

ER = register_method(MethodCard(
    name="er", Params=MethodParams, classifier="learnable", uses_replay=True,
    objective="pipelines.methods.er:ER"))

"""pipelines.stages.feature_way: which way an extract stores features, decided from cards alone, and the numbers
`compat plan` prints for both ways (worked out by hand below)."""
from __future__ import annotations

import pytest
import tiny_scenario_helpers as tiny

from pipelines.config.load import validate_config
from pipelines.stages.feature_way import feature_way, plan_lines


def _config(method: str, num_slots: int = 100, features: str = "auto", head: str = "auto"):
    tiny.register()
    document = tiny.method_scenario(method, "runs/unused")
    document["model"].update(num_slots=num_slots, head=head)
    document["evaluation"]["features"] = features
    return validate_config(document)


def test_plan_lines_give_storage_and_similarity_cost_of_both_ways():
    # cnn4 at width 4: m = 8 * 4 = 32 (its card); K = 100: d = 99 > m, so auto takes the bridge
    lines = plan_lines(_config("dsimplex-hoc"), query_rows=30, gallery_rows=30, entries=6)
    assert lines[0] == "features: bridge (d=99 > m=32); evaluation.features=auto"
    # float16: 2 bytes a value; the head A is 99 x 32 fp32 = 12,672 B = 0.0 MiB
    assert lines[1] == ("  storage per image per model: direct 198 B (d=99), bridge 64 B (m=32; the head A, 0.0 MiB "
                        "fp32, is read from the model weights)")
    # direct 2*30*30*99 = 178,200; bridge 2*2*99*32^2 + 2*30*32^2 + 2*30*30*32 = 405,504 + 61,440 + 57,600 = 524,544
    assert lines[2] == ("  similarity cost per entry: direct 1.782e+05 FLOPs, bridge 5.245e+05 FLOPs (0.3x less); "
                        "6 entries")


def test_methods_whose_features_cannot_take_the_bridge():
    way, reason = feature_way("auto", "fan", "junction", 99, 32)
    assert way == "direct" and reason.startswith("method fan applies its feature adapters to gallery features")
    assert feature_way("auto", "psp", "junction", 99, 32) == ("direct", "method psp stores logits, not junction "
                                                                         "features")
    with pytest.raises(ValueError, match="'bridge' is not possible here: the model has no junction"):
        feature_way("bridge", "er", "backbone", 99, 32)
    assert feature_way("auto", "dsimplex-hoc", "junction", 20, 32)[0] == "direct"  # d <= m: nothing saved

"""output.shared_store: third-party models trained once and adopted by other runs (pipelines.store.shared_store), and the
pretrain entry's classifier family that lets runs of different methods share them."""
from __future__ import annotations

import threading
import time

import pytest
import tiny_scenario_helpers as tiny
import torch

from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.store.run_store import RunStore
from pipelines.store.shared_store import SharedStore, copy_stage


def _config(method: str, run_dir, shared, classifier: str = "simplex"):
    document = tiny.scenario(method, output=str(run_dir))
    document["pretrain"][0]["classifier"] = classifier
    document["output"]["shared_store"] = None if shared is None else str(shared)
    return validate_config(document)


def _blobs(store: RunStore, key: str) -> dict:
    return {name: info["sha256"] for name, info in store.load_manifest(key)["blobs"].items()}


@pytest.fixture(autouse=True)
def _tiny():
    tiny.register()
    torch.set_num_threads(1)


def test_pretrain_keys_follow_the_resolved_classifier_family(tmp_path):
    hoc = compile_scenario(_config("dsimplex-hoc", tmp_path / "a", None, "method"))
    er_simplex = compile_scenario(_config("er", tmp_path / "b", None, "simplex"))
    er_own = compile_scenario(_config("er", tmp_path / "c", None, "method"))
    # "method" resolves to the method's family, so an ER run pre-training d-Simplex models needs HOC's exact models
    assert er_simplex.pretrain_stages == hoc.pretrain_stages
    assert er_own.pretrain_stages["p1"] != hoc.pretrain_stages["p1"]
    assert er_own[er_own.pretrain_stages["p1"]].inputs.classifier == "learnable"
    with pytest.raises(ValueError, match=r"pretrain\[0\]\.classifier: 'learnable' cannot feed method 'dsimplex-hoc'"):
        compile_scenario(_config("dsimplex-hoc", tmp_path / "d", None, "learnable"))


def test_second_run_adopts_the_published_model_and_computes_the_same_results(tmp_path):
    shared = tmp_path / "shared"
    hoc_config = _config("dsimplex-hoc", tmp_path / "hoc", shared)
    first = LocalExecutor(progress=False).run(compile_scenario(hoc_config), RunStore(tmp_path / "hoc"))
    key = compile_scenario(hoc_config).pretrain_stages["p1"]
    assert first.published == [key] and first.adopted == [] and key in first.executed
    assert RunStore(shared).stage_keys() == [key]
    assert _blobs(RunStore(shared), key) == _blobs(RunStore(tmp_path / "hoc"), key)

    # an ER run on the same store: the d-Simplex model is copied, not trained, and ER starts from it
    er_config = _config("er", tmp_path / "er", shared)
    er_graph = compile_scenario(er_config)
    second = LocalExecutor(progress=False).run(er_graph, RunStore(tmp_path / "er"))
    assert second.adopted == [key] and key in second.skipped and key not in second.executed
    assert second.published == [] and second.matrix is not None
    # the same ER run without the shared store trains its own copy: the same bytes and the same matrix
    alone = LocalExecutor(progress=False).run(compile_scenario(_config("er", tmp_path / "alone", None)),
                                              RunStore(tmp_path / "alone"))
    assert key in alone.executed
    assert _blobs(RunStore(tmp_path / "alone"), key) == _blobs(RunStore(tmp_path / "er"), key)
    assert alone.matrix == second.matrix


def test_a_run_waits_for_a_claimed_model_then_adopts_it(tmp_path):
    """While another process holds the claim on a key, the run trains nothing that needs it; once the model is
    published it is adopted (never trained twice)."""
    source_dir, shared = tmp_path / "source", tmp_path / "shared"
    LocalExecutor(progress=False).run(compile_scenario(_config("dsimplex-hoc", source_dir, None)),
                                      RunStore(source_dir))
    config = _config("dsimplex-hoc", tmp_path / "waiting", shared)
    graph = compile_scenario(config)
    key = graph.pretrain_stages["p1"]
    holder = SharedStore(str(shared))
    assert holder.claim(key)  # "another run" trains p1

    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(
        summary=LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "waiting"))))
    worker.start()
    time.sleep(3 * 2.0)
    assert worker.is_alive()  # nothing but p1's descendants to run: it waits for the claim
    assert not RunStore(tmp_path / "waiting").has(key)
    assert holder.publish(key, RunStore(source_dir))  # published, claim released
    worker.join(timeout=300)
    summary = outcome["summary"]
    assert summary.adopted == [key] and key not in summary.executed and summary.matrix is not None
    assert _blobs(RunStore(tmp_path / "waiting"), key) == _blobs(RunStore(source_dir), key)


def test_claim_is_exclusive_until_released(tmp_path):
    first, second = SharedStore(str(tmp_path)), SharedStore(str(tmp_path))
    assert first.claim("pretrain-p1-0123456789abcdef")
    assert first.claim("pretrain-p1-0123456789abcdef")  # held already
    assert not second.claim("pretrain-p1-0123456789abcdef")
    assert second.claim("pretrain-p2-0123456789abcdef")  # claims are per key
    first.close()
    assert second.claim("pretrain-p1-0123456789abcdef")
    second.close()


def test_shared_store_on_s3_round_trip(tmp_path, s3_bucket):
    """Publish from a local run to an S3 shared store and adopt back into another run folder, verified bytes."""
    source_dir = tmp_path / "source"
    LocalExecutor(progress=False).run(compile_scenario(_config("dsimplex-hoc", source_dir, None)),
                                      RunStore(source_dir))
    key = compile_scenario(_config("dsimplex-hoc", source_dir, None)).pretrain_stages["p1"]
    from cluster.storage.s3 import object_storage

    with object_storage():  # S3 claims are conditional writes through the configured S3 access
        shared = SharedStore(f"s3://{s3_bucket}/third-party")
        assert shared.claim(key)
        assert not SharedStore(f"s3://{s3_bucket}/third-party").claim(key)  # the heartbeat object is fresh
        assert shared.publish(key, RunStore(source_dir))
        assert not shared.publish(key, RunStore(source_dir))  # there already
        target = RunStore(tmp_path / "target")
        assert SharedStore(f"s3://{s3_bucket}/third-party").adopt(key, target)
        assert _blobs(target, key) == _blobs(RunStore(source_dir), key)
        assert target.load_record(key) == RunStore(source_dir).load_record(key)


def test_copy_stage_refuses_a_corrupt_blob(tmp_path):
    from compat_core.integrity import IntegrityError

    source = RunStore(tmp_path / "a")
    source.commit("pretrain-p1-0123456789abcdef", {"x": 1}, {"model.safetensors": b"weights"})
    (tmp_path / "a" / "artifacts" / "pretrain-p1-0123456789abcdef" / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(IntegrityError, match="model.safetensors: sha256 expected"):
        copy_stage(source, RunStore(tmp_path / "b"), "pretrain-p1-0123456789abcdef")
    assert not RunStore(tmp_path / "b").has("pretrain-p1-0123456789abcdef")


def test_plan_says_which_third_party_models_the_shared_store_holds(tmp_path):
    from app.commands.plan import describe_shared

    shared = RunStore(tmp_path / "shared")
    shared.commit("pretrain-p1-0123456789abcdef", {"x": 1})
    line = describe_shared(str(tmp_path / "shared"), {"p1": "pretrain-p1-0123456789abcdef",
                                                      "p2": "pretrain-p2-0123456789abcdef"})
    assert line == (f"third-party models: shared store {tmp_path / 'shared'} holds 1 of 2 (p1 copied, not trained; "
                    f"p2 trained by the first run that needs them, then published)")


def test_a_corrupt_shared_copy_is_trained_again_and_republished(tmp_path, caplog):
    shared = tmp_path / "shared"
    config = _config("dsimplex-hoc", tmp_path / "first", shared)
    key = compile_scenario(config).pretrain_stages["p1"]
    LocalExecutor(progress=False).run(compile_scenario(config), RunStore(tmp_path / "first"))
    good = _blobs(RunStore(shared), key)
    (shared / "artifacts" / key / "model.safetensors").write_bytes(b"tampered")
    second = _config("dsimplex-hoc", tmp_path / "second", shared)
    with caplog.at_level("WARNING", logger="pipelines.store.shared_store"):
        summary = LocalExecutor(progress=False).run(compile_scenario(second), RunStore(tmp_path / "second"))
    assert f"stage {key} is uncommitted there and trained again" in caplog.text
    assert key in summary.executed and summary.published == [key] and summary.adopted == []
    assert _blobs(RunStore(shared), key) == good == _blobs(RunStore(tmp_path / "second"), key)
    RunStore(shared).read_blob(key, "model.safetensors")  # verified again


def test_the_longest_pretraining_is_submitted_first(tmp_path):
    """Classes x epochs decides (p2: 4 x 3 = 12 > p1: 4 x 1); then graph order."""
    from pipelines.engine.runner import Backend, run_graph

    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path))
    document["pretrain"].append({"name": "p2", "pool": {"dataset": "tiny-synth", "split": "pretrain"},
                                 "num_classes": 4, "epochs": 3})
    document["replacements"] = [{"at_task": 3, "source": "pretrain:p2"}]
    graph = compile_scenario(validate_config(document))
    assert [stage.label for stage in graph if stage.first] == ["pretrain[p2]"]

    class Recorder(Backend):
        def __init__(self):
            self.order = []

        def submit(self, stage, graph, store):
            self.order.append(stage.label)

        def wait(self, timeout=None):
            raise KeyboardInterrupt  # stop after the first round of submissions

    backend = Recorder()
    with pytest.raises(KeyboardInterrupt):
        run_graph(graph, RunStore(tmp_path), backend, emit=lambda record: None)
    # the tiny scenario's first task starts from random weights, so it is ready at once too
    assert backend.order == ["pretrain[p2]", "pretrain[p1]", "finetune[t=0]"]

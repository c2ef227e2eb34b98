"""`compat tune --resume` of a search whose saved Tune state names a class this code does not have (a search started
by another version of compat, e.g. before the search's MLflow callback moved from cluster.tune.runner to
cluster.tune.tracking): one clear error naming the folder and the fix instead of an unpickling traceback, refused
before the search's MLflow store is touched."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

SPACE = {"parameters": {"method.params.lam": {"type": "categorical", "values": [0.0, 1.0]}}}


def test_resume_of_a_search_saved_by_other_code_names_the_folder_and_the_fix(ray_local, tmp_path, capsys,
                                                                              monkeypatch):
    import cluster.tune.runner as tune_module
    from app.cli import main
    from cluster.tune.spec import SearchSpec, seal_tuner_state, write_spec
    from pipelines.config.load import config_to_dict, validate_config

    tiny.register()
    base = config_to_dict(validate_config(tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0})))
    tracking = tmp_path / "mlflow" / "mlflow.db"
    spec = SearchSpec(name="older", base_config=base, space=SPACE, objective="AA", samples=2,
                      storage=str(tmp_path / "searches"), tracking_uri=f"sqlite:///{tracking}",
                      parent_run_id="0" * 32)
    write_spec(spec)
    experiment = Path(spec.experiment_path)

    # Tune's state as the earlier code saved it: the run config's callback pickled by reference to
    # cluster.tune.runner.MlflowSearchCallback, a name this code no longer has
    class MlflowSearchCallback:
        pass

    MlflowSearchCallback.__module__, MlflowSearchCallback.__qualname__ = "cluster.tune.runner", "MlflowSearchCallback"
    monkeypatch.setattr(tune_module, "MlflowSearchCallback", MlflowSearchCallback, raising=False)
    state = pickle.dumps({"callbacks": [MlflowSearchCallback()]})
    monkeypatch.delattr(tune_module, "MlflowSearchCallback")
    (experiment / "tuner.pkl").write_bytes(state)
    seal_tuner_state(str(experiment))  # as `compat tune` pins the tuner.pkl Tune wrote

    code = main(["tune", "--resume", str(experiment)])
    error = capsys.readouterr().err
    assert code == 2, error
    first = error.splitlines()[0]
    assert f"error: --resume {experiment}: Ray Tune's saved state of this search names code" in first
    assert "MlflowSearchCallback" in first and "started by another version" in first
    assert f"`compat compare {experiment}`" in first
    assert (f"`compat tune CONFIG --space SPACE --objective aa --samples 2 --storage {tmp_path / 'searches'} "
            f"--name NEW_NAME`") in first
    assert "Traceback" not in error
    assert not tracking.exists()  # refused before the search's MLflow run was reopened

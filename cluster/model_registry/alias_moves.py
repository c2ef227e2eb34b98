"""Moving a registry alias as a recorded decision, without torch: the runs of the ``compat-gate`` experiment that
record every move, the reconciliation of a move a killed process left between intent and confirmation
(:func:`reconcile_moves`), an alias's history (:func:`alias_history`, ``compat gate history``) and
:func:`rollback`. The gate's evaluation, which embeds images with the models, is :mod:`cluster.model_registry.gate`.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from cluster.tracking.client import ensure_experiment, open_client

GATE_EXPERIMENT = "compat-gate"
DEFAULT_ALIAS = "champion"


def version_by_alias(client: Any, name: str, alias: str) -> Any | None:
    """ModelVersion behind ``alias`` or None when the alias is not set."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


MOVE_STATE = "move_state"
MOVE_STEPS = ("intent", "moved")  # the points between the steps of an alias move, as told to ``on_move_step``
MoveStep = Callable[[str], None]


def _no_step(step: str) -> None:
    """The default ``on_move_step``: nothing happens between the steps of a move."""


def reconcile_moves(client: Any, model: str, alias: str, experiment: str = GATE_EXPERIMENT) -> list[str]:
    """Settle every alias move of ``model``/``alias`` whose process died between intent and confirmation: confirmed
    when the alias is at its ``new_version`` (the move happened), else recorded as ``interrupted`` (KILLED, alias
    not moved). Returns the run ids settled."""
    found = client.get_experiment_by_name(experiment)
    if found is None or "'" in model or "'" in alias:
        return []
    runs = client.search_runs([found.experiment_id], f"tags.run_role = 'gate' and tags.registered_model = '{model}' "
                              f"and tags.alias = '{alias}' and tags.{MOVE_STATE} = 'intended'", max_results=100)
    settled = []
    for run in runs:
        tags = run.data.tags
        current = version_by_alias(client, model, alias)
        at = str(current.version) if current is not None else None
        if at == tags.get("new_version"):
            if tags.get("action") == "gate" and tags.get("previous_version"):
                client.set_model_version_tag(model, tags["previous_version"], f"gate.{alias}.replaced_by",
                                             tags["new_version"])
            client.set_tag(run.info.run_id, MOVE_STATE, "confirmed")
            client.set_tag(run.info.run_id, "reconciled", "alias found at the intended version: move confirmed")
            client.set_terminated(run.info.run_id, "FINISHED")
        else:
            client.set_tag(run.info.run_id, MOVE_STATE, "interrupted")
            client.set_tag(run.info.run_id, "intended_decision", tags.get("decision", ""))
            client.set_tag(run.info.run_id, "decision", "interrupted")
            client.set_tag(run.info.run_id, "new_version", at or "")
            client.set_tag(run.info.run_id, "reason", f"the process stopped before the alias moved (alias at "
                           f"{'v' + at if at else 'nothing'}); intended: {tags.get('reason', '')}"[:4000])
            client.set_terminated(run.info.run_id, "KILLED")
        settled.append(run.info.run_id)
    return settled


def _experiment_id(client: Any, name: str) -> str:
    return ensure_experiment(client, name)


def _version(client: Any, model: str, version: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(model, str(version))
    except MlflowException as error:
        raise ValueError(f"registered model {model!r} has no version {version!r} "
                         f"({error.error_code}); list them with `mlflow models` or the MLflow UI") from None


def alias_history(tracking_uri: str, model: str, alias: str = DEFAULT_ALIAS,
                  experiment: str = GATE_EXPERIMENT) -> list[dict]:
    """Gate and rollback runs of ``model``/``alias``, oldest first: time, action, versions, decision, reason."""
    client = open_client(tracking_uri)
    reconcile_moves(client, model, alias, experiment)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    if "'" in model or "'" in alias:
        raise ValueError(f"model {model!r} / alias {alias!r}: quotes are not allowed")
    runs = client.search_runs([found.experiment_id], f"tags.run_role = 'gate' and tags.registered_model = '{model}' "
                              f"and tags.alias = '{alias}'", order_by=["attributes.start_time ASC"],
                              max_results=1000)
    rows = []
    for run in runs:
        tags = run.data.tags
        rows.append({"time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(run.info.start_time / 1000)),
                     "start_ms": run.info.start_time, "run_id": run.info.run_id, "action": tags.get("action"),
                     "candidate_version": tags.get("candidate_version"),
                     "previous_version": tags.get("previous_version") or None,
                     "new_version": tags.get("new_version") or None, "decision": tags.get("decision"),
                     "adapter": tags.get("adapter") or None, "reason": tags.get("reason", ""),
                     "margin": run.data.metrics.get("margin")})
    return rows


def refusal_of(history: list[dict], version: str) -> dict | None:
    """The gate's latest decision on ``version`` when it was a refusal (a later promotion clears it), else None."""
    decisions = [row for row in history if row["action"] == "gate" and row["candidate_version"] == str(version)
                 and row["decision"] in ("promoted", "refused")]
    return decisions[-1] if decisions and decisions[-1]["decision"] == "refused" else None


def rollback(tracking_uri: str, model: str, alias: str = DEFAULT_ALIAS, to_version: str | None = None,
             reason: str = "", experiment: str = GATE_EXPERIMENT, force: bool = False,
             on_move_step: MoveStep = _no_step) -> dict:
    """Move ``alias`` back to the version it pointed to before its last move (or to ``to_version``); recorded.

    A target the gate refused (its latest gate decision) is installed only with ``force``, recorded as forced
    (tag ``forced`` on the rollback run, the refusal's run id in ``overrides_refusal``); otherwise ValueError.
    on_move_step: as for :func:`run_gate`."""
    client = open_client(tracking_uri)
    reconcile_moves(client, model, alias, experiment)
    current = version_by_alias(client, model, alias)
    if current is None:
        raise ValueError(f"registered model {model!r}: alias {alias!r} is not set, nothing to roll back")
    if to_version is None:
        moves = [row for row in alias_history(tracking_uri, model, alias, experiment)
                 if row["decision"] in ("promoted", "rolled-back") and row["new_version"] == str(current.version)]
        if not moves or not moves[-1]["previous_version"]:
            raise ValueError(f"registered model {model!r}: no recorded move of alias {alias!r} to version "
                             f"{current.version} with a previous version; give the target with --to VERSION")
        to_version = moves[-1]["previous_version"]
    target = _version(client, model, to_version)
    refused = refusal_of(alias_history(tracking_uri, model, alias, experiment), str(target.version))
    if refused is not None and not force:
        raise ValueError(f"registered model {model!r}: the gate refused version {target.version} for alias {alias!r} "
                         f"on {refused['time']} UTC ({refused['reason']}; gate run {refused['run_id']}); installing "
                         f"it breaks compatibility with the gallery; add --force to roll back to it anyway (recorded)")
    tags = {"run_role": "gate", "action": "rollback", "registered_model": model, "alias": alias,
            "candidate_version": str(target.version), "previous_version": str(current.version),
            "new_version": str(target.version), "decision": "rolled-back",
            "reason": (reason or f"rollback of alias {alias!r} from version {current.version} to {target.version}"),
            MOVE_STATE: "intended", "forced": str(refused is not None).lower()}
    if refused is not None:
        tags["overrides_refusal"] = refused["run_id"]
        tags["reason"] = f"FORCED over the gate's refusal (run {refused['run_id']}): {tags['reason']}"
    run = client.create_run(_experiment_id(client, experiment), tags=tags,
                            run_name=f"rollback-{model}-v{current.version}-to-v{target.version}")
    on_move_step("intent")
    client.set_registered_model_alias(model, alias, str(target.version))
    on_move_step("moved")
    client.set_model_version_tag(model, str(current.version), f"gate.{alias}.rolled_back_by", run.info.run_id)
    client.set_model_version_tag(model, str(target.version), f"gate.{alias}.decision", "rolled-back")
    client.set_tag(run.info.run_id, MOVE_STATE, "confirmed")
    client.set_terminated(run.info.run_id, "FINISHED")
    return {"model": model, "alias": alias, "from_version": str(current.version), "to_version": str(target.version),
            "run_id": run.info.run_id, "forced": refused is not None}


__all__ = ["DEFAULT_ALIAS", "GATE_EXPERIMENT", "MOVE_STATE", "MOVE_STEPS", "MoveStep", "alias_history",
           "reconcile_moves", "refusal_of", "rollback", "version_by_alias"]

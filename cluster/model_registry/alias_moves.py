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
# the points between the steps of an alias move, as told to ``on_move_step``: the move recorded as intended, the
# version tags of the new holder written, the alias moved
MOVE_STEPS = ("intent", "tagged", "moved")
MoveStep = Callable[[str], None]
# a check of a rollback target before the alias moves: (target version, version behind the alias) -> None, raising
# ValueError when the target cannot serve in place of the current one
TargetCheck = Callable[[str, str], None]
# the version tags (``gate.<alias>.<name>``) that say how a version came to hold the alias: the gate run that
# promoted it (the search service reads its adapter file), its decision, margin and adapter kind. A promotion
# writes them before the alias moves; its run keeps their earlier values as ``prior.<name>`` so that a move
# interrupted before the alias moved restores them.
INSTALL_TAGS = ("decision", "run_id", "margin", "adapter")
PRIOR = "prior."


def _no_step(step: str) -> None:
    """The default ``on_move_step``: nothing happens between the steps of a move."""


def install_tags(version: Any, alias: str) -> dict[str, str]:
    """The install tags of ``version`` for ``alias``: name -> value ("" when unset)."""
    tags = version.tags or {}
    return {name: tags.get(f"gate.{alias}.{name}", "") for name in INSTALL_TAGS}


def set_version_tags(client: Any, model: str, version: str, alias: str, values: dict[str, str]) -> None:
    """Set ``gate.<alias>.<name>`` of ``model`` version ``version`` to each value; an empty value removes the tag."""
    present = client.get_model_version(model, str(version)).tags or {}
    for name, value in values.items():
        key = f"gate.{alias}.{name}"
        if value:
            client.set_model_version_tag(model, str(version), key, str(value))
        elif key in present:
            client.delete_model_version_tag(model, str(version), key)


def after_move(client: Any, model: str, alias: str, tags: dict[str, str], run_id: str) -> None:
    """The version tags a move writes once the alias is at its new version (the same again when a reader confirms
    a move whose process died): the replaced version names what replaced it; a rollback target is tagged so."""
    previous, new = tags.get("previous_version"), tags.get("new_version")
    if tags.get("action") == "gate" and previous:
        client.set_model_version_tag(model, previous, f"gate.{alias}.replaced_by", new)
    elif tags.get("action") == "rollback":
        client.set_model_version_tag(model, previous, f"gate.{alias}.rolled_back_by", run_id)
        client.set_model_version_tag(model, new, f"gate.{alias}.decision", "rolled-back")


def _restore_install_tags(client: Any, model: str, alias: str, tags: dict[str, str], run_id: str) -> None:
    """A promotion stopped before the alias moved: the candidate's install tags back to their values before it
    (only where they are this run's: another process may have written them since)."""
    candidate = tags.get("candidate_version")
    if tags.get("action") != "gate" or not candidate:
        return
    if install_tags(client.get_model_version(model, candidate), alias)["run_id"] != run_id:
        return
    set_version_tags(client, model, candidate, alias, {name: tags.get(PRIOR + name, "") for name in INSTALL_TAGS})


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
            after_move(client, model, alias, tags, run.info.run_id)
            client.set_tag(run.info.run_id, MOVE_STATE, "confirmed")
            client.set_tag(run.info.run_id, "reconciled", "alias found at the intended version: move confirmed")
            client.set_terminated(run.info.run_id, "FINISHED")
        else:
            _restore_install_tags(client, model, alias, tags, run.info.run_id)
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


def held_alias(history: list[dict], version: str) -> bool:
    """Whether ``version`` held the alias according to ``history``: moved there by a completed move (a promotion or
    a rollback), or behind it when one moved it away."""
    return any(str(version) in (row["new_version"], row["previous_version"])
               and row["decision"] in ("promoted", "rolled-back") for row in history)


def _last_previous(history: list[dict], model: str, alias: str, current: str) -> str:
    """The version behind ``alias`` before its last completed move to ``current``."""
    moves = [row for row in history if row["decision"] in ("promoted", "rolled-back") and row["new_version"] == current]
    if not moves or not moves[-1]["previous_version"]:
        raise ValueError(f"registered model {model!r}: no recorded move of alias {alias!r} to version {current} "
                         f"with a previous version; give the target with --to VERSION")
    return moves[-1]["previous_version"]


def _objection(history: list[dict], model: str, alias: str, target: str) -> tuple[str, dict | None] | None:
    """Why a rollback to ``target`` needs ``--force`` (message, the refusal row when the gate refused it), or
    None: a version the gate refused last, or one that never held the alias."""
    refused = refusal_of(history, target)
    if refused is not None:
        return (f"the gate refused version {target} for alias {alias!r} on {refused['time']} UTC "
                f"({refused['reason']}; gate run {refused['run_id']}); installing it breaks compatibility with the "
                f"gallery", refused)
    if not held_alias(history, target):
        return (f"version {target} never held alias {alias!r} (no promotion or rollback to it is recorded); a "
                f"rollback returns to an earlier holder, a new version goes through `compat gate`", None)
    return None


def rollback(tracking_uri: str, model: str, alias: str = DEFAULT_ALIAS, to_version: str | None = None,
             reason: str = "", experiment: str = GATE_EXPERIMENT, force: bool = False,
             on_move_step: MoveStep = _no_step, *, check_target: TargetCheck) -> dict:
    """Move ``alias`` back to the version it pointed to before its last move (or to ``to_version``); recorded.

    A target the gate refused (its latest gate decision) or one that never held the alias is installed only with
    ``force``, recorded as forced (tag ``forced``; the refusal's run id in ``overrides_refusal``); otherwise
    ValueError. Every target, forced or not, first passes ``check_target(target, current)`` (it loads the target
    and compares it with the version behind the alias), which raises ValueError to refuse it.
    on_move_step: as for ``cluster.model_registry.gate.run_gate``."""
    client = open_client(tracking_uri)
    reconcile_moves(client, model, alias, experiment)
    current = version_by_alias(client, model, alias)
    if current is None:
        raise ValueError(f"registered model {model!r}: alias {alias!r} is not set, nothing to roll back")
    history = alias_history(tracking_uri, model, alias, experiment)
    if to_version is None:
        to_version = _last_previous(history, model, alias, str(current.version))
    target = _version(client, model, to_version)
    if str(target.version) == str(current.version):
        raise ValueError(f"registered model {model!r}: version {target.version} is already behind alias {alias!r}; "
                         f"nothing to roll back")
    objection = _objection(history, model, alias, str(target.version))
    if objection is not None and not force:
        raise ValueError(f"registered model {model!r}: {objection[0]}; add --force to roll back to it anyway "
                         f"(recorded)")
    check_target(str(target.version), str(current.version))
    tags = {"run_role": "gate", "action": "rollback", "registered_model": model, "alias": alias,
            "candidate_version": str(target.version), "previous_version": str(current.version),
            "new_version": str(target.version), "decision": "rolled-back",
            "reason": (reason or f"rollback of alias {alias!r} from version {current.version} to {target.version}"),
            MOVE_STATE: "intended", "forced": str(objection is not None).lower()}
    if objection is not None:
        refused = objection[1]
        if refused is not None:
            tags["overrides_refusal"] = refused["run_id"]
            tags["reason"] = f"FORCED over the gate's refusal (run {refused['run_id']}): {tags['reason']}"
        else:
            tags["reason"] = f"FORCED: version {target.version} never held alias {alias!r}: {tags['reason']}"
    run = client.create_run(_experiment_id(client, experiment), tags=tags,
                            run_name=f"rollback-{model}-v{current.version}-to-v{target.version}")
    on_move_step("intent")
    on_move_step("tagged")  # a rollback writes no version tag before the move: the target keeps its install tags
    client.set_registered_model_alias(model, alias, str(target.version))
    on_move_step("moved")
    after_move(client, model, alias, tags, run.info.run_id)
    client.set_tag(run.info.run_id, MOVE_STATE, "confirmed")
    client.set_terminated(run.info.run_id, "FINISHED")
    return {"model": model, "alias": alias, "from_version": str(current.version), "to_version": str(target.version),
            "run_id": run.info.run_id, "forced": objection is not None}


__all__ = ["DEFAULT_ALIAS", "GATE_EXPERIMENT", "INSTALL_TAGS", "MOVE_STATE", "MOVE_STEPS", "MoveStep", "PRIOR",
           "TargetCheck", "after_move", "alias_history", "held_alias", "install_tags", "reconcile_moves",
           "refusal_of", "rollback", "set_version_tags", "version_by_alias"]

"""app.dispatch: every error a command raises becomes one line with its exit code (2 for bad input, 1 otherwise),
--debug re-raises it, an interrupt exits 130, and a bad --tracking-uri is refused before the command runs."""
from __future__ import annotations

import argparse
import os
import sys
import types

import pytest

from app.dispatch import describe_error, run_command
from compat_core.integrity import IntegrityError
from pipelines.store.lease import RunFolderBusyError


def _command(monkeypatch, behaviour) -> str:
    """Register app.commands.fake whose run(args) calls ``behaviour(args)``; returns the command name."""
    module = types.ModuleType("app.commands.fake")
    module.run = behaviour
    monkeypatch.setitem(sys.modules, "app.commands.fake", module)
    return "fake"


def _args(**values) -> argparse.Namespace:
    return argparse.Namespace(command="fake", debug=False, **values)


def _raises(error: BaseException):
    def run(args):
        raise error
    return run


def test_a_corrupt_artifact_names_the_recompute_command(monkeypatch, capsys):
    key = "finetune-t1-0123456789abcdef0123456789"
    _command(monkeypatch, _raises(IntegrityError("model.safetensors: sha256 mismatch", stage_key=key)))
    assert run_command(_args(resume="runs/x")) == 1
    lines = capsys.readouterr().err.splitlines()
    # the key is cut to its first 24 characters, a unique prefix --recompute accepts
    assert lines == ["error: model.safetensors: sha256 mismatch; recompute that stage with: compat run --resume "
                     "runs/x --recompute finetune-t1-0123456789ab", "(run again with --debug for the traceback)"]


@pytest.mark.parametrize(("error", "line", "code"), [
    (ValueError("training.epochs: expected >= 1"), "training.epochs: expected >= 1", 2),
    (KeyError("unknown method 'x'"), "unknown method 'x'", 2),  # the message itself, not KeyError's quoted repr
    (FileNotFoundError("data/x: missing"), "data/x: missing", 2),
    (RunFolderBusyError("runs/x is held by pid 7"), "runs/x is held by pid 7", 1),
    (RuntimeError("worker died"), "RuntimeError: worker died", 1),
    (IntegrityError("blob differs"), "blob differs", 1),  # no stage key: no recompute hint
])
def test_each_error_kind_gives_one_line_and_its_exit_code(error, line, code):
    assert describe_error(error, _args()) == (line, code)


def test_debug_re_raises_with_the_traceback(monkeypatch):
    _command(monkeypatch, _raises(ValueError("bad value")))
    args = _args()
    args.debug = True
    with pytest.raises(ValueError, match="bad value"):
        run_command(args)


def test_an_interrupt_exits_130_and_a_result_is_passed_on(monkeypatch, capsys):
    _command(monkeypatch, _raises(KeyboardInterrupt()))
    assert run_command(_args()) == 130 and capsys.readouterr().err == "interrupted\n"
    _command(monkeypatch, lambda args: 3)
    assert run_command(_args()) == 3
    _command(monkeypatch, lambda args: None)  # a command returning nothing succeeded
    assert run_command(_args()) == 0


def test_a_bad_tracking_uri_is_refused_before_the_command_runs(monkeypatch, capsys):
    ran = []
    _command(monkeypatch, lambda args: ran.append(args) or 0)
    assert run_command(_args(tracking_uri="ftp://host/store")) == 2
    assert ran == [] and capsys.readouterr().err.startswith("error: --tracking-uri: tracking URI 'ftp://host/store'")
    # 'none' switches tracking off: the command receives the resolved target, without a URI
    assert run_command(_args(tracking_uri="none")) == 0 and ran[0].tracking.uri is None
    assert not hasattr(ran[0], "tracking_uri")


def test_credentials_in_a_tracking_uri_move_to_mlflows_variables(monkeypatch, mlflow_server):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    seen = []
    _command(monkeypatch, lambda args: seen.append(args.tracking.uri) or 0)
    server = mlflow_server.tracking_uri  # a real server: the command waits for its target to answer first
    assert run_command(_args(tracking_uri=server.replace("http://", "http://alice:s3cret@"))) == 0
    assert seen == [server]
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("alice", "s3cret")


def test_an_error_raised_in_a_ray_task_is_one_line_with_its_cause(ray_local):
    """A real Ray task fails: the command prints the cause the task raised, with the task named, not Ray's wrapper
    text (which holds the remote traceback, shown only with --debug)."""
    import argparse

    import ray

    from app.dispatch import describe_error

    @ray.remote(max_retries=0)
    def stage_in_worker():
        raise ValueError("replacements[0].source: weights file /w.safetensors: tensor 'junction.weight' has dtype "
                         "int8; expected floating-point weights")

    with pytest.raises(Exception) as raised:
        ray.get(stage_in_worker.remote())
    assert 'File "' in str(raised.value)  # Ray's wrapper carries the remote traceback in its text
    message, code = describe_error(raised.value, argparse.Namespace())
    assert code == 2
    assert message.startswith("replacements[0].source: weights file /w.safetensors: tensor 'junction.weight' has "
                              "dtype int8; expected floating-point weights (raised in a Ray task)")
    assert "\n" not in message and 'File "' not in message

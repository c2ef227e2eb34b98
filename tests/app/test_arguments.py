"""The argument modules: each command parses to the defaults its help text promises (read from the help strings
and the docs, not from the code), and the --executor choices are the registered executors."""
from __future__ import annotations

import argparse

import pytest

from app.arguments.cluster_access import add_executor_argument
from app.cli import build_parser
from pipelines.engine.backends import EXECUTORS

# (argv, the values the help text promises)
PROMISED = [
    (["run", "c.yaml"], {"executor": "local", "overrides": [], "recompute": [], "resume": None, "address": None,
                         "tracking_uri": None, "no_progress": False}),
    (["submit", "c.yaml"], {"executor": "ray", "wait": False, "follow": True, "shared_filesystem": False}),
    (["submit", "c.yaml", "--wait"], {"wait": True, "follow": True}),  # "printing its logs as they come"
    (["submit", "c.yaml", "--wait", "--no-follow"], {"wait": True, "follow": False}),
    (["plan", "c.yaml"], {"check_data": False, "no_cost": False, "seconds_per_image": None, "calibrated": None}),
    (["ui"], {"port": 5000, "tracking_uri": None}),  # "default 5000"
    (["tune", "c.yaml"], {"samples": 8, "concurrent": 1, "objective": "aca", "scheduler": "asha",
                          "storage": "runs/tune", "seed": 0}),
    (["serve", "IDX", "--model", "models:/m@champion"], {"host": "127.0.0.1", "port": 8000, "replicas": 1,
                                                         "max_k": 100}),
    (["cluster", "up"], {"name": "local", "object_store_memory": 500_000_000, "auth": "token"}),  # "500 MB"
    (["gate", "history", "m"], {"words": ["history", "m"], "alias": "champion", "non_strict": False}),
    (["index", "show", "IDX"], {"pool": "gallery", "shard_rows": 4096, "chunk_rows": 256, "probe": "query"}),
    (["calibrate"], {"config": None, "device": "cpu", "show": False, "force": False}),
    (["logs", "job-1"], {"follow": False, "address": None}),
    (["status"], {"submission_id": None}),
    (["compare", "a", "b"], {"run_dirs": ["a", "b"], "output": None}),
    (["report", "r"], {"run_dir": "r"}),
    (["eval", "r"], {"gallery": None, "metric": None, "strict": None}),
    (["demo"], {"output": "runs/demo", "executor": "ray", "jobs": None}),
]


@pytest.mark.parametrize(("argv", "promised"), PROMISED, ids=[case[0][0] for case in PROMISED])
def test_every_command_parses_to_its_promised_defaults(argv, promised):
    args = build_parser(load=[argv[0]]).parse_args(argv)
    assert {key: getattr(args, key) for key in promised} == promised
    assert args.debug is False


def test_cost_options_of_plan_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as end:
        build_parser(load=["plan"]).parse_args(["plan", "c.yaml", "--seconds-per-image", "0.1", "--calibrated",
                                                "cpu"])
    assert end.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_the_executor_argument_offers_every_registered_executor():
    parser = argparse.ArgumentParser()
    add_executor_argument(parser, default="local", help="where stages run")
    action = next(a for a in parser._actions if a.dest == "executor")
    assert list(action.choices) == EXECUTORS.names() and {"local", "ray"} <= set(action.choices)
    assert action.help.startswith("where stages run. local: ") and "ray: " in action.help

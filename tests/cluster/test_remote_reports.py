"""`compat report` and `compat compare` read s3:// runs through the standard AWS chain (here: an endpoint that lives
only in an AWS profile), and report writes its files back under the run folder's lease."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
from test_reports import MATRIX_2, MATRIX_3, METRICS_2, METRICS_3, make_run  # noqa: E402

from app.cli import main  # noqa: E402


def _profile_only(s3_server, tmp_path, monkeypatch) -> None:
    config = tmp_path / "aws-config"
    config.write_text("[profile seaweed]\nregion = us-east-1\n"
                      f"endpoint_url = {s3_server.endpoint_url}\ns3 =\n    addressing_style = path\n")
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(f"[seaweed]\naws_access_key_id = {s3_server.credentials.access_key}\n"
                           f"aws_secret_access_key = {s3_server.credentials.secret_key}\n")
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "seaweed")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_report_and_compare_on_s3_runs(s3_server, s3_bucket, tmp_path, monkeypatch, capsys, fresh_object_storage):
    from cluster.storage.s3 import object_storage
    from compat_core import io as cio

    hoc = make_run(tmp_path / "hoc", MATRIX_3, METRICS_3)
    er = make_run(tmp_path / "er", MATRIX_2, METRICS_2, name="toy-er", method="er", replacements=(2,))
    _profile_only(s3_server, tmp_path, monkeypatch)
    with object_storage():
        for folder in (hoc, er):
            for path in folder.iterdir():
                cio.write_bytes(f"s3://{s3_bucket}/runs/{folder.name}/{path.name}", path.read_bytes())
    # nothing configured now (fresh_object_storage): the commands configure S3 themselves, from the profile
    assert main(["report", f"s3://{s3_bucket}/runs/hoc"]) == 0
    out = capsys.readouterr().out
    assert "| AC | 0.6667 |" in out and "| AA | 62.50 |" in out
    with object_storage():
        names = cio.list_dir(f"s3://{s3_bucket}/runs/hoc")
        assert {"report.md", "matrix.png", "aa_tau.png", "matrix.csv"} <= set(names)
        assert "0.6667" in cio.read_bytes(f"s3://{s3_bucket}/runs/hoc/report.md").decode()
    assert main(["compare", f"s3://{s3_bucket}/runs/hoc", f"s3://{s3_bucket}/runs/er",
                 "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "toy-hoc" in out and "toy-er" in out and (tmp_path / "out" / "compare.md").is_file()
    assert main(["report", f"s3://{s3_bucket}/runs/nothing"]) == 2
    assert f"s3://{s3_bucket}/runs/nothing: not a run folder" in capsys.readouterr().err


def test_ingest_reaches_the_endpoint_of_an_aws_profile(s3_server, s3_bucket, tmp_path, monkeypatch, capsys,
                                                       fresh_object_storage):
    import subprocess

    from cluster.storage.s3 import object_storage
    from compat_core import io as cio

    _profile_only(s3_server, tmp_path, monkeypatch)
    out = f"s3://{s3_bucket}/datasets/digits"
    # a process of its own, as a user runs it: its Ray tasks start on a node that sees the profile files (the
    # session's shared Ray instance was started before this test wrote them)
    done = subprocess.run([sys.executable, "-m", "app.cli", "ingest", "digits", "--split", "test", "--out", out],
                          capture_output=True, text=True, timeout=600,
                          env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                               "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rows in" in done.stdout
    with object_storage():
        assert cio.list_dir(out)


def test_report_and_compare_of_an_eval_variant_folder_on_s3(s3_server, s3_bucket, tmp_path, monkeypatch, capsys,
                                                             fresh_object_storage):
    """A `compat eval` variant folder (RUN/eval-*/: matrix.json and metrics.json, the run's config.yaml one level
    up) on S3 is reported and compared like a local one; the report is written into the variant folder."""
    from cluster.storage.s3 import object_storage
    from compat_core import io as cio

    hoc = make_run(tmp_path / "hoc", MATRIX_3, METRICS_3)
    run = f"s3://{s3_bucket}/runs/hoc"
    variant = f"{run}/eval-recall_at_1-instances-coarse"
    _profile_only(s3_server, tmp_path, monkeypatch)
    with object_storage():
        for path in hoc.iterdir():
            cio.write_bytes(f"{run}/{path.name}", path.read_bytes())
            if path.name != "config.yaml":
                cio.write_bytes(f"{variant}/{path.name}", path.read_bytes())
    assert main(["report", variant]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("toy-hoc/eval-recall_at_1-instances-coarse: method dsimplex-hoc")
    assert "| AC | 0.6667 |" in out and "| AA | 62.50 |" in out
    with object_storage():
        assert {"report.md", "matrix.png", "matrix.csv"} <= set(cio.list_dir(variant))
        assert "config.yaml" not in cio.list_dir(variant)  # the run's config stays where it was
    assert main(["compare", run, variant, "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "toy-hoc/eval-recall_at_1-instances-coarse" in out and "| toy-hoc |" in out


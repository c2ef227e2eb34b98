"""The CelebA/DINOv3 job rehearsed at its real shape on CPUs, in one command: a Ray head and two worker nodes
(``ray.cluster_utils.Cluster``), data, run store and MLflow artifacts on a SeaweedFS S3 server started here, the real
config (``configs/iam-cl2r-celeba-dinov3-t16.yaml``) with only compute shrunk (1 epoch, ViT depth 1 at width 768,
16 px images), run through ``compat run --executor ray``.

Full shape (default): K = 22,000, 16 tasks of 512 identities, replacements at tasks 5 and 10, replay 10 per identity,
batch 320, CelebA-layout synthetic JPEGs, CASIA-layout identity folders (3,525 / 7,050 / 10,575 identities), a
DINOv3 ViT-B/16 checkpoint in Meta's key layout. About an hour on 2 CPUs. ``--tasks``, ``--ids-per-task`` and
``--num-slots`` shrink it (CASIA pools and replacement tasks scale with it):

    python benchmarks/rehearsal.py --tasks 4 --ids-per-task 16 --num-slots 200     # a few minutes

Prints, beside ``compat plan``'s image counts: wall time per stage kind, peak RSS of the driver and of the stage
processes (per stage kind), run-store bytes per artifact kind, MLflow artifact bytes and backend rows, and the S3
requests the server counted.
"""
from __future__ import annotations

import argparse
import io as _stdio
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
# the checkout first (tests/ has folders named like the packages, which would shadow them as namespace packages),
# the script's folder dropped (benchmarks/cluster.py must not shadow the cluster package), the suite's server helpers
# from tests/ last
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(ROOT / "tests"))

CONFIG = ROOT / "configs" / "iam-cl2r-celeba-dinov3-t16.yaml"
CASIA_FULL = (3525, 7050, 10575)
CELEBA_TRAIN_IDS = 8192  # the full shape's 16 x 512
IMAGE_SIZE = 16
BUCKET = "rehearsal"


# ---- data ----------------------------------------------------------------------------------------------------------
def _jpeg(rng: np.random.Generator, base: np.ndarray) -> bytes:
    from PIL import Image

    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = _stdio.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _upload(objects: list[tuple[str, bytes]], threads: int = 16) -> int:
    from compat_core import io as cio

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda item: cio.write_bytes(*item), objects))
    return sum(len(data) for _, data in objects)


def write_celeba(prefix: str, train_ids: int, train_per_id: int, test_ids: int, test_per_id: int,
                 side: int) -> int:
    """CelebA's layout on S3: img_align_celeba/*.jpg and the two text files; returns the JPEG count."""
    rng = np.random.default_rng(0)
    objects, identity_lines, partition_lines, number = [], [], [], 0
    for identity in range(1, train_ids + test_ids + 1):
        partition, count = (0, train_per_id) if identity <= train_ids else (2, test_per_id)
        base = np.random.default_rng(identity).integers(0, 256, (side, side, 3)).astype(np.float64)
        for _ in range(count):
            number += 1
            name = f"{number:06d}.jpg"
            objects.append((f"{prefix}/img_align_celeba/{name}", _jpeg(rng, base)))
            identity_lines.append(f"{name} {identity}")
            partition_lines.append(f"{name} {partition}")
    objects.append((f"{prefix}/identity_CelebA.txt", ("\n".join(identity_lines) + "\n").encode()))
    objects.append((f"{prefix}/list_eval_partition.txt", ("\n".join(partition_lines) + "\n").encode()))
    _upload(objects)
    return number


def write_casia(prefix: str, identities: int, per_id: int, side: int) -> int:
    """CASIA-WebFace's folder layout on S3 (CASIA-WebFace/<identity>/<n>.jpg); returns the JPEG count."""
    rng = np.random.default_rng(1)
    objects = []
    for identity in range(identities):
        base = np.random.default_rng(100_000 + identity).integers(0, 256, (side, side, 3)).astype(np.float64)
        for number in range(per_id):
            objects.append((f"{prefix}/CASIA-WebFace/{identity:07d}/{number + 1:03d}.jpg", _jpeg(rng, base)))
    _upload(objects)
    return len(objects)


def write_dinov3(uri: str, backbone_config: dict) -> int:
    """A DINOv3 ViT-B/16 checkpoint in Meta's key names (storage_tokens, ls1.gamma, rope_embed, mask_token)."""
    import torch

    from compat_core import io as cio
    from compat_core.models.backbones import create_backbone

    torch.manual_seed(0)
    state = create_backbone("dinov3_vitb16", **backbone_config).state_dict()
    meta = {}
    for key, value in state.items():
        key = key.replace("reg_token", "storage_tokens").replace("gamma_1", "ls1.gamma").replace("gamma_2",
                                                                                               "ls2.gamma")
        meta[key] = value.clone()
    dim = state["cls_token"].shape[-1]
    meta["mask_token"] = torch.zeros(1, dim)
    meta["rope_embed.periods"] = torch.arange(1, 64 // 4 + 1, dtype=torch.float32)
    buffer = _stdio.BytesIO()
    torch.save(meta, buffer)
    cio.write_bytes(uri, buffer.getvalue())
    return len(buffer.getvalue())


# ---- the config ----------------------------------------------------------------------------------------------------
def rehearsal_config(args, data: str, output: str, casia: tuple[int, ...], replacements: list[int]) -> dict:
    """The shipped config with the data on S3 and only compute shrunk."""
    document = yaml.safe_load(CONFIG.read_text())
    backbone_config = {"depth": 1, "img_size": IMAGE_SIZE}  # width 768 (ViT-B), 12 heads, 16 px: one patch
    document["tasks"]["spec"] = f"{args.tasks}x{args.ids_per_task}"
    document["model"].update(num_slots=args.num_slots, backbone_config=backbone_config)
    document["training"]["epochs"] = 1
    document["data"]["root"] = f"{data}/celeba"
    document["data"]["options"]["image_size"] = IMAGE_SIZE
    for pool in ("query_set", "gallery_set"):
        document["evaluation"][pool].update(root=f"{data}/celeba", options={"image_size": IMAGE_SIZE})
    for entry, classes in zip(document["pretrain"], casia):
        entry.update(epochs=1, num_classes=classes, init=f"{data}/dinov3/dinov3_vitb16_pretrain_lvd1689m.pth")
        entry["name"] = f"casia-{classes}"
        entry["pool"].update(root=f"{data}/casia-webface", options={"num_classes": classes, "image_size": IMAGE_SIZE})
    document["initial_model"] = f"pretrain:casia-{casia[0]}"
    document["replacements"] = [{"at_task": task, "source": f"pretrain:casia-{classes}"}
                                for task, classes in zip(replacements, casia[1:])]
    cpus = {"num_gpus": 0, "num_cpus": 1, "custom": {"stage_worker": 1}}
    document["resources"] = {kind: dict(cpus) for kind in ("pretrain", "finetune", "extract", "evaluate")}
    for kind in ("pretrain", "finetune"):  # as on the GPUs of the real job: each training node in a fresh worker
        document["resources"][kind]["own_process"] = True
    document["output"] = {"dir": output}
    document["device"] = "cpu"
    document.pop("paper", None)
    return document


# ---- measuring -----------------------------------------------------------------------------------------------------
class ProcessSampler:
    """Peak resident memory of this rehearsal's processes, sampled every ``every_s`` from /proc: every process whose
    command line names ``root`` (the Ray nodes, the S3 and MLflow servers) and their descendants (Ray workers,
    their input workers), so that other Ray clusters on the machine are not counted.

    Per stage kind (the process title Ray sets to the task name, e.g. ``ray::finetune[t=3]``): the largest VmRSS
    sampled (``by_kind``) and the largest VmHWM (``hwm_by_kind``; the Ray worker restarts it at each node, so it is
    the node's exact peak, input workers included as processes of their own)."""

    def __init__(self, root: str, every_s: float = 0.5) -> None:
        self.root = root.encode()
        self.every_s = every_s
        self.by_kind: dict[str, int] = defaultdict(int)
        self.hwm_by_kind: dict[str, int] = defaultdict(int)
        self.peak_any = 0
        self.peak_any_title = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcessSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            processes = {}
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                    status = (entry / "status").read_text()
                except OSError:
                    continue
                parent = re.search(r"PPid:\s+(\d+)", status)
                processes[int(entry.name)] = (cmdline, status, int(parent.group(1)) if parent else 0)
            ours = {pid for pid, (cmdline, _, _) in processes.items() if self.root in cmdline}
            for pid, (cmdline, status, parent) in processes.items():
                ancestor, depth = pid, 0
                while ancestor not in ours and depth < 8 and ancestor in processes:
                    ancestor, depth = processes[ancestor][2], depth + 1
                if ancestor not in ours:
                    continue
                rss = re.search(r"VmRSS:\s+(\d+) kB", status)
                hwm = re.search(r"VmHWM:\s+(\d+) kB", status)
                if not rss:
                    continue
                rss_bytes = int(rss.group(1)) * 1024
                title = cmdline.split(b"\0")[0].decode(errors="replace")
                if rss_bytes > self.peak_any:
                    self.peak_any, self.peak_any_title = rss_bytes, title[:60]
                kind = re.match(r"ray::(\w+)\[", title)
                if kind:
                    self.by_kind[kind.group(1)] = max(self.by_kind[kind.group(1)], rss_bytes)
                    if hwm:
                        self.hwm_by_kind[kind.group(1)] = max(self.hwm_by_kind[kind.group(1)],
                                                              int(hwm.group(1)) * 1024)
            self._stop.wait(self.every_s)


def s3_requests(metrics_url: str) -> dict[str, float]:
    """S3 request counters of the SeaweedFS server (Prometheus text), summed per request type."""
    try:
        text = urlopen(metrics_url, timeout=5).read().decode()
    except OSError as error:
        return {"unavailable": str(error)}  # type: ignore[dict-item]
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("SeaweedFS_s3_request_total"):
            kind = re.search(r'type="([^"]+)"', line)
            totals[kind.group(1) if kind else "all"] += float(line.rsplit(" ", 1)[1])
    return dict(totals)


def bytes_by_prefix(uri: str) -> dict[str, int]:
    """Bytes under ``uri`` per artifact kind: artifacts/<kind>-..., replay, manifests, checkpoints, other folders."""
    import pyarrow.fs as pafs

    from compat_core import io as cio

    fs, path = cio.resolve(uri)
    totals: dict[str, int] = defaultdict(int)
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File:
            continue
        relative = info.path[len(path):].lstrip("/").split("/")
        kind = relative[0]
        if kind == "artifacts" and len(relative) > 1:
            kind = relative[1].split("-", 1)[0]
        totals[kind] += int(info.size)
    return dict(totals)


def mlflow_rows(database: Path) -> dict[str, int]:
    with sqlite3.connect(database) as connection:
        tables = [row[0] for row in connection.execute("select name from sqlite_master where type='table'")]
        wanted = ("runs", "metrics", "latest_metrics", "params", "tags", "registered_models", "model_versions",
                  "logged_models")
        return {t: connection.execute(f"select count(*) from {t}").fetchone()[0] for t in tables if t in wanted}


def human(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1000
    return str(value)


# ---- main ----------------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--ids-per-task", type=int, default=512)
    parser.add_argument("--num-slots", type=int, default=22_000, help="K")
    parser.add_argument("--train-per-id", type=int, default=2, help="CelebA training JPEGs per identity")
    parser.add_argument("--test-ids", type=int, default=None, help="CelebA test identities (default: ids/8)")
    parser.add_argument("--test-per-id", type=int, default=4)
    parser.add_argument("--casia-per-id", type=int, default=1)
    parser.add_argument("--jpeg-side", type=int, default=24, help="pixels of the synthetic JPEGs (square)")
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (servers' data, logs)")
    args = parser.parse_args()

    import boto3
    import ray
    from local_services import MlflowServer, SeaweedS3Server, free_port

    from cluster.ray.loopback import prepare_loopback
    from cluster.storage.s3 import configure_object_storage

    scale = args.tasks * args.ids_per_task / CELEBA_TRAIN_IDS
    casia = tuple(max(2, round(c * scale)) for c in CASIA_FULL)
    first = max(2, round(5 * args.tasks / 16))  # the config's at_task 5 and 10 of 16, scaled
    replacements = [first, max(first + 1, round(10 * args.tasks / 16))]
    if replacements[-1] > args.tasks:
        raise SystemExit(f"--tasks {args.tasks}: too few tasks for two replacements (use >= 4)")
    if casia[-1] + args.tasks * args.ids_per_task > args.num_slots:
        raise SystemExit(f"--num-slots {args.num_slots}: needs >= {casia[-1] + args.tasks * args.ids_per_task} "
                         f"(largest CASIA pool + CelebA classes)")
    test_ids = args.test_ids or max(2, args.tasks * args.ids_per_task // 8)
    tmp = Path(tempfile.mkdtemp(prefix="rh-", dir="/tmp"))  # short: Ray's socket paths stay < 108 bytes
    metrics_port = free_port()
    server = SeaweedS3Server(tmp / "weed", extra_args=(f"-metricsPort={metrics_port}", "-metricsIp=127.0.0.1"))
    mlflow = None
    cluster = None
    try:
        server.start()
        os.environ.update(server.environment())
        os.environ.pop("AWS_PROFILE", None)
        os.environ["COMPAT_CALIBRATION_DIR"] = str(tmp / "calibration")
        configure_object_storage()
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        data, output = f"s3://{BUCKET}/data", f"s3://{BUCKET}/runs/rehearsal"
        started = time.perf_counter()
        celeba = write_celeba(f"{data}/celeba", args.tasks * args.ids_per_task, args.train_per_id, test_ids,
                              args.test_per_id, args.jpeg_side)
        casia_images = write_casia(f"{data}/casia-webface", casia[-1], args.casia_per_id, args.jpeg_side)
        dinov3 = write_dinov3(f"{data}/dinov3/dinov3_vitb16_pretrain_lvd1689m.pth", {"depth": 1,
                                                                                     "img_size": IMAGE_SIZE})
        print(f"data on S3 in {time.perf_counter() - started:.0f} s: {celeba} CelebA-layout JPEGs "
              f"({args.tasks * args.ids_per_task} training identities x {args.train_per_id}, {test_ids} test x "
              f"{args.test_per_id}), {casia_images} CASIA-layout JPEGs ({casia[-1]} identities), DINOv3 checkpoint "
              f"{human(dinov3)} (Meta key layout, depth 1, width 768)")

        document = rehearsal_config(args, data, output, casia, replacements)
        config_path = tmp / "rehearsal.yaml"
        config_path.write_text(yaml.safe_dump(document, sort_keys=False))
        from pipelines.config.load import validate_config
        from pipelines.graph.compile import compile_scenario
        from pipelines.graph.plan_cost import stage_images

        graph = compile_scenario(validate_config(document))
        planned = stage_images(graph)
        requests_before = s3_requests(f"http://127.0.0.1:{metrics_port}/metrics")

        mlflow = MlflowServer(tmp / "mlflow", artifacts_destination=f"s3://{BUCKET}/mlflow").start()
        prepare_loopback()
        from ray.cluster_utils import Cluster

        node_args = dict(node_ip_address="127.0.0.1", object_store_memory=200 * 1024 * 1024,
                         include_dashboard=False)
        (tmp / "head").mkdir()
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "num_cpus": 0,
                                                                "temp_dir": str(tmp / "head")})
        for number in (1, 2):
            (tmp / f"worker{number}").mkdir()
            cluster.add_node(**node_args, num_cpus=args.cpus_per_node, resources={"stage_worker": 1},
                             temp_dir=str(tmp / f"worker{number}"))
        cluster.wait_for_nodes()
        print(f"Ray: head (0 CPUs) + 2 worker nodes of {args.cpus_per_node} CPU(s) at {cluster.address}; "
              f"{len(graph)} stages; load {open('/proc/loadavg').read().split()[:3]}")

        command = [sys.executable, "-m", "app.cli", "run", str(config_path), "--executor", "ray", "--address",
                   cluster.address, "--tracking-uri", mlflow.tracking_uri, "--no-progress"]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(tmp / "driver.log", "wb")
        with ProcessSampler(str(tmp)) as sampler:
            started = time.perf_counter()
            driver = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(driver.pid, 0)
            wall = time.perf_counter() - started
        log.close()
        if status != 0:
            print((tmp / "driver.log").read_text()[-4000:])
            raise SystemExit(f"compat run failed (status {status}); log {tmp / 'driver.log'}")
        requests_after = s3_requests(f"http://127.0.0.1:{metrics_port}/metrics")
        report(graph, planned, output, wall, usage.ru_maxrss * 1024, sampler, requests_before, requests_after,
               tmp / "mlflow" / "mlflow.db", f"s3://{BUCKET}/mlflow")
        return 0
    finally:
        if cluster is not None:
            ray.shutdown()
            cluster.shutdown()
        if mlflow is not None:
            mlflow.stop()
        server.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


def report(graph, planned, output, wall, driver_rss, sampler, requests_before, requests_after, mlflow_db,
           mlflow_uri) -> None:
    from pipelines.engine.runner import read_invocations
    from pipelines.store.run_store import RunStore

    store = RunStore(output)
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for invocation in read_invocations(store):
        for key, value in invocation["seconds"].items():
            kind = key.split("-", 1)[0]
            seconds[kind] += value
            counts[kind] += 1
    images: dict[str, int] = defaultdict(int)
    for item in planned.values():
        images[item.kind] += item.train_images + item.forward_images
    compute: dict[str, float] = defaultdict(float)  # what the stages' records say they computed for
    checkpoint_seconds: dict[str, float] = defaultdict(float)  # epoch checkpoint writes inside the training seconds
    checkpoint_writes: dict[str, int] = defaultdict(int)
    for stage in graph:
        if not store.has(stage.key):
            continue
        record = store.load_record(stage.key)
        if not isinstance(record, dict):
            continue
        training = record.get("training") or {}
        value = training.get("seconds") or record.get("seconds") or (record.get("features") or {}).get("seconds")
        compute[stage.kind] += float(value or 0.0)
        checkpoint_seconds[stage.kind] += float(training.get("checkpoint_seconds") or 0.0)
        checkpoint_writes[stage.kind] += int(training.get("checkpoints_written") or 0)
    print(f"\ncompat run wall {wall:.0f} s; driver peak RSS {human(driver_rss)}; any process of the rehearsal: peak "
          f"RSS {human(sampler.peak_any)} ({sampler.peak_any_title}); load {open('/proc/loadavg').read().split()[:3]}")
    print("\nsubmit-to-done s: from the executor's log (includes waiting for a free node); compute s: what the "
          "stage records measured (training loop / extraction / entry), summed per kind; peak RSS: largest VmRSS "
          "sampled every 0.5 s of a process running the kind (its input workers included); VmHWM: largest peak "
          "the kernel kept for such a process (the exact per-node peak where the worker restarts it per node); "
          "checkpoints: epoch checkpoint writes (count, seconds) and their share of the training seconds")
    print("\n| stage kind | stages | submit-to-done s | compute s | plan: images (train + forward) | compute s per "
          "plan image | peak RSS | VmHWM | checkpoints |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("pretrain", "finetune", "replace", "extract", "entry", "evaluate", "adapt"):
        if counts.get(kind):
            per = f"{compute[kind] / images[kind] * 1e3:.2f} ms" if images.get(kind) and compute[kind] else "-"
            trains = kind in ("pretrain", "finetune", "replace")
            share = (f"{checkpoint_writes[kind]}, {checkpoint_seconds[kind]:.1f} s, "
                     f"{100 * checkpoint_seconds[kind] / max(compute[kind], 1e-9):.2f} %") if trains else "-"
            print(f"| {kind} | {counts[kind]} | {seconds[kind]:.1f} | {compute[kind]:.1f} | {images.get(kind, 0):,} | "
                  f"{per} | {human(sampler.by_kind[kind]) if sampler.by_kind.get(kind) else '-'} | "
                  f"{human(sampler.hwm_by_kind[kind]) if sampler.hwm_by_kind.get(kind) else '-'} | {share} |")
    stored = bytes_by_prefix(output)
    print("\n| run store (S3) | bytes |")
    print("| --- | --- |")
    for kind, value in sorted(stored.items(), key=lambda item: -item[1]):
        print(f"| {kind} | {value:,} ({human(value)}) |")
    print(f"| total | {sum(stored.values()):,} ({human(sum(stored.values()))}) |")
    artifacts = bytes_by_prefix(mlflow_uri)
    print(f"\nMLflow artifacts (S3): {sum(artifacts.values()):,} bytes ({human(sum(artifacts.values()))}); backend rows: "
          f"{json.dumps(mlflow_rows(mlflow_db))}")
    model_weights = stored.get("pretrain", 0) + stored.get("finetune", 0) + stored.get("replace", 0)
    if model_weights:
        print(f"MLflow artifact bytes / model-stage artifact bytes in the store: "
              f"{sum(artifacts.values()) / model_weights:.2f}")
    during = {k: v - requests_before.get(k, 0) for k, v in requests_after.items() if isinstance(v, float)}
    print(f"S3 requests during the run (SeaweedFS counters): {int(sum(during.values())):,} "
          f"{json.dumps({k: int(v) for k, v in sorted(during.items(), key=lambda i: -i[1])[:8]})}")


if __name__ == "__main__":
    sys.exit(main())

"""Runs the public IAM-CL2R ``main()`` unmodified inside the user's clone's Python, replaying a plan; records a trace.

Started by ``benchmarks/reference_parity.py`` as ``REFERENCE_PYTHON reference_driver.py JOB.json``; imports only the
clone (``<clone>/src``), torch, torchvision, numpy and continuum, never this project. What it changes around
``main()`` is environment, not the code's computation: the integrity check of the CIFAR files (synthetic files fail
their md5, and there is no network to download from), the training transform (the clone's own evaluation transform,
i.e. augmentation off), the sources of randomness (the plan's batches and memory instead of the samplers' draws), and
a recorder in place of the AMP GradScaler (AMP is off: it scales nothing) that logs each step's loss and lr and
snapshots the model's state after each optimiser step as ``.npz`` (no pickle on our side).

Outputs under the job's ``out``: ``trace.json`` (steps: step, task, loss, lr; per task the sha256 of the training
rows in the public code's order), ``snap/step_NNNN.npz`` (state after each step, our names),
``start/task_T.npz`` (the trained model's state right after it was built for task T), and for a run with evaluation
``matrix.json`` (the compatibility matrix the public code computed, as floats).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np


def _ours(name: str) -> str:
    return {"fc1.weight": "junction.weight", "fc2.weight": "classifier.weight"}.get(name, name)


def _state_arrays(net, method: str) -> dict[str, np.ndarray]:
    out = {}
    for name, value in net.state_dict().items():
        if not value.is_floating_point() or (method == "hoc" and name == "fc2.weight"):
            continue  # the d-Simplex fc2 is the fixed prototype matrix: ours computes it in closed form
        out[_ours(name)] = value.detach().cpu().numpy()
    return out


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    out = Path(job["out"])
    sys.path.insert(0, str(Path(job["clone"]) / "src"))
    import torch

    torch.set_num_threads(int(job.get("threads", 1)))
    if job.get("fp64", True):
        torch.set_default_dtype(torch.float64)
    import torchvision.datasets.cifar as tv_cifar

    tv_cifar.check_integrity = lambda *args, **kwargs: True  # synthetic files: no md5 to match, nothing to download
    import continuum.rehearsal.memory as continuum_memory
    import iamcl2r.dataset.cifar as public_cifar
    import iamcl2r.main as public_main

    plan, method = job["plan"], job["method"]
    per_class = plan["shape"]["per_class"]
    record = {"steps": [], "task_rows_sha256": {}, "task": 0, "net": None, "created": 0}
    snapshots = job.get("snapshots", True)

    original_load = public_cifar.load_cifar

    def load_without_augmentation(*args, **kwargs):
        data = original_load(*args, **kwargs)
        if not job.get("augment", False):
            data["train_transform"] = data["val_transform"]
        return data

    public_cifar.load_cifar = load_without_augmentation

    def planned_herd(x, y, t, z, nb_per_class):
        rows = []
        for c in np.unique(y):
            members = np.where(y == c)[0]
            rows.append(members[[r - int(c) * per_class for r in plan["memory_after"][str(int(c))]][:nb_per_class]])
        rows = np.concatenate(rows)
        return x[rows], y[rows], t[rows]

    if plan.get("replay_memory", True):
        continuum_memory.herd_random = planned_herd

    class PlannedBatches:
        """A batch sampler yielding the plan's positions, one epoch per iteration; checks the rows it indexes."""

        def __init__(self, dataset, task: int) -> None:
            entry = plan["tasks"][task]
            labels = [r // per_class for r in entry["rows"]] + entry["memory_labels"]
            have = np.asarray(dataset._y).tolist()
            if have != labels:
                raise RuntimeError(f"task {task}: the public task set's labels {have[:8]}... differ from the plan's "
                                   f"{labels[:8]}... (rows or memory order)")
            record["task_rows_sha256"][str(task)] = hashlib.sha256(np.ascontiguousarray(dataset._x).tobytes()).hexdigest()
            self.epochs, self.epoch = entry["batches"], 0

        def __iter__(self):
            batches = self.epochs[self.epoch]
            self.epoch += 1
            yield from batches

        def __len__(self) -> int:
            return len(self.epochs[0])

    import torch.utils.data as tud

    def data_loader(dataset, *args, **kwargs):
        if kwargs.get("shuffle") and plan.get("replay_batches", True):  # task 1's shuffled loader
            return tud.DataLoader(dataset, batch_sampler=PlannedBatches(dataset, 0), num_workers=0)
        return tud.DataLoader(dataset, *args, **kwargs)

    class BalancedFromPlan(PlannedBatches):
        def __init__(self, dataset, **kwargs) -> None:
            super().__init__(dataset, record["task"])

    if plan.get("replay_batches", True):
        public_main.DataLoader = data_loader
        public_main.BalancedBatchSampler = BalancedFromPlan

    original_create = public_main.create_model

    def create_model(args, device, resume_path=None, **kwargs):
        net = original_create(args, device, resume_path=resume_path, **kwargs)
        if kwargs.get("new_classes") != 0:  # the model trained in this task (the other call builds the old model)
            record["task"], record["net"] = args.current_task_id, net
            if snapshots:
                (out / "start").mkdir(parents=True, exist_ok=True)
                np.savez(out / "start" / f"task_{args.current_task_id}.npz", **_state_arrays(net, method))
        return net

    public_main.create_model = create_model

    class StepRecorder:
        """In place of torch.cuda.amp.GradScaler (AMP off): records each step's loss and lr, then steps."""

        def __init__(self, *args, **kwargs) -> None:
            self.loss = float("nan")

        def scale(self, loss):
            self.loss = float(loss.item())
            return loss

        def step(self, optimizer) -> None:
            lr = float(optimizer.param_groups[0]["lr"])
            optimizer.step()
            number = len(record["steps"]) + 1
            record["steps"].append({"step": number, "task": record["task"], "loss": self.loss, "lr": lr})
            if snapshots:
                (out / "snap").mkdir(parents=True, exist_ok=True)
                np.savez(out / "snap" / f"step_{number:04d}.npz", **_state_arrays(record["net"], method))

        def update(self) -> None:
            pass

        def state_dict(self) -> dict:
            return {}

    torch.cuda.amp.GradScaler = StepRecorder
    if "evaluate" in job:
        import iamcl2r.eval as public_eval

        original_ac = public_eval.average_compatibility

        def keep_matrix(matrix, *args, **kwargs):
            (out / "matrix.json").write_text(json.dumps(np.asarray(matrix, dtype=float).tolist()))
            return original_ac(matrix, *args, **kwargs)

        public_eval.average_compatibility = keep_matrix
    sys.argv = ["iamcl2r", "-c", str(job["config"])]
    public_main.main()
    (out / "trace.json").write_text(json.dumps({"steps": record["steps"], "task_rows_sha256": record["task_rows_sha256"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Step-by-step parity of our training with the public IAM-CL2R code (a user's clone of github.com/miccunifi/iamcl2r).

    python benchmarks/reference_parity.py --reference PATH [--reference-python PY] [--methods hoc,er] [--out DIR]

PATH is the user's clone (never fetched, never copied: it runs in a subprocess with ``--reference-python``, the
clone's own virtualenv, default the current Python). Both codes train on the same small pool written in CIFAR-100's
python format, from the same initial weights (ours exported to the public key layout), on the same class order,
replay memory and batch order (one plan replayed into both), augmentation off, fp64 on the CPU, one thread each:
d-Simplex-HOC (``masking: reference``) and ER for 3 tasks (2 + 2 + 2 classes) with a model replacement at task 3.
Ours runs through the product's trainer (``pipelines.training.loop.train_task``) with the options that follow the
public script: cosine per epoch to 1e-5, no weight decay on norm/bias parameters, task 1's last partial batch
dropped, the public CIFAR-100 normalisation constants, d-Simplex rows divided by norm + 1e-8. It prints, per step,
both losses, their difference and the largest parameter difference after the step, and a summary per method.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from compat_core.data.datasets import load_dataset  # noqa: E402
from compat_core.models.compat_model import create_model, frozen_copy  # noqa: E402
from parity.cifar_pool import PoolShape, write_cifar_pool  # noqa: E402
from parity.plan import PlanShape, make_plan, steps  # noqa: E402
from parity.scenario import run_scenario  # noqa: E402
from parity.traces import compare_traces, format_table  # noqa: E402
from parity.weight_layout import public_state  # noqa: E402
from pipelines.methods import get_method  # noqa: E402
from pipelines.training.loop import train_task  # noqa: E402
from pipelines.training.settings import TrainConfig  # noqa: E402
from pipelines.training.task_data import TaskData  # noqa: E402
from pipelines.training.trainer import lr_factor  # noqa: E402

# the public script's CIFAR-100 constants (src/iamcl2r/dataset/cifar.py:18-19), used for training and evaluation
PUBLIC_MEAN = (0.5071, 0.4867, 0.4408)
PUBLIC_STD = (0.2675, 0.2565, 0.2761)
K = 1024  # the public d-Simplex size (src/iamcl2r/methods/hoc.py: preallocated_classes)
PUBLIC_METHOD = {"hoc": "dsimplex-hoc", "er": "er"}

NEEDS = """reference_parity.py needs --reference PATH: a clone of the public IAM-CL2R code
(git clone https://github.com/miccunifi/iamcl2r PATH) and a Python that runs it (--reference-python, default this
one), e.g. python -m venv REFVENV && REFVENV/bin/pip install -e PATH "numpy<2.4" continuum wandb faiss-cpu
(numpy < 2.4: the clone calls np.in1d). Nothing is downloaded at run time."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", help="a clone of github.com/miccunifi/iamcl2r (holds src/iamcl2r/main.py)")
    parser.add_argument("--reference-python", default=sys.executable, help="the Python of the clone's virtualenv")
    parser.add_argument("--methods", default="hoc,er", help="comma list of hoc, er")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per task (4: 64 steps over 3 tasks)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1, help="seed of the pool, the weights and the plan")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reference_parity"),
                        help="working folder, emptied first (default benchmarks/results/reference_parity, git-ignored)")
    parser.add_argument("--keep-snapshots", action="store_true", help="keep the public per-step state files")
    parser.add_argument("--ours-masking", default="reference", choices=("reference", "standard", "paper"),
                        help="HOC masking of ours (a negative control: another masking than the public code's must "
                        "show in the table)")
    parser.add_argument("--part", choices=("steps", "scenario", "both"), default="steps",
                        help="steps: per-step parity (default); scenario: the 7-task scenario end to end in both codes")
    parser.add_argument("--seeds", default="1,2,3", help="scenario: comma list of non-zero seeds (0 means a random "
                        "seed to the public code)")
    parser.add_argument("--scenario-epochs", type=int, default=2, help="scenario: epochs per task")
    return parser.parse_args(argv)


def check_reference(args: argparse.Namespace) -> Path:
    """The clone's path, or SystemExit with what the benchmark needs."""
    if not args.reference:
        raise SystemExit(NEEDS)
    clone = Path(args.reference).expanduser().resolve()
    if not (clone / "src" / "iamcl2r" / "main.py").is_file():
        raise SystemExit(f"--reference {clone}: no src/iamcl2r/main.py there.\n{NEEDS}")
    probe = subprocess.run([args.reference_python, "-c", "import torch, numpy, continuum, yaml, wandb, faiss; "
                            "print(torch.__version__, numpy.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"--reference-python {args.reference_python} cannot import the clone's dependencies "
                         f"(torch numpy continuum yaml wandb faiss):\n{probe.stderr.strip()[-800:]}\n{NEEDS}")
    print(f"reference: {clone} with {args.reference_python} (torch, numpy {probe.stdout.strip()})")
    return clone


def initial_models(method: str, seed: int) -> list[torch.nn.Module]:
    """Our fp64 models for task 1 and the replacement: ResNet18 (the public ImageNet stem) + junction to K-1
    (HOC) or the backbone feature with a learnable classifier grown per task (ER); seeded, not pre-trained."""
    models = []
    for number in range(2):
        torch.manual_seed(seed * 100 + number)
        if method == "hoc":
            models.append(create_model("resnet18", K, simplex_norm="row_eps"))
        else:
            models.append(create_model("resnet18", K, classifier="learnable", head="backbone"))
    return models


def public_config(work: Path, method: str, weights: list[Path], shape: PlanShape, seed: int) -> Path:
    replace_ids = [2 * i for i in range(1, len(weights))]
    lines = {
        "method": method, "data_path": str(work / "data"), "output_folder": str(work / f"public_{method}"),
        "pretrained_model_path": [str(w) for w in weights], "replace_ids": replace_ids,
        "initial_increment": shape.initial, "increment": shape.increment, "epochs": shape.epochs,
        "batch_size": shape.batch_size, "num_workers": 0, "amp": False, "seed": seed,
        "use_subsampled_dataset": True, "img_per_class": shape.per_class, "rehearsal": shape.rehearsal,
        "lr": 0.001, "min_lr": 1e-5, "weight_decay": 5e-4, "eval_period": shape.epochs, "save_period": shape.epochs,
        "learning_rate": 0.001, "momentum": 0.9, "train_only": True,
    }
    path = work / f"public_{method}.yaml"

    def scalar(value):  # YAML 1.1 (yaml.safe_load) reads 1e-05 as a string: write floats positionally
        return np.format_float_positional(value) if isinstance(value, float) else json.dumps(value)

    path.write_text("".join(f"{key}: {scalar(value)}\n" for key, value in lines.items()))
    return path


def run_reference(args, clone: Path, work: Path, method: str, config: Path, plan: dict) -> dict:
    """The public main() on ``plan`` in a subprocess; returns its trace. Prints progress every <= 30 s."""
    out = work / f"public_{method}_trace"
    out.mkdir(parents=True, exist_ok=True)
    job = {"clone": str(clone), "out": str(out), "method": method, "plan": plan, "config": str(config), "threads": 1}
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
           "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"}
    total = steps(plan)
    started = time.time()
    with open(out / "run.log", "w") as log:
        process = subprocess.Popen([args.reference_python, str(ROOT / "benchmarks" / "parity" / "reference_driver.py"),
                                    str(job_path)], cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(2)
            done = len(list((out / "snap").glob("step_*.npz"))) if (out / "snap").is_dir() else 0
            elapsed = time.time() - started
            if int(elapsed) % 30 < 2:
                eta = elapsed / done * (total - done) if done else float("nan")
                print(f"  public {method}: {done}/{total} steps, {elapsed:.0f} s, ETA {eta:.0f} s", flush=True)
    if process.returncode != 0:
        tail = (out / "run.log").read_text()[-3000:]
        raise SystemExit(f"the public code failed ({method}, exit {process.returncode}); log {out / 'run.log'}:\n{tail}")
    trace = json.loads((out / "trace.json").read_text())
    trace["dir"] = str(out)
    print(f"  public {method}: {len(trace['steps'])} steps in {time.time() - started:.0f} s")
    return trace


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def max_state_diff(model: torch.nn.Module, public: dict[str, np.ndarray]) -> float:
    """max |ours - public| over every floating-point tensor of the state (ValueError when the names differ)."""
    ours = {n: v for n, v in model.state_dict().items() if v.is_floating_point()}
    if set(ours) != set(public):
        raise ValueError(f"state names differ: only ours {sorted(set(ours) - set(public))[:5]}, only public "
                         f"{sorted(set(public) - set(ours))[:5]}")
    return max(float(np.max(np.abs(v.detach().numpy() - public[n]))) if v.numel() else 0.0 for n, v in ours.items())


def train_config(shape: PlanShape, seed: int) -> TrainConfig:
    """Our settings that follow the public script (src/iamcl2r/main.py:147-162, params.py)."""
    return TrainConfig(optimizer={"name": "sgd", "lr": 0.001, "momentum": 0.9, "weight_decay": 5e-4,
                                  "weight_decay_exclude": "norm_and_bias"},
                       schedule={"name": "cosine", "min_lr": 1e-5, "interval": "epoch"}, epochs=shape.epochs,
                       batch_size=shape.batch_size, augment=False, autocast="off", compile="off", drop_last=True,
                       seed=seed, device="cpu", epoch_length="reference")


def run_ours(method: str, models: list[torch.nn.Module], plan: dict, shape: PlanShape, seed: int, source,
             trace_dir: Path, masking: str = "reference") -> tuple[list[dict], list[float], dict]:
    """Our trainer on ``plan``; after every step the largest state difference to the public snapshot."""
    config = train_config(shape, seed)
    ours_steps: list[dict] = []
    param_diffs: list[float] = []
    checks: dict = {"start_diff": {}, "rows_sha256_equal": {}}
    model = None
    public_hashes = json.loads((trace_dir / "trace.json").read_text())["task_rows_sha256"]
    for entry in plan["tasks"]:
        task = entry["task"]
        loaded = task == 0 or task == 2
        if loaded:
            model = copy.deepcopy(models[0 if task == 0 else 1])
        start = _load_npz(trace_dir / "start" / f"task_{task}.npz")
        if method == "er":  # new classifier rows are random in both codes: ours takes the public ones
            carried = 0 if loaded else model.num_active_classes
            with torch.no_grad():
                rows = torch.from_numpy(start["classifier.weight"])
                model.expand_classes(rows.shape[0])
                model.classifier.weight[carried:].copy_(rows[carried:])
        checks["start_diff"][task] = max_state_diff(model, start)
        old_model = frozen_copy(model) if method == "hoc" else None
        rows = np.asarray(entry["rows"] + entry["memory_rows"])
        sha = hashlib.sha256(np.ascontiguousarray(source.images[rows]).tobytes()).hexdigest()
        checks["rows_sha256_equal"][task] = sha == public_hashes[str(task)]
        labels = np.asarray(source.labels)
        slots = (K - 1 - labels) if method == "hoc" else labels
        memory = np.asarray(entry["memory_rows"], dtype=np.int64)
        data = TaskData(source=source, task=task, indices=np.asarray(entry["rows"]), slots=slots[entry["rows"]],
                        num_old_classes=int(memory.size and np.unique(labels[memory]).size),
                        num_new_classes=len(entry["classes"]),
                        memory_indices=memory if memory.size else None,
                        memory_slots=slots[memory] if memory.size else None,
                        batch_plan=[[np.asarray(b) for b in epoch] for epoch in entry["batches"]])
        objective = get_method(PUBLIC_METHOD[method], **({"lam": 0.1, "rho": 10.0, "masking": masking}
                                                          if method == "hoc" else {}))
        factor = lr_factor(config, len(entry["batches"][0]))
        task_start = len(ours_steps)
        original_loss = objective.loss

        def recorded_loss(batch, ctx, _original=original_loss, _task=task, _start=task_start, _factor=factor):
            value, parts = _original(batch, ctx)
            in_task = len(ours_steps) - _start
            ours_steps.append({"step": len(ours_steps) + 1, "task": _task, "loss": float(value.item()),
                               "lr": config.optimizer.lr * _factor(in_task)})
            return value, parts

        objective.loss = recorded_loss
        current = model

        def compare(epoch, step, total, ips, _model=current):
            snap = _load_npz(trace_dir / "snap" / f"step_{len(ours_steps):04d}.npz")
            param_diffs.append(max_state_diff(_model, snap))

        result = train_task(model, old_model, objective, data, config, progress=compare)
        model = result.model
        print(f"  ours {method}: task {task + 1} done, {len(ours_steps)} steps, last |dparam| {param_diffs[-1]:.2e}",
              flush=True)
    return ours_steps, param_diffs, checks


def step_parity(args, clone: Path, work: Path, method: str) -> dict:
    shape = PlanShape(epochs=args.epochs, batch_size=args.batch_size)
    plan = make_plan(shape, args.seed)
    models = initial_models(method, args.seed)
    weights = []
    for number, model in enumerate(models):
        path = work / "pretrained_models" / f"{method}_{number}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(public_state(model.state_dict()), path)  # plain tensors; the public loader needs "pretrained"
        weights.append(path)
    config = public_config(work, method, weights, shape, args.seed)
    print(f"{method}: {steps(plan)} steps planned; public code first")
    trace = run_reference(args, clone, work, method, config, plan)
    source = load_dataset("cifar100", str(work / "data"), "train")
    source = replace(source, mean=PUBLIC_MEAN, std=PUBLIC_STD)
    ours_steps, diffs, checks = run_ours(method, models, plan, shape, args.seed, source, Path(trace["dir"]),
                                         args.ours_masking)
    rows, summary = compare_traces(ours_steps, trace["steps"], diffs)
    title = {"hoc": "d-Simplex-HOC (masking: reference)", "er": "ER"}[method]
    print(format_table(rows, summary, f"\n{title}: per step (task 3 loads the replacement model)"))
    print(f"checks: state difference at each task start {checks['start_diff']}; same training rows in both "
          f"codes {checks['rows_sha256_equal']}")
    if not args.keep_snapshots:
        shutil.rmtree(Path(trace["dir"]) / "snap", ignore_errors=True)
    return {"method": method, "summary": summary.__dict__, "checks": checks,
            "rows": [r.__dict__ for r in rows]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clone = check_reference(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(PUBLIC_METHOD))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; valid: {sorted(PUBLIC_METHOD)}")
    work = Path(args.out).resolve()
    marker = work / ".reference_parity"
    if work.exists() and any(work.iterdir()) and not marker.exists():
        raise SystemExit(f"--out {work}: not empty and not a folder of this benchmark; give a new or empty folder")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marker.touch()
    torch.set_num_threads(1)
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}, 1 thread")
    if args.part in ("steps", "both"):
        shape = PlanShape(epochs=args.epochs, batch_size=args.batch_size)
        write_cifar_pool(work / "data", PoolShape(classes=shape.initial + (shape.tasks - 1) * shape.increment,
                                                  train_per_class=shape.per_class), seed=args.seed)
        torch.set_default_dtype(torch.float64)
        results = [step_parity(args, clone, work, method) for method in methods]
        torch.set_default_dtype(torch.float32)
        (work / "parity.json").write_text(json.dumps(results, indent=1))
        print(f"\nresults: {work / 'parity.json'}")
        for result in results:
            s = result["summary"]
            print(f"{result['method']}: {s['steps']} steps, max |loss diff| {s['max_loss_diff']:.2e}, max |param "
                  f"diff| {s['max_param_diff']:.2e}")
    if args.part in ("scenario", "both"):
        seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
        if not seeds or 0 in seeds:
            raise SystemExit("--seeds: non-zero integers (the public code draws a random seed for 0)")
        print(f"\nscenario: 7 tasks (2 + 6 x 2), replacements at tasks 3 and 5, {methods}, {args.scenario_epochs} "
              f"epochs per task, batch {args.batch_size}, seeds {seeds}, fp32")
        scenario = run_scenario(args.reference_python, clone, work / "scenario", seeds, args.scenario_epochs,
                                args.batch_size, tuple(methods))
        (work / "scenario.json").write_text(json.dumps(scenario, indent=1))
        print(f"results: {work / 'scenario.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

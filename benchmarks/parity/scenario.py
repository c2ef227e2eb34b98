"""The 7-task scenario with two replacements, both codes end to end (``reference_parity.py --scenario``).

Reduced shape: 14 CIFAR-100-format classes (2 + 6 x 2) of 24 structured images, replacements at tasks 3 and 5
(1-based), batch 16, a few epochs, ResNet18 with the ImageNet stem, K = 1024, d-Simplex-HOC (lam 0.1, rho 10,
``masking: reference``) and ER, replay 20 per class, queries CIFAR-10-format train, gallery CIFAR-10-format test as class-mean
templates, Recall@1, strict compatibility. Each code draws its own batches, memory and augmentation from its own
seeded generators (nothing is replayed): the matrices agree in distribution, not entry by entry. Ours runs as a user
runs it, ``compat run CONFIG --executor local``, with the options that follow the public script; the public code runs
its own ``main()`` (training and evaluation) in the clone's Python. fp32 on the CPU in both.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import save_file

from compat_core.evaluation.metrics import average_accuracy, average_compatibility
from compat_core.models.compat_model import create_model
from parity.weight_layout import public_state

PUBLIC_NORMALIZE = {"mean": [0.5071, 0.4867, 0.4408], "std": [0.2675, 0.2565, 0.2761]}
INITIAL, INCREMENT, TASKS, PER_CLASS, REHEARSAL = 2, 2, 7, 24, 20
REPLACED_AT = (3, 5)  # 1-based tasks that start from a new model


def export_models(work: Path, seed: int, method: str = "hoc") -> tuple[list[Path], list[Path]]:
    """Initial model and the two replacements: ours as safetensors, the public layout as .pt (plain tensors). ER's
    files hold no classifier rows: the public code deletes a loaded classifier and grows a fresh one, and ours then
    grows its classifier from 0 rows too (fine-tuning class i at output i)."""
    ours, public = [], []
    for number in range(3):
        torch.manual_seed(seed * 100 + number)
        model = create_model("resnet18", 1024) if method == "hoc" else create_model(
            "resnet18", 1024, classifier="learnable", head="backbone")
        state = {name: value.contiguous() for name, value in model.state_dict().items() if name != "classifier.weight"}
        path = work / "models" / f"model_{number}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path))
        ours.append(path)
        pt = work / "pretrained_models" / f"model_{number}.pt"
        pt.parent.mkdir(parents=True, exist_ok=True)
        torch.save(public_state(state), pt)
        public.append(pt)
    return ours, public


def our_config(work: Path, models: list[Path], seed: int, epochs: int, batch_size: int, method: str = "hoc") -> Path:
    data = str(work / "data")
    document = {
        "name": f"parity-scenario-s{seed}", "seed": seed,
        "data": {"dataset": "cifar100", "root": data, "split": "train", "normalize": PUBLIC_NORMALIZE},
        "tasks": {"spec": f"{INITIAL}+{TASKS - 1}x{INCREMENT}", "order": "given"},
        "model": {"backbone": "resnet18", "num_slots": 1024},
        "method": ({"name": "dsimplex-hoc", "params": {"lam": 0.1, "rho": 10.0, "masking": "reference"}}
                   if method == "hoc" else {"name": "er", "params": {}}),
        "training": {"optimizer": {"name": "sgd", "lr": 0.001, "momentum": 0.9, "weight_decay": 0.0005,
                                   "weight_decay_exclude": "norm_and_bias"},
                     "schedule": {"name": "cosine", "min_lr": 1e-5, "interval": "epoch"},
                     "epochs": epochs, "batch_size": batch_size, "drop_last": True, "autocast": "off"},
        "replay": {"per_class": REHEARSAL, "strategy": "random", "epoch_length": "reference"},
        "initial_model": str(models[0]),
        "replacements": [{"at_task": at, "source": str(path)} for at, path in zip(REPLACED_AT, models[1:])],
        "evaluation": {"query_set": {"dataset": "cifar10", "root": data, "split": "train", "normalize": PUBLIC_NORMALIZE},
                       "gallery_set": {"dataset": "cifar10", "root": data, "split": "test", "normalize": PUBLIC_NORMALIZE},
                       "metric": "recall_at_1", "gallery": "class_means", "strict": True},
    }
    path = work / f"ours_{method}_s{seed}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def run_ours(work: Path, config: Path, seed: int) -> np.ndarray:
    """``compat run`` of ``config`` in a subprocess; returns the matrix (fractions) from the run's matrix.json."""
    run_dir = work / config.stem
    command = [sys.executable, "-m", "app.cli", "run", str(config), "--executor", "local", "--output", str(run_dir),
               "--tracking-uri", "none", "--no-progress"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMPAT_CALIBRATION": "off"}
    log_path = work / f"{config.stem}.log"
    with open(log_path, "w") as log:
        done = subprocess.run(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"compat run failed (seed {seed}); log {log_path}:\n{log_path.read_text()[-3000:]}")
    values = json.loads((run_dir / "matrix.json").read_text())["values"]  # fractions, null above the diagonal
    return np.array([[np.nan if v is None else v for v in row] for row in values], dtype=float)


def public_yaml(work: Path, models: list[Path], seed: int, epochs: int, batch_size: int, method: str = "hoc") -> Path:
    values = {"method": method, "data_path": str(work / "data"), "output_folder": str(work / f"public_{method}_s{seed}"),
              "pretrained_model_path": [str(m) for m in models], "replace_ids": [at - 1 for at in REPLACED_AT],
              "initial_increment": INITIAL, "increment": INCREMENT, "epochs": epochs, "batch_size": batch_size,
              "num_workers": 0, "amp": False, "seed": seed, "use_subsampled_dataset": True, "img_per_class": PER_CLASS,
              "rehearsal": REHEARSAL, "lr": 0.001, "min_lr": 0.00001, "weight_decay": 0.0005, "eval_period": epochs,
              "save_period": epochs, "learning_rate": 0.001, "momentum": 0.9}
    path = work / f"public_{method}_s{seed}.yaml"
    path.write_text("".join(f"{key}: {np.format_float_positional(value) if isinstance(value, float) else json.dumps(value)}\n"
                            for key, value in values.items()))
    return path


def run_public(reference_python: str, clone: Path, work: Path, config: Path, seed: int, method: str = "hoc") -> np.ndarray:
    """The public main() (training with its own samplers and augmentation, then its evaluation); its float matrix."""
    out = work / f"{config.stem}_trace"
    out.mkdir(parents=True, exist_ok=True)
    job = {"clone": str(clone), "out": str(out), "method": method, "config": str(config), "threads": 1, "fp64": False,
           "snapshots": False, "augment": True, "evaluate": True,
           "plan": {"shape": {"per_class": PER_CLASS}, "replay_batches": False, "replay_memory": False}}
    (out / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
           "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"}
    with open(out / "run.log", "w") as log:
        done = subprocess.run([reference_python, str(Path(__file__).with_name("reference_driver.py")),
                               str(out / "job.json")], cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"the public code failed (seed {seed}); log {out / 'run.log'}:\n"
                         f"{(out / 'run.log').read_text()[-3000:]}")
    matrix = np.array(json.loads((out / "matrix.json").read_text()), dtype=float)
    return matrix / 100.0 if np.nanmax(matrix) > 1.0 else matrix  # the public code may report percent


def _lower(matrix: np.ndarray) -> np.ndarray:
    out = np.array(matrix, dtype=float)
    out[np.triu_indices(out.shape[0], 1)] = np.nan
    return out


def side_by_side(ours: np.ndarray, public: np.ndarray, seed: int) -> str:
    lines = [f"seed {seed}: compatibility matrices (Recall@1, rows = query model after task t, columns = gallery "
             f"model after task k <= t)", f"{'ours':<{8 * TASKS}}   public"]
    for row_ours, row_public in zip(_lower(ours), _lower(public)):
        cell = lambda v: "   -   " if np.isnan(v) else f"{v:7.3f}"  # noqa: E731
        lines.append(" ".join(cell(v) for v in row_ours) + "   " + " ".join(cell(v) for v in row_public))
    return "\n".join(lines)


def metrics(matrix: np.ndarray) -> tuple[float, float]:
    """(AC, AA) with ours' definitions (strict compatibility; AA as a fraction over the lower triangle)."""
    return float(average_compatibility(matrix, strict=True)), float(average_accuracy(matrix))


def run_scenario(reference_python: str, clone: Path, work: Path, seeds: list[int], epochs: int,
                 batch_size: int, methods: tuple[str, ...] = ("hoc",)) -> dict:
    """Both codes on every method and seed; prints the matrices side by side and AC / AA with their spread."""
    from parity.cifar_pool import PoolShape, write_cifar_pool

    write_cifar_pool(work / "data", PoolShape(classes=INITIAL + (TASKS - 1) * INCREMENT, train_per_class=PER_CLASS,
                                              test_per_class=2, cifar10_train_per_class=20,
                                              cifar10_test_per_class=10, structured=True), seed=0)
    results: dict = {"seeds": seeds}
    for method in methods:
        runs: dict = {"ours": [], "public": []}
        for seed in seeds:
            ours_models, public_models = export_models(work / f"weights_{method}_s{seed}", seed, method)
            started = time.time()
            public = run_public(reference_python, clone, work,
                                public_yaml(work, public_models, seed, epochs, batch_size, method), seed, method)
            print(f"  {method} seed {seed}: public code done in {time.time() - started:.0f} s", flush=True)
            started = time.time()
            ours = run_ours(work, our_config(work, ours_models, seed, epochs, batch_size, method), seed)
            print(f"  {method} seed {seed}: ours done in {time.time() - started:.0f} s", flush=True)
            print(f"{method}, " + side_by_side(ours, public, seed))
            for name, matrix in (("ours", ours), ("public", public)):
                ac, aa = metrics(matrix)
                runs[name].append({"seed": seed, "matrix": np.nan_to_num(_lower(matrix), nan=-1).tolist(),
                                   "AC": ac, "AA": aa})
                print(f"  {name}: AC {ac:.3f}  AA {aa:.3f}", flush=True)
        for name in ("ours", "public"):
            acs = [r["AC"] for r in runs[name]]
            aas = [r["AA"] for r in runs[name]]
            print(f"{method} {name}: {len(acs)} seed(s): AC {np.mean(acs):.3f} +- {np.std(acs):.3f}, AA "
                  f"{np.mean(aas):.3f} +- {np.std(aas):.3f} (mean +- population std over seeds)", flush=True)
        results[method] = runs
    return results

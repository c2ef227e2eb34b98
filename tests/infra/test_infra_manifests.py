"""infra/ is consistent with the code, offline: manifests parse, pins match pyproject.toml, overlays apply, every
Secret/ConfigMap/PVC/image reference resolves, every `compat` / `ray start` / `mlflow server` / `weed mini` command
line parses with the real parsers, and the service definitions use the same settings as tests/local_services.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infra_manifest_tools import (  # noqa: E402
    INFRA,
    REPO,
    PatchError,
    apply_json_patch,
    build_kustomization,
    collect_images,
    collect_references,
    command_lines,
    dockerfile_arg_defaults,
    dockerfile_instructions,
    load_documents,
    pip_requirements,
    resource_id,
    yaml_files,
)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# the distribution's version is compat_core.__version__ (pyproject declares it dynamic, read from there)
VERSION = re.search(r'^__version__ = "([^"]+)"', (REPO / "compat_core" / "__init__.py").read_text(), re.M).group(1)
OVERLAYS = ("dev", "gpu", "gcs-ft")
CELEBA_CONFIG = "configs/iam-cl2r-celeba-dinov3-t16.yaml"


def _built(name: str):
    if name == "base":
        return build_kustomization(INFRA / "kuberay" / "base")
    return build_kustomization(INFRA / "kuberay" / "overlays" / name)


def _secret_templates() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in load_documents(INFRA / "secrets" / "secrets.template.yaml")}


def _all_k8s_documents() -> list[tuple[Path, dict]]:
    """Every Kubernetes object in infra/ (not kustomizations, not JSON patches, not compose/launcher files)."""
    out = []
    for path in yaml_files():
        for doc in load_documents(path):
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc and doc["kind"] != "Kustomization":
                out.append((path, doc))
    return out


# ---- parsing ------------------------------------------------------------------------------------------------------
def test_every_yaml_file_in_infra_parses_and_is_not_empty():
    paths = yaml_files()
    assert len(paths) >= 15, [str(p) for p in paths]
    for path in paths:
        assert load_documents(path), f"{path} has no YAML document"


# ---- Dockerfile ---------------------------------------------------------------------------------------------------
def _dockerfile():
    instructions = dockerfile_instructions(INFRA / "docker" / "Dockerfile")
    return instructions, dockerfile_arg_defaults(instructions)


def test_dockerfile_pins_every_pyproject_dependency_with_a_satisfying_version():
    instructions, args = _dockerfile()
    installs = pip_requirements(instructions, args)
    main_install = max(installs, key=len)  # the dependency line; the others install torch first and the project
    pinned = {}
    for text in main_install:
        requirement = Requirement(text)
        specifiers = list(requirement.specifier)
        assert len(specifiers) == 1 and specifiers[0].operator == "==", f"{text!r} is not pinned with =="
        pinned[requirement.name.lower()] = (requirement, specifiers[0].version)
    declared = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]]
    assert {r.name.lower() for r in declared} == set(pinned), "Dockerfile pins differ from pyproject dependencies"
    for requirement in declared:
        pin, version = pinned[requirement.name.lower()]
        assert requirement.specifier.contains(version), f"{pin} does not satisfy pyproject's {requirement}"
        assert pin.extras == requirement.extras, f"{pin}: extras differ from pyproject's {requirement}"
    # torch of the GPU base image (tag built from TORCH_VERSION) is the pinned torch
    assert pinned["torch"][1] == args["TORCH_VERSION"]
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert "pytorch/pytorch:${TORCH_VERSION}-${CUDA_TAG} AS base-gpu" in froms
    assert "base-${VARIANT} AS runtime" in froms and any(f.endswith("AS base-cpu") for f in froms)
    # the project itself goes in without touching the pins, then pip check verifies them
    assert ["."] in installs
    project_run = next(rest for word, rest in instructions if word == "RUN" and "--no-deps ." in rest)
    assert "pip check" in project_run


def test_dockerfile_final_user_is_not_root_and_copies_only_existing_unignored_paths():
    instructions, _ = _dockerfile()
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    last_run = max(i for i, (word, _) in enumerate(instructions) if word == "RUN")
    last_user = max(i for i, (word, _) in enumerate(instructions) if word == "USER")
    assert last_user > last_run, "USER must come after the last RUN so nothing runs as root at run time"
    ignored = {line.strip() for line in (INFRA / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", "data", "runs", ".git"} <= ignored
    copied = []
    for word, rest in instructions:
        if word == "COPY":
            sources = [t for t in rest.split() if not t.startswith("--")][:-1]
            copied.extend(sources)
    assert set(copied) >= {"pyproject.toml", "compat_core", "pipelines", "cluster", "configs"}
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert source not in ignored, f"COPY {source}: excluded by Dockerfile.dockerignore"


def test_mlflow_server_image_uses_the_same_mlflow_and_boto3_pins_as_the_project_image():
    instructions, args = _dockerfile()
    project = {Requirement(t).name: str(Requirement(t).specifier) for t in max(pip_requirements(instructions, args),
                                                                                   key=len)}
    server_instructions = dockerfile_instructions(INFRA / "services" / "mlflow" / "Dockerfile")
    server = {Requirement(t).name: Requirement(t) for reqs in pip_requirements(server_instructions, {}) for t in reqs}
    assert str(server["mlflow"].specifier) == project["mlflow"] and server["mlflow"].extras == {"auth"}
    assert str(server["boto3"].specifier) == project["boto3"]
    assert "psycopg2-binary" in server
    assert [rest for word, rest in server_instructions if word == "USER"][-1] == "mlflow"


# ---- kustomize overlays -------------------------------------------------------------------------------------------
def test_json_patch_applier_follows_rfc6902_on_a_hand_made_document():
    document = {"a": [{"n": "x"}, {"n": "y"}], "b": {"c": 1}}
    patched = apply_json_patch(document, [
        {"op": "test", "path": "/a/1/n", "value": "y"},
        {"op": "add", "path": "/a/1", "value": {"n": "new"}},
        {"op": "remove", "path": "/a/0"},
        {"op": "replace", "path": "/b/c", "value": 2},
        {"op": "add", "path": "/b/d~1e", "value": 3},
        {"op": "add", "path": "/a/-", "value": {"n": "last"}},
    ])
    assert patched == {"a": [{"n": "new"}, {"n": "y"}, {"n": "last"}], "b": {"c": 2, "d/e": 3}}
    assert document["b"] == {"c": 1}  # the input is not modified
    with pytest.raises(PatchError, match="test expected"):
        apply_json_patch(document, [{"op": "test", "path": "/a/0/n", "value": "y"}])
    with pytest.raises(PatchError, match="needs an existing key"):
        apply_json_patch(document, [{"op": "replace", "path": "/b/missing", "value": 1}])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_patch_targets_an_existing_resource_and_applies(overlay):
    built = _built(overlay)  # raises PatchError when a target is missing or an op does not apply
    own = [p for p, _ in built.patch_targets if (INFRA / "kuberay" / "overlays" / overlay) in p.parents]
    assert own, f"overlay {overlay} applies no patch"
    ids = [resource_id(r) for r in built.resources]
    assert len(ids) == len(set(ids)), f"duplicate resources in {overlay}: {ids}"
    assert {("RayCluster", "compat"), ("RayJob", "compat-celeba-dinov3"), ("ConfigMap", "compat-endpoints")} <= set(ids)
    assert all(r["metadata"]["namespace"] == "compat" for r in built.resources)


@pytest.mark.parametrize("overlay", ("base",) + OVERLAYS)
def test_rayjob_cluster_spec_equals_the_raycluster_spec(overlay):
    built = _built(overlay)
    cluster = dict(built.get("RayCluster", "compat")["spec"])
    job_cluster = built.get("RayJob", "compat-celeba-dinov3")["spec"]["rayClusterSpec"]
    # GCS fault tolerance is an option of the long-lived cluster only
    cluster.pop("gcsFaultToleranceOptions", None)
    assert job_cluster == cluster


def _worker_group(spec: dict, name: str) -> dict:
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == name)


def test_gpu_overlay_places_gpu_workers_on_a100_or_h100_nodes_and_keeps_the_rest_off_them():
    built = _built("gpu")
    for spec in (built.get("RayCluster", "compat")["spec"],
                 built.get("RayJob", "compat-celeba-dinov3")["spec"]["rayClusterSpec"]):
        pod = _worker_group(spec, "gpu")["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        products = terms[0]["matchExpressions"][0]["values"]
        assert any("A100" in p for p in products) and any("H100" in p for p in products)
        assert "tolerations" not in _worker_group(spec, "cpu-eval")["template"]["spec"]
        assert "tolerations" not in spec["headGroupSpec"]["template"]["spec"]
        assert 1 <= _worker_group(spec, "gpu")["minReplicas"] + 1 <= _worker_group(spec, "gpu")["maxReplicas"] + 1
    images = set(collect_images(built.resources))
    assert images == {f"registry.example.com/compat/compat-learning:{VERSION}-gpu"}


def test_dev_overlay_is_cpu_only_small_and_runs_the_offline_demo():
    built = _built("dev")
    text = json.dumps(built.resources)
    assert "nvidia.com/gpu" not in text
    assert set(collect_images(built.resources)) == {
        f"registry.example.com/compat/compat-learning:{VERSION}-cpu"}
    spec = built.get("RayCluster", "compat")["spec"]
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["cpu-small"]
    assert spec["workerGroupSpecs"][0]["maxReplicas"] == 2
    job = built.get("RayJob", "compat-celeba-dinov3")["spec"]
    assert "configs/demo-dsimplex-hoc.yaml" in job["entrypoint"]
    assert built.get("PersistentVolumeClaim", "compat-datasets")["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_gcs_ft_overlay_reads_the_redis_password_from_a_secret():
    options = _built("gcs-ft").get("RayCluster", "compat")["spec"]["gcsFaultToleranceOptions"]
    assert options["redisPassword"] == {"valueFrom": {"secretKeyRef": {"name": "compat-redis", "key": "password"}}}
    assert re.fullmatch(r"[\w.-]+:\d+", options["redisAddress"])


# ---- KubeRay CRD field names (ray.io/v1, KubeRay v1.6: ray-operator/apis/ray/v1/{raycluster,rayjob}_types.go) ------
RAYCLUSTER_SPEC_FIELDS = {"upgradeStrategy", "authOptions", "suspend", "managedBy", "autoscalerOptions",
                          "headServiceAnnotations", "enableInTreeAutoscaling", "gcsFaultToleranceOptions",
                          "historyServerOptions", "networkPolicy", "tlsOptions", "headGroupSpec", "rayVersion",
                          "workerGroupSpecs"}
HEAD_GROUP_FIELDS = {"template", "headService", "enableIngress", "ingressOptions", "resources", "labels",
                     "rayStartParams", "serviceType"}
WORKER_GROUP_FIELDS = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
                       "priority", "resources", "labels", "rayStartParams", "template", "scaleStrategy", "numOfHosts"}
AUTOSCALER_FIELDS = {"resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds",
                     "upscalingMode", "version", "env", "envFrom", "volumeMounts", "command", "args"}
AUTH_FIELDS = {"enableK8sTokenAuth", "secretName", "mode"}
GCS_FT_FIELDS = {"backend", "redisUsername", "redisPassword", "externalStorageNamespace", "redisAddress", "storage"}
RAYJOB_SPEC_FIELDS = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
                      "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint",
                      "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
                      "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend",
                      "schedule"}


def _check_cluster_fields(spec: dict, where: str) -> None:
    assert set(spec) <= RAYCLUSTER_SPEC_FIELDS, f"{where}: unknown fields {set(spec) - RAYCLUSTER_SPEC_FIELDS}"
    assert set(spec["headGroupSpec"]) <= HEAD_GROUP_FIELDS, where
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP_FIELDS, f"{where}: {set(group) - WORKER_GROUP_FIELDS}"
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    assert set(spec.get("autoscalerOptions", {})) <= AUTOSCALER_FIELDS, where
    assert set(spec.get("authOptions", {})) <= AUTH_FIELDS, where
    assert set(spec.get("gcsFaultToleranceOptions", {})) <= GCS_FT_FIELDS, where


@pytest.mark.parametrize("overlay", ("base",) + OVERLAYS)
def test_kuberay_resources_use_only_crd_field_names(overlay):
    built = _built(overlay)
    cluster = built.get("RayCluster", "compat")
    assert cluster["apiVersion"] == "ray.io/v1"
    _check_cluster_fields(cluster["spec"], f"{overlay} RayCluster")
    job = built.get("RayJob", "compat-celeba-dinov3")
    assert job["apiVersion"] == "ray.io/v1"
    assert set(job["spec"]) <= RAYJOB_SPEC_FIELDS, set(job["spec"]) - RAYJOB_SPEC_FIELDS
    _check_cluster_fields(job["spec"]["rayClusterSpec"], f"{overlay} RayJob")


def test_rayjob_has_lifecycle_limits_token_auth_and_a_yaml_runtime_env():
    job = _built("gpu").get("RayJob", "compat-celeba-dinov3")["spec"]
    assert job["shutdownAfterJobFinishes"] is True
    assert isinstance(job["ttlSecondsAfterFinished"], int) and job["ttlSecondsAfterFinished"] > 0
    # 72 h = 259,200 s: about 1.6x the README's 1-GPU sequential estimate (44.8 GPU-hours, `compat plan`)
    assert job["activeDeadlineSeconds"] == 72 * 3600
    assert isinstance(job["backoffLimit"], int) and job["backoffLimit"] >= 1
    runtime_env = yaml.safe_load(job["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict) and set(runtime_env) <= {"env_vars", "config", "pip", "working_dir", "py_modules"}
    secret_words = re.compile(r"(?i)secret|password|token|access_key")
    assert not any(secret_words.search(k) for k in runtime_env.get("env_vars", {})), "credentials belong in Secrets"
    assert job["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": "compat-ray-auth"}
    assert job["entrypoint"].split()[:3] == ["compat", "run", CELEBA_CONFIG]


def test_ray_start_params_are_real_ray_start_options():
    from ray.scripts.scripts import start

    option_names = {opt.lstrip("-") for param in start.params for opt in param.opts}
    for overlay in ("base",) + OVERLAYS:
        spec = _built(overlay).get("RayCluster", "compat")["spec"]
        groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
        for group in groups:
            unknown = set(group["rayStartParams"]) - option_names
            assert not unknown, f"{overlay}: rayStartParams {unknown} are not `ray start` options"


# ---- references: Secrets, ConfigMaps, PVCs, images ----------------------------------------------------------------
def _defined_objects() -> tuple[dict, dict, set]:
    secrets = {name: set(doc.get("stringData", {})) | set(doc.get("data", {}))
               for name, doc in _secret_templates().items()}
    configmaps, claims = {}, set()
    for path, doc in _all_k8s_documents():
        if doc["kind"] == "ConfigMap":
            configmaps[doc["metadata"]["name"]] = set(doc["data"])
        elif doc["kind"] == "PersistentVolumeClaim":
            claims.add(doc["metadata"]["name"])
        elif doc["kind"] == "StatefulSet":
            claims.update(t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", []))
        assert doc["kind"] != "Secret" or path.parent.name == "secrets", f"{path}: Secrets only as templates"
    return secrets, configmaps, claims


def test_every_secret_configmap_and_claim_reference_resolves_to_a_defined_key():
    secrets, configmaps, claims = _defined_objects()
    documents = [doc for _, doc in _all_k8s_documents()]
    documents += [r for overlay in OVERLAYS for r in _built(overlay).resources]
    references = [ref for doc in documents for ref in collect_references(doc, f"{doc['kind']}/{doc['metadata']['name']}")]
    kinds = {ref.kind for ref in references}
    assert kinds == {"Secret", "ConfigMap", "PersistentVolumeClaim"}, kinds
    for ref in references:
        if ref.kind == "Secret":
            assert ref.name in secrets, f"{ref.where}: Secret {ref.name} is not in infra/secrets/secrets.template.yaml"
            assert ref.key is None or ref.key in secrets[ref.name], f"{ref.where}: no key {ref.key} in {ref.name}"
        elif ref.kind == "ConfigMap":
            assert ref.name in configmaps, f"{ref.where}: ConfigMap {ref.name} not defined in infra/"
            assert ref.key is None or ref.key in configmaps[ref.name], f"{ref.where}: no key {ref.key}"
        else:
            assert ref.name in claims, f"{ref.where}: PVC {ref.name} not defined in infra/"
    # every Secret template is used somewhere (a stale template is a drift too)
    used = {ref.name for ref in references if ref.kind == "Secret"}
    assert used == set(secrets), set(secrets) ^ used


def _is_pinned_external(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest") and re.match(r"\d", tag) is not None


def test_every_image_is_built_from_this_repo_or_a_pinned_official_image():
    version = VERSION
    instructions, args = _dockerfile()
    mlflow_pin = next(t.split("==")[1] for t in max(pip_requirements(instructions, args), key=len)
                      if t.startswith("mlflow=="))
    ours = {f"registry.example.com/compat/compat-learning:{version}-gpu",
            f"registry.example.com/compat/compat-learning:{version}-cpu",
            f"registry.example.com/compat/compat-mlflow:{mlflow_pin}", f"compat-mlflow:{mlflow_pin}"}
    images = [i for o in OVERLAYS for i in collect_images(_built(o).resources)]
    images += collect_images(build_kustomization(INFRA / "services" / "k8s").resources)
    images += collect_images(load_documents(INFRA / "services" / "compose" / "docker-compose.yaml"))
    images.append(load_documents(INFRA / "ray-cluster" / "cluster.yaml")[0]["docker"]["image"])
    external = {"postgres", "chrislusf/seaweedfs"}
    for image in images:
        if image in ours:
            continue
        assert image.rpartition(":")[0] in external and _is_pinned_external(image), f"unknown or unpinned {image}"
    assert {f"registry.example.com/compat/compat-learning:{version}-gpu", f"compat-mlflow:{mlflow_pin}"} <= set(images)


# ---- compat invocations vs the real CLI ---------------------------------------------------------------------------
def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _readme_shell_text() -> str:
    text = (INFRA / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S)
    return "\n".join(block.replace("\\\n", " ") for block in blocks)


def _compat_invocations() -> list[tuple[str, list[str]]]:
    found = []
    for path in yaml_files():
        for doc in load_documents(path):
            for text in _strings(doc):
                if re.search(r"(^|[\s;])compat\s+\w", text):
                    found += [(str(path), args) for args in command_lines(text, "compat")]
    found += [("infra/README.md", args) for args in command_lines(_readme_shell_text(), "compat")]
    return found


def test_every_compat_invocation_in_infra_parses_with_the_real_cli(monkeypatch):
    from app.cli import build_parser
    from pipelines.config.load import load_config

    invocations = _compat_invocations()
    commands = {args[0] for _, args in invocations if args and not args[0].startswith("-")}
    assert {"run", "submit", "status", "logs"} <= commands, commands
    parser = build_parser()
    monkeypatch.chdir(REPO)
    for where, args in invocations:
        try:
            parsed = parser.parse_args(args)
        except SystemExit as error:
            pytest.fail(f"{where}: `compat {' '.join(args)}` is rejected by app.cli ({error})")
        config = getattr(parsed, "config", None)
        if parsed.command in ("run", "submit") and config and config.startswith("configs/"):
            # the config exists and every --set override names a real field (validation never reads data)
            load_config(config, getattr(parsed, "overrides", []) or [])


# ---- Ray cluster launcher -----------------------------------------------------------------------------------------
def test_cluster_launcher_config_validates_against_rays_schema_and_binds_the_dashboard_privately():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config
    from ray.scripts.scripts import start

    config = load_documents(INFRA / "ray-cluster" / "cluster.yaml")[0]
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(json.loads(json.dumps(config))))
    assert config["provider"]["type"] == "aws" and config["provider"]["use_internal_ips"] is True
    gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types and all(t["max_workers"] >= 1 for t in gpu_types)
    head_commands = [args for text in config["head_start_ray_commands"] for args in command_lines(text, "ray")
                     if args[:1] == ["start"]]
    assert len(head_commands) == 1
    head = start.make_context("start", head_commands[0][1:])
    assert head.params["head"] is True
    assert head.params["dashboard_host"] == "$PRIVATE_IP" != "0.0.0.0"
    assert head.params["node_ip_address"] == "$PRIVATE_IP"
    for text in config["worker_start_ray_commands"]:
        for args in command_lines(text, "ray"):
            if args[:1] == ["start"]:
                start.make_context("start", args[1:])
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "compat-src" in setup and "compat --help" in setup


# ---- services: same settings as the test fixture ------------------------------------------------------------------
def _fixture_commands(tmp_path, monkeypatch) -> dict[str, tuple[list[str], dict]]:
    """The exact command lines and environments tests/local_services.py starts (no process is started)."""
    import local_services

    captured = {}

    class FakePopen:
        def __init__(self, command, env=None, **kwargs):
            captured[Path(command[0]).name] = (list(command), dict(env or os.environ))
            self.pid = 0

    # a stand-in module, so that only local_services' own process starts are faked
    fake_subprocess = SimpleNamespace(Popen=FakePopen, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(local_services, "subprocess", fake_subprocess)
    monkeypatch.setattr(local_services, "_wait_until", lambda *a, **k: None)
    monkeypatch.setattr(local_services, "_tool", lambda name: name)
    local_services.SeaweedS3Server(tmp_path / "s3").start()
    local_services.MlflowServer(tmp_path / "mlflow").start()
    return captured


def _weed_flags(args: list[str]) -> dict[str, str]:
    assert args[0] == "mini", args
    return dict(arg.lstrip("-").split("=", 1) if "=" in arg else (arg.lstrip("-"), "true") for arg in args[1:])


def _infra_weed_commands() -> dict[str, list[str]]:
    statefulset = next(d for _, d in _all_k8s_documents() if d["kind"] == "StatefulSet" and
                       d["metadata"]["name"] == "seaweedfs")
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    compose = load_documents(INFRA / "services" / "compose" / "docker-compose.yaml")[0]["services"]["seaweedfs"]
    unit = (INFRA / "services" / "systemd" / "seaweedfs.service").read_text()
    exec_start = next(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart="))
    return {"k8s": container["args"], "compose": compose["command"][1:],
            "systemd": command_lines(exec_start, "weed")[0]}


def test_seaweedfs_services_use_the_fixture_flags_and_identity_layout(tmp_path, monkeypatch):
    captured = _fixture_commands(tmp_path, monkeypatch)
    local = _weed_flags(captured["weed"][0][1:])
    for variant, args in _infra_weed_commands().items():
        flags = _weed_flags(args)
        assert set(flags) == set(local), f"{variant}: flags differ from the fixture: {set(flags) ^ set(local)}"
        for behaviour in ("admin.ui", "webdav"):
            assert flags[behaviour] == local[behaviour], f"{variant}: -{behaviour}"
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if Path(weed).exists():
        help_text = subprocess.run([weed, "mini", "-h"], capture_output=True, text=True, timeout=20)
        known = set(re.findall(r"^\s+-([\w.]+)", help_text.stdout + help_text.stderr, flags=re.M))
        assert set(local) <= known, set(local) - known
    # s3.json: same identity structure and actions as the fixture writes
    local_config = json.loads((tmp_path / "s3" / "s3.json").read_text())
    template = json.loads(_secret_templates()["compat-seaweedfs-s3"]["stringData"]["s3.json"])
    local_identity, template_identity = local_config["identities"][0], template["identities"][0]
    assert template_identity["actions"] == local_identity["actions"]
    assert set(template_identity["credentials"][0]) == set(local_identity["credentials"][0])
    assert set(template_identity["credentials"][0].values()) == {"REPLACE_ME"}


def _mlflow_variants() -> dict[str, tuple[list[str], dict]]:
    deployment = next(d for _, d in _all_k8s_documents() if d["kind"] == "Deployment" and
                      d["metadata"]["name"] == "mlflow")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    k8s_env = {e["name"]: e.get("value", "from-ref") for e in container["env"]}
    compose = load_documents(INFRA / "services" / "compose" / "docker-compose.yaml")[0]["services"]["mlflow"]
    unit = (INFRA / "services" / "systemd" / "mlflow.service").read_text()
    exec_start = next(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart="))
    unit_env = dict(line.split("=", 1)[1].split("=", 1) for line in unit.splitlines()
                    if line.startswith("Environment="))
    documented = re.search(r"/etc/compat/mlflow.env.*?:(.*?)\n# The", unit, flags=re.S).group(1)
    unit_env.update({name: "from-file" for name in re.findall(r"[A-Z][A-Z0-9_]+", documented)})
    compose_env = dict(compose["environment"])
    compose_env["MLFLOW_BACKEND_STORE_URI"] = "from-secrets.env"  # documented content of secrets.env
    return {"k8s": (container["args"], k8s_env),
            "compose": (compose["command"], compose_env),
            "systemd": (command_lines(exec_start, "mlflow")[0], unit_env)}


def test_mlflow_services_parse_with_mlflow_server_and_match_the_fixture(tmp_path, monkeypatch):
    from mlflow.cli import server

    captured = _fixture_commands(tmp_path, monkeypatch)
    local_args, local_env = captured["mlflow"]
    for name in list(os.environ):
        if name.startswith("MLFLOW_"):
            monkeypatch.delenv(name)
    local = server.make_context("server", local_args[2:]).params
    assert local_env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    for variant, (args, env) in _mlflow_variants().items():
        assert args[0] == "server", variant
        with monkeypatch.context() as scoped:
            for key, value in env.items():
                scoped.setenv(key, value)
            params = server.make_context("server", list(args[1:])).params
        assert params["workers"] == local["workers"], variant
        assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == local_env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"], variant
        assert params["backend_store_uri"], f"{variant}: no backend store (flag or MLFLOW_BACKEND_STORE_URI)"
        assert params["artifacts_destination"].startswith("s3://"), variant
        assert params["allowed_hosts"] and "*" not in params["allowed_hosts"].split(","), variant
        assert params["app_name"] == "basic-auth", variant
        assert "MLFLOW_BACKEND_STORE_URI" in env and "--backend-store-uri" not in args, \
            f"{variant}: the backend URI (with its password) must come from the environment, not the command line"


# ---- secrets ------------------------------------------------------------------------------------------------------
SECRET_PATTERNS = {
    "AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "password assignment": re.compile(r"(?i)\b(password|passwd|secret_?key)\b\s*[:=]\s*(?!REPLACE_ME|\$|\"\$|"
                                      r"\{|$|from|<|\(|\[|--)[^\s,#]{4,}"),
    "credentials in a URL": re.compile(r"://[^/\s:@]+:(?!REPLACE_ME@|\$)[^/\s@]+@"),
    # at least 40 characters mixing letters and digits (long camelCase field names alone are not tokens)
    # (hyphens and slashes split it: kebab-case names, paths and JSON pointers are not tokens)
    "long random token": re.compile(r"(?<![\w+])(?=[\w+]*\d)(?=[\w+]*[A-Za-z])[\w+]{40,}={0,2}"),
}


def test_secret_pattern_detector_catches_hand_made_leaks():
    leaks = ["AKIAABCDEFGHIJKLMNOP", "password: hunter2hunter2", "postgresql://mlflow:s3cr3t@db:5432/mlflow",
             "-----BEGIN RSA PRIVATE KEY-----", "token " + "aB3" * 15]
    for leak in leaks:
        assert any(p.search(leak) for p in SECRET_PATTERNS.values()), leak
    for fine in ["password: REPLACE_ME", "postgresql://REPLACE_ME:REPLACE_ME@postgres:5432/mlflow",
                 "MLFLOW_TRACKING_PASSWORD", "secretKeyRef: {name: compat-redis, key: password}"]:
        assert not any(p.search(fine) for p in SECRET_PATTERNS.values()), fine


def test_no_file_in_infra_contains_an_obvious_secret():
    files = [p for p in INFRA.rglob("*") if p.is_file()]
    assert len(files) >= 20
    for path in files:
        text = path.read_text(encoding="utf-8")
        for label, pattern in SECRET_PATTERNS.items():
            match = pattern.search(text)
            assert match is None, f"{path.relative_to(REPO)}: looks like a {label}: {match.group(0)!r}"
    for name, doc in _secret_templates().items():
        for key, value in doc["stringData"].items():
            assert "REPLACE_ME" in value, f"Secret template {name}/{key} must hold a placeholder only"


# ---- README sizing arithmetic -------------------------------------------------------------------------------------
def test_readme_states_the_feature_storage_arithmetic():
    readme = (INFRA / "README.md").read_text()
    images = 19_962        # CelebA published test partition (list_eval_partition.txt code 2): query + gallery
    full_d, bridge_m, fp16 = 21_999, 768, 2
    per_model_full = images * full_d * fp16
    per_model_bridge = images * bridge_m * fp16
    assert per_model_full == 878_288_076 and per_model_bridge == 30_661_632  # hand-checked: 19,962 x 43,998 bytes
    for value in (per_model_full, per_model_bridge, 16 * per_model_full, 16 * per_model_bridge):
        assert f"{value:,}" in readme, f"README lacks {value:,}"
    assert "compat submit" in readme and "kubectl apply -k infra/kuberay/overlays/gpu" in readme

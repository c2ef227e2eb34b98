"""Offline readers for infra/: YAML manifests, a small kustomize (resources, namespace, images, JSON 6902 patches),
Dockerfile instructions and shell command lines. No Kubernetes, Docker or kustomize binary is needed.
"""
from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"


def load_documents(path: Path) -> list:
    """All non-empty YAML documents of ``path`` (yaml.safe_load_all)."""
    with open(path, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def yaml_files(root: Path = INFRA) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def resource_id(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


# ---- JSON 6902 (RFC 6902) on plain dicts/lists, as kustomize applies `patches:` files that are op lists ----------
class PatchError(ValueError):
    pass


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _parent(document, parts: list[str], path: str):
    node = document
    for part in parts[:-1]:
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise PatchError(f"{path}: index {part!r} out of range")
            node = node[int(part)]
        elif isinstance(node, dict):
            if part not in node:
                raise PatchError(f"{path}: key {part!r} does not exist")
            node = node[part]
        else:
            raise PatchError(f"{path}: cannot descend into a scalar at {part!r}")
    return node


def apply_json_patch(document: dict, operations: list[dict]) -> dict:
    """A patched deep copy; supports add / replace / remove / test (what infra/ uses). Raises PatchError."""
    result = copy.deepcopy(document)
    for operation in operations:
        op, path = operation.get("op"), operation.get("path")
        parts = _pointer(path)
        parent = _parent(result, parts, path)
        last = parts[-1]
        if isinstance(parent, list):
            if last == "-" and op == "add":
                parent.append(copy.deepcopy(operation["value"]))
                continue
            if not last.isdigit():
                raise PatchError(f"{path}: {last!r} is not a list index")
            index = int(last)
            limit = len(parent) + (1 if op == "add" else 0)
            if index >= limit:
                raise PatchError(f"{path}: index {index} out of range (length {len(parent)})")
        elif isinstance(parent, dict):
            if op in ("replace", "remove", "test") and last not in parent:
                raise PatchError(f"{path}: {op} needs an existing key {last!r}")
        else:
            raise PatchError(f"{path}: parent is a scalar")
        if op == "add":
            if isinstance(parent, list):
                parent.insert(index, copy.deepcopy(operation["value"]))
            else:
                parent[last] = copy.deepcopy(operation["value"])
        elif op == "replace":
            parent[index if isinstance(parent, list) else last] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del parent[index if isinstance(parent, list) else last]
        elif op == "test":
            actual = parent[index if isinstance(parent, list) else last]
            if actual != operation["value"]:
                raise PatchError(f"{path}: test expected {operation['value']!r}, found {actual!r}")
        else:
            raise PatchError(f"{path}: unsupported op {op!r}")
    return result


# ---- kustomize subset ---------------------------------------------------------------------------------------------
@dataclass
class Built:
    resources: list[dict]
    patch_targets: list[tuple[Path, dict]]   # (patch file, target) for every patch applied

    def get(self, kind: str, name: str) -> dict:
        matches = [r for r in self.resources if resource_id(r) == (kind, name)]
        if len(matches) != 1:
            raise KeyError(f"{kind}/{name}: found {len(matches)} resources")
        return matches[0]


def _matches(resource: dict, target: dict) -> bool:
    group, _, version = resource["apiVersion"].rpartition("/")
    checks = {"kind": resource["kind"], "name": resource["metadata"]["name"], "group": group, "version": version}
    return all(checks[key] == value for key, value in target.items() if key in checks)


def _image_transform(resources: list[dict], images: list[dict]) -> None:
    def rewrite(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "image" and isinstance(value, str):
                    name = value.split(":")[0]
                    for rule in images:
                        if rule["name"] == name:
                            node[key] = f"{rule.get('newName', name)}:{rule['newTag']}" if "newTag" in rule else \
                                rule.get("newName", name)
                else:
                    rewrite(value)
        elif isinstance(node, list):
            for item in node:
                rewrite(item)

    for resource in resources:
        rewrite(resource)


def build_kustomization(directory: Path) -> Built:
    """Resources of ``directory/kustomization.yaml`` after its patches, images and namespace, like `kustomize build`.

    Raises PatchError when a patch's target matches no resource or an operation does not apply.
    """
    spec = load_documents(directory / "kustomization.yaml")[0]
    resources: list[dict] = []
    targets: list[tuple[Path, dict]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            child = build_kustomization(path)
            resources.extend(child.resources)
            targets.extend(child.patch_targets)
        else:
            resources.extend(load_documents(path))
    for patch in spec.get("patches", []):
        patch_path = directory / patch["path"]
        target = patch["target"]
        operations = load_documents(patch_path)[0]
        hits = [i for i, r in enumerate(resources) if _matches(r, target)]
        if not hits:
            raise PatchError(f"{patch_path}: target {target} matches no resource of {directory}")
        for i in hits:
            resources[i] = apply_json_patch(resources[i], operations)
        targets.append((patch_path, target))
    _image_transform(resources, spec.get("images", []))
    if "namespace" in spec:
        for resource in resources:
            resource.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return Built(resources, targets)


# ---- references inside manifests -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    kind: str       # "Secret", "ConfigMap" or "PersistentVolumeClaim"
    name: str
    key: str | None  # None: the whole object (envFrom, volumes, claims)
    where: str


def collect_references(node, where: str = "") -> list[Reference]:
    """Every secretKeyRef, configMapKeyRef, envFrom, secret/configMap volume, PVC claim and KubeRay authOptions
    secret in ``node`` (a manifest or part of one)."""
    found: list[Reference] = []
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{where}/{key}"
            if key == "secretKeyRef":
                found.append(Reference("Secret", value["name"], value["key"], here))
            elif key == "configMapKeyRef":
                found.append(Reference("ConfigMap", value["name"], value["key"], here))
            elif key == "secretRef":
                found.append(Reference("Secret", value["name"], None, here))
            elif key == "configMapRef":
                found.append(Reference("ConfigMap", value["name"], None, here))
            elif key == "secret" and isinstance(value, dict) and "secretName" in value:
                keys = [item["key"] for item in value.get("items", [])] or [None]
                found.extend(Reference("Secret", value["secretName"], k, here) for k in keys)
            elif key == "configMap" and isinstance(value, dict) and "name" in value:
                keys = [item["key"] for item in value.get("items", [])] or [None]
                found.extend(Reference("ConfigMap", value["name"], k, here) for k in keys)
            elif key == "persistentVolumeClaim" and isinstance(value, dict):
                found.append(Reference("PersistentVolumeClaim", value["claimName"], None, here))
            elif key == "authOptions" and isinstance(value, dict) and "secretName" in value:
                # KubeRay reads the token from the data key auth_token of this Secret
                found.append(Reference("Secret", value["secretName"], "auth_token", here))
            else:
                found.extend(collect_references(value, here))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found.extend(collect_references(item, f"{where}/{i}"))
    return found


def collect_images(node) -> list[str]:
    if isinstance(node, dict):
        out = [v for k, v in node.items() if k == "image" and isinstance(v, str)]
        for k, v in node.items():
            if k != "image":
                out.extend(collect_images(v))
        return out
    if isinstance(node, list):
        return [image for item in node for image in collect_images(item)]
    return []


# ---- Dockerfile ----------------------------------------------------------------------------------------------------
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    instructions, pending = [], ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        word, _, rest = pending.partition(" ")
        instructions.append((word.upper(), rest.strip()))
        pending = ""
    return instructions


def dockerfile_arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    defaults = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            defaults.setdefault(name.strip(), value.strip())
    return defaults


def substitute(text: str, variables: dict[str, str]) -> str:
    """Expand ${NAME} and $NAME with the Dockerfile's ARG defaults (unknown names are left as they are)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def pip_requirements(instructions: list[tuple[str, str]], variables: dict[str, str]) -> list[list[str]]:
    """The requirement arguments of every `pip install` in RUN lines (options and their values removed)."""
    installs = []
    for word, rest in instructions:
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", substitute(rest, variables)):
            tokens = shlex.split(command)
            if "pip" not in tokens or "install" not in tokens:
                continue
            args = tokens[tokens.index("install") + 1:]
            requirements, skip = [], False
            for token in args:
                if skip:
                    skip = False
                elif token in ("--extra-index-url", "--index-url", "-c", "-r", "--constraint"):
                    skip = True
                elif not token.startswith("-"):
                    requirements.append(token)
            installs.append(requirements)
    return installs


# ---- shell command lines -------------------------------------------------------------------------------------------
def command_lines(text: str, program: str) -> list[list[str]]:
    """Argument lists of every `program ...` command in ``text``: each line is shell-tokenised (quotes respected),
    then cut at the operators ; && || | & and at comments."""
    found = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in list(lexer) + [";"]:
            if token and set(token) <= set(";&|"):
                # the program is the command word: the first token after VAR=value assignments and sudo
                words = list(command)
                while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                    words.pop(0)
                if words[:1] == ["sudo"]:
                    words = words[1:]
                if words and (words[0] == program or words[0].endswith("/" + program)):
                    found.append(words[1:])
                command = []
            else:
                command.append(token)
    return found

"""An offline ``kustomize build`` for the subset of kustomization fields deploy/k8s uses.

No kustomize binary is on PyPI and none can be downloaded here, so the tests build the overlays with
this: ``resources`` (files and directories), ``namespace``, ``labels`` (metadata only),
``images`` (newName/newTag) and ``patches`` given as JSON 6902 operations with a kind/name target.
Any other field, or a strategic-merge patch, is refused, so the manifests cannot silently rely on
something this builder would ignore.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]
_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass"}
_POD_TEMPLATES = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


class KustomizeError(ValueError):
    pass


def build(directory: Path) -> list[Resource]:
    """The resources ``kustomize build directory`` emits (in resource order)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _FIELDS
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            resources.extend(build(path))
        else:
            resources.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for patch in kustomization.get("patches", []):
        _apply_patch(directory, resources, patch)
    for image in kustomization.get("images", []):
        _set_image(resources, image)
    if "namespace" in kustomization:
        for res in resources:
            if res["kind"] not in _CLUSTER_SCOPED:
                res["metadata"]["namespace"] = kustomization["namespace"]
    for label in kustomization.get("labels", []):
        if label.get("includeSelectors") or label.get("includeTemplates"):
            raise KustomizeError("labels with includeSelectors/includeTemplates are not supported")
        for res in resources:
            res["metadata"].setdefault("labels", {}).update(label["pairs"])
    return resources


def _apply_patch(directory: Path, resources: list[Resource], patch: dict[str, Any]) -> None:
    target = patch.get("target", {})
    if set(target) - {"kind", "name"}:
        raise KustomizeError(f"patch targets select by kind and name only, not {sorted(target)}")
    text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise KustomizeError("only JSON 6902 patches (a list of operations) are supported")
    matched = [
        r
        for r in resources
        if r["kind"] == target.get("kind", r["kind"])
        and r["metadata"]["name"] == target.get("name", r["metadata"]["name"])
    ]
    if not matched:
        raise KustomizeError(f"patch target {target} matches no resource")
    for res in matched:
        for op in ops:
            json_patch(res, op)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def json_patch(doc: Resource, op: dict[str, Any]) -> None:
    """One RFC 6902 add/replace/remove operation, in place."""
    *parents, last = _pointer(op["path"])
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[int(last)]
        else:
            raise KustomizeError(f"unsupported op {kind!r}")
        return
    if kind in ("replace", "remove") and last not in node:
        raise KustomizeError(f"{op['path']} does not exist (op {kind})")
    if kind in ("add", "replace"):
        node[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[last]
    else:
        raise KustomizeError(f"unsupported op {kind!r}")


def containers(res: Resource) -> list[dict[str, Any]]:
    """The containers and init containers of a workload's pod template ([] for other kinds)."""
    if res["kind"] not in _POD_TEMPLATES:
        return []
    spec = res["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _set_image(resources: list[Resource], image: dict[str, str]) -> None:
    for res in resources:
        for container in containers(res):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"

#!/usr/bin/env python3
"""Render a kustomization directory without a kustomize binary.

Supports exactly the subset tandem's manifests use, and rejects anything else so that an
overlay cannot silently depend on a feature this renderer would ignore:

- ``resources``: YAML files (multi-document allowed) or directories holding a kustomization.
- ``patches``: entries with only ``path``; every document in the file is a strategic-merge patch
  applied to the resource with the same ``kind`` and ``metadata.name``. A document whose top
  level has ``$patch: delete`` removes that resource.
- ``labels``: entries with ``pairs`` and optionally ``includeTemplates``; the pairs go on every
  resource's ``metadata.labels`` (and pod template labels when ``includeTemplates``).
  ``includeSelectors: true`` is rejected (selectors are immutable; keep them explicit).
- ``images``: ``name`` with ``newName`` / ``newTag`` / ``digest`` for containers and
  initContainers of pod templates.

Strategic merge follows Kubernetes semantics for the fields used here: maps merge recursively, a
``null`` value deletes the key, lists of objects with a known merge key (containers by ``name``,
volumeMounts by ``mountPath``, ports by ``containerPort``/``port``, ...) merge element-wise (an
element with ``$patch: delete`` removes its match), every other list is replaced.

Usage: ``python scripts/render_kustomize.py k8s/overlays/gpu > rendered.yaml``
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

SUPPORTED_KEYS = frozenset({"apiVersion", "kind", "resources", "patches", "labels", "images"})

# Merge keys of the list fields we patch (from the Kubernetes OpenAPI x-kubernetes-patch-merge-key).
LIST_MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "volumes": ("name",),
    "env": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"),
    "imagePullSecrets": ("name",),
}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or is inconsistent."""


def resource_id(doc: Resource) -> tuple[str, str]:
    """The identity patches match on: (kind, metadata.name)."""
    try:
        return doc["kind"], doc["metadata"]["name"]
    except (KeyError, TypeError) as exc:
        raise KustomizeError(f"document without kind/metadata.name: {doc!r:.200}") from exc


def load_yaml_docs(path: Path) -> list[Resource]:
    """All non-empty documents of a YAML file."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def _merge_key(field: str, base: list[Any], patch: list[Any]) -> str | None:
    """The merge key for this list, or None when the list is replaced wholesale."""
    candidates = LIST_MERGE_KEYS.get(field, ())
    items = [x for x in [*base, *patch] if isinstance(x, dict)]
    if len(items) != len(base) + len(patch):
        return None
    for key in candidates:
        if items and all(key in x for x in items):
            return key
    return None


def _merge_list(field: str, base: list[Any], patch: list[Any]) -> list[Any]:
    key = _merge_key(field, base, patch)
    if key is None:
        return copy.deepcopy(patch)
    merged = copy.deepcopy(base)
    for item in patch:
        index = next((i for i, cur in enumerate(merged) if cur[key] == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                merged.pop(index)
        elif index is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[index] = strategic_merge(merged[index], item)
    return merged


def strategic_merge(base: Resource, patch: Resource) -> Resource:
    """Return ``base`` with ``patch`` merged in (neither argument is modified)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if key == "$patch":
            continue
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = strategic_merge(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = _merge_list(key, out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _pod_spec(doc: Resource) -> Resource | None:
    template = doc.get("spec", {}).get("template") if isinstance(doc.get("spec"), dict) else None
    return template.get("spec") if isinstance(template, dict) else None


def apply_patches(docs: list[Resource], patches: list[Resource]) -> list[Resource]:
    """Apply strategic-merge patches by (kind, name); every patch must find its target."""
    out = list(docs)
    for patch in patches:
        target = resource_id(patch)
        index = next((i for i, d in enumerate(out) if resource_id(d) == target), None)
        if index is None:
            raise KustomizeError(f"patch target {target} not found")
        if patch.get("$patch") == "delete":
            out.pop(index)
        else:
            out[index] = strategic_merge(out[index], patch)
    return out


def apply_labels(docs: list[Resource], entries: list[Resource]) -> None:
    """Add label pairs to metadata (and pod templates when asked), in place."""
    for entry in entries:
        unknown = set(entry) - {"pairs", "includeTemplates", "includeSelectors"}
        if unknown or entry.get("includeSelectors"):
            raise KustomizeError(f"unsupported labels entry: {entry}")
        pairs = {str(k): str(v) for k, v in entry["pairs"].items()}
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            template = doc.get("spec", {}).get("template") if isinstance(doc.get("spec"), dict) else None
            if entry.get("includeTemplates") and isinstance(template, dict):
                template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def _image_name(image: str) -> str:
    """The repository part of an image reference (no tag, no digest)."""
    name = image.split("@", 1)[0]
    last_colon = name.rfind(":")
    return name[:last_colon] if last_colon > name.rfind("/") else name


def _rewrite_image(image: str, rule: Resource) -> str:
    if "@" in image:
        tail = "@" + image.split("@", 1)[1]
    else:
        repo = _image_name(image)
        tail = image[len(repo) :]
    if rule.get("digest"):
        tail = "@" + str(rule["digest"])
    elif rule.get("newTag") is not None:
        tail = ":" + str(rule["newTag"])
    return str(rule.get("newName", _image_name(image))) + tail


def apply_images(docs: list[Resource], rules: list[Resource]) -> None:
    """Rewrite container images whose repository equals a rule's ``name``, in place."""
    for rule in rules:
        if set(rule) - {"name", "newName", "newTag", "digest"}:
            raise KustomizeError(f"unsupported images entry: {rule}")
    by_name = {rule["name"]: rule for rule in rules}
    for doc in docs:
        spec = _pod_spec(doc)
        if spec is None:
            continue
        for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            match = by_name.get(_image_name(container["image"]))
            if match is not None:
                container["image"] = _rewrite_image(container["image"], match)


def load_kustomization(directory: Path) -> Resource:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory} has no kustomization.yaml")
    docs = load_yaml_docs(path)
    if len(docs) != 1:
        raise KustomizeError(f"{path} must hold exactly one document")
    unknown = set(docs[0]) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {sorted(unknown)}")
    return docs[0]


def render(directory: str | Path) -> list[Resource]:
    """Render the kustomization in ``directory`` into its list of resources, in input order."""
    directory = Path(directory)
    spec = load_kustomization(directory)
    docs: list[Resource] = []
    for entry in spec.get("resources", []):
        target = directory / entry
        docs.extend(render(target) if target.is_dir() else load_yaml_docs(target))
    ids = [resource_id(d) for d in docs]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise KustomizeError(f"{directory}: duplicate resources {sorted(duplicates)}")
    patches: list[Resource] = []
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{directory}: only `patches: - path: FILE` is supported, got {entry}")
        patches.extend(load_yaml_docs(directory / entry["path"]))
    docs = apply_patches(docs, patches)
    apply_labels(docs, spec.get("labels", []))
    apply_images(docs, spec.get("images", []))
    return docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a directory holding kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        docs = render(args.directory)
    except KustomizeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False, default_flow_style=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

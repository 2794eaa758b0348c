"""Admission in the emulated API server: a PyTorchJob is checked against the vendored CRD's
structural schema (``deploy/crds/``) as the server applies one (unknown fields pruned or, under
``fieldValidation=Strict``, refused; defaults applied; values validated), then against the
training operator's validating webhook rules. Patches are applied here too (JSON merge patch).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml

from trainer.emulation.api import CRD_FILE, GROUP, KIND, VERSION, ApiError

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def load_crd(crd_file: Path = CRD_FILE) -> dict:
    """The vendored CustomResourceDefinition."""
    return next(
        d for d in yaml.safe_load_all(crd_file.read_text()) if d and d.get("kind") == "CustomResourceDefinition"
    )


class CrdSchema:
    """The PyTorchJob CRD's ``openAPIV3Schema``, applied as the API server applies a structural
    schema: prune unknown fields, apply defaults, validate.
    """

    def __init__(self, crd_file: Path = CRD_FILE) -> None:
        import jsonschema  # the dev extra; only the emulator (test tooling) needs it

        crd = load_crd(crd_file)
        version = next(v for v in crd["spec"]["versions"] if v["name"] == VERSION)
        self.schema = version["schema"]["openAPIV3Schema"]
        self.names: dict[str, Any] = crd["spec"]["names"]
        self.printer_columns: list[dict] = version.get("additionalPrinterColumns") or []
        self.validator = jsonschema.Draft7Validator(self.schema)

    def admit(self, obj: dict, *, field_validation: str) -> list[str]:
        """Prune, default and validate ``obj`` in place (its ``spec``; metadata and status are the
        server's). Returns the warnings (unknown fields under the default ``Warn``).

        Raises:
            ApiError: 400 for unknown fields under ``Strict``, 422 for invalid values.
        """
        unknown: list[str] = []
        for key in [k for k in obj if k not in ("apiVersion", "kind", "metadata", "spec", "status")]:
            unknown.append(key)
            del obj[key]
        if "spec" in obj:
            _prune(obj["spec"], self.schema["properties"]["spec"], "spec", unknown)
            _default(obj["spec"], self.schema["properties"]["spec"])
        if unknown and field_validation == "Strict":
            listed = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise ApiError(
                400,
                "BadRequest",
                f'{KIND} in version "{VERSION}" cannot be handled as a {KIND}: strict decoding error: {listed}',
            )
        errors = sorted(
            self.validator.iter_errors({k: v for k, v in obj.items() if k != "metadata"}),
            key=lambda e: list(e.absolute_path),
        )
        if errors:
            causes = [
                {"reason": "FieldValueInvalid", "message": e.message, "field": _field_path(e.absolute_path)}
                for e in errors
            ]
            text = "; ".join(
                f"{c['field']}: Invalid value: {json.dumps(e.instance)}: {c['message']}"
                for c, e in zip(causes, errors, strict=True)
            )
            name = obj.get("metadata", {}).get("name", "")
            raise ApiError(
                422,
                "Invalid",
                f'{KIND}.{GROUP} "{name}" is invalid: {text}',
                {"name": name, "group": GROUP, "kind": KIND, "causes": causes},
            )
        return [f'unknown field "{u}"' for u in unknown] if field_validation != "Ignore" else []


def _field_path(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def _prune(node: Any, schema: dict, path: str, unknown: list[str]) -> None:
    """Drop fields the schema does not declare (recording their paths), as the server does."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(node, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in node.items():
                _prune(value, extra, f"{path}.{key}", unknown)
            return
        for key in list(node):
            if props is None or key not in props:
                unknown.append(f"{path}.{key}")
                del node[key]
            else:
                _prune(node[key], props[key], f"{path}.{key}", unknown)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(node):
            _prune(item, schema["items"], f"{path}[{i}]", unknown)


def _default(node: Any, schema: dict) -> None:
    """Fill in the schema's ``default`` values where a field is absent, as the server does."""
    if isinstance(node, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key, sub in props.items():
            if key not in node and "default" in sub:
                node[key] = copy.deepcopy(sub["default"])
            if key in node:
                _default(node[key], sub)
        if isinstance(extra, dict):
            for value in node.values():
                _default(value, extra)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for item in node:
            _default(item, schema["items"])


def webhook_violations(job: dict) -> list[str]:
    """The training operator v1.9.4's validating webhook rules for a PyTorchJob."""
    out = []
    name = job["metadata"].get("name", "")
    if len(name) > 63 or not _DNS_1035.match(name):
        out.append(
            f"metadata.name: Invalid value: {name!r}: a DNS-1035 label "
            "must consist of lower case alphanumeric characters or '-'"
        )
    spec = job.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        out.append("spec.pytorchReplicaSpecs: Required value: must be required")
    for rtype, replica in replicas.items():
        if rtype not in ("Master", "Worker"):
            out.append(f'spec.pytorchReplicaSpecs: Unsupported value: "{rtype}": supported values: "Master", "Worker"')
        containers = replica.get("template", {}).get("spec", {}).get("containers") or []
        if not any(c.get("name") == "pytorch" for c in containers):
            out.append(
                f"spec.pytorchReplicaSpecs[{rtype}].template.spec.containers: Required value: "
                "There is no container named pytorch"
            )
    if "Master" in replicas and replicas["Master"].get("replicas", 1) != 1:
        out.append("spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1")
    elastic = spec.get("elasticPolicy")
    if elastic is not None and "Worker" not in replicas:
        out.append("spec.elasticPolicy: Forbidden: must be configured with a Worker replica spec")
    if elastic and elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
        out.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what ``kubectl apply`` and ``patch --type merge`` send for a
    custom resource): objects merge key by key, ``null`` deletes, anything else replaces.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out

"""What the emulated API server says about itself: ``/version``, API discovery (the legacy
documents and, where the client asks for it, aggregated discovery ``apidiscovery.k8s.io/v2``)
and OpenAPI v3 (``/openapi/v3``), which ``kubectl`` reads for ``explain`` and to learn that the
server validates fields itself (``fieldValidation``). The PyTorchJob schema is the vendored CRD's.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from trainer.emulation.admission import CrdSchema
from trainer.emulation.api import GROUP, KIND, PLURAL, VERSION

SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-emulated",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
AUTHZ = "authorization.k8s.io"
RBAC = "rbac.authorization.k8s.io"
PLAIN_VERBS = ("create", "delete", "get", "list", "patch", "watch")


@dataclass(frozen=True)
class Resource:
    """One served resource as discovery describes it."""

    group: str
    plural: str
    kind: str
    verbs: tuple[str, ...]
    namespaced: bool = True
    short: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Subresource -> its verbs (its kind is the resource's)."""
    version: str = "v1"

    @property
    def group_version(self) -> str:
        """``v1`` or ``GROUP/VERSION``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        """The singular name (the kind in lower case)."""
        return self.kind.lower()


def resources(crd: CrdSchema) -> list[Resource]:
    """Everything the emulated server serves."""
    names = crd.names
    return [
        Resource(
            "",
            "pods",
            "Pod",
            ("delete", "get", "list", "watch"),
            short=("po",),
            categories=("all",),
            subresources={"log": ("get",), "status": ("get",)},
        ),
        Resource("", "events", "Event", ("create", "get", "list", "watch"), short=("ev",)),
        Resource("", "nodes", "Node", ("delete", "get", "list", "watch"), namespaced=False, short=("no",)),
        Resource(
            GROUP,
            PLURAL,
            KIND,
            ("create", "delete", "get", "list", "patch", "watch"),
            short=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()),
            subresources={"status": ("get",)},
            version=VERSION,
        ),
        Resource("", "serviceaccounts", "ServiceAccount", PLAIN_VERBS, short=("sa",)),
        Resource(RBAC, "roles", "Role", PLAIN_VERBS),
        Resource(RBAC, "rolebindings", "RoleBinding", PLAIN_VERBS),
        Resource(AUTHZ, "selfsubjectaccessreviews", "SelfSubjectAccessReview", ("create",), namespaced=False),
        Resource(AUTHZ, "subjectaccessreviews", "SubjectAccessReview", ("create",), namespaced=False),
    ]


class Discovery:
    """The discovery and OpenAPI documents, by path (None: not a discovery path)."""

    def __init__(self, crd: CrdSchema, address: str) -> None:
        self.crd, self.address = crd, address
        self.served = resources(crd)
        self.groups = sorted({r.group for r in self.served if r.group})
        self.openapi = {gv: self._openapi(gv) for gv in {r.group_version for r in self.served}}
        self.hashes = {
            gv: hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:64].upper()
            for gv, doc in self.openapi.items()
        }

    def document(self, path: str, accept: str) -> tuple[object, str] | None:
        """The document at ``path`` and its content type, for a client that accepts ``accept``."""
        path = path.rstrip("/") or "/"
        aggregated = any(
            {"g=apidiscovery.k8s.io", "v=v2"} <= {p.strip() for p in part.split(";")} for part in accept.split(",")
        )
        if path == "/version":
            return SERVER_VERSION, "application/json"
        if path in ("/api", "/apis") and aggregated:
            return self._aggregated(core=path == "/api"), AGGREGATED
        if path == "/api":
            address = [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.address}]
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": address,
            }, "application/json"
        if path == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [self._group(g) for g in self.groups],
            }, "application/json"
        if path == "/api/v1":
            return self._resource_list("", "v1"), "application/json"
        parts = path.split("/")
        if len(parts) == 3 and parts[1] == "apis" and parts[2] in self.groups:
            return {"kind": "APIGroup", "apiVersion": "v1", **self._group(parts[2])}, "application/json"
        if len(parts) == 4 and parts[1] == "apis" and f"{parts[2]}/{parts[3]}" in self.openapi:
            return self._resource_list(parts[2], parts[3]), "application/json"
        if path == "/openapi/v3":
            return {
                "paths": {
                    ("api/" if "/" not in gv else "apis/") + gv: {
                        "serverRelativeURL": f"/openapi/v3/{'api/' if '/' not in gv else 'apis/'}{gv}?hash={h}"
                    }
                    for gv, h in sorted(self.hashes.items())
                }
            }, "application/json"
        for prefix in ("/openapi/v3/api/", "/openapi/v3/apis/"):
            if path.startswith(prefix) and path[len(prefix) :] in self.openapi:
                return self.openapi[path[len(prefix) :]], "application/json"
        return None

    def find(self, group: str, plural: str) -> Resource | None:
        """The served resource ``plural`` of ``group`` (None: not served)."""
        return next((r for r in self.served if r.group == group and r.plural == plural), None)

    # ------------------------------------------------------------ legacy discovery
    def _group(self, group: str) -> dict:
        version = next(r.version for r in self.served if r.group == group)
        gv = {"groupVersion": f"{group}/{version}", "version": version}
        return {"name": group, "versions": [gv], "preferredVersion": gv}

    def _resource_list(self, group: str, version: str) -> dict:
        out = []
        for r in self.served:
            if r.group != group or r.version != version:
                continue
            entry: dict[str, Any] = {
                "name": r.plural,
                "singularName": r.singular,
                "namespaced": r.namespaced,
                "kind": r.kind,
            }
            entry["verbs"] = list(r.verbs)
            if r.short:
                entry["shortNames"] = list(r.short)
            if r.categories:
                entry["categories"] = list(r.categories)
            out.append(entry)
            out += [
                {
                    "name": f"{r.plural}/{sub}",
                    "singularName": "",
                    "namespaced": r.namespaced,
                    "kind": r.kind,
                    "verbs": list(verbs),
                }
                for sub, verbs in r.subresources.items()
            ]
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": out}

    # ------------------------------------------------------------ aggregated discovery
    def _aggregated(self, *, core: bool) -> dict:
        items = []
        for group in [""] if core else self.groups:
            served = [r for r in self.served if r.group == group]
            entries = []
            for r in served:
                kind = {"group": r.group, "version": r.version, "kind": r.kind}
                entry: dict[str, Any] = {
                    "resource": r.plural,
                    "responseKind": kind,
                    "scope": "Namespaced" if r.namespaced else "Cluster",
                }
                entry.update(singularResource=r.singular, verbs=list(r.verbs))
                if r.short:
                    entry["shortNames"] = list(r.short)
                if r.categories:
                    entry["categories"] = list(r.categories)
                if r.subresources:
                    entry["subresources"] = [
                        {"subresource": sub, "responseKind": kind, "verbs": list(verbs)}
                        for sub, verbs in r.subresources.items()
                    ]
                entries.append(entry)
            version = {"version": served[0].version, "resources": entries, "freshness": "Current"}
            items.append({"metadata": {"name": group, "creationTimestamp": None}, "versions": [version]})
        return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": items}

    # ------------------------------------------------------------ OpenAPI v3
    def _openapi(self, group_version: str) -> dict:
        paths: dict[str, Any] = {}
        schemas: dict[str, Any] = {}
        for r in (r for r in self.served if r.group_version == group_version):
            gvk = {"group": r.group, "version": r.version, "kind": r.kind}
            name = _schema_name(r)
            schemas[name] = self._schema(r) | {"x-kubernetes-group-version-kind": [gvk]}
            ref = {"$ref": f"#/components/schemas/{name}"}
            prefix = f"/{'apis' if r.group else 'api'}/{r.group_version}" + (
                "/namespaces/{namespace}" if r.namespaced else ""
            )
            params = (
                [{"name": "namespace", "in": "path", "required": True, "schema": {"type": "string"}}]
                if r.namespaced
                else []
            )
            item_params = [*params, {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
            collection: dict[str, Any] = {"parameters": params}
            item: dict[str, Any] = {"parameters": item_params}
            for verb in r.verbs:
                op = {
                    "operationId": f"{verb}{r.kind}",
                    "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}},
                    "x-kubernetes-action": verb,
                    "x-kubernetes-group-version-kind": gvk,
                }
                if verb in ("create", "patch"):
                    op["parameters"] = [_query(q) for q in ("dryRun", "fieldManager", "fieldValidation")]
                    op["requestBody"] = {"content": {"application/json": {"schema": ref}}}
                method = {
                    "create": "post",
                    "list": "get",
                    "watch": None,
                    "delete": "delete",
                    "get": "get",
                    "patch": "patch",
                }[verb]
                if method:
                    (collection if verb in ("create", "list") else item)[method] = op
            paths[f"{prefix}/{r.plural}"] = collection
            paths[f"{prefix}/{r.plural}/{{name}}"] = item
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes (emulated)", "version": SERVER_VERSION["gitVersion"]},
            "paths": paths,
            "components": {"schemas": schemas},
        }

    def _schema(self, r: Resource) -> dict:
        if r.kind == KIND:
            return copy.deepcopy(self.crd.schema)
        base = {
            "apiVersion": {
                "type": "string",
                "description": "APIVersion defines the versioned schema of this representation of an object.",
            },
            "kind": {
                "type": "string",
                "description": "Kind is a string value representing the REST resource this object represents.",
            },
            "metadata": {"type": "object", "description": "Standard object's metadata."},
        }
        return {
            "type": "object",
            "description": f"{r.kind} (the emulated cluster publishes no schema for its fields).",
            "properties": base,
            "x-kubernetes-preserve-unknown-fields": True,
        }


def _schema_name(r: Resource) -> str:
    if r.group == GROUP:
        return f"org.kubeflow.{r.version}.{r.kind}"
    return f"io.k8s.api.{r.group.split('.')[0] if r.group else 'core'}.{r.version}.{r.kind}"


def _query(name: str) -> dict:
    return {"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}

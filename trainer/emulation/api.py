"""The object model of the emulated API server (``trainer.emulation.apiserver``): its errors, the
label and field selectors, and the store with its history of changes (what watches replay).
"""

from __future__ import annotations

import copy
import itertools
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "deploy" / "crds" / "kubeflow.org_pytorchjobs.v1.9.4.yaml"
RBAC_FILE = REPO / "deploy" / "rbac.yaml"
GROUP, VERSION, KIND, PLURAL = "kubeflow.org", "v1", "PyTorchJob", "pytorchjobs"
PLAIN = {
    "serviceaccounts": ("v1", "ServiceAccount"),
    "roles": ("rbac.authorization.k8s.io/v1", "Role"),
    "rolebindings": ("rbac.authorization.k8s.io/v1", "RoleBinding"),
}
"""Resources only stored, by plural: (apiVersion, kind) (``kubectl apply -f deploy/rbac.yaml``;
RBAC decisions stay the file's)."""
ADMIN = "system:admin"
"""The user of the admin kubeconfig (tests, kubectl): a member of system:masters, never checked."""
META_FIELDS = {"name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences"}
SERVER_META = {
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
}
HISTORY = 4000
"""Changes the store keeps for watches; a watch from an older resourceVersion is ``410 Expired``."""


def now_rfc3339() -> str:
    """The current time as Kubernetes writes timestamps."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ApiError(Exception):
    """A request the server refuses; ``status()`` is the Status object it answers with."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        """The ``Status`` object (kind Status, status Failure) of this error."""
        out = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message}
        out.update({"reason": self.reason, "code": self.code})
        if self.details:
            out["details"] = self.details
        return out


def qualified(resource: str) -> str:
    """A resource as the server's messages name it (``pytorchjobs.kubeflow.org``, ``pods``)."""
    return f"{resource}.{GROUP}" if resource == PLURAL else resource


def not_found(resource: str, name: str) -> ApiError:
    """``404 NotFound`` for ``name``, worded like the real server."""
    kind = resource.split("/")[0]
    return ApiError(404, "NotFound", f'{qualified(kind)} "{name}" not found', {"name": name, "kind": kind})


def flag(value: str | None) -> bool:
    """A boolean query parameter as the server parses it (Go's ParseBool: the Python client sends ``True``)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


# ------------------------------------------------------------------ label selectors
_REQUIREMENT = re.compile(
    r"\s*(?P<neg>!)?(?P<key>[A-Za-z0-9./_-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9._-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether ``labels`` match a label selector string (the API's syntax).

    Raises:
        ApiError: 400 for a selector that does not parse.
    """
    for part in _split_selector(selector):
        m = _REQUIREMENT.match(part)
        if not m or (m["neg"] and (m["op"] or m["setop"])):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        key = m["key"]
        present = key in labels
        if m["op"]:
            ok = labels.get(key) == m["value"] if m["op"] != "!=" else labels.get(key) != m["value"]
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",") if v.strip()}
            ok = labels.get(key) in values if m["setop"] == "in" else labels.get(key) not in values
        else:
            ok = not present if m["neg"] else present
        if not ok:
            return False
    return True


def _split_selector(selector: str) -> Iterator[str]:
    depth, start = 0, 0
    for i, ch in enumerate(selector):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            yield selector[start:i]
            start = i + 1
    if selector[start:].strip():
        yield selector[start:]


# ------------------------------------------------------------------ field selectors
_FIELDS = {
    "pods": {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "status.phase",
        "status.podIP",
    },
    "events": {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    },
}
_FIELD_REQUIREMENT = re.compile(r"^\s*(?P<key>[A-Za-z0-9.]+)\s*(?P<op>==|=|!=)\s*(?P<value>.*?)\s*$")


def field_matches(selector: str, resource: str, obj: dict) -> bool:
    """Whether ``obj`` matches a field selector (``=``, ``==``, ``!=`` on the fields the real
    server indexes for the resource: ``metadata.name`` and ``metadata.namespace`` everywhere).

    Raises:
        ApiError: 400 for a requirement that does not parse or a field that is not supported.
    """
    for part in filter(str.strip, selector.split(",")):
        m = _FIELD_REQUIREMENT.match(part)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid selector: '{selector}'; can't understand '{part}'")
        key = m["key"]
        if key not in {"metadata.name", "metadata.namespace"} | _FIELDS.get(resource, set()):
            raise ApiError(400, "BadRequest", f"field label not supported: {key}")
        value: Any = obj
        for step in key.split("."):
            value = value.get(step) if isinstance(value, dict) else None
        if key == "source" and isinstance(value, dict):
            value = value.get("component")
        equal = str(value if value is not None else "") == m["value"]
        if equal != (m["op"] != "!="):
            return False
    return True


# ------------------------------------------------------------------ the store
@dataclass(frozen=True, slots=True)
class Change:
    """One change of the store, as a watch sends it."""

    version: int
    type: str
    """ADDED, MODIFIED or DELETED."""
    resource: str
    object: dict
    """A copy of the object as it was then."""


@dataclass
class Store:
    """Every object of the cluster, by (resource, namespace, name; namespace "" for a
    cluster-scoped one); one lock for all of it.

    The operator and the kubelet (``trainer.emulation.operator``) work on the same objects under
    the same lock, as controllers work on the API server's state. Every change gets a new
    resourceVersion and goes into the history that watches replay (the last :data:`HISTORY`).
    """

    lock: threading.RLock = field(default_factory=threading.RLock)
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    history: deque[Change] = field(default_factory=deque)
    compacted: int = 0
    """The newest resourceVersion no longer in the history."""
    _versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _last: int = 0
    _keys: dict[int, tuple[str, str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        """The stored object (not a copy: callers hold the lock while they use it)."""
        return self.objects.get((resource, namespace, name))

    def items(self, resource: str, namespace: str | None = None) -> list[dict]:
        """The stored objects of a resource, in one namespace or all, by name."""
        keys = sorted(k for k in self.objects if k[0] == resource and (namespace is None or k[1] == namespace))
        return [self.objects[k] for k in keys]

    def put(self, resource: str, obj: dict) -> dict:
        """Store (or replace) ``obj`` under a new resourceVersion."""
        meta = obj["metadata"]
        key = (resource, meta.get("namespace", ""), meta["name"])  # "": a cluster-scoped object (a Node)
        old = self.objects.get(key)
        if old is not None:
            self._keys.pop(id(old), None)
        self._stamp(obj)
        self.objects[key] = obj
        self._keys[id(obj)] = key
        kind = "MODIFIED" if old is not None else "ADDED"
        self._record(kind, resource, obj)
        return obj

    def touch(self, obj: dict) -> None:
        """Give an object changed in place a new resourceVersion."""
        self._stamp(obj)
        key = self._keys.get(id(obj))
        if key is not None and self.objects.get(key) is obj:  # not stored (yet): nothing to tell watchers
            self._record("MODIFIED", key[0], obj)

    def remove(self, resource: str, namespace: str, name: str) -> None:
        """Delete an object for good (the API then answers 404)."""
        obj = self.objects.pop((resource, namespace, name), None)
        if obj is not None:
            self._keys.pop(id(obj), None)
            self._stamp(obj)
            self._record("DELETED", resource, obj)

    def version(self) -> str:
        """A resourceVersion for a list response: the newest one."""
        return str(self._last)

    def since(self, version: int) -> list[Change]:
        """The changes after ``version``.

        Raises:
            ApiError: 410 Expired where changes after ``version`` are no longer kept.
        """
        if version < self.compacted:
            raise ApiError(410, "Expired", f"too old resource version: {version} ({self.compacted + 1})")
        return [c for c in self.history if c.version > version]

    def _stamp(self, obj: dict) -> None:
        self._last = next(self._versions)
        obj["metadata"]["resourceVersion"] = str(self._last)

    def _record(self, kind: str, resource: str, obj: dict) -> None:
        self.history.append(Change(self._last, kind, resource, copy.deepcopy(obj)))
        while len(self.history) > HISTORY:
            self.compacted = self.history.popleft().version
        with self.changed:  # the lock is re-entrant: callers normally hold it already
            self.changed.notify_all()


def new_metadata(meta: dict, namespace: str) -> dict:
    """Metadata of a newly created object: the client's fields plus the server's own."""
    out = {k: copy.deepcopy(v) for k, v in meta.items() if k in META_FIELDS}
    out.update(namespace=namespace, uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_rfc3339())
    return out

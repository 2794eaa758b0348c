"""What the emulated API server's verbs do to the store: create (admission included), get,
list (label and field selectors, Tables for ``kubectl get``), merge patch, delete (with its
propagation policy) and the access reviews. The pod side (graceful deletion, logs) comes from the
kubelet (``trainer.emulation.operator``).
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.emulation.admission import CrdSchema, merge_patch, webhook_violations
from trainer.emulation.api import (
    GROUP,
    KIND,
    META_FIELDS,
    PLAIN,
    PLURAL,
    SERVER_META,
    VERSION,
    ApiError,
    Store,
    field_matches,
    new_metadata,
    not_found,
    now_rfc3339,
    selector_matches,
)
from trainer.emulation.rbac import Rbac, Request
from trainer.emulation.tables import table, wants_table

_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_KINDS = {
    "pods": ("v1", "Pod"),
    "events": ("v1", "Event"),
    "nodes": ("v1", "Node"),
    PLURAL: (f"{GROUP}/{VERSION}", KIND),
    **PLAIN,
}
_PATCH_TYPES = ("application/merge-patch+json", "application/json-patch+json", "application/apply-patch+yaml")
Result = tuple[int, object, dict[str, str]]


class Handlers:
    """What the verbs do to the store (the operator module supplies the pod side)."""

    def __init__(
        self,
        store: Store,
        schema: CrdSchema,
        *,
        delete_pod: Callable[[dict, int | None], None],
        log_source: Callable[..., tuple[Path, Callable[[], bool]]],
        rbac: Rbac | None = None,
    ) -> None:
        self.store, self.schema, self.delete_pod, self.log_source, self.rbac = (
            store,
            schema,
            delete_pod,
            log_source,
            rbac,
        )

    def handle(
        self,
        req: Request,
        query: dict[str, str],
        body: dict | None,
        *,
        accept: str = "",
        content_type: str = "application/json",
    ) -> Result:
        """Answer one authorized request: (code, body, extra headers); the body is a copy, made
        under the store's lock (the controllers change stored objects in place).
        """
        resource, sub = (req.resource.split("/") + [""])[:2]
        with self.store.lock:
            code, out, headers = self._handle(req, resource, sub, query, body, accept, content_type)
            return code, copy.deepcopy(out), headers

    def matches(self, resource: str, namespace: str, query: dict[str, str], obj: dict) -> bool:
        """Whether ``obj`` is in the selection of a list or watch (namespace, label and field
        selectors).
        """
        meta = obj["metadata"]
        return (
            (not namespace or meta.get("namespace") == namespace)
            and selector_matches(query.get("labelSelector", ""), meta.get("labels") or {})
            and field_matches(query.get("fieldSelector", ""), resource, obj)
        )

    def render(
        self, resource: str, objects: list[dict], query: dict[str, str], accept: str, *, headers: bool = True
    ) -> dict:
        """A list of objects as the client asked for it: a Table or a ``KindList``."""
        if wants_table(accept):
            return table(
                resource,
                objects,
                printer_columns=self.schema.printer_columns,
                include=query.get("includeObject", "Metadata"),
                version=self.store.version(),
                headers=headers,
            )
        api_version, kind = _KINDS.get(resource, ("v1", "List"))
        return {
            "kind": f"{kind}List",
            "apiVersion": api_version,
            "metadata": {"resourceVersion": self.store.version()},
            "items": objects,
        }

    def _handle(
        self,
        req: Request,
        resource: str,
        sub: str,
        query: dict[str, str],
        body: dict | None,
        accept: str,
        content_type: str,
    ) -> Result:
        if req.verb == "create" and not sub:
            if resource == PLURAL:
                return self._create_job(
                    req.namespace, body or {}, query.get("fieldValidation", "Warn"), query.get("dryRun") == "All"
                )
            if resource == "events":
                return self._create_event(req.namespace, body or {})
            if resource in PLAIN:
                return self._create_plain(resource, req.namespace, body or {}, query.get("dryRun") == "All")
            if resource in ("selfsubjectaccessreviews", "subjectaccessreviews") and self.rbac is not None:
                user = req.user if resource.startswith("self") else ((body or {}).get("spec") or {}).get("user", "")
                return 201, self.rbac.review(user, body or {}), {}
        if req.verb == "get":
            obj = self.store.get(resource, req.namespace, req.name)
            if obj is None:
                raise not_found(resource, req.name)
            return 200, (self.render(resource, [obj], query, accept) if wants_table(accept) else obj), {}
        if req.verb == "list":
            items = [
                o
                for o in self.store.items(resource, req.namespace or None)
                if self.matches(resource, req.namespace, query, o)
            ]
            return 200, self.render(resource, items, query, accept), {}
        if req.verb == "patch" and resource == PLURAL and not sub:
            return self._patch_job(req, body, query, content_type)
        if req.verb == "patch" and resource in PLAIN and not sub:
            return self._patch_plain(resource, req, body, query, content_type)
        if req.verb == "delete" and not sub:
            return self._delete(resource, req.namespace, req.name, body or {}, query)
        raise ApiError(405, "MethodNotAllowed", f"{req.verb} on {req.resource} is not emulated")

    def _create_job(self, namespace: str, body: dict, field_validation: str, dry_run: bool = False) -> Result:
        if field_validation not in ("Ignore", "Warn", "Strict"):
            raise ApiError(
                400, "BadRequest", f"invalid fieldValidation {field_validation!r}: must be Ignore, Warn or Strict"
            )
        if body.get("apiVersion") != f"{GROUP}/{VERSION}" or body.get("kind") != KIND:
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({body.get('apiVersion')}) does not match "
                f"the expected API version ({GROUP}/{VERSION})",
            )
        obj = copy.deepcopy(body)
        meta = obj.get("metadata") or {}
        if not isinstance(meta, dict):
            raise ApiError(
                400,
                "BadRequest",
                f'{KIND} in version "{VERSION}" cannot be handled as a {KIND}: metadata must be an object',
            )
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        name = meta.get("name", "")
        if not name or len(name) > 253 or not _DNS_1123_SUBDOMAIN.match(name):
            raise ApiError(
                422,
                "Invalid",
                f'{KIND}.{GROUP} "{name}" is invalid: metadata.name: Invalid value: '
                f'"{name}": a lowercase RFC 1123 subdomain is required',
            )
        warnings = self._admit(obj, meta, field_validation)
        if self.store.get(PLURAL, namespace, name) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{PLURAL}.{GROUP} "{name}" already exists',
                {"name": name, "group": GROUP, "kind": PLURAL},
            )
        obj["metadata"] = new_metadata(meta, namespace)
        obj.pop("status", None)  # the status subresource: only the operator writes it
        stored = obj if dry_run else self.store.put(PLURAL, obj)
        return 201, stored, _warning_header(warnings)

    def _admit(self, obj: dict, meta: dict, field_validation: str) -> list[str]:
        """The structural schema, then the operator's webhook; returns the warnings."""
        warnings = self.schema.admit(obj, field_validation=field_validation)
        unknown_meta = [k for k in meta if k not in META_FIELDS | SERVER_META]
        if unknown_meta and field_validation == "Strict":
            listed = ", ".join(f'unknown field "metadata.{k}"' for k in unknown_meta)
            raise ApiError(
                400,
                "BadRequest",
                f'{KIND} in version "{VERSION}" cannot be handled as a {KIND}: strict decoding error: {listed}',
            )
        warnings += [f'unknown field "metadata.{k}"' for k in unknown_meta] if field_validation != "Ignore" else []
        if violations := webhook_violations(obj):
            raise ApiError(
                422,
                "Invalid",
                f'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied the request: '
                f'{KIND}.{GROUP} "{meta.get("name", "")}" is invalid: ' + ", ".join(violations),
            )
        return warnings

    def _patch_job(self, req: Request, body: Any, query: dict[str, str], content_type: str) -> Result:
        """A JSON merge patch of a PyTorchJob (``kubectl apply`` of a changed manifest, ``kubectl
        patch --type merge``): metadata the server owns and the status stay as they are.
        """
        media = content_type.split(";")[0].strip()
        if media != "application/merge-patch+json":
            accepted = ", ".join(_PATCH_TYPES)
            if media in _PATCH_TYPES:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"{media} patches are not emulated; accepted: application/merge-patch+json",
                )
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: {accepted}",
            )
        current = self.store.get(PLURAL, req.namespace, req.name)
        if current is None:
            raise not_found(PLURAL, req.name)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the patch must be a JSON object")
        patched = merge_patch(current, body)
        if not isinstance(patched.get("metadata"), dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        meta = patched["metadata"]
        field_validation = query.get("fieldValidation", "Warn")
        patched.update(apiVersion=f"{GROUP}/{VERSION}", kind=KIND)
        warnings = self._admit(patched, meta, field_validation)
        kept = {k: v for k, v in meta.items() if k in META_FIELDS - {"name", "namespace"}}
        new_meta = {**copy.deepcopy(current["metadata"]), **kept}
        for key in META_FIELDS - {"name", "namespace"} - set(kept):
            new_meta.pop(key, None)
        if patched.get("spec") != current.get("spec"):
            new_meta["generation"] = current["metadata"].get("generation", 1) + 1
        patched["metadata"] = new_meta
        if "status" in current:
            patched["status"] = current["status"]
        else:
            patched.pop("status", None)
        if query.get("dryRun") == "All":
            return 200, patched, _warning_header(warnings)
        current.clear()
        current.update(patched)  # in place: the controllers hold this object
        self.store.touch(current)
        return 200, current, _warning_header(warnings)

    def _create_plain(self, resource: str, namespace: str, body: dict, dry_run: bool) -> Result:
        """A ServiceAccount, Role or RoleBinding: stored as sent (no schema), for ``kubectl apply``."""
        api_version, kind = PLAIN[resource]
        if (body.get("apiVersion"), body.get("kind")) != (api_version, kind):
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({body.get('apiVersion')}) does not match "
                f"the expected API version ({api_version})",
            )
        obj = copy.deepcopy(body)
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        name = meta.get("name", "")
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        if not name or len(name) > 253 or not _DNS_1123_SUBDOMAIN.match(name):
            raise ApiError(
                422,
                "Invalid",
                f'{kind} "{name}" is invalid: metadata.name: Invalid value: '
                f'"{name}": a lowercase RFC 1123 subdomain is required',
            )
        if self.store.get(resource, namespace, name) is not None:
            raise ApiError(
                409, "AlreadyExists", f'{resource} "{name}" already exists', {"name": name, "kind": resource}
            )
        obj["metadata"] = new_metadata(meta, namespace)
        return 201, obj if dry_run else self.store.put(resource, obj), {}

    def _patch_plain(self, resource: str, req: Request, body: Any, query: dict[str, str], content_type: str) -> Result:
        """A merge patch, or a strategic merge patch taken as one (its ``$`` directives dropped:
        these kinds' lists are replaced whole either way), of a stored object.
        """
        media = content_type.split(";")[0].strip()
        if media not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            raise ApiError(
                415, "UnsupportedMediaType", f"{media} patches are not emulated; send a merge or strategic merge patch"
            )
        current = self.store.get(resource, req.namespace, req.name)
        if current is None:
            raise not_found(resource, req.name)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the patch must be a JSON object")
        patched = merge_patch(current, _without_directives(body))
        meta = patched.get("metadata") if isinstance(patched.get("metadata"), dict) else {}
        kept = {k: v for k, v in meta.items() if k in META_FIELDS - {"name", "namespace"}}
        patched["metadata"] = {
            **{k: v for k, v in current["metadata"].items() if k not in META_FIELDS - {"name", "namespace"}},
            **kept,
        }
        patched["apiVersion"], patched["kind"] = PLAIN[resource]
        if query.get("dryRun") == "All":
            return 200, patched, {}
        current.clear()
        current.update(patched)
        self.store.touch(current)
        return 200, current, {}

    def _create_event(self, namespace: str, body: dict) -> Result:
        if body.get("kind") != "Event" or not isinstance(body.get("involvedObject"), dict):
            raise ApiError(422, "Invalid", 'Event "" is invalid: involvedObject: Required value')
        obj = copy.deepcopy(body)
        meta = obj.get("metadata") or {}
        if not meta.get("name"):
            meta["name"] = f"{meta.get('generateName', 'event.')}{uuid.uuid4().hex[:5]}"
        if self.store.get("events", namespace, meta["name"]) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'events "{meta["name"]}" already exists',
                {"name": meta["name"], "kind": "events"},
            )
        obj["metadata"] = new_metadata(meta, namespace)
        return 201, self.store.put("events", obj), {}

    def _delete(self, resource: str, namespace: str, name: str, body: dict, query: dict[str, str]) -> Result:
        obj = self.store.get(resource, namespace, name)
        if obj is None:
            raise not_found(resource, name)
        policy = body.get("propagationPolicy") or query.get("propagationPolicy") or "Background"
        if policy not in ("Background", "Foreground", "Orphan"):
            raise ApiError(
                400, "BadRequest", f"propagationPolicy {policy!r} is not one of Background, Foreground, Orphan"
            )
        grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
        meta = obj["metadata"]
        if resource == "pods":
            try:
                self.delete_pod(obj, None if grace is None else int(grace))
            except (TypeError, ValueError) as e:
                raise ApiError(400, "BadRequest", f"gracePeriodSeconds: {e}") from e
            return 200, obj, {}
        if resource != PLURAL:
            # A Node goes at once too; its pods are the node lifecycle's (trainer.emulation.kubelet).
            self.store.remove(resource, namespace, name)
            return 200, _success(name, resource, meta["uid"]), {}
        # A PyTorchJob has no graceful deletion of its own: Background and Orphan remove it at
        # once (the garbage collector then deletes or keeps its pods); Foreground keeps it,
        # with a deletionTimestamp and the foregroundDeletion finalizer, until its pods are gone.
        meta.setdefault("deletionTimestamp", now_rfc3339())
        meta["deletionGracePeriodSeconds"] = 0
        if policy == "Foreground":
            meta["finalizers"] = sorted({*(meta.get("finalizers") or []), "foregroundDeletion"})
            self.store.touch(obj)
            return 200, obj, {}
        if policy == "Orphan":
            for pod in self.store.items("pods", namespace):
                refs = pod["metadata"].get("ownerReferences") or []
                pod["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != meta["uid"]]
        self.store.remove(resource, namespace, name)
        return 200, _success(name, resource, meta["uid"]), {}


def _without_directives(patch: Any) -> Any:
    if isinstance(patch, dict):
        return {k: _without_directives(v) for k, v in patch.items() if not k.startswith("$")}
    if isinstance(patch, list):
        return [_without_directives(v) for v in patch]
    return patch


def _success(name: str, resource: str, uid: str) -> dict:
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
    status["details"] = {"name": name, "group": GROUP if resource == PLURAL else "", "kind": resource, "uid": uid}
    return status


def _warning_header(warnings: list[str]) -> dict[str, str]:
    return {"Warning": ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in warnings)} if warnings else {}

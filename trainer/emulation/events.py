"""core/v1 Events, as the emulated controllers record them (client-go's event recorder): one Event
per object, reason and message, its ``count`` and ``lastTimestamp`` bumped when it repeats.
``kubectl describe`` shows them under the object; ``kubectl get events`` lists them.
"""

from __future__ import annotations

import time

from trainer.emulation.api import Store, new_metadata, now_rfc3339

EVENT_NAMESPACE = "default"
"""Where the Events of a cluster-scoped object (a Node) go, as on a real cluster."""


class Recorder:
    """Records Events in the store (call with the store's lock held)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._seen: dict[tuple, dict] = {}

    def record(
        self,
        obj: dict,
        kind: str,
        reason: str,
        message: str,
        *,
        component: str,
        field_path: str = "",
        host: str = "",
    ) -> None:
        """An Event about ``obj``: ``kind`` is Normal or Warning, ``component`` who reports it
        (``kubelet``, ``pytorchjob-controller``, ``default-scheduler``, ``node-controller``),
        ``host`` the node of a kubelet's Event.
        """
        meta = obj["metadata"]
        namespace = meta.get("namespace") or EVENT_NAMESPACE
        key = (meta["uid"], field_path, kind, reason, message, component)
        now = now_rfc3339()
        seen = self._seen.get(key)
        if (
            seen is not None
            and self.store.get("events", seen["metadata"]["namespace"], seen["metadata"]["name"]) is seen
        ):
            seen["count"] += 1
            seen["lastTimestamp"] = now
            self.store.touch(seen)
            return
        involved = {"kind": obj["kind"], "name": meta["name"], "uid": meta["uid"]}
        if meta.get("namespace"):
            involved["namespace"] = meta["namespace"]
        involved.update(apiVersion=obj["apiVersion"], resourceVersion=meta.get("resourceVersion", ""))
        if field_path:
            involved["fieldPath"] = field_path
        source = {"component": component, **({"host": host} if host else {})}
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": new_metadata({"name": f"{meta['name']}.{time.time_ns():x}"}, namespace),
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "source": source,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "type": kind,
            "eventTime": None,
            "reportingComponent": component,
            "reportingInstance": host,
        }
        self._seen[key] = self.store.put("events", event)

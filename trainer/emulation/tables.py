"""What ``kubectl get`` prints: the server's Table responses (``Accept: ...;as=Table``), with the
CRD's printer columns for PyTorchJobs, the usual pod columns (READY, STATUS, RESTARTS, AGE; IP
and NODE with ``-o wide``), the node columns (STATUS, ROLES, AGE, VERSION; the addresses and
the node's software with ``-o wide``) and the event columns, ages as the server words them.
"""

from __future__ import annotations

import calendar
import re
import time
from typing import Any

from trainer.emulation.api import PLURAL

_NAME = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name must be unique within a namespace.",
    "priority": 0,
}


def wants_table(accept: str) -> bool:
    """Whether the client asks for a Table (``kubectl get``)."""
    return any({"as=Table", "g=meta.k8s.io"} <= {p.strip() for p in part.split(";")} for part in accept.split(","))


def table(
    resource: str, objects: list[dict], *, printer_columns: list[dict], include: str, version: str, headers: bool = True
) -> dict:
    """A ``meta.k8s.io/v1`` Table of ``objects``; ``include`` is the ``includeObject`` parameter
    (Metadata, the default; Object; None).
    """
    if resource == "pods":
        columns, cells = _POD_COLUMNS, _pod_cells
    elif resource == "events":
        columns, cells = _EVENT_COLUMNS, _event_cells
    elif resource == "nodes":
        columns, cells = _NODE_COLUMNS, _node_cells
    elif resource == PLURAL:
        columns = [_NAME] + [
            {
                "name": c["name"],
                "type": c["type"],
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": c.get("priority", 0),
            }
            for c in printer_columns
        ]

        def cells(obj: dict) -> list[Any]:
            return [obj["metadata"]["name"]] + [_printer_cell(obj, c) for c in printer_columns]
    else:
        columns = [_NAME, {"name": "Age", "type": "string", "format": "", "description": "", "priority": 0}]

        def cells(obj: dict) -> list[Any]:
            return [obj["metadata"]["name"], age(obj["metadata"].get("creationTimestamp"))]

    rows = []
    for obj in objects:
        row: dict[str, Any] = {"cells": cells(obj)}
        if include == "Object":
            row["object"] = obj
        elif include != "None":
            meta = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
            row["object"] = meta
        rows.append(row)
    out: dict[str, Any] = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": version}}
    out["columnDefinitions"] = columns if headers else []
    out["rows"] = rows
    return out


def human_duration(seconds: float) -> str:
    """A duration as the API server words ages (apimachinery's ``duration.HumanDuration``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24 % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def age(stamp: str | None) -> str:
    """The age of an RFC 3339 timestamp (``<unknown>`` without one)."""
    if not stamp:
        return "<unknown>"
    return human_duration(time.time() - calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))


# ------------------------------------------------------------------ printer columns (CRDs)
_STEP = re.compile(r"\.([A-Za-z0-9_-]+)|\[(-?\d*)(:?)(-?\d*)\]|\[\*\]")


def jsonpath(obj: Any, path: str) -> list[Any]:
    """The values a CRD printer column's JSONPath (``.a.b``, ``[i]``, ``[i:j]``, ``[*]``) selects."""
    values = [obj]
    for m in _STEP.finditer(path):
        out: list[Any] = []
        for v in values:
            if m[1] is not None:
                if isinstance(v, dict) and m[1] in v:
                    out.append(v[m[1]])
            elif isinstance(v, list):
                if m[0] == "[*]":
                    out += v
                elif m[3]:
                    out += v[int(m[2]) if m[2] else None : int(m[4]) if m[4] else None]
                elif m[2] and -len(v) <= int(m[2]) < len(v):
                    out.append(v[int(m[2])])
        values = out
    return values


def _printer_cell(obj: dict, column: dict) -> Any:
    values = jsonpath(obj, column["jsonPath"])
    if not values:
        return None
    value = values[0]
    if column["type"] == "date" and isinstance(value, str):
        return age(value)
    return value if isinstance(value, str | int | float | bool) else str(value)


# ------------------------------------------------------------------ pods
def _column(name: str, description: str, priority: int = 0, kind: str = "string") -> dict:
    return {"name": name, "type": kind, "format": "", "description": description, "priority": priority}


_POD_COLUMNS = [
    _NAME,
    _column("Ready", "The aggregate readiness state of this pod for accepting traffic."),
    _column("Status", "The aggregate status of the containers in this pod."),
    _column(
        "Restarts",
        "The number of times the containers in this pod have been restarted "
        "and when the last container in this pod has restarted.",
    ),
    _column("Age", "CreationTimestamp is a timestamp representing the server time when this object was created."),
    _column(
        "IP", "IP address allocated to the pod. Routable at least within the cluster. Empty if not yet allocated.", 1
    ),
    _column("Node", "NodeName is a request to schedule this pod onto a specific node.", 1),
    _column("Nominated Node", "nominatedNodeName is set when this pod preempts other pods on the node.", 1),
    _column("Readiness Gates", "If specified, all readiness gates will be evaluated for pod readiness.", 1),
]


def _pod_cells(pod: dict) -> list[Any]:
    status, meta = pod.get("status") or {}, pod["metadata"]
    containers = status.get("containerStatuses") or []
    total = len(pod["spec"].get("containers") or [])
    ready = sum(1 for c in containers if c.get("ready"))
    restarts = sum(c.get("restartCount", 0) for c in containers)
    reason = status.get("reason") or status.get("phase") or "Pending"
    last_restart = None
    for c in containers:
        state = c.get("state") or {}
        if state.get("waiting", {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated"):
            reason = state["terminated"].get("reason") or f"ExitCode:{state['terminated'].get('exitCode')}"
        finished = ((c.get("lastState") or {}).get("terminated") or {}).get("finishedAt")
        if finished and c.get("restartCount"):
            last_restart = finished
    if reason == "Pending" and not containers:
        scheduled = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
        reason = (
            "Pending"
            if scheduled and scheduled.get("status") == "False"
            else "ContainerCreating"
            if status.get("startTime")
            else "Pending"
        )
    if meta.get("deletionTimestamp"):
        reason = "Terminating"
    restarts_cell = f"{restarts} ({age(last_restart)} ago)" if last_restart else str(restarts)
    ip = status.get("podIP") or "<none>"
    node = pod["spec"].get("nodeName") or "<none>"
    return [
        meta["name"],
        f"{ready}/{total}",
        reason,
        restarts_cell,
        age(meta.get("creationTimestamp")),
        ip,
        node,
        "<none>",
        "<none>",
    ]


# ------------------------------------------------------------------ nodes
_NODE_COLUMNS = [
    _NAME,
    _column("Status", "The status of the node"),
    _column("Roles", "The roles of the node"),
    _column("Age", "CreationTimestamp is a timestamp representing the server time when this object was created."),
    _column("Version", "Kubelet Version reported by the node."),
    _column("Internal-IP", "List of internal IPs in the cluster.", 1),
    _column("External-IP", "List of external IPs in the cluster.", 1),
    _column("OS-Image", "OS Image reported by the node from /etc/os-release (e.g. Debian GNU/Linux 7 (wheezy)).", 1),
    _column("Kernel-Version", "Kernel Version reported by the node from 'uname -r' (e.g. 3.16.0-0.bpo.4-amd64).", 1),
    _column(
        "Container-Runtime",
        "Container Runtime Version reported by the node through runtime remote API (e.g. containerd://1.4.2).",
        1,
    ),
]


def _node_cells(node: dict) -> list[Any]:
    status, meta = node.get("status") or {}, node["metadata"]
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    state = "Ready" if ready and ready.get("status") == "True" else "NotReady" if ready else "Unknown"
    if (node.get("spec") or {}).get("unschedulable"):
        state += ",SchedulingDisabled"
    prefix = "node-role.kubernetes.io/"
    roles = sorted(k[len(prefix) :] for k in meta.get("labels") or {} if k.startswith(prefix))

    def addresses(kind: str) -> str:
        return ",".join(a["address"] for a in status.get("addresses") or [] if a.get("type") == kind) or "<none>"

    info = status.get("nodeInfo") or {}
    return [
        meta["name"],
        state,
        ",".join(roles) or "<none>",
        age(meta.get("creationTimestamp")),
        info.get("kubeletVersion", ""),
        addresses("InternalIP"),
        addresses("ExternalIP"),
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


# ------------------------------------------------------------------ events
_EVENT_COLUMNS = [
    _column("Last Seen", "The last time this event was seen."),
    _column("Type", "The type of the event (Normal, Warning)."),
    _column("Reason", "The reason for the event."),
    _column("Object", "The object the event is about."),
    _column("Subobject", "The field of the object the event is about.", 1),
    _column("Source", "The component that reported the event.", 1),
    _column("Message", "A human-readable description of the event."),
    _column("First Seen", "The first time this event was seen.", 1),
    _column("Count", "How many times this event was seen.", 1, "integer"),
    _column("Name", "The event's name.", 1),
]


def _event_cells(event: dict) -> list[Any]:
    involved = event.get("involvedObject") or {}
    source = event.get("source") or {}
    return [
        age(event.get("lastTimestamp")),
        event.get("type", ""),
        event.get("reason", ""),
        f"{(involved.get('kind') or '').lower()}/{involved.get('name', '')}",
        involved.get("fieldPath", ""),
        ", ".join(v for v in (source.get("component"), source.get("host")) if v),
        event.get("message", ""),
        age(event.get("firstTimestamp")),
        event.get("count", 1),
        event["metadata"]["name"],
    ]

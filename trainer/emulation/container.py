"""A container's start, for the emulated kubelet (``trainer.emulation.operator``).

``python -m trainer.emulation.container SPEC_JSON`` joins the pod's network namespace (one per
job: the job's pods reach each other on loopback addresses) and its sandbox's mount namespace
(where the pod's ``medium: Memory`` emptyDirs are mounted, so that they outlive the container),
enters a mount namespace of its own (a copy of the sandbox's) and a UTS namespace, bind-mounts
the pod's volumes where the container expects them, puts the pod's ``/etc/hosts`` in place (the
job's service names, as cluster DNS would resolve them), sets the hostname to the pod's name, and
then execs the container's command: the process the kubelet watches is the command itself. Needs
root.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def main(spec: dict) -> None:
    """Set the container's namespaces and mounts up, then exec its command (never returns)."""
    for path, kind, what in (
        (spec["netns"], _CLONE_NEWNET, "the job's network"),
        (spec["sandbox"], _CLONE_NEWNS, "the pod's sandbox"),
    ):
        fd = os.open(path, os.O_RDONLY)
        _check(_libc.setns(fd, kind), f"setns ({what})")
        os.close(fd)
    _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWUTS), "unshare (mount, uts)")
    # To the kubelet, which kills every process in this namespace when the container ends.
    ns = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    with socket.socket(fileno=spec["namespace_fd"]) as kubelet:
        socket.send_fds(kubelet, [b"mnt"], [ns])
    os.close(ns)
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here leaks to the sandbox or the machine
    for m in spec["mounts"]:
        os.makedirs(m["target"], exist_ok=True)
        _mount(m["source"], m["target"], None, _MS_BIND | _MS_REC)
        if m.get("readOnly"):
            _mount("none", m["target"], None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
    _mount(spec["hosts"], "/etc/hosts", None, _MS_BIND)
    name = spec["hostname"].encode()
    _check(_libc.sethostname(name, len(name)), "sethostname")
    os.chdir(spec["cwd"])
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except OSError as e:  # what a container runtime reports: the container could not start
        print(f"emulated container runtime: {e}", file=sys.stderr)
        sys.exit(128)

"""A snapshot packed into one byte buffer: the local tier's format.

One tensor instead of a hundred is what makes a small model's snapshot cheap: ``torch.save`` pays
per tensor (a record each), and so does a replica's exchange (a send each). The buffer is reused
from snapshot to snapshot, and the walk over the state (:func:`plan`) is apart from the copy
(:func:`fill`), which the local tier makes beside the next step.
"""

import math
from dataclasses import dataclass

import torch

ALIGN = 64
"""Byte alignment of each tensor in a packed snapshot (any dtype's view of it is aligned)."""


@dataclass(slots=True)
class Plan:
    """How :func:`fill` packs a tree (nested dicts and lists of tensors and plain values)."""

    skeleton: object
    """The tree with None for each tensor."""
    layout: list[tuple]
    """Each tensor's place in the tree, dtype, shape and byte offset."""
    tensors: list[torch.Tensor]
    """The tensors, in the layout's order."""
    nbytes: int


def plan(tree: object) -> Plan:
    """How to pack ``tree``: a walk over it, no copy."""
    tensors: list[torch.Tensor] = []
    layout: list[tuple] = []
    offset = 0

    def hollow(node: object, path: tuple) -> object:
        nonlocal offset
        if isinstance(node, dict):
            return {k: hollow(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [hollow(v, (*path, i)) for i, v in enumerate(node)]
        if not isinstance(node, torch.Tensor):
            return node  # plain values: immutable leaves (the dicts and lists around them are made here)
        tensors.append(node)
        layout.append((path, node.dtype, tuple(node.shape), offset))
        offset += -(-node.numel() * node.dtype.itemsize // ALIGN) * ALIGN  # rounded up
        return None

    skeleton = hollow(tree, ())
    return Plan(skeleton, layout, tensors, offset)


def fill(planned: Plan, buffers: dict) -> dict:
    """The packed snapshot: ``skeleton``, ``layout`` and ``data``, every tensor copied into one
    byte buffer reused from save to save (``buffers``: it and its views, made again when the
    layout changes).
    """
    if buffers.get("layout") != planned.layout:  # the views are made with the buffer, not at every snapshot
        # zeroed, the alignment gaps too: a snapshot's bytes are its state's alone
        data = torch.zeros(planned.nbytes, dtype=torch.uint8)
        buffers.update(layout=planned.layout, data=data, views=views(data, planned.layout))
    for tensor, view in zip(planned.tensors, buffers["views"], strict=True):
        view.copy_(tensor)
    return {"skeleton": planned.skeleton, "layout": planned.layout, "data": buffers["data"]}


def pack(tree: object, buffers: dict) -> dict:
    """``tree`` as one snapshot: :func:`plan`, then :func:`fill`."""
    return fill(plan(tree), buffers)


def views(data: torch.Tensor, layout: list[tuple]) -> list[torch.Tensor]:
    """Each tensor of a packed snapshot, as a view of its bytes in ``data``."""
    out = []
    for _, dtype, shape, offset in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(data[offset : offset + nbytes].view(dtype).view(shape))
    return out


def unpack(snapshot: dict) -> dict:
    """The tree that :func:`pack` packed, each tensor a copy of its bytes in the snapshot's
    ``data`` (not a view: ``torch.set_rng_state`` reads a tensor's storage from its start).
    """
    tree = snapshot["skeleton"]
    for (path, *_), view in zip(snapshot["layout"], views(snapshot["data"], snapshot["layout"]), strict=True):
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = view.clone()
    return tree

"""Meshes cut from a group's :class:`~dhp.layout.ParallelLayout`, and the named-axis helpers the
strategies share.

A module's mesh has axes in the order dp, fsdp, sp, tp, and only the axes with degree > 1 (plus at
least one axis), so every strategy asks for its axis by name and treats a missing axis as degree 1.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dhp.errors import PlanError
from dhp.layout import MESH_AXES, ParallelLayout

AXES = MESH_AXES  # the mesh order (dhp.layout)


def build_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """The group's DeviceMesh over its whole default world, with ``layout.mesh()``'s axes (a collective:
    every rank of the group calls it; creates one process group per axis)."""
    shape = layout.mesh()
    return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def inner_group(mesh: DeviceMesh, layout: ParallelLayout, names: tuple[str, ...]) -> dist.ProcessGroup | None:
    """The process group of the one axis among ``names`` with degree > 1 (None: all are 1), e.g. the
    other ranks of a data replica (``("sp", "tp")``) or of a TP group."""
    name = layout.inner_axis(names)
    return None if name is None else mesh[name].get_group()


def axis(mesh: DeviceMesh, name: str) -> DeviceMesh | None:
    """The 1-D sub-mesh of axis ``name``, or None when the mesh has no such axis (degree 1)."""
    names = mesh.mesh_dim_names or ()
    if name not in names:
        return None
    sub = mesh[name]
    return sub if sub.size() > 1 else None


def axis_size(mesh: DeviceMesh, name: str) -> int:
    """Degree of axis ``name`` in ``mesh`` (1 when the axis is absent)."""
    sub = axis(mesh, name)
    return 1 if sub is None else sub.size()


def axes(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh | None:
    """The sub-mesh spanned by those of ``names`` that are present with degree > 1, or None."""
    present = tuple(n for n in names if axis(mesh, n) is not None)
    if not present:
        return None
    return mesh[present] if len(present) > 1 else mesh[present[0]]


def group_world(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group spanning every rank of ``mesh`` (the group's own default world).

    Raises PlanError when the mesh does not cover the whole default world: dhp gives each module group
    its own world, so a partial mesh means the caller built the mesh wrong.
    """
    if mesh.size() != dist.get_world_size():
        raise PlanError(
            f"mesh {mesh.mesh_dim_names} has {mesh.size()} ranks but the default world has "
            f"{dist.get_world_size()}; build the module mesh over the group's whole world."
        )
    return dist.group.WORLD

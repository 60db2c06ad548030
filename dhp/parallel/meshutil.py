"""Mesh helpers shared by the strategies: find a named axis of a group's DeviceMesh.

A module's mesh has axes in the order dp, fsdp, sp, tp, and only the axes with degree > 1 (plus at
least one axis), so every strategy asks for its axis by name and treats a missing axis as degree 1.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dhp.config.constants import PARALLEL_AXES
from dhp.errors import PlanError

AXES = PARALLEL_AXES  # the mesh order, from dhp.config.constants (see dhp.layout.RankLayout)


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

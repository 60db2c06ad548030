"""The planner: pure functions from a RunConfig to a Plan (no Ray, no process groups, no GPU).

``dhp.plan.reserve`` (Ray placement-group reservation) is deliberately not imported here, so
importing the planner never imports Ray.
"""

from dhp.plan.compile import compile_plan
from dhp.plan.render import render_plan
from dhp.plan.types import DeviceUsage, GroupPlan, MemoryEstimate, Plan, RankPlan, Route

__all__ = [
    "DeviceUsage",
    "GroupPlan",
    "MemoryEstimate",
    "Plan",
    "RankPlan",
    "Route",
    "compile_plan",
    "render_plan",
]

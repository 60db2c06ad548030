"""The planner's ZeRO-1 axes and the optimizer's must agree, or the memory estimate lies."""

import pytest

from dhp.parallel.optim import ZERO1_AXES as OPTIM_AXES
from dhp.plan.memory import ZERO1_AXES as PLAN_AXES

pytestmark = pytest.mark.unit


def test_zero1_axes_agree() -> None:
    assert PLAN_AXES == OPTIM_AXES == ("dp", "sp")

"""Suite-wide settings. Plans use the built-in cluster numbers, never this machine's probe or its
profile cache (dhp.machine): a test's plan must not depend on the box or on earlier runs. Set in
the environment, so the CLI processes tests start inherit it."""

from __future__ import annotations

import os

os.environ.setdefault("DHP_MACHINE_PROFILE", "off")

"""JSON round trip of ``random.Random`` state, so seeded plug-ins resume their exact sequence."""

from __future__ import annotations

import random
from typing import Any


def rng_to_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_state(state: list[Any]) -> random.Random:
    rng = random.Random()
    rng.setstate((state[0], tuple(state[1]), state[2]))
    return rng

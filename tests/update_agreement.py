"""How far two trainers' updates of the same weights differ (the same batch on another device or
backend)."""

from __future__ import annotations


def update_disagreement(start: dict, a: dict, b: dict) -> float:
    """||(b - start) - (a - start)|| / ||a - start|| over all tensors: how far two updates of the same
    weights differ, relative to the update. Not the largest entry: Adam divides each gradient by its
    own magnitude, so an entry whose gradient is ~0 moves by a sign that summation order decides."""
    diff = sum(float((b[k].double() - a[k].double()).square().sum()) for k in a)
    move = sum(float((a[k].double() - start[k].double()).square().sum()) for k in a)
    assert move > 0  # it trained
    print(f"update disagreement {(diff / move) ** 0.5:.2e}, largest entry "
          f"{max((a[k] - b[k]).abs().max().item() for k in a):.2e}")
    return (diff / move) ** 0.5

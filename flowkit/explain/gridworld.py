"""The bundled toy task: a scripted agent walking to a goal on a grid, explained from its last steps.

Each record holds the agent's last four steps (relative goal offset, action) with the final action
masked; that action is the decision to explain. The scripted policy moves along the axis with the
larger gap to the goal (ties → x), so the decision is inferable from the context, and a good
explanation names the gap that decides it. Reference explanations come in three kinds — informative,
filler and misleading — so that an LLM fine-tuned on them starts imperfect and rewards can improve it.
Every record also carries a ``preferred`` explanation (the informative one, as the paper's preferred
explanations are written knowing the true decision) for the SFT start (seed 000 §4, App. F).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DECISIONS = ("north", "south", "east", "west")
MOVES = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
HISTORY = 4


@dataclass(frozen=True)
class Step:
    dx: int  # goal x minus agent x
    dy: int  # goal y minus agent y
    action: str


def scripted_action(dx: int, dy: int) -> str:
    """Move along the axis with the larger gap to the goal; ties go along x."""
    if abs(dx) >= abs(dy) and dx != 0:
        return "east" if dx > 0 else "west"
    return "north" if dy > 0 else "south"


def rollout(rng: random.Random, size: int) -> list[Step]:
    """One episode from a random start to a random goal at Manhattan distance ≥ HISTORY + 1."""
    while True:
        ax, ay, gx, gy = (rng.randrange(size) for _ in range(4))
        if abs(gx - ax) + abs(gy - ay) >= HISTORY + 1:
            break
    steps = []
    while (ax, ay) != (gx, gy):
        action = scripted_action(gx - ax, gy - ay)
        steps.append(Step(gx - ax, gy - ay, action))
        mx, my = MOVES[action]
        ax, ay = ax + mx, ay + my
    return steps


def render_context(steps: list[Step]) -> str:
    """``d=+3,+2 a=east; ... d=+1,+1 a=?`` — the last action is masked."""
    parts = [f"d={s.dx:+d},{s.dy:+d} a={s.action}" for s in steps[:-1]]
    last = steps[-1]
    parts.append(f"d={last.dx:+d},{last.dy:+d} a=?")
    return "; ".join(parts)


def _gap_sentence(dx: int, dy: int) -> str:
    if abs(dx) > abs(dy):
        return "x gap is larger."
    if abs(dy) > abs(dx):
        return "y gap is larger."
    return "gaps are equal."


def _offset_sentence(dx: int, dy: int) -> str:
    ew = f"{abs(dx)} {'east' if dx >= 0 else 'west'}"
    ns = f"{abs(dy)} {'north' if dy >= 0 else 'south'}"
    return f"goal is {ew}, {ns}."


def _misleading_offset(step: Step) -> tuple[int, int]:
    """A goal offset mirrored on the deciding axis, so sentences about it point at a wrong action."""
    if step.action in ("east", "west"):
        return -step.dx, step.dy
    return step.dx, -step.dy


def explanation(step: Step, kind: str, rng: random.Random) -> str:
    """A reference explanation of ``kind`` informative / filler / misleading (decision never named)."""
    dist = (step.dx**2 + step.dy**2) ** 0.5
    filler = [f"dist is {dist:.1f}.", "it is not at the goal.", "it moved before."]
    if kind == "informative":
        return " ".join([_offset_sentence(step.dx, step.dy), _gap_sentence(step.dx, step.dy)])
    if kind == "filler":
        return " ".join(rng.sample(filler, 2))
    if kind == "misleading":
        wrong_dx, wrong_dy = _misleading_offset(step)
        return " ".join([_offset_sentence(wrong_dx, wrong_dy), _gap_sentence(wrong_dx, wrong_dy)])
    raise ValueError(f"unknown explanation kind {kind!r}")


def implied_decision(step: Step, kind: str) -> str | None:
    """The decision a reader would infer from an explanation of ``kind`` (None: nothing to infer)."""
    if kind == "informative":
        return step.action
    if kind == "misleading":
        return scripted_action(*_misleading_offset(step))
    return None


def make_records(num: int, seed: int, size: int = 6,
                 kinds: tuple[float, float, float] = (0.5, 0.25, 0.25)) -> list[dict]:
    """``num`` records ``{context, decisions, decision, explanation, kind, implied, preferred}`` from fresh
    episodes (``preferred`` draws nothing from ``rng``, so the other fields do not depend on it)."""
    rng = random.Random(seed)
    records = []
    while len(records) < num:
        steps = rollout(rng, size)
        end = rng.randrange(HISTORY, len(steps) + 1)
        window = steps[end - HISTORY:end]
        last = window[-1]
        kind = rng.choices(("informative", "filler", "misleading"), weights=kinds)[0]
        records.append({
            "context": render_context(window),
            "decisions": list(DECISIONS),
            "decision": last.action,
            "explanation": explanation(last, kind, rng),
            "kind": kind,
            "implied": implied_decision(last, kind),
            "preferred": explanation(last, "informative", rng),
        })
    return records

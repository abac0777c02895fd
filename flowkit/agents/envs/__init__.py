"""The bundled environments; importing this package registers them (:data:`flowkit.agents.environment.ENVIRONMENTS`).

- ``calculator_math`` (:mod:`.calculator_math`): math problems with a ``calculate`` tool, graded by the math grader.
- ``long_addition`` (:mod:`.long_addition`): the long-addition task with an ``add`` tool called per column.
- ``guess_number`` (:mod:`.guess_number`): find a hidden number from "higher" / "lower" answers.
"""

from flowkit.agents.envs import calculator_math, guess_number, long_addition

__all__ = ["calculator_math", "guess_number", "long_addition"]

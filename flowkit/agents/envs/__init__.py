"""The bundled environments; importing this package registers them (:data:`flowkit.agents.environment.ENVIRONMENTS`).

- ``long_addition`` (:mod:`.long_addition`): the long-addition task with an ``add`` tool called per column.
- ``guess_number`` (:mod:`.guess_number`): find a hidden number from "higher" / "lower" answers.
"""

from flowkit.agents.envs import guess_number, long_addition

__all__ = ["guess_number", "long_addition"]

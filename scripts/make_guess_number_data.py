"""Write the bundled ``guess_number`` records, ``flowkit/assets/guess_number/{train,val,test}.jsonl``: the games of
:data:`flowkit.agents.evaluate.GUESS_SPLITS` (the draws ``scripts/make_tiny_guesser.py`` trains and measures on), as
data records a :class:`~flowkit.modules.RolloutDataModule` reads with ``record_fields: [secret, low, high,
max_guesses]``: ``prompt`` the game's opening line (the environment writes its own; the data module checks this one
fits the policy's context) and ``answer`` the secret.

Run from the repository root: ``python scripts/make_guess_number_data.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowkit.agents.envs.guess_number import GuessNumber
from flowkit.agents.evaluate import GUESS_SPLITS, guess_split

OUT = Path(__file__).resolve().parent.parent / "flowkit" / "assets" / "guess_number"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for split in GUESS_SPLITS:
        with open(OUT / f"{split}.jsonl", "w") as file:
            for game in guess_split(split):
                opening = GuessNumber().reset(game)[0]["content"]
                file.write(json.dumps({"prompt": opening, "answer": str(game["secret"]), **game}) + "\n")
        print(f"wrote {OUT / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()

"""Child process of :mod:`flowkit.data.grader`: answers ``{"pred", "ref"}`` JSON lines with ``1``/``0``.

Run as a script (not imported), so it loads only math-verify. The parent enforces the time limit by
killing this process, which also stops work stuck inside C code where math-verify's own SIGALRM
timeout cannot reach; math-verify's timeouts are therefore disabled here.
"""

import json
import logging
import resource
import sys

from math_verify import parse, verify

MEMORY_LIMIT_BYTES = 4 << 30  # a runaway expansion fails with MemoryError instead of swapping the host


def equivalent(pred: str, ref: str) -> bool:
    gold = parse("\\boxed{" + ref + "}", parsing_timeout=None)
    answer = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)


def main() -> None:
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = equivalent(request["pred"], request["ref"])
        except Exception:  # math-verify raises many types on malformed input; any failure is "not equal"
            result = False
        print("1" if result else "0", flush=True)


if __name__ == "__main__":
    main()

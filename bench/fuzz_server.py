"""Fuzz the loopback server for longer than CI does.

    python bench/fuzz_server.py [--quick] [--requests 10000] [--seed 13]

The same hostile requests as tests/server/test_fuzz.py (malformed and deeply nested JSON, invalid
UTF-8, wrong types, unknown roles, broken tool calls, huge bodies, other sessions' ids and keys,
unknown routes) against a real engine on the tiny model. Prints the requests tried, the status
codes seen and every broken promise (a 5xx, an error not in the wire's shape, a refused request
that changed a session, another session's content or key in a reply); exits 1 if there was any.
`--quick` sends 100 requests: a smoke run of seconds.
"""

import argparse
import importlib.util
import sys
import time
from collections import Counter
from pathlib import Path

from transformers import AutoTokenizer

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.models.tiny import tiny_model_path
from workbench.server.loopback import LoopbackServer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 requests, for a CI smoke run")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    budget = 100 if args.quick else args.requests
    spec = importlib.util.spec_from_file_location(
        "test_fuzz", Path(__file__).parent.parent / "tests/server/test_fuzz.py"
    )
    fuzzing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzzing)
    path = str(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    server = LoopbackServer(
        TorchEngine(path),
        tokenizer,
        SamplingParams(max_tokens=4, stop_token_ids=(tokenizer.eos_token_id,)),
        max_total_tokens=256,
    )
    victim, target = fuzzing.victim_and_target(server)
    statuses = Counter()
    problems = []
    started = time.perf_counter()
    fuzzing.fuzz(server, victim, target, budget, statuses, problems, seed=args.seed)
    seconds = time.perf_counter() - started
    server.stop()
    tried = sum(statuses.values())
    print(f"requests tried: {tried} in {seconds:.1f} s ({tried / seconds:.0f}/s)")
    print(
        "status codes:   "
        + ", ".join(f"{code}: {count}" for code, count in sorted(statuses.items()))
    )
    print(f"crashes (5xx) and broken promises: {len(problems)}")
    for problem in problems[:20]:
        print("  " + problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

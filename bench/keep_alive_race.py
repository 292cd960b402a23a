"""Clients reusing a kept-alive connection after an idle gap: does the server's idle close race them?

A server on one zoo model; `--sessions` `requests` sessions (a pool with no expiry of its own,
as schemathesis uses) each send `GET /models`, wait `--gap-s` (plus or minus 30 ms), and send
again, for `--seconds`. With a gap at the server's keep-alive idle limit, a request can reach a
connection the server is closing, and the client gets a reset instead of an answer.

    python -m bench.keep_alive_race [--gap-s 5.0] [--sessions 16] [--seconds 90]

prints the requests sent and the errors by kind.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections import Counter
from pathlib import Path

import requests

from tests.live_server import OptionValue, live_server

MODEL = Path(__file__).resolve().parents[1] / "models" / "zoo-rope"
JITTER_S = 0.03


def _session(url: str, gap_s: float, until: float, outcomes: list[str]) -> None:
    with requests.Session() as session:
        while time.monotonic() < until:
            try:
                session.get(url, timeout=30).raise_for_status()
                outcomes.append("ok")
            except requests.RequestException as error:
                outcomes.append(f"{type(error).__name__}: {str(error)[:100]}")
            time.sleep(gap_s + random.uniform(-JITTER_S, JITTER_S))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gap-s", type=float, default=5.0)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=90.0)
    args = parser.parse_args(argv)
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "max_context": 256,
        "engine_mode": "thread",
        "no_warmup": True,
    }
    with live_server([MODEL], options=options, env={"OMP_NUM_THREADS": "1"}) as server:
        outcomes: list[str] = []
        until = time.monotonic() + args.seconds
        sessions = [
            threading.Thread(target=_session, args=(server.url("/models"), args.gap_s, until, outcomes))
            for _ in range(args.sessions)
        ]
        for thread in sessions:
            thread.start()
        for thread in sessions:
            thread.join()
    errors = Counter(outcome for outcome in outcomes if outcome != "ok")
    print(f"gap {args.gap_s} s: {len(outcomes)} requests, {sum(errors.values())} errors")
    for error, count in errors.most_common():
        print(f"  {count} x {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

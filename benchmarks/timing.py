"""Timing helpers the side-by-side benchmarks share (``from timing import ...`` when a script in this
directory runs): the clock, one timed call, runs interleaved so that drift on a shared machine hits
every side alike, and a rate at the median."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # what every helper here reads; use_clock switches it


def use_clock(name: str) -> None:
    """``"wall"`` (the default) or ``"cpu"``: the process's CPU time, which other jobs on a shared
    machine disturb far less."""
    global clock
    clock = CLOCKS[name]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, result)`` of one call of ``fn`` on the chosen clock."""
    t = clock()
    out = fn()
    return clock() - t, out


def interleaved(runs: dict[str, Callable[[], float]], repeat: int) -> dict[str, list[float]]:
    """Call each of ``runs`` (name -> a function returning the seconds it measured) ``repeat`` times,
    in turn: name -> its ``repeat`` measurements."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            seconds[name].append(fn())
    return seconds


def rate(n: float, seconds: list[float]) -> float:
    """``n`` (tokens, steps) per second at the median of ``seconds``."""
    return n / statistics.median(seconds)


def write_results(result: dict, json_path: str | None, markdown_path: str | None, markdown: Callable[[dict], str]) -> None:
    """Write ``result`` as JSON and as ``markdown(result)`` where asked. Called after each measurement
    too, so that a run stopped by a time limit keeps what it measured."""
    import json

    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(markdown(result))

"""Engines stopped side by side, and started in the background while another test runs. A tensor-parallel engine's
start is mostly its rank processes' imports (one core, while rank 0 waits) and its stop mostly their exit: on a small
host either overlaps well with other work."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


def start_each(makers: list[Callable[[], T]], close: Callable[[T], None]) -> list[T]:
    """Each maker's result, made one after another (two rank groups starting at once lost a rank once, unexplained:
    starts are not overlapped); if one fails, those made are closed and its error raised."""
    made: list[T] = []
    try:
        for make in makers:
            made.append(make())
    except BaseException:
        close_together(made, close)
        raise
    return made


def close_together(things: list[T], close: Callable[[T], None]) -> None:
    if things:
        with ThreadPoolExecutor(len(things)) as pool:
            list(pool.map(close, things))


@contextlib.contextmanager
def llms_together(*makers: Callable[[], T]) -> Iterator[list[T]]:
    """Embedded LLMs (raypd.LLM) started, and shut down together when the block ends."""
    llms = start_each(list(makers), lambda llm: llm.shutdown())
    try:
        yield llms
    finally:
        close_together(llms, lambda llm: llm.shutdown())


class Prestarted:
    """Things made in the background, one at a time, in the order given (a parametrized test's cases, in the order
    they run): a test takes its own, waiting only for that one, while the next are made beside it. What no test
    took is closed by close()."""

    def __init__(self, makers: dict[str, Callable[[], T]], close: Callable[[T], None]):
        self._close = close
        self._pool = ThreadPoolExecutor(1)
        self._futures = {key: self._pool.submit(make) for key, make in makers.items()}

    def take(self, key: str) -> T:
        return self._futures.pop(key).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        futures, self._futures = self._futures, {}
        close_together([f.result() for f in futures.values() if f.exception() is None], self._close)


def selected(request, test, param: str, values: list[str]) -> list[str]:
    """The values of param that this session's selected cases of test (a function) take, in the order they run
    (all of values where none is selected): what a Prestarted fixture needs to make, and no more."""
    chosen = {item.callspec.params[param] for item in request.session.items
              if getattr(item, "function", None) is test and param in getattr(item, "callspec", None).params}
    return [v for v in values if v in chosen] or values

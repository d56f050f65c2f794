"""The one worker inbox of every backend: callers hand requests in, the backend's thread takes them between steps.

An idle worker waits for a burst (a LangChain ``batch``, ``asyncio.gather``, clients of a server) so that it
starts together: until no request came for ``window`` seconds (at most 50 windows; once a second request came,
``burst_window`` instead, since a server's requests reach it some milliseconds apart), and for the rest of a
batch announced with :meth:`Inbox.expect`, at most ``EXPECT_AT_MOST`` after the announcement; once all of an
announced batch is in, at once (nothing is known to be on its way). A busy worker takes what is there and goes
on. Closing hands back what was never taken, for the caller to end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

logger = logging.getLogger(__name__)

EXPECT_AT_MOST = 0.1
"""Seconds the idle driver waits at most for the rest of an announced batch (a member may fail before it arrives)."""


class WorkerTask:
    """Work a backend's own thread runs between steps (a decision's label scoring), handed in beside requests.

    Its :attr:`future` gets the function's result or exception. A backend that closes before running it ends it as
    it ends a request (:func:`~.base.fail_all` calls :meth:`emit`): the future fails with the error, or with
    :class:`~exllama_integrations.errors.RuntimeClosedError`.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()

    def run(self) -> None:
        """Run the function on the calling (the backend's) thread; its outcome goes to :attr:`future`."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except BaseException as e:  # noqa: BLE001 - the caller gets it; the backend's thread goes on
            self.future.set_exception(e)
        else:
            self.future.set_result(result)

    def emit(self, step: Any) -> None:
        """Ended without running (the backend closed or failed)."""
        from ..errors import RuntimeClosedError

        error = getattr(step, "error", None) or RuntimeClosedError("the backend closed before this work ran.")
        try:
            self.future.set_exception(error)
        except InvalidStateError:  # already done or cancelled
            pass


class Inbox:
    """The requests handed to the driver, and when an idle driver takes them (so that a burst prefills together).

    Callers :meth:`put` requests (and :meth:`expect` the rest of a batch); the driver takes them
    (:meth:`take`) between steps. From idle it waits until no request came for ``window`` seconds (at most
    50 windows), and for the rest of an announced batch, at most ``EXPECT_AT_MOST`` after the announcement.
    """

    def __init__(self, window: float, burst_window: float | None = None) -> None:
        """An inbox whose idle taker waits for ``window`` seconds of quiet, ``burst_window`` in a burst.

        ``burst_window``: the quiet waited for once a second request came while the taker waited (a burst whose
        members arrive some ms apart, as a server's requests do); None: ``window``.
        """
        self._window = window
        self._burst = max(window, burst_window or 0.0)
        self._cv = threading.Condition()
        self._items: deque[Any] = deque()
        self._closing = False
        self._arrived = 0.0
        self._expected, self._expected_until = 0, 0.0
        self._complete = False  # every member of an announced batch is in: the idle taker starts at once

    def put(self, requests: Sequence[Any]) -> bool:
        """Hand requests in; False (nothing taken) once closing."""
        with self._cv:
            if self._closing:
                return False
            self._items.extend(requests)
            self._arrived = time.monotonic()
            if self._expected:
                self._expected = max(0, self._expected - len(requests))
                self._complete = not self._expected
            self._cv.notify()
            return True

    def expect(self, n: int) -> None:
        """``n`` requests of one batch are on their way."""
        with self._cv:
            self._expected += n
            self._expected_until = time.monotonic() + EXPECT_AT_MOST

    def take(self, idle: bool) -> list[Any] | None:
        """The requests handed in since the last take (None once closing); ``idle``: wait for some, a burst's worth."""
        with self._cv:
            while not self._closing and not self._items and idle:
                self._cv.wait()
            announced = self._expected
            if idle and self._window:
                woke = time.monotonic()
                quiet, quiet_deadline = self._window, woke + 50 * self._window
                while not self._closing and not self._complete:  # an announced batch all here: at once
                    now = time.monotonic()
                    if quiet < self._burst and len(self._items) > 1:  # a burst is arriving: wait out its gaps
                        quiet, quiet_deadline = self._burst, woke + 50 * self._burst
                    quiet_left = self._arrived + quiet - now
                    if self._expected and now < self._expected_until:
                        timeout = self._expected_until - now  # the rest of an announced batch
                    elif quiet_left > 0 and now < quiet_deadline:
                        timeout = min(quiet_left, quiet_deadline - now)
                    else:
                        break
                    self._cv.wait(timeout)
                if announced:
                    waited = time.monotonic() - woke
                    logger.debug(
                        "exllamav3: %d requests start together after %.1f ms waiting for an announced batch "
                        "(%d of it never came)",
                        len(self._items),
                        1000 * waited,
                        self._expected,
                        extra={"inbox_wait_s": waited, "inbox_missing": self._expected},
                    )
            if self._expected and time.monotonic() >= self._expected_until:
                self._expected = 0  # members that never came (failed before they were handed in)
            if self._closing:
                return None
            incoming = list(self._items)
            self._items.clear()
            self._complete = False
            return incoming

    def close(self) -> list[Any]:
        """Take no more, wake the driver; the requests still waiting (the caller ends them)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            pending = list(self._items)
            self._items.clear()
            return pending

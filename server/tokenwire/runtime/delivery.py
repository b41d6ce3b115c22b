"""Delivery: a session's events from its outbox, through its event log, to
the socket attached to it, bufferedAmount-style.

`buffered_amount` is the socket's write buffer plus the outbox. Above the
high-water mark deltas are merged; above the hard cap (or when the writer
has been blocked for `stall_s`) the owner pauses its generations, freeing
their engine slots, and the socket stops reading from the client; once the
client has read it all they resume. A client blocked for
`slow_client_timeout_s` is closed with 4008; during a resume's replay too.

While the client keeps up (its socket buffer empty, nothing queued) and the
log is not durable, events skip the outbox and the writer task: they are
framed and written by the task that produced them, one write per batch.
With a durable log (Redis) every event is flushed to the log before it
reaches the socket, and logging goes on while no socket is attached.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedError
from websockets.protocol import State

from ..core.outbox import Outbox
from ..storage.eventlog import EventLog, Fenced, Frame, LogState
from ..wire import Dialect
from ..wire.close_codes import CLOSE_SLOW_CLIENT
from .flag import Flag
from .ws import (
    close_or_abort,
    fell_behind_the_log,
    set_sndbuf,
    wait_buffer_below,
    write_messages,
)

_OPEN = State.OPEN  # per token: a lookup through the enum class takes 9x as long


def writable_now(ws: ServerConnection) -> bool:
    """Open, with nothing waiting in its write buffer: a frame written now
    goes out at once, in order."""
    transport = ws.transport
    return not (
        transport is None
        or transport.get_write_buffer_size()
        or transport.is_closing()
        or ws.protocol.state is not _OPEN
    )


def frames_of(
    event: dict[str, Any], frame: Frame, logged_by: Dialect, dialect: Dialect
) -> list[Frame]:
    """What goes out for a logged event: its logged frame, or the frames of
    another socket's dialect that took over meanwhile."""
    if dialect.single_frame:
        return [frame if dialect is logged_by else dialect.encode(event)]
    return list(dialect.frames(event))


@dataclass(frozen=True, slots=True)
class Pace:
    """The backpressure settings (see config.ServerConfig)."""

    high_water: int
    hard_cap: int
    stall_s: float
    slow_client_timeout_s: float
    sndbuf: int = 0


class DeliveryOwner(Protocol):
    """What delivery asks of the runtime that owns the session."""

    def fall_behind(self, why: str) -> None:
        """The client is too far behind: pause its generations."""

    def caught_up(self) -> None:
        """The client read everything: resume what was paused."""

    def slow_client(self) -> None:
        """The client stopped reading for good: end what it owns."""

    def log_state(self, events: list[dict[str, Any]]) -> LogState:
        """What a durable log keeps beside these events."""
        ...

    def lost_ownership(self) -> Awaitable[None]:
        """Another instance took the session over."""
        ...


class Delivery:
    def __init__(
        self,
        owner: DeliveryOwner,
        log: EventLog,
        dialect: Dialect,
        pace: Pace,
        *,
        logged_seq: int = 0,
    ) -> None:
        self._owner = owner
        self.log = log
        self._durable = log.durable  # read per event on the fast path
        self.dialect = dialect
        self.pace = pace
        # The last seq logged, and the last one the attached socket was sent.
        self.logged_seq = logged_seq
        self.sent_seq = 0
        self.outbox = Outbox(first_seq=logged_seq + 1)
        self.ws: ServerConnection | None = None
        self.live = False  # the attached socket is past its replay
        self.paused = False  # the owner paused generations for this client
        self.closed_for: str | None = None  # why we closed the socket ourselves
        self.stopped = False  # the session ended or moved: log nothing more
        # The writer task runs only while there is work: idle, a socket has none.
        self._writer: asyncio.Task[None] | None = None
        self._writing = False  # between start_writer and stop_writer
        self._log_lock = asyncio.Lock()  # one durable batch at a time, in seq order
        self._wakeup = Flag()
        self.drained = Flag(True)  # set while below the hard cap
        self._stall_timer: asyncio.TimerHandle | None = None
        self._slow_timer: asyncio.TimerHandle | None = None
        self._closer: asyncio.Task[None] | None = None
        # Events sent by each path: straight from the producing task, or by the writer.
        self.sent_directly = 0
        self.sent_by_writer = 0

    @property
    def clocks_running(self) -> bool:
        """The stall or slow-client clock runs: the client is behind."""
        return self._stall_timer is not None or self._slow_timer is not None

    @property
    def buffered_amount(self) -> int:
        """Bytes waiting for the client: the socket's write buffer plus our queue."""
        transport = self.ws.transport if self.ws is not None else None
        sent = transport.get_write_buffer_size() if transport is not None else 0
        return sent + self.outbox.pending_bytes

    # -- the socket ------------------------------------------------------------

    def attach(self, ws: ServerConnection, dialect: Dialect) -> None:
        self.ws, self.dialect = ws, dialect
        if self.pace.sndbuf:
            set_sndbuf(ws, self.pace.sndbuf)

    async def replay(self, last_seq: int) -> int:
        """Resend what came after last_seq, then go live; returns how many."""
        assert self.ws is not None
        self.sent_seq = last_seq
        replayed = await self._send_logged(self.ws, paced=True)
        async with self._log_lock:  # a batch in Redis's hands now: it goes out first
            replayed += await self._send_logged(self.ws, paced=True)
            self.live = True
        return replayed

    async def _send_logged(self, ws: ServerConnection, *, paced: bool = False) -> int:
        """Send what the log holds after sent_seq (read until caught up: a durable
        log may be written meanwhile); returns how many events."""
        sent = 0
        while self.sent_seq < self.logged_seq:
            got = await self.log.read(self.sent_seq)
            frames = [(seq, f) for seq, f in got if seq > self.sent_seq]
            if not frames:
                break
            if frames[0][0] != self.sent_seq + 1:  # trimmed (MAXLEN) as a slow replay went on
                self.closed_for = "replay_gap"
                await fell_behind_the_log(ws, self.dialect, self.sent_seq, frames[0][0])
                raise ConnectionClosedError(None, None)
            for seq, frame in frames:
                if paced:
                    await self._paced(ws, list(self.dialect.from_logged(frame)))
                else:
                    for out in self.dialect.from_logged(frame):
                        await ws.send(out)
                self.sent_seq = seq
                sent += 1
        return sent

    async def _paced(self, ws: ServerConnection, out: list[Frame], replay: bool = True) -> None:
        """A write under the slow-client clocks (`ws.send`'s wait has none); the
        writer's run from falling behind to `_caught_up`, not per wait."""
        if ws.protocol.state is not _OPEN:
            raise ConnectionClosedError(None, None)  # closed (as slow) meanwhile
        write_messages(ws, out)
        if ws.transport.get_write_buffer_size() > self.pace.high_water:
            self._arm_clocks()
            await wait_buffer_below(ws, self.pace.high_water // 2)
            if replay:
                self._stop_clocks()  # it reads; the writer sees to a pause once live

    def go_live(self) -> None:
        """A new session's socket: nothing to replay."""
        self.sent_seq = self.logged_seq
        self.live = True

    async def detach(self) -> None:
        self.live = False
        self._stop_clocks()
        self.ws = None
        if self.log.durable:
            self._wake()  # what a dead socket (or a replay) paused goes on into the log
        else:
            # Nothing is written while detached: events wait in the outbox
            # (and pause generation at the hard cap).
            await self.stop_writer()

    async def close_socket(self, code: int, reason: str) -> None:
        if self.ws is not None:
            await close_or_abort(self.ws, code, reason)

    # -- events in ---------------------------------------------------------------

    def send(self, events: list[dict[str, Any]]) -> None:
        """Deliver the session's new events: at once if the client keeps up,
        else through the outbox and the writer task.

        At once means: no log to write first, nothing queued ahead, and a
        client that keeps up (the socket's buffer is empty). Run per token:
        `behind()` inlined."""
        ws = self.ws
        if (
            ws is not None
            and self.live
            and not (self._durable or self.paused or self.outbox.queue)
            and not (self._stall_timer or self._slow_timer)
            and self.drained._value  # is_set(), without the call
            and writable_now(ws)
        ):
            # The outbox is empty: what waits is in the socket's buffer.
            buffered = self._write_now(ws, events)
        else:
            self.outbox.extend(events)
            self._wake()
            buffered = self.buffered_amount
        if buffered > self.pace.high_water:
            # Only the writer task sees the client catch up and stops the
            # clocks; a direct write did not wake it.
            self._wake()
            if self.ws is not None:
                self._arm_clocks()
            if buffered > self.pace.hard_cap:
                self._fall_behind("hard_cap")

    def enqueue(self, event: dict[str, Any]) -> None:
        """An event that waits its turn behind everything queued, for the writer."""
        self.outbox.push(event)
        self._wake()

    def send_first(self, event: dict[str, Any]) -> None:
        """An event that goes ahead of everything queued (session.resumed)."""
        self.outbox.push_front(event)
        self._wake()

    def _write_now(self, ws: ServerConnection, events: list[dict[str, Any]]) -> int:
        """Number, log, frame and write `events` in one go, without a task
        switch per event; returns what the socket's buffer holds after the write.

        What `ws.send` does for one frame, minus its wait for the buffer to
        drain (the buffer is empty, and the caller checks what it holds now).
        Order holds because `ws.send` too writes its frame before it first
        awaits, and we never send fragmented messages. Per token: `_log_frame`
        inlined."""
        dialect, outbox = self.dialect, self.outbox
        encode, append = dialect.encode, self.log.append
        messages: list[Frame] = []
        for event in events:
            seq = event["seq"] = outbox.next_seq  # `outbox.number`, inlined
            outbox.next_seq = seq + 1
            frame = encode(event)
            append(seq, event, frame)
            self.logged_seq = self.sent_seq = seq
            if dialect.single_frame:
                messages.append(frame)
            else:
                messages.extend(dialect.frames(event))
        write_messages(ws, messages)
        self.sent_directly += len(events)
        return ws.transport.get_write_buffer_size()

    def _log_frame(self, event: dict[str, Any]) -> Frame:
        """Encode a numbered event and append it to the log."""
        frame = self.dialect.encode(event)
        self.log.append(event["seq"], event, frame)
        self.logged_seq = event["seq"]
        return frame

    # -- backpressure ------------------------------------------------------------

    def behind(self) -> bool:
        """The client fell behind, not yet seen to catch up (`_caught_up` ends this)."""
        return (
            self.paused
            or self._stall_timer is not None
            or self._slow_timer is not None
            or not self.drained.is_set()
        )

    def _arm_clocks(self) -> None:
        """The client is behind: from now on it has stall_s, then slow_client_timeout_s."""
        if self._stall_timer is None and self._slow_timer is None:
            loop = asyncio.get_running_loop()
            self._stall_timer = loop.call_later(self.pace.stall_s, self._on_stall)
            self._slow_timer = loop.call_later(
                self.pace.slow_client_timeout_s, self._on_slow_client
            )

    def _stop_clocks(self) -> None:
        for timer in (self._stall_timer, self._slow_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._slow_timer = None

    def _fall_behind(self, why: str) -> None:
        if self.drained.is_set():  # newly behind: compact once, not on every event
            self.drained.clear()
            self.outbox.compact()
        # Every time, though: a frame read just before may have started a generation.
        self._owner.fall_behind(why)

    def _on_stall(self) -> None:
        self._stall_timer = None
        self._fall_behind("stall")

    def _on_slow_client(self) -> None:
        self._slow_timer = None
        # Free what it holds now; the close frame may never be read.
        self.outbox.clear()
        self._owner.slow_client()
        self._stop_clocks()  # re-armed by the events that ended its responses; once is enough
        self.closed_for = "slow_client"
        self.close_soon(CLOSE_SLOW_CLIENT, "client is not reading")

    def close_soon(self, code: int, reason: str) -> None:
        """Close the attached socket in a task: the client may never answer."""
        if self.ws is not None and self._closer is None:
            self._closer = asyncio.create_task(close_or_abort(self.ws, code, reason))

    def _caught_up(self) -> None:
        """The writer emptied the queue and the socket accepted it all."""
        self._stop_clocks()
        self.drained.set()
        if self.paused:
            self.paused = False
            self._owner.caught_up()

    # -- the writer task ---------------------------------------------------------

    def start_writer(self) -> None:
        self._writing = True
        self._wake()  # events may have queued up meanwhile

    def _wake(self) -> None:
        self._wakeup.set()
        if self._writing and self._writer is None:
            self._writer = asyncio.create_task(self._write_loop())

    async def stop_writer(self) -> None:
        self._writing = False
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.cancel()
            task = asyncio.current_task()
            cancels = task.cancelling() if task is not None else 0
            try:
                await writer
            except asyncio.CancelledError:
                if task is not None and task.cancelling() > cancels:
                    raise  # the caller was cancelled meanwhile, not only the writer

    async def _write_loop(self) -> None:
        try:
            while self._wakeup.is_set():  # else it ends; `_wake` starts another
                self._wakeup.clear()
                try:
                    await self._write_queued()
                    ws = self.ws if self.live else None
                    if ws is None:  # no socket, or one still in its replay
                        if self.log.durable and self.ws is None and self.behind():
                            self._caught_up()  # the log took it all: generate on
                        continue
                    if self.behind():
                        # The queue is empty, but the socket may still hold what
                        # the client has not read: wait until it has.
                        await wait_buffer_below(ws, self.pace.high_water // 2)
                        if len(self.outbox):
                            self._wakeup.set()  # events queued meanwhile: send them first
                            continue
                        self._caught_up()
                except (ConnectionClosed, OSError):
                    self.live = False
                    self.drained.set()  # never leave the reader waiting on a dead socket
                    if not self.log.durable:
                        self._writing = False  # until a socket attaches again
                        return
                    self._wakeup.set()  # keep logging what is queued
        except Fenced:
            await self._owner.lost_ownership()
        finally:
            self.drained.set()
            if self._writer is asyncio.current_task():
                self._writer = None

    async def _write_queued(self) -> None:
        """Log what is queued, then send it to the socket if one is live."""
        while True:
            ws = self.ws if self.live else None
            if ws is None and not self.log.durable:
                return  # events wait in the outbox for a socket
            behind = ws is not None and self.buffered_amount > self.pace.high_water
            if self.log.durable:
                if not self.outbox:
                    return  # nothing to log: no shielded task just to learn so
                # Shielded: a batch once popped is always logged, even if the
                # writer is cancelled meanwhile (it then holds the lock until done).
                batch = await asyncio.shield(self._locked_log_batch(behind))
            else:
                # One event at a time: what queues meanwhile merges into the next.
                event = self.outbox.pop(merge=behind)
                batch = [] if event is None else [(event, self._log_frame(event))]
            if not batch:
                return
            if behind:
                self._arm_clocks()  # the send below may block on a slow reader
            await self._send_batch(batch)

    async def _send_batch(self, batch: list[tuple[dict[str, Any], Frame]]) -> None:
        """Send logged events (each with its logged frame) in one write, then
        wait while the client is behind. One by one, an event's frames (several
        in the OpenAI dialect) could be overtaken by a direct write meanwhile."""
        if (ws := self.ws if self.live else None) is None:
            return
        logged_by, messages = self.dialect, []
        for event, frame in batch:
            if event["seq"] > self.sent_seq:  # else the replay sent it already
                self.sent_seq, self.sent_by_writer = event["seq"], self.sent_by_writer + 1
                messages += frames_of(event, frame, logged_by, self.dialect)
        if messages:
            await self._paced(ws, messages, replay=False)

    async def _locked_log_batch(self, merge: bool) -> list[tuple[dict[str, Any], Frame]]:
        async with self._log_lock:
            if self.stopped:
                return []
            return await self.log_batch(merge)

    async def log_batch(self, merge: bool) -> list[tuple[dict[str, Any], Frame]]:
        """Pop everything queued, append it to the log and flush it."""
        events = []
        while (event := self.outbox.pop(merge=merge)) is not None:
            events.append(event)
        if not events:
            return []
        # Taken before any await, so they match the events exactly.
        batch = [(e, self._log_frame(e)) for e in events]
        await self.log.flush(self._owner.log_state(events))
        return batch

    async def hand_over(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Log the last events, then a final snapshot (taken after them), and
        give the live socket what it has not had (best effort)."""
        await self.stop_writer()
        fenced = False
        async with self._log_lock:
            try:
                await self.log_batch(merge=False)
                # Nothing pending now: this writes the snapshot alone.
                await self.log.flush(LogState(snapshot(), {}, 0))
            except Fenced:
                fenced = True  # what is not logged must not reach the client
            self.stopped = True
        if self.live and self.ws is not None and not fenced:
            # From the log: the writer may have been stopped mid-batch, with
            # events logged but not sent yet.
            with contextlib.suppress(Exception):
                await self._send_logged(self.ws)
        if self.live and self.ws is not None:
            # Let the socket take the last frames before the close.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(wait_buffer_below(self.ws, 0), 1)

    async def stop(self) -> None:
        """The session ended: nothing more goes anywhere."""
        self._stop_clocks()
        await self.stop_writer()
        self.stopped = True
        self.live = False  # nor to a socket still attached: send() takes no direct path
        self.outbox.clear()
        self.log.clear()

"""Publishes event batches over ZMQ exactly as vLLM's ZmqEventPublisher does, so a subscriber
written for vLLM needs no change:

- PUB socket, one multipart message per batch: (topic, 8-byte big-endian sequence number,
  msgpack payload); sequence numbers count from 0 without gaps.
- ROUTER replay socket (optional): a DEALER/REQ client sends (empty delimiter, 8-byte start
  sequence number) and gets back, for every buffered batch from there on, (empty, topic,
  sequence number, payload), then (empty, b"", -1 as 8 signed bytes, b"") to end.

The engine thread only queues batches; a thread of ours encodes and sends them (and answers
replays), so a slow subscriber never stalls a step (PUB drops past its high-water mark).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count

from jaxbatch.kv_events.config import KVEventsConfig
from jaxbatch.kv_events.events import EventBatch, encoder

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_SECONDS = 0.05
SHUTDOWN_SECONDS = 2.0
CLOSE_LINGER_MS = 500


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or a local transport is bound, anything else is dialled."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Replica r of a data-parallel engine publishes on the endpoint's port + r (vLLM's rule)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit():
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} for data-parallel rank "
                     f"{data_parallel_rank}")


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig):
        import zmq
        self._zmq = zmq
        self.data_parallel_rank = data_parallel_rank = config.data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self.num_published = 0
        # Made here, so a port in use fails the engine's start; used only by the thread after.
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {self.endpoint} / "
                             f"{self.replay_endpoint}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher",
                                        daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)

    def shutdown(self) -> None:
        """Sends what is queued (for up to a few seconds), then closes the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=SHUTDOWN_SECONDS)
        if self._thread.is_alive():
            logger.warning("KV event publisher: %d batches unsent at shutdown",
                           self._queue.qsize())
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        # The PUB socket lingers a moment, so the last batches still reach the subscribers.
        self._pub.close(linger=CLOSE_LINGER_MS)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the publisher thread ------------------------------------------------------------
    def _run(self) -> None:
        pack = encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except self._zmq.ZMQError:
                    logger.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = pack.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError:
                logger.exception("KV event batch %d not sent", seq)
                time.sleep(POLL_SECONDS)
            # Kept for replay even if the send failed: a subscriber can still fetch it.
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV event replay: a request of %d frames, not 3, ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

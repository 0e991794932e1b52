"""uvicorn's h11 protocol with a header-read deadline.

uvicorn times out only an idle keep-alive connection (--timeout-keep-alive, between requests);
a connection that is open but has not finished sending a request's headers is never closed,
and any byte resets nothing because no timer runs. 100 sockets sending one header byte a
second (slowloris) were held for good, and with a low file-descriptor limit they made /health
unreachable. Here a connection must complete each request's headers within `header_timeout`
seconds of opening (or of its previous response), else it is closed; the keep-alive and body
timeouts (guards.BodyLimit) cover the other waits.
"""
from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def guarded_protocol(header_timeout: float) -> type:
    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()      # a request has begun (or the next one) and its headers have not
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()       # the keep-alive timer (armed by uvicorn) takes over

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self):
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                                         b"Content-Length: 0\r\n\r\n")
                    self.transport.close()

    return GuardedH11Protocol

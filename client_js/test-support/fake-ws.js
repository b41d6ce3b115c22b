// A scripted stand-in for WebSocket, for unit tests of the client's own logic
// (reconnect, resume, backpressure) with no server. The test plays the server.

import { decode } from "@msgpack/msgpack";

export function fakeWebSocket() {
  const sockets = [];

  class FakeWebSocket {
    constructor(url, protocols, options) {
      this.url = url;
      this.protocols = protocols;
      this.options = options;
      this.readyState = 0;
      this.bufferedAmount = 0;
      this.protocol = "";
      this.binaryType = "blob";
      /** Client events sent on this socket, decoded. */
      this.sent = [];
      sockets.push(this);
    }

    send(data) {
      if (this.readyState !== 1) throw new Error("send on a socket that is not open");
      this.sent.push(typeof data === "string" ? JSON.parse(data) : decode(data));
    }

    close(code = 1000, reason = "") {
      if (this.readyState >= 2) return;
      this.readyState = 3;
      queueMicrotask(() => this.onclose?.({ code, reason }));
    }

    // -- the test's side ------------------------------------------------------

    accept(protocol = this.protocols[0]) {
      this.protocol = protocol;
      this.readyState = 1;
      this.onopen?.({});
    }

    push(event) {
      this.onmessage?.({ data: JSON.stringify(event) });
    }

    /** The connection dies (1006) or the server closes it with `code`. */
    drop(code = 1006, reason = "") {
      this.readyState = 3;
      this.onclose?.({ code, reason });
    }
  }

  /** Resolves with the n-th socket (0-based) once the client has created it. */
  async function socket(n, timeoutMs = 2000) {
    const deadline = Date.now() + timeoutMs;
    while (sockets.length <= n) {
      if (Date.now() > deadline) throw new Error(`socket #${n} was never opened`);
      await new Promise((r) => setTimeout(r, 1));
    }
    return sockets[n];
  }

  return { FakeWebSocket, sockets, socket };
}

export const tick = (ms = 0) => new Promise((r) => setTimeout(r, ms));

/** Poll `predicate` until it is true. */
export async function until(predicate, timeoutMs = 2000, what = "condition") {
  const deadline = Date.now() + timeoutMs;
  while (!predicate()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await tick(1);
  }
}

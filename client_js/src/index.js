// tokenwire JavaScript client: ESM, for browsers (no build step) and Node 20+.
//
//   import { connect } from "tokenwire";
//   const session = await connect("ws://127.0.0.1:8765/v1/realtime");
//   await session.addMessage("hello");
//   const r = session.createResponse({ max_output_tokens: 64 });
//   for await (const delta of r.text()) process.stdout.write(delta);
//   console.log((await r.done()).status);
//
// The wire contract is docs/protocol.md. Types are in index.d.ts.

// @msgpack/msgpack is loaded on first use, so a JSON-only client (e.g. a page
// without an import map for it) never needs it.
let msgpack = null;
async function loadMsgpack() {
  msgpack ??= await import("@msgpack/msgpack");
  return msgpack;
}

export const SUBPROTOCOL_MSGPACK = "tokenwire.v1.msgpack";
export const SUBPROTOCOL_JSON = "tokenwire.v1.json";
/** Prefix of the subprotocol entry that carries an API key (browsers cannot set headers). */
export const AUTH_SUBPROTOCOL_PREFIX = "tokenwire.auth.";

export const DEFAULT_RECONNECT = Object.freeze({
  initialDelayMs: 250,
  maxDelayMs: 10_000,
  maxAttempts: 10,
});
export const DEFAULT_BACKPRESSURE = Object.freeze({
  // A frame at least this big is a "large item": it waits for the socket to drain.
  largeFrameBytes: 16 * 1024,
  // ...while ws.bufferedAmount is above this many bytes.
  highWaterMark: 64 * 1024,
  pollIntervalMs: 5,
});
// Node (`ws`) pings the server every intervalMs; a socket that has let nothing
// through (no pong, no frame) for timeoutMs after a ping is dead: reconnect.
// Well inside the server's own keepalive (20 s) plus resume grace (30 s).
export const DEFAULT_KEEPALIVE = Object.freeze({
  intervalMs: 15_000,
  timeoutMs: 10_000,
});

const OPEN = 1;
const TERMINAL = "response.done";
// Closes after which reconnecting is wrong: 4000, the server ended an idle
// session (a new one would only idle again).
const FINAL_CLOSES = new Set([4000]);
// Time for session.created, and for each reconnect attempt's answer (connectTimeoutMs).
const CONNECT_TIMEOUT_MS = 10_000;
// Handshake answers after which reconnecting is wrong: the key or the request
// is refused. Node's `ws` names the status in its error; browsers hide it (the
// attempts then run out as for any failure).
const REFUSED_HANDSHAKE = /Unexpected server response: (400|401|403|404)\b/;
// How the client lets go of a socket that failed it (no answer to the resume,
// no pong) where it cannot just drop it (browsers): any code but 1000/1001
// keeps the session on the server for a resume (docs/protocol.md, Resume).
const CLOSE_ABANDONED = 4001;
const IS_NODE = typeof process !== "undefined" && !!process.versions?.node && typeof window === "undefined";

/** An `error` event from the server (or a client-side failure), with a stable `code`. */
export class TokenwireError extends Error {
  /**
   * @param {{code?: string, message?: string, type?: string, event_id?: string, param?: string}} error
   */
  constructor(error) {
    super(`${error.code}: ${error.message}`);
    this.name = "TokenwireError";
    this.error = error;
    this.code = error.code ?? "";
    this.param = error.param;
  }
}

function clientError(code, message, param) {
  return new TokenwireError({ type: "client_error", code, message, ...(param === undefined ? {} : { param }) });
}

/**
 * Delay before reconnect attempt `attempt` (0-based): exponential backoff with
 * full jitter, `random() * min(maxDelayMs, initialDelayMs * 2**attempt)`.
 * @param {number} attempt
 * @param {{initialDelayMs?: number, maxDelayMs?: number, random?: () => number}} [opts]
 */
export function backoffDelay(attempt, opts = {}) {
  const initial = opts.initialDelayMs ?? DEFAULT_RECONNECT.initialDelayMs;
  const max = opts.maxDelayMs ?? DEFAULT_RECONNECT.maxDelayMs;
  const random = opts.random ?? Math.random;
  const cap = Math.min(max, initial * 2 ** attempt);
  return Math.floor(random() * cap);
}

/**
 * The subprotocol list a client offers: the wire format first, then the API
 * key entry when the key cannot travel in an Authorization header.
 * @param {"msgpack"|"json"} protocol
 * @param {{apiKey?: string, keyInSubprotocol?: boolean}} [opts]
 */
export function subprotocols(protocol, opts = {}) {
  if (protocol !== "msgpack" && protocol !== "json") {
    throw new TypeError(`protocol must be "msgpack" or "json", got ${JSON.stringify(protocol)}`);
  }
  const list = [protocol === "msgpack" ? SUBPROTOCOL_MSGPACK : SUBPROTOCOL_JSON];
  if (opts.apiKey && opts.keyInSubprotocol) list.push(AUTH_SUBPROTOCOL_PREFIX + opts.apiKey);
  return list;
}

/** Code points in a string: what `text_end` counts (not UTF-16 units). */
export function codePointLength(text) {
  let n = 0;
  for (const _ of text) n++;
  return n;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function deferred() {
  let resolve, reject;
  const promise = new Promise((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject, settled: false };
}

function settle(d, ok, value) {
  if (d.settled) return;
  d.settled = true;
  if (ok) d.resolve(value);
  else d.reject(value);
}

// ---------------------------------------------------------------------------
// WebSocket selection

let wsModule = null;

async function pickWebSocket(options, wantHeaders) {
  if (options.WebSocket) return { WebSocketImpl: options.WebSocket, headers: !!options.headersSupported };
  if (IS_NODE) {
    // `ws` sends headers (Authorization) and is there on every Node 20.
    try {
      wsModule ??= (await import("ws")).default;
      return { WebSocketImpl: wsModule, headers: true };
    } catch (err) {
      if (typeof globalThis.WebSocket !== "function" || wantHeaders) throw err;
    }
  }
  if (typeof globalThis.WebSocket !== "function") {
    throw new Error("no WebSocket implementation: install `ws` or pass options.WebSocket");
  }
  return { WebSocketImpl: globalThis.WebSocket, headers: false };
}

// ---------------------------------------------------------------------------
// Response

/**
 * One response. Iterate it for its events (up to and including
 * `response.done`), iterate `text()` for text deltas, or await `text()` /
 * `done()` for the result. Several iterators may read it, from the start.
 */
export class Response {
  /** @param {Session} session @param {object} params */
  constructor(session, params) {
    this.session = session;
    this.params = params;
    /** @type {string|null} */
    this.id = null;
    /** @type {string|null} event_id of the response.create */
    this.eventId = null;
    /** Every event of this response so far, in order. */
    this.events = [];
    /** @type {object|null} the `response` of response.done */
    this.result = null;
    this._status = "pending";
    this._created = deferred();
    this._done = deferred();
    this._error = null;
    this._waiters = new Set();
    this._items = new Map(); // item_id -> text so far
    // Consumers may never await these; don't report unhandled rejections.
    this._created.promise.catch(() => {});
    this._done.promise.catch(() => {});
  }

  /** pending (not yet created), in_progress, requires_action, or the final status. */
  get status() {
    return this._status;
  }

  /** Resolves with the `response` object of response.created. */
  get created() {
    return this._created.promise;
  }

  /** The `response` object of response.done. Rejects if the response could not be created or the connection was lost. */
  done() {
    return this._done.promise;
  }

  /** All assistant text received so far (every item, in order). */
  get textSoFar() {
    return [...this._items.values()].join("");
  }

  /**
   * The text: `await r.text()` gives the full output text once done;
   * `for await (const delta of r.text())` gives the deltas as they come.
   */
  text() {
    const response = this;
    return {
      then(onFulfilled, onRejected) {
        return response
          .done()
          .then(
            (result) =>
              result.output
                .filter((item) => item.type === "message")
                .map((item) => item.content ?? "")
                .join(""),
          )
          .then(onFulfilled, onRejected);
      },
      async *[Symbol.asyncIterator]() {
        for await (const ev of response) {
          if (ev.type === "response.output_text.delta") yield ev.delta;
        }
      },
    };
  }

  async *[Symbol.asyncIterator]() {
    let index = 0;
    while (true) {
      while (index < this.events.length) {
        const ev = this.events[index++];
        yield ev;
        if (ev.type === TERMINAL) return;
      }
      if (this._error) throw this._error;
      await new Promise((resolve) => this._waiters.add(resolve));
    }
  }

  /**
   * Stop the response; resolves with its final `response` (status cancelled,
   * or whatever it ended with if it had already finished).
   */
  async cancel() {
    await this.created;
    if (!this.result) {
      try {
        await this.session._requestUntil(
          { type: "response.cancel", response_id: this.id },
          this.done(),
        );
      } catch (err) {
        // It finished meanwhile; not the caller's problem.
        if (!(err instanceof TokenwireError && err.code === "response_not_active")) throw err;
      }
    }
    return this.done();
  }

  /** Add user input into the running response; resolves with `response.steered`. */
  async steer(input) {
    await this.created;
    return this.session.request({ type: "response.steer", response_id: this.id, input });
  }

  /**
   * Voice barge-in: cancel, then truncate the conversation at what the user
   * heard, so the history keeps only that. `heard` is the heard text itself, or
   * its length in code points, counted over the response's whole output text.
   * Resolves with the final `response` and the truncations made.
   * @param {string|number} heard
   */
  async bargeIn(heard) {
    const result = await this.cancel();
    let left = typeof heard === "number" ? heard : codePointLength(heard);
    const truncated = [];
    if (result.conversation === "none") return { response: result, truncated };
    for (const item of result.output) {
      if (item.type !== "message" || item.role !== "assistant") continue;
      const length = codePointLength(item.content ?? "");
      const keep = Math.max(0, Math.min(left, length));
      left -= keep;
      // Empty items (e.g. closed by a steer before any token) are not in the prompt.
      if (keep < length) {
        await this.session.truncate(item.id, keep);
        truncated.push({ item_id: item.id, text_end: keep });
      }
    }
    return { response: result, truncated };
  }

  /** Send a tool result for one of this response's calls (when no handler answered it). */
  submitToolOutput(callId, output) {
    return this.session.submitToolOutput(callId, output);
  }

  // -- fed by the session --------------------------------------------------

  _bind(created) {
    this.id = created.response.id;
    this._status = created.response.status;
    this._push(created);
    settle(this._created, true, created.response);
  }

  _push(ev) {
    this.events.push(ev);
    switch (ev.type) {
      case "response.output_text.delta":
        this._items.set(ev.item_id, (this._items.get(ev.item_id) ?? "") + ev.delta);
        if (this._status === "requires_action") this._status = "in_progress"; // the tool round's continuation
        break;
      case "response.output_text.done":
        this._items.set(ev.item_id, ev.text);
        break;
      case "response.requires_action":
        this._status = "requires_action";
        break;
      case "response.function_call_arguments.delta":
      case "response.steered":
        this._status = "in_progress";
        break;
      case TERMINAL:
        this.result = ev.response;
        this._status = ev.response.status;
        settle(this._done, true, ev.response);
        break;
    }
    this._wake();
  }

  _fail(err) {
    if (this.result) return;
    this._error = err;
    if (this._status === "pending") this._status = "failed";
    settle(this._created, false, err);
    settle(this._done, false, err);
    this._wake();
  }

  _wake() {
    const waiters = [...this._waiters];
    this._waiters.clear();
    for (const w of waiters) w();
  }
}

// ---------------------------------------------------------------------------
// Session

/**
 * One tokenwire session over one WebSocket (or several, across reconnects).
 * Create it with `connect()`.
 */
export class Session {
  constructor(url, options = {}) {
    this.url = url;
    this.options = options;
    this.protocol = options.protocol ?? "msgpack";
    subprotocols(this.protocol); // validates
    this.reconnectOptions =
      options.reconnect === false ? null : { ...DEFAULT_RECONNECT, ...(options.reconnect === true ? {} : options.reconnect) };
    this.backpressure = { ...DEFAULT_BACKPRESSURE, ...options.backpressure };
    this.keepalive =
      options.keepalive === false ? null : { ...DEFAULT_KEEPALIVE, ...(options.keepalive === true ? {} : options.keepalive) };
    /** Tool name -> async (args, call) => result. Results that are not strings are JSON-encoded. */
    // No prototype: a tool named "toString" or "constructor" has no handler unless given one.
    this.tools = Object.assign(Object.create(null), options.tools);
    /** @type {object|null} the session object from session.created / session.updated */
    this.session = null;
    /** @type {string|null} */
    this.id = null;
    /** seq of the last server event received. */
    this.lastSeq = 0;
    /** connecting | open | reconnecting | closed */
    this.state = "connecting";
    /** The negotiated subprotocol, e.g. "tokenwire.v1.msgpack". */
    this.subprotocol = null;
    /** @type {any} the current WebSocket */
    this.ws = null;
    this._nextId = 1;
    this._pending = new Map(); // event_id -> deferred (+ response)
    this._responses = new Map(); // response_id -> Response
    this._byCreateEvent = new Map(); // response.create event_id -> Response (for generation errors)
    this._listeners = new Map(); // type -> Set<fn>
    this._sendQueue = [];
    this._sending = false;
    this._closing = false;
    this._resume = null; // {eventId, newSession} while a resume is being confirmed
    // Frames sent in this session the server may not have taken yet, numbered
    // as session.resumed's client_events counts them (session.resume excluded).
    this._sentCount = 0;
    this._unconfirmed = []; // [{n, eventId, frame}]
    this._attempt = 0;
    this._attemptTimer = undefined;
    this._socketError = "";
    this._retryAfterMs = 0;
    this._ready = deferred();
    this._ready.promise.catch(() => {});
  }

  // -- listeners -----------------------------------------------------------

  /**
   * Listen to server events by `type` ("response.output_text.delta", ...), to
   * every server event ("event"), or to the client's lifecycle: "open",
   * "reconnecting" {attempt, delayMs}, "reconnected", "resumefailed", "close".
   * Returns a function that removes the listener.
   */
  on(type, listener) {
    if (!this._listeners.has(type)) this._listeners.set(type, new Set());
    this._listeners.get(type).add(listener);
    return () => this._listeners.get(type)?.delete(listener);
  }

  _emit(type, payload) {
    for (const fn of this._listeners.get(type) ?? []) {
      try {
        fn(payload);
      } catch (err) {
        queueMicrotask(() => {
          throw err;
        });
      }
    }
  }

  // -- requests ------------------------------------------------------------

  _newEventId() {
    return `evt_${this._nextId++}`;
  }

  /** Send an event, no reply awaited. Resolves once it is handed to the socket. */
  send(event) {
    event.event_id ??= this._newEventId();
    return this._enqueue(event);
  }

  /**
   * Send an event and resolve with the server's reply that echoes its
   * `event_id`; reject with TokenwireError on an `error` about it.
   */
  request(event) {
    event.event_id ??= this._newEventId();
    const d = deferred();
    this._pending.set(event.event_id, d);
    this._enqueue(event).catch((err) => settle(d, false, err));
    return d.promise.finally(() => this._pending.delete(event.event_id));
  }

  /** Like request(), for events the server answers with no echo: wait for `until` instead. */
  async _requestUntil(event, until) {
    event.event_id ??= this._newEventId();
    const d = deferred();
    this._pending.set(event.event_id, d);
    this._enqueue(event).catch((err) => settle(d, false, err));
    try {
      return await Promise.race([d.promise, until]);
    } finally {
      this._pending.delete(event.event_id);
    }
  }

  /** Set session defaults (instructions, tools, tool_choice, temperature, max_output_tokens, ...). */
  async update(fields) {
    const reply = await this.request({ type: "session.update", session: fields });
    this.session = reply.session;
    return reply.session;
  }

  /** Add an item to the conversation; resolves with the created item. */
  async createItem(item, previousItemId) {
    const event = { type: "conversation.item.create", item };
    if (previousItemId !== undefined) event.previous_item_id = previousItemId;
    return (await this.request(event)).item;
  }

  /** Add a message (role "user" by default). */
  addMessage(content, role = "user") {
    return this.createItem({ type: "message", role, content });
  }

  /** Answer a tool call; the response continues by itself once all its calls have outputs. */
  submitToolOutput(callId, output) {
    const text = typeof output === "string" ? output : JSON.stringify(output);
    return this.createItem({ type: "function_call_output", call_id: callId, output: text });
  }

  /** Keep only the first `textEnd` code points of an assistant item. */
  truncate(itemId, textEnd) {
    return this.request({ type: "conversation.item.truncate", item_id: itemId, text_end: textEnd });
  }

  /** Take an item out of the conversation; resolves with conversation.item.deleted. */
  deleteItem(itemId) {
    return this.request({ type: "conversation.item.delete", item_id: itemId });
  }

  /** The current state of one conversation item. */
  async retrieveItem(itemId) {
    return (await this.request({ type: "conversation.item.retrieve", item_id: itemId })).item;
  }

  /**
   * Start a response. Returns at once; iterate it or await its methods.
   * `params.input` may be a string: it becomes one user message.
   */
  createResponse(params = {}) {
    const body = { ...params };
    if (typeof body.input === "string") {
      body.input = [{ type: "message", role: "user", content: body.input }];
    }
    const response = new Response(this, body);
    const event = { type: "response.create", event_id: this._newEventId(), response: body };
    response.eventId = event.event_id;
    const d = deferred();
    d.response = response;
    this._pending.set(event.event_id, d);
    this._byCreateEvent.set(event.event_id, response);
    this._enqueue(event).catch((err) => settle(d, false, err));
    d.promise.then(
      () => this._pending.delete(event.event_id),
      (err) => {
        this._pending.delete(event.event_id);
        this._byCreateEvent.delete(event.event_id);
        response._fail(err);
      },
    );
    return response;
  }

  /** Add a user message, run a response, resolve with its text. */
  async ask(text, params = {}) {
    await this.addMessage(text);
    return this.createResponse(params).text();
  }

  /** Close the connection for good (no reconnect). */
  close(code = 1000, reason = "") {
    this._closing = true;
    clearTimeout(this._reconnectTimer);
    clearTimeout(this._attemptTimer);
    if (this.ws && this.ws.readyState <= OPEN) this.ws.close(code, reason);
    else this._finalClose(clientError("connection_closed", "the session was closed"));
    return this._closed ?? Promise.resolve();
  }

  // -- sending: ordered, with upstream backpressure ------------------------------

  _encode(event) {
    event = wellFormed(event);
    if (this.subprotocol === SUBPROTOCOL_MSGPACK) return msgpack.encode(event, { ignoreUndefined: true });
    return JSON.stringify(event);
  }

  _enqueue(event) {
    if (this.state === "closed") {
      return Promise.reject(clientError("connection_closed", "the session is closed"));
    }
    // Refused here, not sent: the server would refuse it with no event_id to
    // fail the call with (it would hang), or the encoder would change it.
    const bad = unsendable(event);
    if (bad) return Promise.reject(clientError("invalid_value", `${bad.path}: ${bad.why}`, bad.path));
    const d = deferred();
    this._sendQueue.push({ event, d });
    this._pump();
    return d.promise;
  }

  async _pump() {
    if (this._sending) return;
    this._sending = true;
    try {
      while (this._sendQueue.length && this.state === "open") {
        const entry = this._sendQueue[0];
        let frame;
        try {
          frame = this._encode(entry.event);
        } catch (err) {
          this._sendQueue.shift();
          settle(entry.d, false, err);
          continue;
        }
        const size = typeof frame === "string" ? utf8Length(frame) : frame.byteLength;
        const limit = this.session?.max_message_bytes;
        if (limit && size > limit) {
          // The server would close the socket with 1009; refuse it here instead.
          this._sendQueue.shift();
          settle(entry.d, false, clientError("message_too_big", `the event is ${size} bytes; the server accepts at most ${limit}`));
          continue;
        }
        if (size >= this.backpressure.largeFrameBytes) {
          const ws = this.ws;
          while (ws.readyState === OPEN && (ws.bufferedAmount ?? 0) > this.backpressure.highWaterMark) {
            await sleep(this.backpressure.pollIntervalMs);
          }
          if (ws !== this.ws || this.state !== "open") continue; // reconnected meanwhile: retry on the new socket
        }
        this._sendQueue.shift();
        try {
          this._unconfirmed.push({ n: ++this._sentCount, eventId: entry.event.event_id, frame });
          this.ws.send(frame);
          settle(entry.d, true);
        } catch (err) {
          settle(entry.d, false, err);
        }
      }
    } finally {
      this._sending = false;
    }
  }

  // -- connection ------------------------------------------------------------------

  async _open() {
    const opts = this.options;
    const wantHeaders = !!opts.apiKey;
    const { WebSocketImpl, headers } = await pickWebSocket(opts, wantHeaders);
    const keyInSubprotocol = !!opts.apiKey && !headers;
    const protocols = subprotocols(this.protocol, { apiKey: opts.apiKey, keyInSubprotocol });
    const ws = headers
      ? new WebSocketImpl(this.url, protocols, {
          headers: opts.apiKey ? { Authorization: `Bearer ${opts.apiKey}` } : {},
          perMessageDeflate: false,
          ...opts.wsOptions,
        })
      : new WebSocketImpl(this.url, protocols);
    ws.binaryType = "arraybuffer";
    return ws;
  }

  /** Open the first connection; resolves once session.created has arrived. */
  async _start() {
    this._closed = new Promise((resolve) => (this._resolveClosed = resolve));
    if (this.protocol === "msgpack") await loadMsgpack();
    const ws = await this._open();
    this._attach(ws);
    const timeoutMs = this.options.connectTimeoutMs ?? CONNECT_TIMEOUT_MS;
    const timer = setTimeout(() => {
      // connect() rejects: nothing may go on behind it (a late session.created,
      // a reconnect after the close). A clean close ends the unused session.
      const err = clientError("connect_timeout", `no session.created within ${timeoutMs} ms`);
      this._closing = true;
      settle(this._ready, false, err);
      this._finalClose(err);
      try {
        ws.close();
      } catch {}
    }, timeoutMs);
    try {
      await this._ready.promise;
    } finally {
      clearTimeout(timer);
    }
    return this;
  }

  _attach(ws) {
    this.ws = ws;
    ws.onopen = () => {
      if (ws !== this.ws) {
        // A socket let go of (its attempt gave up) or superseded: it must not
        // resume the session behind the current socket. Its fresh session is
        // of no use: a clean close ends it.
        try {
          ws.close(1000);
        } catch {}
        return;
      }
      this.subprotocol = ws.protocol || SUBPROTOCOL_JSON;
      this._keepAlive(ws);
      const resume = this._resume;
      if (resume) {
        // session.resume must be the first event on the new connection. The
        // queue waits for session.resumed: what the server never took goes first.
        ws.send(this._encode(resume.event));
        this._giveUpAfter(ws, resume); // it answered: the wait starts over
        this._emit("reconnected", { attempt: resume.attempt });
      }
    };
    ws.onmessage = (msg) => {
      // A socket let go of, or a connect() that timed out: not ours any more.
      if (ws !== this.ws || this.state === "closed") return;
      // A replay may take longer than connectTimeoutMs; only silence is a hang.
      if (this._resume && this.state === "reconnecting") this._giveUpAfter(ws, this._resume);
      let event;
      try {
        event = typeof msg.data === "string" ? JSON.parse(msg.data) : msgpack.decode(new Uint8Array(msg.data));
      } catch (err) {
        this._emit("decodeerror", err);
        return;
      }
      this._dispatch(event);
    };
    ws.onerror = (ev) => {
      // A close event always follows; keep what it cannot say (the HTTP status).
      if (ws === this.ws) this._socketError = String(ev?.message ?? "");
    };
    ws.onclose = (ev) => {
      if (ws !== this.ws) return;
      this._onClose(ev);
    };
  }

  _onClose(ev) {
    // This attempt is over: its give-up timer must not start a second,
    // parallel reconnect later.
    clearTimeout(this._attemptTimer);
    const info = { code: ev.code, reason: ev.reason };
    const socketError = this._socketError;
    this._socketError = "";
    if (this.state === "connecting" && !this._resume) {
      // The first connection never got going: connect() rejects, no reconnect.
      const why = `${ev.code}${ev.reason ? `: ${ev.reason}` : ""}${socketError ? `; ${socketError}` : ""}`;
      const err = clientError("connect_failed", `could not open ${this.url} (close ${why})`);
      settle(this._ready, false, err);
      this._finalClose(err, info);
      return;
    }
    const refused = this._resume && REFUSED_HANDSHAKE.exec(socketError);
    if (refused) {
      const code = refused[1] === "401" || refused[1] === "403" ? "unauthorized" : "handshake_refused";
      this._finalClose(clientError(code, `the server refused the reconnect (HTTP ${refused[1]}): ${socketError}`), info);
      return;
    }
    if (this._closing || !this.reconnectOptions || !this.id || FINAL_CLOSES.has(ev.code)) {
      this._finalClose(clientError("connection_closed", `the connection closed (${ev.code}${ev.reason ? `: ${ev.reason}` : ""})`), info);
      return;
    }
    this._scheduleReconnect(info);
  }

  _scheduleReconnect(info) {
    // One reconnect at a time: a pending one is replaced, never doubled.
    clearTimeout(this._attemptTimer);
    clearTimeout(this._reconnectTimer);
    const r = this.reconnectOptions;
    if (this._attempt >= r.maxAttempts) {
      this._finalClose(clientError("reconnect_failed", `gave up after ${this._attempt} reconnect attempts`), info);
      return;
    }
    this.state = "reconnecting";
    let delayMs = backoffDelay(this._attempt, r);
    if (this._retryAfterMs) {
      delayMs = Math.max(delayMs, this._retryAfterMs);
      this._retryAfterMs = 0;
    }
    const attempt = ++this._attempt;
    this._emit("reconnecting", { attempt, delayMs, ...info });
    this._reconnectTimer = setTimeout(async () => {
      if (this._closing) return;
      const event = {
        type: "session.resume",
        event_id: this._newEventId(),
        session_id: this.id,
        last_seq: this.lastSeq,
      };
      const resume = { event, attempt, newSession: null, oldSeq: this.lastSeq };
      this._resume = resume;
      try {
        const ws = await this._open();
        if (this._closing || this._resume !== resume) {
          ws.close(1000); // closed, or given up, meanwhile
          return;
        }
        this._attach(ws);
        this._giveUpAfter(ws, resume);
      } catch (err) {
        this._scheduleReconnect({ code: 1006, reason: String(err?.message ?? err) });
      }
    }, delayMs);
  }

  /**
   * A reconnect attempt that hangs (an address that never answers, a server
   * that never answers the resume) is dropped once nothing has come for
   * connectTimeoutMs, as the first connect is, and the next attempt is
   * scheduled. Called again whenever the attempt's socket answers.
   */
  _giveUpAfter(ws, resume) {
    const timeoutMs = this.options.connectTimeoutMs ?? CONNECT_TIMEOUT_MS;
    clearTimeout(this._attemptTimer);
    this._attemptTimer = setTimeout(() => {
      if (this._resume !== resume || this.ws !== ws || this.state !== "reconnecting") return;
      this._abandon(ws);
      this._scheduleReconnect({ code: 1006, reason: `no answer to session.resume within ${timeoutMs} ms` });
    }, timeoutMs);
  }

  /**
   * Let go of a socket that failed us without ending the session: the server
   * may already have handed it the session (the resume), and a clean close
   * would end that. Node drops it (no close handshake with a dead peer).
   */
  _abandon(ws) {
    if (this.ws === ws) this.ws = null; // its late close is not ours any more
    try {
      if (typeof ws.terminate === "function") ws.terminate();
      else ws.close(CLOSE_ABANDONED, "resume later");
    } catch {}
  }

  /**
   * Dead-socket detection where the WebSocket can ping (Node's `ws`; a
   * browser's cannot, and only answers the server's pings): a ping every
   * intervalMs, and a socket that lets nothing through (pong, ping, frame)
   * for timeoutMs after one is dropped and reconnected, as on a 1006.
   */
  _keepAlive(ws) {
    const k = this.keepalive;
    if (!k || !(k.intervalMs > 0) || typeof ws.ping !== "function" || typeof ws.on !== "function") return;
    let waiting; // the timer of the ping nothing has answered yet
    const heard = () => {
      clearTimeout(waiting);
      waiting = undefined;
    };
    const stop = () => {
      clearInterval(interval);
      heard();
    };
    const interval = setInterval(() => {
      if (ws !== this.ws || ws.readyState !== OPEN || this.state === "closed") return stop();
      if (waiting) return; // the last ping still waits (timeoutMs > intervalMs)
      waiting = setTimeout(() => {
        stop();
        if (ws !== this.ws || this.state === "closed") return;
        this._abandon(ws);
        this._onClose({ code: 1006, reason: `no pong within ${k.timeoutMs} ms` });
      }, k.timeoutMs);
      waiting.unref?.();
      try {
        ws.ping();
      } catch {}
    }, k.intervalMs);
    interval.unref?.(); // the socket itself keeps the process alive
    for (const type of ["pong", "ping", "message"]) ws.on(type, heard);
    ws.on("close", stop);
  }

  _finalClose(err, info = {}) {
    if (this.state === "closed") return;
    this.state = "closed";
    clearTimeout(this._attemptTimer);
    this._resume = null;
    for (const entry of this._sendQueue.splice(0)) settle(entry.d, false, err);
    for (const d of this._pending.values()) settle(d, false, err);
    for (const r of this._responses.values()) r._fail(err);
    for (const r of this._byCreateEvent.values()) r._fail(err);
    this._responses.clear();
    this._byCreateEvent.clear();
    this._emit("close", { ...info, error: err });
    this._resolveClosed?.();
  }

  // -- receiving -------------------------------------------------------------------

  _dispatch(event) {
    const type = event.type;
    const resume = this._resume;
    if (resume) {
      // A resuming connection first gets its own fresh session.created (another
      // session id): hold it until we know whether the resume worked. Then the
      // server either replays the old session's events after last_seq (original
      // seq numbers, handled as usual below) and confirms with session.resumed,
      // or refuses with an error echoing the resume's event_id.
      if (type === "session.created" && event.session?.id !== this.id) {
        resume.newSession = event;
        return;
      }
      if (type === "error" && event.error?.event_id === resume.event.event_id) {
        this._resumeFailed(event);
        return;
      }
      if (type === "session.resumed") {
        clearTimeout(this._attemptTimer);
        this._resume = null;
        this._attempt = 0; // this connection works: the next drop starts the backoff over
        this._resendUntaken(event.client_events ?? 0);
      }
    }
    if (typeof event.seq === "number") {
      if (event.seq <= this.lastSeq) return; // a replayed event we already have
      this.lastSeq = event.seq;
    }
    if (type === "session.resumed") {
      if (event.session) this.session = event.session;
    } else if (type === "session.created" || type === "session.updated") {
      this.session = event.session;
      this.id = event.session.id;
      if (type === "session.created" && this.state === "connecting") {
        this.state = "open";
        this._emit("open", event);
        settle(this._ready, true, this);
        this._pump();
      }
    } else if (type === "session.going_away") {
      this._retryAfterMs = event.retry_after_ms ?? 0;
    }

    // Route to the response it belongs to.
    let response = null;
    if (type === "response.created") {
      const d = this._pending.get(event.event_id);
      response = d?.response ?? new Response(this, {});
      this._responses.set(event.response.id, response);
      response._bind(event);
    } else {
      const responseId = event.response_id ?? (type === TERMINAL ? event.response?.id : undefined);
      response = responseId ? this._responses.get(responseId) : undefined;
      if (!response && type === "error" && event.error?.event_id) {
        const r = this._byCreateEvent.get(event.error.event_id);
        if (r?.id) response = r; // a generation failure: its error goes to the response too
      }
      if (response) response._push(event);
      if (type === TERMINAL && response) {
        this._responses.delete(response.id);
        this._byCreateEvent.delete(response.eventId);
      }
    }

    if (type === "response.function_call_arguments.done" && this.tools[event.name]) {
      this._runTool(event);
    }

    // Settle the request this event answers.
    const eventId = type === "error" ? event.error?.event_id : event.event_id;
    if (eventId) this._confirm(eventId);
    const d = eventId ? this._pending.get(eventId) : undefined;
    if (d && !(type === "error" && response && d.response === response && response.id)) {
      if (type === "error") settle(d, false, new TokenwireError(event.error));
      else settle(d, true, event);
    }

    this._emit(type, event);
    this._emit("event", event);
  }

  /** A reply echoes `eventId`: the server took it and, in order, all before it. */
  _confirm(eventId) {
    const i = this._unconfirmed.findIndex((u) => u.eventId === eventId);
    if (i >= 0) this._unconfirmed.splice(0, i + 1);
  }

  /** After session.resumed: send again, in order, what the server never took; then the queue. */
  _resendUntaken(taken) {
    this._unconfirmed = this._unconfirmed.filter((u) => u.n > taken);
    for (const u of this._unconfirmed) this.ws.send(u.frame);
    this.state = "open";
    this._pump();
  }

  _resumeFailed(errorEvent) {
    // The old session is gone. Everything in flight on it fails; the
    // connection goes on with the fresh session the server announced.
    const err = new TokenwireError({
      ...errorEvent.error,
      code: "resume_failed",
      message: `could not resume session ${this.id}: ${errorEvent.error.code}: ${errorEvent.error.message}`,
      cause_code: errorEvent.error.code,
    });
    const oldId = this.id;
    const fresh = this._resume.newSession;
    clearTimeout(this._attemptTimer);
    this._resume = null;
    this._attempt = 0;
    // Calls made while reconnecting were meant for the old session: they fail
    // too, and are not sent to the new one.
    for (const entry of this._sendQueue.splice(0)) settle(entry.d, false, err);
    for (const [id, d] of this._pending) {
      if (id !== errorEvent.error.event_id) settle(d, false, err);
    }
    for (const r of this._responses.values()) r._fail(err);
    for (const r of this._byCreateEvent.values()) r._fail(err);
    this._responses.clear();
    this._byCreateEvent.clear();
    this.lastSeq = 0;
    if (fresh) {
      this.lastSeq = fresh.seq ?? 0;
      this.session = fresh.session;
      this.id = fresh.session.id;
    }
    this.lastSeq = Math.max(this.lastSeq, errorEvent.seq ?? 0);
    this._sentCount = 0;
    this._unconfirmed = [];
    this.state = "open";
    this._emit("resumefailed", { previousSessionId: oldId, sessionId: this.id, error: err });
    this._pump();
  }

  async _runTool(event) {
    const handler = this.tools[event.name];
    let output;
    try {
      const args = event.arguments ? JSON.parse(event.arguments) : {};
      const result = await handler(args, event);
      output = typeof result === "string" ? result : JSON.stringify(result ?? null);
    } catch (err) {
      output = JSON.stringify({ error: `${err?.name ?? "Error"}: ${err?.message ?? err}` });
    }
    if (!this._responses.has(event.response_id)) {
      // The response ended meanwhile (tool_timeout, cancel): an output now
      // would only land in the history as a stale result.
      const err = clientError("response_ended", `response ${event.response_id} ended before ${event.name} returned; its output was not sent`);
      this._emit("toolerror", { call: event, error: err });
      return;
    }
    try {
      await this.submitToolOutput(event.call_id, output);
    } catch (err) {
      this._emit("toolerror", { call: event, error: err });
    }
  }
}

const LONE_SURROGATE_SOURCE = "[\\ud800-\\udbff](?![\\udc00-\\udfff])|(?<![\\ud800-\\udbff])[\\udc00-\\udfff]";
const LONE_SURROGATE = new RegExp(LONE_SURROGATE_SOURCE);
const LONE_SURROGATES = new RegExp(LONE_SURROGATE_SOURCE, "g");

/**
 * `value` with every lone UTF-16 surrogate (text cut in the middle of an
 * emoji, e.g. by `slice`) replaced by U+FFFD, as a browser's WebSocket does
 * for a text frame: the server refuses them with an error no call can be
 * matched to. Returns `value` itself when there is none.
 */
export function wellFormed(value) {
  if (typeof value === "string") {
    if (value.isWellFormed ? value.isWellFormed() : !LONE_SURROGATE.test(value)) return value;
    return value.toWellFormed ? value.toWellFormed() : value.replace(LONE_SURROGATES, "\ufffd");
  }
  if (Array.isArray(value)) {
    const out = value.map(wellFormed);
    return out.some((v, i) => v !== value[i]) ? out : value;
  }
  if (value && typeof value === "object" && !(value instanceof Uint8Array)) {
    let out = null;
    for (const [k, v] of Object.entries(value)) {
      const w = wellFormed(v);
      if (w !== v) (out ??= { ...value })[k] = w;
    }
    return out ?? value;
  }
  return value;
}

const MAX_DEPTH = 1000;

/**
 * Why `event` cannot be sent as it is: `{path, why}`, or null. What neither
 * wire format carries faithfully: NaN and infinities (JSON writes null; in
 * msgpack the server refuses the frame with no event_id, so the call would
 * hang), a Date (a string in JSON, a timestamp the server refuses in msgpack),
 * bytes, a Map or Set ({}), any other non-plain object, a BigInt, a function
 * or a symbol (dropped, or the encoder fails), a `__proto__` key (the
 * server's echo of it cannot be decoded), and undefined where it is data: in
 * an array (it becomes null) or as a `metadata` value (its key would vanish).
 * Elsewhere a property set to undefined is left out, as JSON.stringify does.
 */
function unsendable(event) {
  const ancestors = new Set();
  // inMetadata: `value` is a value of a metadata map (data, not a field).
  const walk = (value, path, inMetadata) => {
    switch (typeof value) {
      case "string":
      case "boolean":
        return null;
      case "number":
        return Number.isFinite(value) ? null : { path, why: `${value} is not JSON; send a finite number or null` };
      case "undefined":
        if (inMetadata) return { path, why: "undefined would drop this metadata key; give it a string" };
        return { path, why: "undefined in an array would arrive as null; send null" };
      case "bigint":
        return { path, why: "a BigInt cannot be sent; send a number" };
      case "function":
      case "symbol":
        return { path, why: `a ${typeof value} cannot be sent` };
    }
    if (value === null) return null;
    if (ancestors.has(value)) return { path, why: "the value contains itself" };
    if (ancestors.size >= MAX_DEPTH) return { path, why: `nested more than ${MAX_DEPTH} levels deep` };
    const proto = Object.getPrototypeOf(value);
    const isArray = Array.isArray(value);
    if (!isArray && proto !== null && Object.getPrototypeOf(proto) !== null) {
      const kind = value.constructor?.name || "non-plain object";
      const hint =
        value instanceof Date
          ? "send a string, e.g. date.toISOString()"
          : ArrayBuffer.isView(value) || value instanceof ArrayBuffer
            ? "send text, e.g. base64"
            : "send a plain object, array or primitive";
      return { path, why: `a ${kind} cannot be sent as it is; ${hint}` };
    }
    ancestors.add(value);
    try {
      if (isArray) {
        for (let i = 0; i < value.length; i++) {
          const bad = walk(value[i], path ? `${path}.${i}` : String(i), false);
          if (bad) return bad;
        }
        return null;
      }
      const metadata = path === "response.metadata";
      for (const key of Object.keys(value)) {
        const at = path ? `${path}.${key}` : key;
        if (key === "__proto__") return { path: at, why: "the key __proto__ cannot be sent; rename it" };
        if (value[key] === undefined && !metadata) continue; // left out
        const bad = walk(value[key], at, metadata);
        if (bad) return bad;
      }
      return null;
    } finally {
      ancestors.delete(value);
    }
  };
  return walk(event, "", false);
}

function utf8Length(text) {
  let bytes = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c < 0x80) bytes += 1;
    else if (c < 0x800) bytes += 2;
    else if (c >= 0xd800 && c <= 0xdbff) {
      bytes += 4;
      i++;
    } else bytes += 3;
  }
  return bytes;
}

/**
 * Open a session. Resolves once the server's `session.created` has arrived.
 * @param {string} url e.g. "ws://127.0.0.1:8765/v1/realtime"
 * @param {object} [options] see index.d.ts (ConnectOptions)
 * @returns {Promise<Session>}
 */
export function connect(url, options = {}) {
  return new Session(url, options)._start();
}

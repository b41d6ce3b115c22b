// Unit tests of the client's own logic: backoff, subprotocols, reconnect and
// resume, upstream backpressure. No server: a fake WebSocket plays its part.

import assert from "node:assert/strict";
import { once } from "node:events";
import { readFileSync } from "node:fs";
import { createServer } from "node:http";
import { describe, test } from "node:test";
import { WebSocketServer } from "ws";
import {
  backoffDelay,
  codePointLength,
  connect,
  DEFAULT_KEEPALIVE,
  DEFAULT_RECONNECT,
  Session,
  subprotocols,
  TokenwireError,
} from "../src/index.js";
import { fakeWebSocket, tick, until } from "../test-support/fake-ws.js";

const SESSION = { id: "sess_a", object: "realtime.session", engine: "scripted", max_message_bytes: 1 << 20 };

/** connect() over a fake socket; returns the session and the first socket. */
async function fakeSession(options = {}, fake = fakeWebSocket()) {
  const pending = connect("ws://fake/v1/realtime", { protocol: "json", WebSocket: options.WebSocket ?? fake.FakeWebSocket, ...options });
  const sock = await fake.socket(0);
  sock.accept();
  sock.push({ type: "session.created", session: SESSION, seq: 1 });
  return { session: await pending, sock, fake };
}

describe("backoff", () => {
  test("exponential with full jitter, capped", () => {
    const opts = { initialDelayMs: 100, maxDelayMs: 1000 };
    const upper = [0, 1, 2, 3, 4, 5, 6].map((n) => backoffDelay(n, { ...opts, random: () => 0.999999 }));
    assert.deepEqual(upper, [99, 199, 399, 799, 999, 999, 999]);
    const half = [0, 1, 2, 3, 4].map((n) => backoffDelay(n, { ...opts, random: () => 0.5 }));
    assert.deepEqual(half, [50, 100, 200, 400, 500]);
    assert.equal(backoffDelay(9, { ...opts, random: () => 0 }), 0);
  });

  test("defaults", () => {
    assert.deepEqual(DEFAULT_RECONNECT, { initialDelayMs: 250, maxDelayMs: 10_000, maxAttempts: 10 });
    assert.equal(backoffDelay(0, { random: () => 0.5 }), 125);
    assert.equal(backoffDelay(20, { random: () => 0.5 }), 5000);
  });

  test("the client follows the schedule, then gives up", async () => {
    const { session, sock, fake } = await fakeSession({
      reconnect: { initialDelayMs: 8, maxDelayMs: 20, maxAttempts: 4, random: () => 0.999999 },
    });
    const seen = [];
    session.on("reconnecting", (e) => {
      seen.push(e.delayMs);
      // Each new socket fails before it opens.
      fake.socket(e.attempt).then((s) => s.drop(1006));
    });
    const closed = new Promise((resolve) => session.on("close", resolve));
    const r = session.createResponse();
    sock.drop(1006);
    const info = await closed;
    assert.deepEqual(seen, [7, 15, 19, 19]);
    assert.equal(fake.sockets.length, 5);
    assert.equal(info.error.code, "reconnect_failed");
    assert.equal(session.state, "closed");
    await assert.rejects(r.done(), { code: "reconnect_failed" });
  });

  test("session.going_away: the next reconnect waits retry_after_ms", async () => {
    const { session, sock } = await fakeSession({ reconnect: { random: () => 0 } });
    const seen = new Promise((resolve) => session.on("reconnecting", resolve));
    sock.push({ type: "session.going_away", reason: "draining", retry_after_ms: 1234, seq: 2 });
    sock.drop(1001);
    assert.equal((await seen).delayMs, 1234);
    await session.close();
  });
});

describe("subprotocols and auth", () => {
  test("wire format first, then the key entry", () => {
    assert.deepEqual(subprotocols("msgpack"), ["tokenwire.v1.msgpack"]);
    assert.deepEqual(subprotocols("json", { apiKey: "k" }), ["tokenwire.v1.json"]);
    assert.deepEqual(subprotocols("json", { apiKey: "sk-1", keyInSubprotocol: true }), [
      "tokenwire.v1.json",
      "tokenwire.auth.sk-1",
    ]);
    assert.throws(() => subprotocols("xml"), TypeError);
  });

  test("a WebSocket that cannot send headers gets the key as a subprotocol (browsers)", async () => {
    const fake = fakeWebSocket();
    const pending = connect("ws://fake/v1/realtime", { apiKey: "sk-1", WebSocket: fake.FakeWebSocket });
    const sock = await fake.socket(0);
    assert.deepEqual(sock.protocols, ["tokenwire.v1.msgpack", "tokenwire.auth.sk-1"]);
    assert.equal(sock.options, undefined);
    sock.accept("tokenwire.v1.msgpack");
    sock.push({ type: "session.created", session: SESSION, seq: 1 });
    const session = await pending;
    assert.equal(session.subprotocol, "tokenwire.v1.msgpack");
    session.close();
  });

  test("Node (ws) sends Authorization: Bearer and offers the wire format", async () => {
    const wss = new WebSocketServer({ host: "127.0.0.1", port: 0, handleProtocols: (set) => [...set][0] });
    await once(wss, "listening");
    const seen = new Promise((resolve) =>
      wss.on("connection", (ws, req) => {
        resolve({ auth: req.headers.authorization, protocol: req.headers["sec-websocket-protocol"] });
        ws.send(JSON.stringify({ type: "session.created", session: SESSION, seq: 1 }));
      }),
    );
    try {
      const session = await connect(`ws://127.0.0.1:${wss.address().port}/v1/realtime`, {
        apiKey: "sk-test",
        protocol: "json",
      });
      assert.deepEqual(await seen, { auth: "Bearer sk-test", protocol: "tokenwire.v1.json" });
      await session.close();
    } finally {
      for (const c of wss.clients) c.terminate();
      wss.close();
    }
  });

  test("codePointLength counts code points, as text_end does", () => {
    assert.equal(codePointLength("héllo"), 5);
    assert.equal(codePointLength("a😀b"), 3);
    assert.equal("a😀b".length, 4);
  });
});

describe("reconnect and resume (client side)", () => {
  test("sends session.resume first, drops replayed duplicates, feeds the same Response", async () => {
    const { session, sock, fake } = await fakeSession({ reconnect: { random: () => 0 } });
    const r = session.createResponse({ input: "hi" });
    await until(() => sock.sent.length === 1, 2000, "response.create");
    const create = sock.sent[0];
    assert.equal(create.type, "response.create");
    assert.deepEqual(create.response.input, [{ type: "message", role: "user", content: "hi" }]);
    sock.push({
      type: "response.created",
      response: { id: "resp_1", status: "in_progress", output: [] },
      event_id: create.event_id,
      seq: 2,
    });
    sock.push({ type: "response.output_text.delta", response_id: "resp_1", item_id: "item_1", delta: "Hel", seq: 3 });
    const events = [];
    session.on("reconnecting", () => events.push("reconnecting"));
    session.on("reconnected", () => events.push("reconnected"));
    sock.drop(1006);
    assert.equal(session.state, "reconnecting");
    // A call made while reconnecting goes out after the resume.
    const added = session.addMessage("while away");

    const sock2 = await fake.socket(1);
    sock2.accept();
    assert.equal(sock2.sent[0].type, "session.resume");
    assert.equal(sock2.sent[0].session_id, "sess_a");
    assert.equal(sock2.sent[0].last_seq, 3);

    // What the server does: the new socket first gets its own fresh session
    // (ignored), then the old session's events after last_seq (seq 3 again
    // here, to check duplicates are dropped), then session.resumed, then live.
    sock2.push({ type: "session.created", session: { ...SESSION, id: "sess_fresh" }, seq: 1 });
    sock2.push({ type: "response.output_text.delta", response_id: "resp_1", item_id: "item_1", delta: "Hel", seq: 3 });
    sock2.push({ type: "response.output_text.delta", response_id: "resp_1", item_id: "item_1", delta: "lo", seq: 4 });
    assert.equal(session.id, "sess_a");
    await new Promise((res) => setTimeout(res, 20));
    assert.equal(sock2.sent.length, 1); // the queued item waits for session.resumed
    sock2.push({ type: "session.resumed", session: SESSION, last_seq: 3, replayed: 1, client_events: 1, seq: 5 });
    assert.equal(session._resume, null);
    await until(() => sock2.sent.length === 2, 2000, "the queued item");
    const create2 = sock2.sent[1];
    assert.equal(create2.type, "conversation.item.create"); // the response.create was taken: not resent
    sock2.push({
      type: "conversation.item.created",
      item: { id: "item_2", type: "message", role: "user", content: "while away", status: "completed" },
      event_id: create2.event_id,
      seq: 6,
    });
    sock2.push({ type: "response.output_text.done", response_id: "resp_1", item_id: "item_1", text: "Hello", seq: 7 });
    sock2.push({
      type: "response.done",
      response: {
        id: "resp_1",
        status: "completed",
        output: [{ id: "item_1", type: "message", role: "assistant", content: "Hello", status: "completed" }],
      },
      seq: 8,
    });
    const deltas = [];
    for await (const d of r.text()) deltas.push(d);
    assert.deepEqual(deltas, ["Hel", "lo"]);
    assert.equal(await r.text(), "Hello");
    assert.equal((await added).id, "item_2");
    assert.deepEqual(events, ["reconnecting", "reconnected"]);
    assert.equal(session.lastSeq, 8);
    assert.equal(session.id, "sess_a");
    assert.equal(session.state, "open");
    await session.close();
  });

  test("frames the server never took are sent again first, in order, once", async () => {
    const { session, sock, fake } = await fakeSession({ reconnect: { random: () => 0 } });
    const a = session.addMessage("a");
    const b = session.addMessage("b");
    const d = session.addMessage("d");
    await until(() => sock.sent.length === 3, 2000, "a, b and d");
    sock.drop(1006); // no reply came: did the server take them?
    const c = session.addMessage("c");
    const sock2 = await fake.socket(1);
    sock2.accept();
    sock2.push({ type: "session.created", session: { ...SESSION, id: "sess_fresh" }, seq: 1 });
    const item = (content, eventId, seq) => ({
      type: "conversation.item.created",
      item: { id: `item_${content}`, type: "message", role: "user", content, status: "completed" },
      event_id: eventId,
      seq,
    });
    // It took "a" (its reply is replayed) and "b" (its reply was never
    // written: it comes after session.resumed), not "d".
    sock2.push(item("a", sock.sent[0].event_id, 2));
    sock2.push({ type: "session.resumed", session: SESSION, last_seq: 1, replayed: 1, client_events: 2, seq: 3 });
    await until(() => sock2.sent.length === 3, 2000, "d again, then c");
    assert.deepEqual(
      sock2.sent.map((e) => [e.type, e.item?.content]),
      [["session.resume", undefined], ["conversation.item.create", "d"], ["conversation.item.create", "c"]],
    );
    assert.equal(sock2.sent[1].event_id, sock.sent[2].event_id); // the same frame
    sock2.push(item("b", sock.sent[1].event_id, 4));
    sock2.push(item("d", sock2.sent[1].event_id, 5));
    sock2.push(item("c", sock2.sent[2].event_id, 6));
    const ids = await Promise.all([a, b, d, c].map(async (p) => (await p).id));
    assert.deepEqual(ids, ["item_a", "item_b", "item_d", "item_c"]);
    await session.close();
  });

  for (const code of ["session_not_found", "resume_not_possible"]) test(`a refused resume (${code}) fails what was in flight and goes on with the new session`, async () => {
    const { session, sock, fake } = await fakeSession({ reconnect: { random: () => 0 } });
    const r = session.createResponse();
    await until(() => sock.sent.length === 1);
    sock.push({
      type: "response.created",
      response: { id: "resp_1", status: "in_progress", output: [] },
      event_id: sock.sent[0].event_id,
      seq: 2,
    });
    const failed = new Promise((resolve) => session.on("resumefailed", resolve));
    sock.drop(1006);
    const sock2 = await fake.socket(1);
    sock2.accept();
    const resume = sock2.sent[0];
    // What the server does: a fresh session, then an error on it.
    sock2.push({ type: "session.created", session: { ...SESSION, id: "sess_b" }, seq: 1 });
    sock2.push({
      type: "error",
      error: { type: "invalid_request_error", code, message: "no", event_id: resume.event_id },
      seq: 2,
    });
    const info = await failed;
    assert.equal(info.previousSessionId, "sess_a");
    assert.equal(info.sessionId, "sess_b");
    await assert.rejects(r.done(), (err) => err instanceof TokenwireError && err.code === "resume_failed" && err.error.cause_code === code);
    assert.equal(session.id, "sess_b");
    assert.equal(session.lastSeq, 2);
    // The session works on.
    const update = session.update({ temperature: 0 });
    await until(() => sock2.sent.length === 2);
    sock2.push({ type: "session.updated", session: { ...SESSION, id: "sess_b" }, event_id: sock2.sent[1].event_id, seq: 3 });
    assert.equal((await update).id, "sess_b");
    await session.close();
  });

  test("reconnect: false closes for good", async () => {
    const { session, sock, fake } = await fakeSession({ reconnect: false });
    const r = session.createResponse();
    const closed = new Promise((resolve) => session.on("close", resolve));
    sock.drop(1006);
    assert.equal((await closed).error.code, "connection_closed");
    await assert.rejects(r.done(), { code: "connection_closed" });
    await tick(20);
    assert.equal(fake.sockets.length, 1);
    await assert.rejects(session.update({}), { code: "connection_closed" });
  });

  test("close() does not reconnect", async () => {
    const { session, fake } = await fakeSession({ reconnect: { random: () => 0 } });
    await session.close();
    await tick(20);
    assert.equal(fake.sockets.length, 1);
    assert.equal(session.state, "closed");
  });
});

describe("upstream backpressure", () => {
  test("a large item waits while bufferedAmount is above the mark; order is kept", async () => {
    const { session, sock } = await fakeSession({
      backpressure: { largeFrameBytes: 1000, highWaterMark: 5000, pollIntervalMs: 1 },
    });
    // Small events go straight out while the buffer is full...
    sock.bufferedAmount = 50_000;
    session.send({ type: "response.cancel" });
    await tick(5);
    assert.equal(sock.sent.length, 1);
    // ...a large one waits, and what comes after it queues behind it.
    const big = session.send({ type: "conversation.item.create", item: { type: "message", role: "user", content: "x".repeat(4000) } });
    const small = session.send({ type: "response.create" });
    await tick(30);
    assert.equal(sock.sent.length, 1);
    sock.bufferedAmount = 6000;
    await tick(20);
    assert.equal(sock.sent.length, 1);
    sock.bufferedAmount = 100;
    await Promise.all([big, small]);
    assert.deepEqual(
      sock.sent.map((e) => e.type),
      ["response.cancel", "conversation.item.create", "response.create"],
    );
    await session.close();
  });

  test("an event over the server's max_message_bytes is refused, not sent", async () => {
    const { session, sock } = await fakeSession();
    await assert.rejects(
      session.addMessage("y".repeat((1 << 20) + 10)),
      (err) => err instanceof TokenwireError && err.code === "message_too_big",
    );
    assert.equal(sock.sent.length, 0);
    await session.close();
  });
});

describe("edges a user meets (from an audit)", () => {
  /** response.create answered by response.created resp_1 on `sock`; seq 2. */
  async function started(session, sock, params = {}) {
    const r = session.createResponse(params);
    await until(() => sock.sent.length >= 1, 2000, "response.create");
    const create = sock.sent.at(-1);
    sock.push({ type: "response.created", response: { id: "resp_1", status: "in_progress", output: [] }, event_id: create.event_id, seq: 2 });
    return r;
  }

  test("a refused resume fails the calls made while reconnecting, and sends none of them", async () => {
    const { session, sock, fake } = await fakeSession({ reconnect: { random: () => 0 } });
    sock.drop(1006);
    const added = session.addMessage("meant for the old session");
    const r = session.createResponse();
    const sock2 = await fake.socket(1);
    sock2.accept();
    sock2.push({ type: "session.created", session: { ...SESSION, id: "sess_b" }, seq: 1 });
    sock2.push({ type: "error", error: { type: "invalid_request_error", code: "session_not_found", message: "no", event_id: sock2.sent[0].event_id }, seq: 2 });
    await assert.rejects(added, { code: "resume_failed" });
    await assert.rejects(r.done(), { code: "resume_failed" });
    await tick(20);
    assert.deepEqual(sock2.sent.map((e) => e.type), ["session.resume"]);
    await session.close();
  });

  test("a reconnect that gets its fresh session.created and then closes counts as failed", async () => {
    const { session, sock, fake } = await fakeSession({
      reconnect: { initialDelayMs: 2, maxDelayMs: 8, maxAttempts: 3, random: () => 0.999999 },
    });
    const delays = [];
    session.on("reconnecting", (e) => {
      delays.push(e.delayMs);
      fake.socket(e.attempt).then((s) => {
        s.accept();
        s.push({ type: "session.created", session: { ...SESSION, id: `sess_${e.attempt}` }, seq: 1 });
        s.drop(1013, "session store unavailable");
      });
    });
    const closed = new Promise((resolve) => session.on("close", resolve));
    sock.drop(1006);
    assert.equal((await closed).error.code, "reconnect_failed");
    assert.deepEqual(delays, [1, 3, 7]); // backing off, not starting over each time
    assert.equal(fake.sockets.length, 4);
  });

  test("an idle close (4000) ends the session: no reconnect", async () => {
    const { session, sock, fake } = await fakeSession({ reconnect: { random: () => 0 } });
    const closed = new Promise((resolve) => session.on("close", resolve));
    sock.drop(4000, "idle timeout");
    const info = await closed;
    assert.equal(info.code, 4000);
    assert.equal(info.error.code, "connection_closed");
    await tick(20);
    assert.equal(fake.sockets.length, 1);
  });

  test("status is in_progress again while a tool round's continuation streams", async () => {
    const { session, sock } = await fakeSession();
    const r = await started(session, sock);
    sock.push({ type: "response.requires_action", response_id: "resp_1", call_ids: ["call_1"], seq: 3 });
    assert.equal(r.status, "requires_action");
    sock.push({ type: "response.output_text.delta", response_id: "resp_1", item_id: "item_2", delta: "Sunny", seq: 4 });
    assert.equal(r.status, "in_progress");
    await session.close();
  });

  test("text cut inside an emoji is sent with U+FFFD, not refused without an event_id", async () => {
    const { session, sock } = await fakeSession();
    const cut = "hi 😀".slice(0, 4);
    const added = session.addMessage(cut);
    await until(() => sock.sent.length === 1);
    assert.equal(sock.sent[0].item.content, "hi \ufffd");
    sock.push({ type: "conversation.item.created", item: { id: "item_1", type: "message", role: "user", content: "hi \ufffd" }, event_id: sock.sent[0].event_id, seq: 2 });
    assert.equal((await added).id, "item_1");
    await session.close();
  });

  test("a tool named like an Object method has no handler unless given one", async () => {
    const { session, sock } = await fakeSession();
    await started(session, sock);
    sock.push({ type: "response.function_call_arguments.done", response_id: "resp_1", item_id: "item_1", call_id: "call_1", name: "toString", arguments: "{}", seq: 3 });
    await tick(20);
    assert.equal(sock.sent.length, 1); // only the response.create: nothing answered the call
    await session.close();
  });

  test("a handler that returns after its response ended sends nothing and says so", async () => {
    let release;
    const { session, sock } = await fakeSession({ tools: { slow: () => new Promise((resolve) => (release = resolve)) } });
    await started(session, sock);
    const toolerror = new Promise((resolve) => session.on("toolerror", resolve));
    sock.push({ type: "response.function_call_arguments.done", response_id: "resp_1", item_id: "item_1", call_id: "call_1", name: "slow", arguments: "{}", seq: 3 });
    sock.push({ type: "response.done", response: { id: "resp_1", status: "incomplete", status_details: { type: "incomplete", reason: "tool_timeout" }, output: [] }, seq: 4 });
    release("late");
    assert.equal((await toolerror).error.code, "response_ended");
    await tick(10);
    assert.equal(sock.sent.length, 1);
    await session.close();
  });

  test("a reconnect attempt with no answer is dropped after connectTimeoutMs and counts as failed", async () => {
    const { session, sock, fake } = await fakeSession({
      connectTimeoutMs: 30,
      reconnect: { initialDelayMs: 1, maxDelayMs: 2, maxAttempts: 2, random: () => 0 },
    });
    const closed = new Promise((resolve) => session.on("close", resolve));
    sock.drop(1006); // the attempts' sockets are never accepted: they hang
    const info = await closed;
    assert.equal(info.error.code, "reconnect_failed");
    assert.equal(fake.sockets.length, 3);
    assert.deepEqual(
      fake.sockets.slice(1).map((s) => s.readyState),
      [3, 3],
    );
  });
});

describe("a handshake the server refuses on reconnect (Node, ws)", () => {
  /** A server whose n-th upgrade gets `answers[n]`: an HTTP status, or "accept". */
  async function server(answers) {
    const wss = new WebSocketServer({ noServer: true, handleProtocols: (set) => [...set][0] });
    const http = createServer();
    let n = 0;
    http.on("upgrade", (req, socket, head) => {
      const answer = answers[Math.min(n++, answers.length - 1)];
      if (answer !== "accept") {
        socket.end(`HTTP/1.1 ${answer} Refused\r\nContent-Length: 0\r\nConnection: close\r\n\r\n`);
        return;
      }
      wss.handleUpgrade(req, socket, head, (ws) => {
        ws.on("message", (data) => {
          const event = JSON.parse(data.toString());
          if (event.type !== "session.resume") return;
          ws.send(JSON.stringify({ type: "session.created", session: { ...SESSION, id: "sess_new" }, seq: 1 }));
          ws.send(JSON.stringify({ type: "session.resumed", session: SESSION, last_seq: 1, replayed: 0, client_events: 0 }));
        });
        if (n === 1) ws.send(JSON.stringify({ type: "session.created", session: SESSION, seq: 1 }));
      });
    });
    http.listen(0, "127.0.0.1");
    await once(http, "listening");
    const stop = () => {
      for (const c of wss.clients) c.terminate();
      http.close();
    };
    return { url: `ws://127.0.0.1:${http.address().port}/v1/realtime`, wss, stop, upgrades: () => n };
  }

  const fast = { initialDelayMs: 1, maxDelayMs: 2, maxAttempts: 5, random: () => 0 };

  for (const [status, code] of [[401, "unauthorized"], [403, "unauthorized"], [404, "handshake_refused"]]) {
    test(`${status} ends the session with ${code}, no more attempts`, async () => {
      const srv = await server(["accept", status]);
      try {
        const session = await connect(srv.url, { protocol: "json", apiKey: "k", reconnect: fast });
        const closed = new Promise((resolve) => session.on("close", resolve));
        for (const c of srv.wss.clients) c.terminate();
        const info = await closed;
        assert.equal(info.error.code, code);
        assert.match(info.error.message, new RegExp(`HTTP ${status}`));
        await tick(20);
        assert.equal(srv.upgrades(), 2);
      } finally {
        srv.stop();
      }
    });
  }

  test("503 is retried, and the session resumes", async () => {
    const srv = await server(["accept", 503, "accept"]);
    try {
      const session = await connect(srv.url, { protocol: "json", apiKey: "k", reconnect: fast });
      const resumed = new Promise((resolve) => session.on("session.resumed", resolve));
      for (const c of srv.wss.clients) c.terminate();
      await resumed;
      assert.equal(session.state, "open");
      assert.equal(session.id, "sess_a");
      assert.equal(srv.upgrades(), 3);
      await session.close();
    } finally {
      srv.stop();
    }
  });
});

describe("reconnect timers, close codes, connect timeout (from a second audit)", () => {
  /** Records the codes `sock.close()` is called with. */
  function recordCloses(sock) {
    const codes = [];
    const close = sock.close.bind(sock);
    sock.close = (code, reason) => {
      codes.push(code);
      close(code, reason);
    };
    return codes;
  }

  test("a failed attempt's give-up timer does not start a second, parallel reconnect", async () => {
    const randoms = [0]; // attempt 1 at once, then the full backoff
    const { session, sock, fake } = await fakeSession({
      connectTimeoutMs: 20,
      reconnect: { initialDelayMs: 40, maxDelayMs: 1000, maxAttempts: 5, random: () => randoms.shift() ?? 0.999999 },
    });
    const attempts = [];
    session.on("reconnecting", (e) => attempts.push(e.attempt));
    sock.drop(1006);
    const sock1 = await fake.socket(1);
    sock1.drop(1006); // the attempt fails at once; attempt 2 waits 79 ms, past its 20 ms give-up timer
    const sock2 = await fake.socket(2);
    sock2.accept();
    sock2.push({ type: "session.created", session: { ...SESSION, id: "sess_fresh" }, seq: 1 });
    sock2.push({ type: "session.resumed", session: SESSION, last_seq: 1, replayed: 0, client_events: 0, seq: 2 });
    assert.equal(session.state, "open");
    await tick(250); // a second chain would have opened another socket by now
    assert.deepEqual(attempts, [1, 2]);
    assert.equal(fake.sockets.length, 3);
    assert.equal(session.ws, sock2);
    assert.equal(session.state, "open");
    await session.close();
  });

  test("a socket let go of that opens late sends nothing (no orphan session.resume)", async () => {
    const { session, sock, fake } = await fakeSession({
      connectTimeoutMs: 20,
      reconnect: { initialDelayMs: 1000, maxDelayMs: 1000, maxAttempts: 5, random: () => 0 },
    });
    sock.drop(1006);
    const sock1 = await fake.socket(1); // never answers: given up after 20 ms
    const closes = recordCloses(sock1);
    const sock2 = await fake.socket(2);
    sock1.accept(); // ...and opens after all
    assert.deepEqual(sock1.sent, []);
    assert.equal(closes.at(-1), 1000); // its own fresh session is ended
    sock2.accept();
    assert.equal(sock2.sent[0].type, "session.resume");
    await session.close();
  });

  test("a given-up attempt is closed with 4001, not cleanly: the server keeps the session", async () => {
    const { session, sock, fake } = await fakeSession({
      connectTimeoutMs: 20,
      reconnect: { initialDelayMs: 1000, maxDelayMs: 1000, maxAttempts: 5, random: () => 0 },
    });
    sock.drop(1006);
    const sock1 = await fake.socket(1);
    const closes = recordCloses(sock1);
    sock1.accept(); // the resume is sent; no answer comes
    assert.equal(sock1.sent[0].type, "session.resume");
    await fake.socket(2);
    // 1000, 1001 or no code would end the session (docs/protocol.md, Resume).
    assert.deepEqual(closes, [4001]);
    await session.close();
  });

  test("a long replay is not given up while events keep coming", async () => {
    const { session, sock, fake } = await fakeSession({
      connectTimeoutMs: 40,
      reconnect: { initialDelayMs: 1, maxDelayMs: 1, maxAttempts: 5, random: () => 0 },
    });
    sock.drop(1006);
    const sock1 = await fake.socket(1);
    sock1.accept();
    sock1.push({ type: "session.created", session: { ...SESSION, id: "sess_fresh" }, seq: 1 });
    // 150 ms of replay, an event every 10 ms: never silent for 40 ms.
    for (let seq = 2; seq < 17; seq++) {
      await tick(10);
      sock1.push({ type: "conversation.item.deleted", item_id: `item_${seq}`, seq });
    }
    sock1.push({ type: "session.resumed", session: SESSION, last_seq: 1, replayed: 15, client_events: 0, seq: 17 });
    assert.equal(fake.sockets.length, 2);
    assert.equal(session.state, "open");
    assert.equal(session.lastSeq, 17);
    await session.close();
  });

  test("a connect timeout ends the session: a late session.created opens nothing, nothing reconnects", async () => {
    const fake = fakeWebSocket();
    const session = new Session("ws://fake/v1/realtime", {
      protocol: "json",
      WebSocket: fake.FakeWebSocket,
      connectTimeoutMs: 20,
      reconnect: { random: () => 0 },
    });
    const opened = [];
    session.on("open", (e) => opened.push(e));
    const pending = session._start();
    const sock = await fake.socket(0);
    sock.close = function () {
      this.readyState = 2; // as `ws`: the close waits for the server's close frame
    };
    sock.accept();
    await assert.rejects(pending, { code: "connect_timeout" });
    assert.equal(session.state, "closed");
    // The server's session.created comes late, then the answer to the close.
    sock.push({ type: "session.created", session: SESSION, seq: 1 });
    sock.drop(1000);
    await tick(30);
    assert.deepEqual(opened, []);
    assert.equal(session.state, "closed");
    assert.equal(session.id, null);
    assert.equal(fake.sockets.length, 1);
  });
});

describe("values the wire cannot carry (from a second audit)", () => {
  const BAD = [
    ["NaN", () => NaN],
    ["Infinity", () => -Infinity],
    ["a Date", () => new Date(0)],
    ["a Uint8Array", () => new Uint8Array([1])],
    ["a Map", () => new Map([["a", "b"]])],
    ["a function", () => () => "x"],
    ["undefined", () => undefined],
  ];
  for (const protocol of ["json", "msgpack"]) {
    for (const [name, make] of BAD) {
      test(`[${protocol}] metadata holding ${name} is refused with invalid_value, and nothing is sent`, async () => {
        const { session, sock } = await fakeSession({ protocol });
        const r = session.createResponse({ metadata: { topic: "x", k: make() } });
        await tick(10);
        assert.equal(sock.sent.length, 0);
        await assert.rejects(r.created, (err) => err instanceof TokenwireError && err.code === "invalid_value" && err.param === "response.metadata.k");
        await assert.rejects(r.done(), { code: "invalid_value" });
        await session.close();
      });
    }

    test(`[${protocol}] a __proto__ key, NaN anywhere, undefined in an array: refused; an undefined field is left out`, async () => {
      const { session, sock } = await fakeSession({ protocol });
      const r = session.createResponse({ metadata: JSON.parse('{"__proto__": "x"}') });
      await assert.rejects(r.done(), { code: "invalid_value", param: "response.metadata.__proto__" });
      await assert.rejects(session.update({ temperature: NaN }), { code: "invalid_value", param: "session.temperature" });
      await assert.rejects(session.request({ type: "response.create", response: { input: [undefined] } }), {
        code: "invalid_value",
        param: "response.input.0",
      });
      const cyclic = { type: "object" };
      cyclic.self = cyclic;
      await assert.rejects(session.update({ tools: [{ name: "t", parameters: cyclic }] }), { code: "invalid_value" });
      await tick(10);
      assert.equal(sock.sent.length, 0);
      // An optional field set to undefined is "not given", as in JSON.stringify.
      session.createResponse({ instructions: undefined, metadata: { topic: "x" } });
      await until(() => sock.sent.length === 1);
      assert.deepEqual(sock.sent[0].response, { metadata: { topic: "x" } });
      await session.close();
    });
  }
});

describe("keepalive (Node: ws can ping)", () => {
  /** A fake with `ws`'s ping API: ping(), on(type, fn), terminate(). */
  function pingingFake() {
    const fake = fakeWebSocket();
    class PingingWebSocket extends fake.FakeWebSocket {
      constructor(...args) {
        super(...args);
        this.pings = 0;
        this.answers = true; // pong every ping
        this.terminated = false;
        this.listeners = {};
      }
      on(type, fn) {
        (this.listeners[type] ??= []).push(fn);
        return this;
      }
      emit(type) {
        for (const fn of this.listeners[type] ?? []) fn();
      }
      ping() {
        this.pings++;
        if (this.answers) queueMicrotask(() => this.emit("pong"));
      }
      terminate() {
        this.terminated = true;
        this.readyState = 3;
        queueMicrotask(() => {
          this.onclose?.({ code: 1006, reason: "" });
          this.emit("close");
        });
      }
    }
    fake.FakeWebSocket = PingingWebSocket;
    return fake;
  }

  test("defaults", () => {
    assert.deepEqual(DEFAULT_KEEPALIVE, { intervalMs: 15_000, timeoutMs: 10_000 });
  });

  test("a socket that stops answering pings is dropped, and the session resumed", async () => {
    const fake = pingingFake();
    const { session, sock } = await fakeSession({ keepalive: { intervalMs: 10, timeoutMs: 30 }, reconnect: { random: () => 0 } }, fake);
    const reconnecting = [];
    session.on("reconnecting", (e) => reconnecting.push(e));
    await tick(100);
    assert.ok(sock.pings >= 3, `${sock.pings} pings`);
    assert.deepEqual(reconnecting, []); // answered: alive
    sock.answers = false; // the peer is gone: no pong, no frame
    await until(() => reconnecting.length === 1, 1000, "the dead socket noticed");
    assert.equal(reconnecting[0].code, 1006);
    assert.match(reconnecting[0].reason, /no pong within 30 ms/);
    assert.equal(sock.terminated, true); // dropped, not closed cleanly: the session lives on
    const sock1 = await fake.socket(1);
    sock1.accept();
    assert.equal(sock1.sent[0].type, "session.resume");
    sock1.push({ type: "session.created", session: { ...SESSION, id: "sess_fresh" }, seq: 1 });
    sock1.push({ type: "session.resumed", session: SESSION, last_seq: 1, replayed: 0, client_events: 0, seq: 2 });
    assert.equal(session.state, "open");
    await session.close();
  });

  test("frames count as an answer; keepalive: false sends no ping", async () => {
    const fake = pingingFake();
    const { session, sock } = await fakeSession({ keepalive: { intervalMs: 10, timeoutMs: 30 } }, fake);
    sock.answers = false;
    const timer = setInterval(() => sock.emit("message"), 5); // a stream of events, pongs stuck behind it
    await tick(120);
    clearInterval(timer);
    assert.equal(session.state, "open");
    await session.close();

    const quiet = pingingFake();
    const off = await fakeSession({ keepalive: false }, quiet);
    await tick(50);
    assert.equal(off.sock.pings, 0);
    await off.session.close();
  });
});

describe("index.d.ts", () => {
  const dts = readFileSync(new URL("../src/index.d.ts", import.meta.url), "utf8");

  test("declares every export of index.js", async () => {
    const missing = Object.keys(await import("../src/index.js")).filter(
      (name) => !new RegExp(`export (const|function|class) ${name}\\b`).test(dts),
    );
    assert.deepEqual(missing, []);
  });

  // No TypeScript among the dev dependencies: what the types must say, as
  // text. Each line is a rule of docs/protocol.md.
  test("agrees with docs/protocol.md", () => {
    assert.match(dts, /type MaxOutputTokens = number \| "inf";/); // max_output_tokens: int | "inf"
    assert.equal(dts.match(/max_output_tokens\??: MaxOutputTokens/g)?.length, 3); // session.update, the session object, response.create
    assert.match(dts, /\binstructions: string \| null;/); // the session object's instructions: string | null
    assert.match(dts, /\binput\?: MessageItemInput\[\] \| string;/); // response.create input: message items only
    assert.doesNotMatch(dts, /§(?!9\D)\d/); // errors are §9
    for (const code of ["invalid_value", "response_ended", "message_too_big"]) assert.match(dts, new RegExp(`\\| "${code}"`));
    assert.match(dts, /keepalive\?: boolean \| KeepaliveOptions;/);
  });
});

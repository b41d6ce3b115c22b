// An unexpected server close triggers reconnect attempts, against a real server.
//
// The server is killed mid-response, so the client keeps trying (backoff with
// jitter) while nothing listens; then a new server starts on the same port and
// the client gets back in, sending session.resume first. A restarted server has
// lost the old session, so the resume is refused: what was in flight fails
// with `resume_failed` and the client goes on in the new session.
//
// A successful end-to-end resume (the server still holds the session) is in
// resume.test.js.

import assert from "node:assert/strict";
import { after, test } from "node:test";
import { connect } from "../src/index.js";
import { freePort, startServer } from "../test-support/server.js";

let server;
after(async () => {
  await server?.stop();
});

test("an unexpected server close triggers reconnect attempts", { timeout: 60_000 }, async () => {
  const port = await freePort();
  server = await startServer({ port, tokensPerS: 100 });
  const tw = await connect(server.wsUrl, {
    reconnect: { initialDelayMs: 20, maxDelayMs: 200, maxAttempts: 200 },
  });
  const firstSession = tw.id;
  const attempts = [];
  tw.on("reconnecting", (e) => attempts.push(e));
  const reconnected = new Promise((resolve) => tw.on("reconnected", resolve));
  const resumeFailed = new Promise((resolve) => tw.on("resumefailed", resolve));

  const r = tw.createResponse({ ignore_eos: true, max_output_tokens: 5000 });
  let seen = 0;
  for await (const ev of r) {
    if (ev.type === "response.output_text.delta" && ++seen === 3) break;
  }
  await server.stop({ signal: "SIGKILL" });

  // Nothing listens now: attempt after attempt fails, with growing delays.
  const deadline = Date.now() + 10_000;
  while (attempts.length < 4 && Date.now() < deadline) await new Promise((res) => setTimeout(res, 10));
  assert.ok(attempts.length >= 4, `${attempts.length} reconnect attempts`);
  assert.equal(tw.state, "reconnecting");
  assert.deepEqual(
    attempts.slice(0, 4).map((a) => a.attempt),
    [1, 2, 3, 4],
  );
  assert.equal(attempts[0].code, 1006);
  for (const [i, a] of attempts.entries()) {
    assert.ok(a.delayMs >= 0 && a.delayMs < Math.min(200, 20 * 2 ** i), `attempt ${a.attempt} waited ${a.delayMs} ms`);
  }
  assert.equal(r.status, "in_progress"); // still waiting to be resumed

  server = await startServer({ port, tokensPerS: 100 });
  await reconnected;
  const failed = await resumeFailed;
  assert.equal(failed.previousSessionId, firstSession);
  assert.notEqual(tw.id, firstSession);
  await assert.rejects(r.done(), { code: "resume_failed" });

  assert.equal(tw.state, "open");
  assert.equal(await tw.ask("back again"), "You said: back again");
  await tw.close();
});

// Node's client pings: a socket through which nothing comes any more (here the
// client's own end stops reading, as when a NAT or a peer silently goes) is
// noticed within the keepalive timeout, dropped without a clean close, and
// the session is resumed on a new one. Without pings the client would wait
// for ever.
test("a socket that stops answering pings is dropped, and the session resumed", { timeout: 60_000 }, async () => {
  const own = await startServer({ tokensPerS: 100 });
  const tw = await connect(own.wsUrl, {
    protocol: "json",
    keepalive: { intervalMs: 100, timeoutMs: 300 },
    reconnect: { initialDelayMs: 20, maxDelayMs: 100, random: () => 0.5 },
  });
  try {
    const sessionId = tw.id;
    const TOKENS = 200;
    const r = tw.createResponse({ ignore_eos: true, max_output_tokens: TOKENS });
    let seen = 0;
    for await (const ev of r) {
      if (ev.type === "response.output_text.delta" && ++seen === 5) break;
    }
    const reconnecting = new Promise((resolve) => tw.on("reconnecting", resolve));
    const resumed = new Promise((resolve) => tw.on("session.resumed", resolve));
    tw.ws._socket.pause(); // nothing gets through any more: no frame, no pong
    const noticed = await Promise.race([reconnecting, new Promise((res) => setTimeout(res, 5000, null))]);
    assert.ok(noticed, "the dead socket was not noticed within 5 s");
    assert.equal(noticed.code, 1006);
    assert.match(noticed.reason, /no pong within 300 ms/);
    await resumed;
    assert.equal(tw.id, sessionId); // the drop kept the session on the server
    const done = await r.done();
    assert.equal(done.status, "completed");
    assert.equal(r.textSoFar, Array.from({ length: TOKENS }, (_, i) => ` t${i}`).join(""));
  } finally {
    await tw.close();
    await own.stop();
  }
});

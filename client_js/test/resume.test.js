// End-to-end session resume against a real `tokenwire serve --engine scripted`.
//
// The client's socket is killed abnormally (ws.terminate(): no close frame),
// twice, in the middle of a long response; the first time after it stopped
// reading for 300 ms, so events the server wrote are lost with it. The server keeps the session for
// its resume grace period and goes on generating; the client reconnects by
// itself, sends session.resume first, ignores the fresh session.created of the
// new socket, gets the missed events replayed and then session.resumed. The
// response must come out whole: every token exactly once, same session id.

import assert from "node:assert/strict";
import { after, test } from "node:test";
import { connect } from "../src/index.js";
import { startServer } from "../test-support/server.js";

const TOKENS = 3000;
const EXPECTED = Array.from({ length: TOKENS }, (_, i) => ` t${i}`).join("");

let server;
after(async () => {
  await server?.stop();
});

for (const protocol of ["json", "msgpack"]) {
  test(`[${protocol}] a dropped socket is resumed: no gap, no duplicate, same session`, { timeout: 60_000 }, async (t) => {
    server ??= await startServer({ tokensPerS: 500 });
    const tw = await connect(server.wsUrl, {
      protocol,
      reconnect: { initialDelayMs: 20, maxDelayMs: 100, maxAttempts: 20, random: () => 0.5 },
    });
    try {
      const sessionId = tw.id;
      const lifecycle = [];
      const resumed = [];
      const seqs = [];
      const firstSeq = tw.lastSeq + 1; // session.created came before the listeners
      tw.on("reconnecting", (e) => lifecycle.push(`reconnecting:${e.code}`));
      tw.on("reconnected", () => lifecycle.push("reconnected"));
      tw.on("resumefailed", (e) => lifecycle.push(`resumefailed:${e.error.message}`));
      tw.on("session.resumed", (e) => resumed.push(e));
      tw.on("event", (e) => seqs.push(e.seq));

      const r = tw.createResponse({ ignore_eos: true, max_output_tokens: TOKENS, temperature: 0 });
      const deltas = [];
      for await (const d of r.text()) {
        deltas.push(d);
        if (deltas.length === 50) {
          // Stop reading for a while, so what the server sends meanwhile is
          // lost with the socket: the resume has to replay it.
          const ws = tw.ws;
          ws._socket.pause();
          await new Promise((res) => setTimeout(res, 300));
          ws.terminate(); // abnormal: no close frame
        } else if (deltas.length === 1500) {
          tw.ws.terminate(); // a plain drop: nothing to replay, the rest comes live
        }
      }

      assert.deepEqual(lifecycle, ["reconnecting:1006", "reconnected", "reconnecting:1006", "reconnected"]);
      assert.equal(resumed.length, 2);
      t.diagnostic(`replayed after each drop: ${resumed.map((e) => e.replayed).join(", ")}`);
      assert.ok(resumed[0].replayed > 0, "the first resume replayed the events lost with the socket");
      for (const e of resumed) assert.equal(e.session.id, sessionId);
      assert.equal(tw.id, sessionId);
      assert.equal(r.status, "completed");
      assert.equal(deltas.length, TOKENS);
      assert.equal(deltas.join(""), EXPECTED);
      assert.equal(await r.text(), EXPECTED);
      // Every event of the session arrived once, in order, none missing.
      assert.deepEqual(
        seqs,
        seqs.map((_, i) => firstSeq + i),
      );
      assert.equal(tw.lastSeq, seqs.at(-1));
      assert.equal(tw.state, "open");
      assert.equal(await tw.ask("still here?"), "You said: still here?");
    } finally {
      await tw.close();
    }
  });
}

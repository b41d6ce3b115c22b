// The client against a real `tokenwire serve --engine scripted`, on both
// subprotocols. The scripted engine answers "You said: <last user message>"
// word by word, or " t0 t1 ..." with ignore_eos.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { connect, TokenwireError } from "../src/index.js";
import { startServer } from "../test-support/server.js";

const WEATHER_TOOL = {
  type: "function",
  name: "get_weather",
  description: "Current weather in a city",
  parameters: {
    type: "object",
    properties: { city: { type: "string" } },
    required: ["city"],
  },
};

const LONG = { ignore_eos: true, max_output_tokens: 2000 }; // 10 s at 200 tokens/s

/** Read events until `n` text deltas have arrived. */
async function deltas(response, n) {
  let seen = 0;
  for await (const ev of response) {
    if (ev.type === "response.output_text.delta" && ++seen >= n) return;
    if (ev.type === "response.done") throw new Error("the response ended early");
  }
}

let server;
before(async () => {
  server = await startServer({ tokensPerS: 200 });
});
after(async () => {
  await server?.stop();
});

for (const protocol of ["msgpack", "json"]) {
  describe(`${protocol} subprotocol`, () => {
    let tw;
    before(async () => {
      tw = await connect(server.wsUrl, { protocol, apiKey: "test-key", reconnect: false });
    });
    after(async () => {
      await tw?.close();
    });

    test("connect: session.created and the negotiated subprotocol", () => {
      assert.equal(tw.subprotocol, `tokenwire.v1.${protocol}`);
      assert.equal(tw.session.subprotocol, `tokenwire.v1.${protocol}`);
      assert.match(tw.id, /^sess_[0-9a-f]{16}$/);
      assert.equal(tw.session.engine, "scripted");
      assert.equal(tw.lastSeq, 1);
      assert.equal(tw.state, "open");
    });

    test("session.update", async () => {
      const s = await tw.update({ instructions: "Be brief.", temperature: 0 });
      assert.equal(s.instructions, "Be brief.");
      assert.equal(s.temperature, 0);
      assert.equal(tw.session.instructions, "Be brief.");
    });

    test("a response streams: events, text deltas, text, done", async () => {
      await tw.addMessage("hello wire");
      const r = tw.createResponse({ metadata: { topic: "demo" } });
      assert.equal(r.status, "pending");
      const types = [];
      const seqs = [];
      let text = "";
      for await (const ev of r) {
        types.push(ev.type);
        seqs.push(ev.seq);
        if (ev.type === "response.output_text.delta") {
          assert.equal(ev.response_id, r.id);
          text += ev.delta;
        }
      }
      assert.equal(types[0], "response.created");
      assert.equal(types.at(-2), "response.output_text.done");
      assert.equal(types.at(-1), "response.done");
      assert.ok(seqs.every((s, i) => i === 0 || s === seqs[i - 1] + 1), `seq rises by one: ${seqs}`);
      assert.equal(text, "You said: hello wire");
      assert.equal(await r.text(), "You said: hello wire");
      assert.equal(r.textSoFar, "You said: hello wire");
      const done = await r.done();
      assert.equal(done.status, "completed");
      assert.deepEqual(done.metadata, { topic: "demo" });
      assert.equal(done.usage.output_tokens, 4);
      assert.equal(r.status, "completed");
      assert.match(r.id, /^resp_/);
    });

    test("r.text() iterates deltas; several readers each see everything", async () => {
      const r = tw.createResponse({ input: "one two three" });
      const read = async () => {
        const out = [];
        for await (const d of r.text()) out.push(d);
        return out;
      };
      const [a, b] = await Promise.all([read(), read()]);
      assert.deepEqual(a, ["You", " said:", " one", " two", " three"]);
      assert.deepEqual(b, a);
      // A late reader replays from the start.
      assert.deepEqual(await read(), a);
    });

    test("cancel stops the response at once", async () => {
      const r = tw.createResponse(LONG);
      await deltas(r, 3);
      const done = await r.cancel();
      assert.equal(done.status, "cancelled");
      assert.deepEqual(done.status_details, { type: "cancelled", reason: "client_cancelled" });
      assert.equal(r.events.at(-1).type, "response.done");
      const count = r.events.filter((e) => e.type === "response.output_text.delta").length;
      assert.ok(count < 100, `${count} deltas before the cancel took effect`);
      // Cancelling again is harmless; the conversation is free for the next response.
      assert.equal((await r.cancel()).status, "cancelled");
      assert.equal(await tw.ask("again"), "You said: again");
    });

    test("cancel before response.created arrives", async () => {
      const r = tw.createResponse(LONG);
      const done = await r.cancel();
      assert.equal(done.status, "cancelled");
    });

    test("steer: new input into the running response", async () => {
      await tw.addMessage(Array.from({ length: 200 }, (_, i) => `w${i}`).join(" "));
      const r = tw.createResponse();
      await deltas(r, 3);
      const steered = await r.steer("make it short");
      assert.equal(steered.type, "response.steered");
      assert.equal(steered.item.content, "make it short");
      assert.equal(r.status, "in_progress");
      const done = await r.done();
      assert.equal(done.status, "completed");
      assert.equal(done.output.length, 2);
      assert.equal(done.output[0].status, "incomplete");
      assert.equal(done.output[1].content, "You said: make it short");
      assert.ok((await r.text()).endsWith("You said: make it short"));
    });

    test("tool handlers are answered automatically; the same response continues", async () => {
      const calls = [];
      tw.tools.get_weather = async (args, call) => {
        calls.push({ args, name: call.name });
        return { city: args.city, temp_c: 21 };
      };
      try {
        await tw.addMessage("What is the weather in Paris?");
        const r = tw.createResponse({ tools: [WEATHER_TOOL], tool_choice: "required" });
        const text = await r.text();
        assert.deepEqual(calls, [{ args: { city: "Paris" }, name: "get_weather" }]);
        assert.equal(text, 'Tool said: {"city":"Paris","temp_c":21}');
        const types = r.events.map((e) => e.type);
        assert.ok(types.includes("response.function_call_arguments.delta"));
        assert.ok(types.indexOf("response.requires_action") < types.indexOf("response.output_text.delta"));
        assert.equal((await r.done()).status, "completed");
      } finally {
        delete tw.tools.get_weather;
      }
    });

    test("a tool handler that throws sends its error as the output", async () => {
      tw.tools.get_weather = async () => {
        throw new Error("no network");
      };
      try {
        await tw.addMessage("weather in Oslo?");
        const text = await tw.createResponse({ tools: [WEATHER_TOOL], tool_choice: "required" }).text();
        assert.equal(text, 'Tool said: {"error":"Error: no network"}');
      } finally {
        delete tw.tools.get_weather;
      }
    });

    test("a call with no handler can be answered by hand", async () => {
      await tw.addMessage("weather in Rome?");
      const r = tw.createResponse({ tools: [WEATHER_TOOL], tool_choice: { type: "function", name: "get_weather" } });
      for await (const ev of r) {
        if (ev.type === "response.function_call_arguments.done") {
          assert.deepEqual(JSON.parse(ev.arguments), { city: "Rome" });
        }
        if (ev.type === "response.requires_action") {
          assert.equal(r.status, "requires_action");
          await r.submitToolOutput(ev.call_ids[0], "sunny");
        }
      }
      assert.equal(await r.text(), "Tool said: sunny");
    });

    test("barge-in: cancel, then keep only what was heard", async () => {
      await tw.addMessage("the quick brown fox jumps over the lazy dog again and again and again");
      const r = tw.createResponse();
      await deltas(r, 4); // "You said: the quick"
      const heard = r.textSoFar.slice(0, 12);
      const { response, truncated } = await r.bargeIn(heard);
      assert.equal(response.status, "cancelled");
      assert.equal(truncated.length, 1);
      assert.equal(truncated[0].text_end, 12);
      const item = await tw.retrieveItem(truncated[0].item_id);
      assert.equal(item.content, heard);
      assert.equal(item.status, "incomplete");
    });

    test("deleteItem takes an item out of the conversation", async () => {
      const first = await tw.addMessage("forget this");
      await tw.addMessage("keep that");
      const deleted = await tw.deleteItem(first.id);
      assert.equal(deleted.type, "conversation.item.deleted");
      assert.equal(deleted.item_id, first.id);
      await assert.rejects(tw.retrieveItem(first.id), (err) => err.code === "unknown_item");
      assert.equal(await tw.createResponse({}).text(), "You said: keep that");
    });

    test("errors reject with a stable code; the connection stays open", async () => {
      await assert.rejects(
        tw.update({ temperature: 5 }),
        (err) => err instanceof TokenwireError && err.code === "invalid_field" && err.param === "session.temperature",
      );
      const first = tw.createResponse(LONG);
      const second = tw.createResponse({});
      await assert.rejects(second.done(), { code: "conversation_already_has_active_response" });
      await assert.rejects(second.created, { code: "conversation_already_has_active_response" });
      assert.equal(second.status, "failed");
      assert.equal((await first.cancel()).status, "cancelled");
      await assert.rejects(tw.truncate("item_nope", 0), { code: "unknown_item" });
      assert.equal(tw.state, "open");
      assert.equal(await tw.ask("still here"), "You said: still here");
    });

    test("out-of-band responses run beside the conversation", async () => {
      const main = tw.createResponse(LONG);
      const side = tw.createResponse({ conversation: "none", input: "side question" });
      assert.equal(await side.text(), "You said: side question");
      await main.cancel();
    });

    test("server events reach listeners", async () => {
      const seen = [];
      const off = tw.on("response.done", (ev) => seen.push(ev.response.status));
      let all = 0;
      const offAll = tw.on("event", () => all++);
      await tw.ask("listen");
      off();
      offAll();
      assert.deepEqual(seen, ["completed"]);
      assert.ok(all >= 7, `${all} events`);
    });
  });
}

test("a large tool output goes through the backpressure path", async () => {
  const tw = await connect(server.wsUrl, {
    reconnect: false,
    backpressure: { largeFrameBytes: 1024, highWaterMark: 0 },
    tools: { get_weather: async () => "z".repeat(200_000) },
  });
  try {
    await tw.addMessage("weather in Lima?");
    const text = await tw.createResponse({ tools: [WEATHER_TOOL], tool_choice: "required" }).text();
    assert.equal(text, `Tool said: ${"z".repeat(200_000)}`);
  } finally {
    await tw.close();
  }
});

test("connect fails cleanly when nothing listens", async () => {
  await assert.rejects(connect("ws://127.0.0.1:9/v1/realtime", { connectTimeoutMs: 3000 }), {
    code: "connect_failed",
  });
});

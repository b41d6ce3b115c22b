// The official `openai` npm package's OpenAIRealtimeWS, unmodified, against a
// tokenwire server over wss://: a text response, then one function-call round.
//
// Run by tests/openai_compat/test_js_sdk.py, which starts a TLS server with a test CA:
//   OPENAI_BASE_URL=https://127.0.0.1:PORT/v1 NODE_EXTRA_CA_CERTS=ca.pem \
//     node test-support/openai_realtime_ws.mjs
// It prints one JSON object: every server event received, and what it saw.
// It lives outside test/ because `node --test` runs every file under test/.

import OpenAI from "openai";
import { OpenAIRealtimeWS } from "openai/realtime/ws";

const WEATHER = {
  type: "function",
  name: "get_weather",
  description: "The weather in a city.",
  parameters: {
    type: "object",
    properties: { city: { type: "string" } },
    required: ["city"],
  },
};

// The base URL as a user gives it; the SDK derives wss://.../v1/realtime from it.
// The API key comes from OPENAI_API_KEY, as the SDK reads it by default.
const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL });
const rt = new OpenAIRealtimeWS({ model: "gpt-realtime" }, client);

const events = [];
const errors = [];
const waiting = [];

rt.on("event", (event) => {
  events.push(event);
  const i = waiting.findIndex((w) => w.type === event.type);
  if (i >= 0) waiting.splice(i, 1)[0].resolve(event);
});
rt.on("error", (err) => errors.push(String(err?.message ?? err)));

/** The next event of this type (registered before the send that causes it). */
function next(type, ms = 15000) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no ${type} within ${ms} ms`)), ms);
    waiting.push({
      type,
      resolve: (event) => {
        clearTimeout(timer);
        resolve(event);
      },
    });
  });
}

function userMessage(text) {
  return {
    type: "conversation.item.create",
    item: { type: "message", role: "user", content: [{ type: "input_text", text }] },
  };
}

function textOf(responseId) {
  return events
    .filter((e) => e.type === "response.output_text.delta" && e.response_id === responseId)
    .map((e) => e.delta)
    .join("");
}

const result = { url: rt.url.toString(), errors };
try {
  const created = next("session.created");
  created.catch(() => {}); // awaited below, once the socket is open
  await new Promise((resolve, reject) => {
    rt.socket.once("open", resolve);
    rt.socket.once("error", reject);
  });
  result.session = (await created).session;

  // A text response.
  let done = next("response.done");
  rt.send({ type: "session.update", session: { type: "realtime", output_modalities: ["text"] } });
  rt.send(userMessage("hello from node"));
  rt.send({ type: "response.create" });
  let response = (await done).response;
  result.text = { status: response.status, output: response.output, said: textOf(response.id) };

  // A tool round: the forced call ends the response; its output, then a new response.
  const updated = next("session.updated");
  rt.send({
    type: "session.update",
    session: {
      type: "realtime",
      tools: [WEATHER],
      tool_choice: { type: "function", name: "get_weather" },
    },
  });
  await updated;
  done = next("response.done");
  rt.send(userMessage("Weather in Paris?"));
  rt.send({ type: "response.create" });
  response = (await done).response;
  const call = response.output.find((item) => item.type === "function_call");
  result.call = { status: response.status, output: response.output };
  const args = JSON.parse(call.arguments);
  const toolResult = `${args.city}: sunny, 22 C`;

  done = next("response.done");
  rt.send({
    type: "conversation.item.create",
    item: { type: "function_call_output", call_id: call.call_id, output: toolResult },
  });
  rt.send({ type: "response.create", response: { tool_choice: "auto" } });
  response = (await done).response;
  result.answer = { status: response.status, output: response.output, said: textOf(response.id) };
} catch (err) {
  result.failure = String(err?.stack ?? err);
} finally {
  result.events = events;
  rt.close();
  // Exit once written: a wait that failed may leave its timer behind.
  process.stdout.write(JSON.stringify(result) + "\n", () => process.exit(0));
}

// The tokenwire demo page: a chat that streams, Stop, Steer, live stats.
// It uses the JS client straight from client_js/src (served at /client/).
//
// Auth: the page connects with a short-lived client secret (ek_...), never with
// an API key. It mints one at POST /v1/realtime/client_secrets, as an app's
// backend would for its browser clients: without a key first (a server with no
// API keys mints anonymously), else with the key the user types, which is used
// for that one request and not kept.

import { connect, TokenwireError } from "/client/index.js";

const $ = (id) => document.getElementById(id);
const ui = {
  transcript: $("transcript"),
  empty: $("empty"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  steerForm: $("steer-form"),
  steerInput: $("steer-input"),
  steer: $("steer"),
  error: $("error"),
  status: $("status"),
  ttft: $("ttft"),
  tps: $("tps"),
  tokens: $("tokens"),
  seq: $("seq"),
  protocol: $("protocol"),
  connDot: $("conn-dot"),
  connText: $("conn-text"),
  sessionId: $("session-id"),
  engine: $("engine"),
  subprotocol: $("subprotocol"),
  keyForm: $("key-form"),
  apiKey: $("api-key"),
};

const params = new URLSearchParams(location.search);
const wsUrl =
  params.get("ws") ?? `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/v1/realtime`;

const mintUrl = (() => {
  const url = new URL(wsUrl);
  url.protocol = url.protocol === "wss:" ? "https:" : "http:";
  url.pathname = "/v1/realtime/client_secrets";
  url.search = "";
  return url.toString();
})();
const SECRET_TTL_S = 3600; // the page mints a new one when this one is near its end

let session = null;
let current = null; // the Response being streamed
let connectSerial = 0;
let secret = null; // {value, expires_at} from the mint endpoint

// -- client secrets -------------------------------------------------------------

/** Mint a client secret; `apiKey` null tries without one. Resolves with the HTTP
 * status (0: the endpoint could not be reached, e.g. another origin via ?ws=). */
async function mint(apiKey) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  try {
    const res = await fetch(mintUrl, {
      method: "POST",
      headers,
      body: JSON.stringify({ expires_after: { anchor: "created_at", seconds: SECRET_TTL_S } }),
    });
    if (res.ok) secret = await res.json();
    return res.status;
  } catch {
    return 0;
  }
}

/** The secret to connect with: a string, null to connect without one (no
 * endpoint there), or undefined when the user must give an API key first. */
async function credential() {
  if (secret && secret.expires_at * 1000 > Date.now() + 60_000) return secret.value;
  secret = null;
  const status = await mint(null);
  if (secret) return secret.value;
  return status === 401 ? undefined : null;
}

function askForKey(text = "") {
  setConn("closed", "API key needed");
  ui.keyForm.hidden = false;
  if (text) showError(text);
  else hideError();
  ui.apiKey.focus();
}

// -- connection -----------------------------------------------------------------

function setConn(state, text) {
  ui.connDot.dataset.state = state;
  ui.connText.textContent = text;
}

async function open(protocol, notice = "") {
  const serial = ++connectSerial;
  if (session) {
    const old = session;
    session = null;
    old.close();
  }
  setConn("connecting", "connecting…");
  setBusy(false);
  ui.send.disabled = true;
  const apiKey = await credential();
  if (serial !== connectSerial) return;
  if (apiKey === undefined) return askForKey();
  try {
    const s = await connect(wsUrl, { protocol, apiKey: apiKey ?? undefined });
    if (serial !== connectSerial) return s.close();
    session = s;
  } catch (err) {
    if (serial !== connectSerial) return;
    if (protocol === "msgpack" && !(err instanceof TokenwireError)) {
      // The msgpack codec could not be loaded (/vendor/msgpack/ missing): JSON needs none.
      ui.protocol.value = "json";
      return open("json", `msgpack is not available here (${err.message}); using json.`);
    }
    setConn("closed", "offline");
    showError(`Could not connect to ${wsUrl}: ${err.message}`);
    return;
  }
  const s = session;
  s.on("event", () => (ui.seq.textContent = String(s.lastSeq)));
  s.on("reconnecting", ({ attempt }) => setConn("reconnecting", `reconnecting (attempt ${attempt})…`));
  s.on("reconnected", () => setConn("open", "connected"));
  s.on("resumefailed", () => {
    showError("The connection dropped and the session could not be resumed; this is a new session.");
    showSession(s);
  });
  s.on("close", () => {
    if (s !== session) return;
    setConn("closed", "disconnected");
    ui.send.disabled = true;
  });
  showSession(s);
  setConn("open", "connected");
  ui.send.disabled = false;
  ui.seq.textContent = String(s.lastSeq);
  if (notice) showError(notice);
  else hideError();
  ui.prompt.focus();
}

function showSession(s) {
  ui.sessionId.textContent = s.id ?? "–";
  ui.engine.textContent = s.session?.engine ?? "–";
  ui.subprotocol.textContent = s.subprotocol ?? "–";
}

// -- UI helpers -------------------------------------------------------------------

function showError(text) {
  ui.error.textContent = text;
  ui.error.hidden = false;
}

function hideError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

function setStatus(status) {
  ui.status.textContent = status;
  ui.status.dataset.status = status;
}

function setBusy(busy) {
  ui.send.disabled = busy || !session;
  ui.stop.disabled = !busy;
  ui.steerInput.disabled = !busy;
  ui.steer.disabled = !busy;
}

function addMessage(role, text) {
  ui.empty?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  if (text) body.textContent = text;
  el.append(body);
  ui.transcript.append(el);
  scrollDown();
  return el;
}

function scrollDown() {
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
}

const fmt = (n, digits = 0) => (n == null || !Number.isFinite(n) ? "–" : n.toFixed(digits));

// -- one turn ---------------------------------------------------------------------

async function send(text) {
  if (!session || current) return;
  hideError();
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  bubble.classList.add("streaming");
  const body = bubble.querySelector(".body");
  const footer = document.createElement("div");
  footer.className = "footer";
  bubble.append(footer);

  ui.ttft.textContent = "–";
  ui.tps.textContent = "–";
  ui.tokens.textContent = "0";
  setStatus("pending");
  setBusy(true);

  const spans = new Map(); // item_id -> span
  const t0 = performance.now();
  let first = null;
  let last = null;
  let tokens = 0;
  const r = session.createResponse({ input: text });
  current = r;
  try {
    for await (const ev of r) {
      switch (ev.type) {
        case "response.created":
          setStatus(ev.response.status);
          break;
        case "response.output_text.delta": {
          const now = performance.now();
          if (first === null) {
            first = now;
            ui.ttft.textContent = fmt(now - t0, 1);
          }
          last = now;
          tokens += 1;
          let span = spans.get(ev.item_id);
          if (!span) {
            span = document.createElement("span");
            span.className = "item";
            spans.set(ev.item_id, span);
            body.append(span);
          }
          span.append(ev.delta);
          ui.tokens.textContent = String(tokens);
          if (tokens > 1) ui.tps.textContent = fmt((tokens - 1) / ((now - first) / 1000), 1);
          scrollDown();
          break;
        }
        case "response.steered": {
          const mark = document.createElement("span");
          mark.className = "steer-mark";
          mark.textContent = `↪ ${ev.item.content}`;
          body.append(mark);
          setStatus("in_progress");
          break;
        }
        case "response.requires_action":
          setStatus("requires_action");
          break;
        case "error":
          showError(`${ev.error.code}: ${ev.error.message}`);
          break;
        case "response.done": {
          const res = ev.response;
          setStatus(res.status);
          const out = res.usage?.output_tokens;
          if (out != null) ui.tokens.textContent = String(out);
          if (out > 1 && first !== null && last > first) {
            ui.tps.textContent = fmt((out - 1) / ((last - first) / 1000), 1);
          }
          const bits = [res.status];
          if (res.status_details?.reason) bits.push(res.status_details.reason.replaceAll("_", " "));
          if (out != null) bits.push(`${out} tokens`);
          if (res.timings?.ttft_ms != null) bits.push(`server TTFT ${res.timings.ttft_ms} ms`);
          footer.textContent = bits.join(" · ");
          bubble.dataset.status = res.status;
          break;
        }
      }
    }
  } catch (err) {
    setStatus("failed");
    bubble.dataset.status = "failed";
    footer.textContent = "failed";
    showError(err.message);
  } finally {
    bubble.classList.remove("streaming");
    if (!body.textContent) body.classList.add("blank");
    current = null;
    setBusy(false);
    ui.prompt.focus();
  }
}

// -- wiring -------------------------------------------------------------------------

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || ui.send.disabled) return;
  ui.prompt.value = "";
  send(text);
});

ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    ui.composer.requestSubmit();
  }
});

ui.stop.addEventListener("click", async () => {
  const r = current;
  if (!r) return;
  ui.stop.disabled = true;
  try {
    await r.cancel();
  } catch (err) {
    showError(err.message);
  }
});

ui.steerForm.addEventListener("submit", async (e) => {
  e.preventDefault();
  const r = current;
  const text = ui.steerInput.value.trim();
  if (!r || !text) return;
  ui.steerInput.value = "";
  try {
    await r.steer(text);
  } catch (err) {
    showError(err.message);
  }
});

ui.keyForm.addEventListener("submit", async (e) => {
  e.preventDefault();
  const key = ui.apiKey.value.trim();
  if (!key) return;
  ui.apiKey.value = ""; // the key is not kept, in the page or in storage
  const status = await mint(key);
  if (!secret) {
    const why = status === 401 ? "that API key was refused" : `the server answered ${status || "nothing"}`;
    return askForKey(`Could not get a client secret: ${why}.`);
  }
  ui.keyForm.hidden = true;
  open(ui.protocol.value);
});

ui.protocol.addEventListener("change", () => {
  ui.transcript.replaceChildren();
  setStatus("idle");
  open(ui.protocol.value);
});

const initial = params.get("protocol") === "json" ? "json" : "msgpack";
ui.protocol.value = initial;
open(initial);

// The demo page against a server with API keys, in a real browser (see
// browser.test.js): it asks for the key once, trades it for a client secret at
// POST /v1/realtime/client_secrets, connects with the secret and keeps no key.

import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { after, before, test } from "node:test";
import { chromium } from "playwright-core";
import { startServer } from "../test-support/server.js";

const CHROMIUM = process.env.CHROMIUM_PATH ?? "/usr/bin/chromium";
const KEY = "demo-key-0123456789";

let server;
let browser;

before(async () => {
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: apt-get install chromium`);
  server = await startServer({ args: ["--api-keys", KEY] });
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"],
  });
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

const minted = async () => {
  const text = await (await fetch(`${server.httpUrl}metrics`)).text();
  return Number(/^tokenwire_client_secrets_minted_total (\S+)$/m.exec(text)[1]);
};

test("the page asks for the key, mints a client secret and connects with it", { timeout: 60_000 }, async () => {
  const page = await browser.newPage();
  const pageErrors = [];
  page.on("pageerror", (err) => pageErrors.push(err.message));
  const sockets = [];
  page.on("websocket", (ws) => sockets.push(ws));
  await page.goto(server.httpUrl);
  await page.waitForSelector("#key-form:not([hidden])", { timeout: 10_000 });
  assert.equal(await page.locator("#conn-dot").getAttribute("data-state"), "closed");
  assert.equal(sockets.length, 0); // no handshake it knew would fail

  await page.locator("#api-key").fill("not-the-key");
  await page.locator("#key-submit").click();
  await page.waitForFunction(() => /refused/.test(document.querySelector("#error").textContent));
  assert.equal(await minted(), 0);

  await page.locator("#api-key").fill(KEY);
  await page.locator("#api-key").press("Enter");
  await page.waitForSelector("#conn-dot[data-state=open]", { timeout: 10_000 });
  assert.ok(await page.locator("#key-form").isHidden());
  assert.equal(await page.locator("#api-key").inputValue(), ""); // not kept in the page
  assert.equal(await minted(), 1);
  const stored = await page.evaluate(() => JSON.stringify({ ...localStorage }) + JSON.stringify({ ...sessionStorage }));
  assert.ok(!stored.includes(KEY));

  await page.locator("#prompt").fill("hello secret");
  await page.locator("#send").click();
  await page.waitForSelector("#status[data-status=completed]", { timeout: 10_000 });
  assert.equal(await page.locator(".msg.assistant .body").last().textContent(), "You said: hello secret");

  // A new session (switching the wire format) reuses the secret: no key asked again.
  await page.locator("#protocol").selectOption("json");
  await page.waitForFunction(() => document.querySelector("#subprotocol").textContent === "tokenwire.v1.json");
  await page.waitForSelector("#conn-dot[data-state=open]", { timeout: 10_000 });
  assert.equal(await minted(), 1);
  assert.deepEqual(pageErrors, []);
  await page.close();
});

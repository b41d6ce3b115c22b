// The demo page in a real browser: playwright-core drives Debian's chromium
// (/usr/bin/chromium; `make test` installs it) against the page served by a
// real `tokenwire serve --engine scripted` at /.
//
// It types a prompt, sees the text stream in, presses Stop and sees status
// cancelled, and saves a screenshot to test-artifacts/demo.png.

import assert from "node:assert/strict";
import { existsSync, mkdirSync } from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";
import { chromium } from "playwright-core";
import { REPO_DIR, startServer } from "../test-support/server.js";

const CHROMIUM = process.env.CHROMIUM_PATH ?? "/usr/bin/chromium";
const ARTIFACTS = path.join(REPO_DIR, "test-artifacts");
const SCREENSHOT = path.join(ARTIFACTS, "demo.png");
const LAUNCH_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

// 30 words at 20 tokens/s: the answer streams for about 1.6 s.
const PROMPT = Array.from({ length: 30 }, (_, i) => `word${i}`).join(" ");
const FULL_ANSWER = `You said: ${PROMPT}`;

let server;
let browser;

before(async () => {
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: \`make test\` installs Debian's chromium (apt-get install chromium)`);
  server = await startServer({ tokensPerS: 20 });
  const res = await fetch(server.httpUrl);
  assert.equal(res.status, 200, `GET / must serve the demo page (static/index.html); got ${res.status}`);
  browser = await chromium.launch({ executablePath: CHROMIUM, args: LAUNCH_ARGS });
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

/** A fresh page on the demo, connected; page errors fail the test. */
async function openDemo(query = "") {
  const page = await browser.newPage({ viewport: { width: 1200, height: 760 } });
  const problems = [];
  page.on("pageerror", (err) => problems.push(`pageerror: ${err.message}`));
  page.on("console", (msg) => {
    if (msg.type() === "error") problems.push(`console: ${msg.text()}`);
  });
  await page.goto(server.httpUrl + query);
  await page.waitForSelector("#conn-dot[data-state=open]", { timeout: 10_000 });
  return { page, problems };
}

const lastAnswer = (page) => page.locator(".msg.assistant .body").last();
const status = (page) => page.locator("#status").getAttribute("data-status");

test("type a prompt, watch it stream, press Stop: status cancelled", { timeout: 60_000 }, async () => {
  const { page, problems } = await openDemo();
  assert.equal(await page.locator("#subprotocol").textContent(), "tokenwire.v1.msgpack");
  assert.ok(await page.locator("#stop").isDisabled());
  assert.ok(await page.locator("#steer-input").isDisabled());

  await page.locator("#prompt").fill(PROMPT);
  await page.locator("#send").click();

  // The text streams in: several different partial texts while in progress.
  const partials = new Set();
  const deadline = Date.now() + 10_000;
  while (partials.size < 3 && Date.now() < deadline) {
    const text = await lastAnswer(page).textContent();
    if (text && (await status(page)) === "in_progress") partials.add(text);
    await page.waitForTimeout(30);
  }
  assert.ok(partials.size >= 3, `saw ${partials.size} partial texts while streaming`);
  assert.ok([...partials].every((t) => FULL_ANSWER.startsWith(t)), [...partials].join(" | "));
  assert.ok(await page.locator("#stop").isEnabled());
  assert.ok(await page.locator("#steer-input").isEnabled());
  assert.notEqual(await page.locator("#ttft").textContent(), "–");

  await page.locator("#stop").click();
  await page.waitForSelector("#status[data-status=cancelled]", { timeout: 5000 });

  const stopped = await lastAnswer(page).textContent();
  assert.ok(stopped.length > 0 && stopped.length < FULL_ANSWER.length, `stopped at ${JSON.stringify(stopped)}`);
  assert.ok(FULL_ANSWER.startsWith(stopped));
  assert.match(await page.locator(".msg.assistant .footer").last().textContent(), /cancelled/);
  // Nothing more arrives after the stop, and the page is ready for the next turn.
  await page.waitForTimeout(400);
  assert.equal(await lastAnswer(page).textContent(), stopped);
  assert.ok(await page.locator("#send").isEnabled());
  assert.ok(await page.locator("#stop").isDisabled());
  assert.ok(await page.locator("#steer-input").isDisabled());
  assert.ok(Number(await page.locator("#seq").textContent()) > 5);
  assert.ok(Number(await page.locator("#tps").textContent()) > 0);

  mkdirSync(ARTIFACTS, { recursive: true });
  await page.screenshot({ path: SCREENSHOT });
  assert.deepEqual(problems, []);
  await page.close();
});

test("steer a running answer over the json subprotocol", { timeout: 60_000 }, async () => {
  const { page, problems } = await openDemo("?protocol=json");
  assert.equal(await page.locator("#subprotocol").textContent(), "tokenwire.v1.json");

  await page.locator("#prompt").fill(PROMPT);
  await page.locator("#prompt").press("Enter");
  await page.waitForFunction(() => document.querySelector("#status").dataset.status === "in_progress");
  await page.waitForFunction(() => document.querySelector(".msg.assistant .body")?.textContent.length > 12);
  await page.locator("#steer-input").fill("make it short");
  await page.locator("#steer").click();
  await page.waitForSelector("#status[data-status=completed]", { timeout: 10_000 });

  assert.equal(await page.locator(".steer-mark").textContent(), "↪ make it short");
  assert.ok((await lastAnswer(page).textContent()).endsWith("You said: make it short"));
  assert.match(await page.locator(".msg.assistant .footer").last().textContent(), /^completed/);
  assert.deepEqual(problems, []);
  await page.close();
});

test("without the msgpack build the page falls back to json", { timeout: 60_000 }, async () => {
  const page = await browser.newPage();
  const pageErrors = [];
  page.on("pageerror", (err) => pageErrors.push(err.message));
  await page.route("**/vendor/msgpack/**", (route) => route.fulfill({ status: 404, body: "" }));
  await page.goto(server.httpUrl);
  await page.waitForSelector("#conn-dot[data-state=open]", { timeout: 10_000 });
  assert.equal(await page.locator("#subprotocol").textContent(), "tokenwire.v1.json");
  assert.equal(await page.locator("#protocol").inputValue(), "json");
  assert.match(await page.locator("#error").textContent(), /msgpack is not available/);
  await page.locator("#prompt").fill("plain json");
  await page.locator("#send").click();
  await page.waitForSelector("#status[data-status=completed]", { timeout: 10_000 });
  assert.equal(await lastAnswer(page).textContent(), "You said: plain json");
  assert.deepEqual(pageErrors, []);
  await page.close();
});

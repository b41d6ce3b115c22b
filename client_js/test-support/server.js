// Test helper: run a real `tokenwire serve --engine scripted` on a free port.
//
// It lives outside test/ because `node --test` runs every file under test/ as
// a test file.

import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";

const HERE = path.dirname(fileURLToPath(import.meta.url));
export const CLIENT_DIR = path.resolve(HERE, "..");
export const REPO_DIR = path.resolve(CLIENT_DIR, "..");
export const TOKENWIRE_BIN = process.env.TOKENWIRE_BIN ?? path.join(REPO_DIR, ".venv", "bin", "tokenwire");

/** A TCP port that was free a moment ago. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.unref();
    srv.on("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

/**
 * Start a scripted tokenwire server; resolves when GET /readyz answers 200.
 * @param {{port?: number, tokensPerS?: number, args?: string[], timeoutMs?: number}} [opts]
 */
export async function startServer(opts = {}) {
  if (!existsSync(TOKENWIRE_BIN)) {
    throw new Error(`${TOKENWIRE_BIN} not found: run \`make install\` at the repo root first`);
  }
  const port = opts.port ?? (await freePort());
  const args = [
    "serve",
    "--engine",
    "scripted",
    "--host",
    "127.0.0.1",
    "--port",
    String(port),
    "--scripted-tokens-per-s",
    String(opts.tokensPerS ?? 200),
    "--log-level",
    "warning",
    ...(opts.args ?? []),
  ];
  const child = spawn(TOKENWIRE_BIN, args, { stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  child.stderr.on("data", (chunk) => {
    stderr = (stderr + chunk).slice(-8000);
  });
  const exited = new Promise((resolve) => child.once("exit", (code, signal) => resolve({ code, signal })));
  const base = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + (opts.timeoutMs ?? 30_000);
  let alive = true;
  exited.then(() => (alive = false));
  while (true) {
    if (!alive) throw new Error(`tokenwire exited before it was ready:\n${stderr}`);
    try {
      const res = await fetch(`${base}/readyz`);
      if (res.status === 200) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      child.kill("SIGKILL");
      throw new Error(`tokenwire was not ready within ${opts.timeoutMs ?? 30_000} ms:\n${stderr}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    port,
    child,
    httpUrl: `${base}/`,
    wsUrl: `ws://127.0.0.1:${port}/v1/realtime`,
    get stderr() {
      return stderr;
    },
    /** Stop the server (SIGTERM, then SIGKILL after 5 s); `signal: "SIGKILL"` simulates a crash. */
    async stop({ signal = "SIGTERM" } = {}) {
      if (!alive) return exited;
      child.kill(signal);
      const timer = setTimeout(() => child.kill("SIGKILL"), 5000);
      const result = await exited;
      clearTimeout(timer);
      return result;
    },
  };
}

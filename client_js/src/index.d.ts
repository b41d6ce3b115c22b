// Types for the tokenwire JavaScript client. The wire contract is docs/protocol.md.

export const SUBPROTOCOL_MSGPACK: "tokenwire.v1.msgpack";
export const SUBPROTOCOL_JSON: "tokenwire.v1.json";
export const AUTH_SUBPROTOCOL_PREFIX: "tokenwire.auth.";

export type WireProtocol = "msgpack" | "json";

// ---------------------------------------------------------------------------
// Protocol objects

export interface FunctionTool {
  type?: "function";
  name: string;
  description?: string;
  /** A JSON schema for the arguments object. */
  parameters?: Record<string, unknown>;
}

export type ToolChoice = "auto" | "none" | "required" | { type?: "function"; name: string };

export interface SessionConfig {
  instructions?: string;
  tools?: FunctionTool[];
  tool_choice?: ToolChoice;
  parallel_tool_calls?: boolean;
  temperature?: number;
  max_output_tokens?: number;
  tool_timeout_s?: number;
  /** Scheduling priority; a lower value runs first. */
  priority?: number;
}

export interface SessionObject extends Required<Omit<SessionConfig, "max_output_tokens">> {
  id: string;
  object: "realtime.session";
  engine: string;
  subprotocol: string;
  max_message_bytes: number;
  max_output_tokens: number | null;
  [key: string]: unknown;
}

export interface MessageItemInput {
  type: "message";
  role: "user" | "system" | "assistant";
  content: string;
  id?: string;
}

export interface FunctionCallOutputItemInput {
  type: "function_call_output";
  call_id: string;
  output: string;
  id?: string;
}

export type ItemInput = MessageItemInput | FunctionCallOutputItemInput;

export interface Item {
  id: string;
  object: "realtime.item";
  type: "message" | "function_call" | "function_call_output";
  role?: "user" | "system" | "assistant";
  content?: string;
  call_id?: string;
  name?: string;
  arguments?: string;
  output?: string;
  status: "completed" | "in_progress" | "incomplete";
}

export interface ResponseParams {
  instructions?: string;
  tools?: FunctionTool[];
  tool_choice?: ToolChoice;
  parallel_tool_calls?: boolean;
  temperature?: number;
  max_output_tokens?: number;
  conversation?: "auto" | "none";
  /** Items for this response; a string is one user message. */
  input?: ItemInput[] | string;
  metadata?: Record<string, string>;
  /** Scheduling priority of this response; a lower value runs first. */
  priority?: number;
  /** The sampler's seed: the same seed samples the same answer. */
  seed?: number | null;
  /** false: the response cache neither serves nor stores this response. */
  cache?: boolean;
  /** Tokens per text delta (the first and last come at once): fewer frames
   * and less server CPU when each token need not be seen as it comes. */
  stream_interval?: number;
  /** Benchmarking knob: generate exactly max_output_tokens. */
  ignore_eos?: boolean;
}

export type ResponseStatus =
  | "in_progress"
  | "requires_action"
  | "completed"
  | "cancelled"
  | "incomplete"
  | "failed";

export interface ResponseObject {
  id: string;
  object: "realtime.response";
  status: ResponseStatus;
  status_details: { type: string; reason?: string; error?: { code: string; message: string } } | null;
  conversation: "auto" | "none";
  metadata: Record<string, string> | null;
  output: Item[];
  usage?: { input_tokens: number; output_tokens: number; cached_tokens: number; total_tokens: number };
  timings?: {
    ttft_ms: number | null;
    queue_wait_ms: number;
    total_ms: number;
    output_tokens_per_s: number | null;
  };
}

export interface ErrorObject {
  type: string;
  code: string;
  message: string;
  event_id?: string;
  param?: string;
}

/** Any server event. Every one has `type` and `seq`. */
export interface ServerEvent {
  type: string;
  seq: number;
  event_id?: string;
  response_id?: string;
  item_id?: string;
  call_id?: string;
  name?: string;
  delta?: string;
  text?: string;
  arguments?: string;
  response?: ResponseObject;
  session?: SessionObject;
  item?: Item;
  error?: ErrorObject;
  [key: string]: unknown;
}

export interface FunctionCallDoneEvent extends ServerEvent {
  type: "response.function_call_arguments.done";
  response_id: string;
  item_id: string;
  call_id: string;
  name: string;
  arguments: string;
}

// ---------------------------------------------------------------------------
// Client

/** An `error` from the server, or a client-side failure, with a stable `code`. */
export class TokenwireError extends Error {
  constructor(error: Partial<ErrorObject> & Record<string, unknown>);
  readonly error: ErrorObject & Record<string, unknown>;
  /**
   * A server error code (docs/protocol.md §8), or a client one:
   * connect_failed, connect_timeout, connection_closed, reconnect_failed,
   * resume_failed, unauthorized, handshake_refused, message_too_big.
   */
  readonly code: string;
  readonly param?: string;
}

/**
 * Tool handler: gets the parsed arguments and the call event; its result (a
 * string as is, anything else JSON-encoded) or its thrown error
 * (`{"error": "..."}`) is sent back as the call's function_call_output.
 */
export type ToolHandler = (args: any, call: FunctionCallDoneEvent) => unknown | Promise<unknown>;

export interface ReconnectOptions {
  /** Base delay; attempt n waits random() * min(maxDelayMs, initialDelayMs * 2**n). Default 250. */
  initialDelayMs?: number;
  /** Default 10000. */
  maxDelayMs?: number;
  /** Consecutive failed attempts before giving up. Default 10. */
  maxAttempts?: number;
  /** Source of jitter in [0, 1); default Math.random. */
  random?: () => number;
}

export interface BackpressureOptions {
  /** An encoded event at least this big waits for the socket to drain. Default 16384. */
  largeFrameBytes?: number;
  /** ...while ws.bufferedAmount is above this. Default 65536. */
  highWaterMark?: number;
  /** How often bufferedAmount is checked while waiting. Default 5 ms. */
  pollIntervalMs?: number;
}

export interface ConnectOptions {
  /** Sent as `Authorization: Bearer` in Node (ws), as the subprotocol `tokenwire.auth.<key>` in browsers. */
  apiKey?: string;
  /** Wire format; default "msgpack". */
  protocol?: WireProtocol;
  /** Tool name -> handler, answered automatically. */
  tools?: Record<string, ToolHandler>;
  /** Reconnect and resume on an unexpected close; `false` turns it off. Default on. */
  reconnect?: boolean | ReconnectOptions;
  backpressure?: BackpressureOptions;
  /** Time to wait for session.created, and for each reconnect attempt's answer. Default 10000. */
  connectTimeoutMs?: number;
  /** A WebSocket constructor to use instead of the global one or `ws`. */
  WebSocket?: any;
  /** With options.WebSocket: whether it takes `{headers}` as a third argument, like `ws`. */
  headersSupported?: boolean;
  /** Extra options for `ws` (Node). */
  wsOptions?: Record<string, unknown>;
}

/** Awaitable for the full text, async-iterable for the deltas. */
export interface TextStream extends PromiseLike<string>, AsyncIterable<string> {}

export interface BargeInResult {
  response: ResponseObject;
  truncated: { item_id: string; text_end: number }[];
}

export class Response implements AsyncIterable<ServerEvent> {
  readonly session: Session;
  readonly params: ResponseParams;
  /** Set once response.created has arrived. */
  readonly id: string | null;
  /** event_id of the response.create. */
  readonly eventId: string | null;
  /** Every event of this response so far, in order (response.created first). */
  readonly events: ServerEvent[];
  /** The `response` of response.done, once it has arrived. */
  readonly result: ResponseObject | null;
  /** "pending" until response.created, then the server's status. */
  readonly status: "pending" | ResponseStatus;
  /** The response object of response.created; rejects if creation failed. */
  readonly created: Promise<ResponseObject>;
  /** Assistant text received so far. */
  readonly textSoFar: string;
  /** Events up to and including response.done; throws if the connection is lost for good. */
  [Symbol.asyncIterator](): AsyncIterator<ServerEvent>;
  /** `await r.text()`: the full text; `for await (const d of r.text())`: the deltas. */
  text(): TextStream;
  /** The response object of response.done. */
  done(): Promise<ResponseObject>;
  /** Stop it (the engine request is aborted); resolves with the final response object. */
  cancel(): Promise<ResponseObject>;
  /** New user input into the running response; resolves with response.steered. */
  steer(input: string): Promise<ServerEvent>;
  /**
   * Voice barge-in: cancel, then truncate the conversation at what the user
   * heard (the text, or its length in code points over the whole output).
   */
  bargeIn(heard: string | number): Promise<BargeInResult>;
  submitToolOutput(callId: string, output: unknown): Promise<Item>;
}

export type LifecycleEvent = "open" | "reconnecting" | "reconnected" | "resumefailed" | "close" | "toolerror" | "decodeerror";

export class Session {
  readonly url: string;
  readonly protocol: WireProtocol;
  /** The negotiated subprotocol. */
  readonly subprotocol: string | null;
  /** The server's session object (session.created / session.updated). */
  readonly session: SessionObject | null;
  readonly id: string | null;
  /** seq of the last server event received. */
  readonly lastSeq: number;
  readonly state: "connecting" | "open" | "reconnecting" | "closed";
  /** The current WebSocket. */
  readonly ws: any;
  /** Tool handlers; add or remove at any time. */
  tools: Record<string, ToolHandler>;

  /**
   * Server events by type, every server event ("event"), or lifecycle events:
   * open, reconnecting {attempt, delayMs, code, reason}, reconnected {attempt} (the
   * socket is back; the server event "session.resumed" confirms the resume),
   * resumefailed {previousSessionId, sessionId, error}, close {code, reason, error},
   * toolerror {call, error}, decodeerror. Returns an unsubscribe function.
   */
  on(type: string, listener: (payload: any) => void): () => void;

  /** Send an event without waiting for a reply. */
  send(event: Record<string, unknown>): Promise<void>;
  /** Send an event; resolve with the reply that echoes its event_id, reject with TokenwireError. */
  request(event: Record<string, unknown>): Promise<ServerEvent>;

  update(fields: SessionConfig): Promise<SessionObject>;
  createItem(item: ItemInput, previousItemId?: string): Promise<Item>;
  addMessage(content: string, role?: "user" | "system" | "assistant"): Promise<Item>;
  submitToolOutput(callId: string, output: unknown): Promise<Item>;
  /** Keep only the first `textEnd` code points of an assistant item. */
  truncate(itemId: string, textEnd: number): Promise<ServerEvent>;
  retrieveItem(itemId: string): Promise<Item>;
  /** Take an item out of the conversation (conversation.item.deleted). */
  deleteItem(itemId: string): Promise<ServerEvent>;
  /** Start a response; returns at once. */
  createResponse(params?: ResponseParams): Response;
  /** Add a user message, run a response, resolve with its text. */
  ask(text: string, params?: ResponseParams): Promise<string>;
  /** Close for good (no reconnect); resolves once closed. */
  close(code?: number, reason?: string): Promise<void>;
}

/** Open a session; resolves once session.created has arrived. */
export function connect(url: string, options?: ConnectOptions): Promise<Session>;

/** Reconnect delay for attempt n (0-based): exponential backoff with full jitter. */
export function backoffDelay(attempt: number, opts?: ReconnectOptions): number;

/** The subprotocols offered: the wire format, then the API-key entry if asked. */
export function subprotocols(protocol: WireProtocol, opts?: { apiKey?: string; keyInSubprotocol?: boolean }): string[];

/** Length in code points, the unit of `text_end`. */
export function codePointLength(text: string): number;
/** `value` with every lone UTF-16 surrogate replaced by U+FFFD (what the client sends). */
export function wellFormed<T>(value: T): T;

export const DEFAULT_RECONNECT: Readonly<Required<Omit<ReconnectOptions, "random">>>;
export const DEFAULT_BACKPRESSURE: Readonly<Required<BackpressureOptions>>;

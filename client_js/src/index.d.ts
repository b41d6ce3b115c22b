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

/** An output cap: 1…2³¹−1 tokens, or "inf" (no cap but the context's room). */
export type MaxOutputTokens = number | "inf";

/** Fields of session.update. An omitted (or null) field stays unchanged. */
export interface SessionConfig {
  /** "" drops the system message; null leaves it as it is. */
  instructions?: string | null;
  tools?: FunctionTool[];
  tool_choice?: ToolChoice;
  parallel_tool_calls?: boolean;
  temperature?: number;
  max_output_tokens?: MaxOutputTokens;
  tool_timeout_s?: number;
  /** Scheduling priority; a lower value runs first. */
  priority?: number;
}

export interface SessionObject extends Required<Omit<SessionConfig, "instructions" | "max_output_tokens">> {
  id: string;
  object: "realtime.session";
  engine: string;
  subprotocol: string;
  max_message_bytes: number;
  /** The server's cap, used when max_output_tokens is null. */
  default_max_output_tokens: number;
  /** null until set. */
  instructions: string | null;
  /** null: default_max_output_tokens applies. */
  max_output_tokens: MaxOutputTokens | null;
  /** Present (true) when the server runs --response-cache. */
  response_cache?: boolean;
  /** The guardrail filters on this session's output; absent when the server has none. */
  guardrails?: string[];
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
  /** null (or omitted): the session's. */
  instructions?: string | null;
  tools?: FunctionTool[];
  tool_choice?: ToolChoice;
  parallel_tool_calls?: boolean;
  temperature?: number;
  /** For the whole response, across steers and tool rounds. */
  max_output_tokens?: MaxOutputTokens;
  conversation?: "auto" | "none";
  /**
   * Message items for this response (appended to the conversation with
   * "auto", its whole context with "none"); a string is one user message.
   * The server refuses a function_call_output here: send it with
   * createItem / submitToolOutput.
   */
  input?: MessageItemInput[] | string;
  /** At most 16 pairs of strings (keys up to 64, values up to 512 characters). */
  metadata?: Record<string, string> | null;
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

/** Why a response ended incomplete or cancelled (status_details.reason). */
export type ResponseEndReason =
  | "max_output_tokens"
  | "content_filter"
  | "tool_timeout"
  | "engine_aborted"
  | "client_cancelled"
  | "client_disconnected";

export interface ResponseObject {
  id: string;
  object: "realtime.response";
  status: ResponseStatus;
  /** null, or {type: status, reason} (incomplete, cancelled), or {type: "failed", error}. */
  status_details: {
    type: "incomplete" | "cancelled" | "failed";
    reason?: ResponseEndReason;
    /** A server error code (docs/protocol.md §9), e.g. invalid_tool_arguments. */
    error?: { code: string; message: string };
  } | null;
  conversation: "auto" | "none";
  metadata: Record<string, string> | null;
  output: Item[];
  usage?: {
    input_tokens: number;
    output_tokens: number;
    cached_tokens: number;
    total_tokens: number;
    /** true when the response cache served it. */
    cached_response?: boolean;
  };
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

/**
 * Codes of failures found by the client itself (`error.type` "client_error").
 * invalid_value: a value neither wire format carries faithfully (NaN, a Date,
 * bytes, ...), refused before anything is sent; `param` names it.
 * response_ended: a tool handler returned after its response ended (toolerror).
 */
export type ClientErrorCode =
  | "connect_failed"
  | "connect_timeout"
  | "connection_closed"
  | "reconnect_failed"
  | "resume_failed"
  | "unauthorized"
  | "handshake_refused"
  | "message_too_big"
  | "invalid_value"
  | "response_ended";

/** An `error` from the server, or a client-side failure, with a stable `code`. */
export class TokenwireError extends Error {
  constructor(error: Partial<ErrorObject> & Record<string, unknown>);
  readonly error: ErrorObject & Record<string, unknown>;
  /** A server error code (docs/protocol.md §9 Errors), or a ClientErrorCode. */
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

/**
 * Dead-socket detection, where the WebSocket can ping (Node's `ws`; browsers
 * cannot, and skip it): a ping every intervalMs; a socket through which
 * nothing (pong, ping, frame) has come for timeoutMs after a ping is dropped
 * (not closed cleanly, so the server keeps the session) and resumed, as after
 * a 1006.
 */
export interface KeepaliveOptions {
  /** Default 15000. */
  intervalMs?: number;
  /** Default 10000. */
  timeoutMs?: number;
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
  /** Pings from Node to notice a dead socket; `false` turns it off. Default on. */
  keepalive?: boolean | KeepaliveOptions;
  /**
   * Time to wait for session.created; and how long a reconnect attempt may
   * stay silent (nothing received) before it is dropped. Default 10000.
   */
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
   * toolerror {call, error} (error.code response_ended when the response had
   * ended), decodeerror. Returns an unsubscribe function.
   */
  on(type: string, listener: (payload: any) => void): () => void;

  /**
   * Send an event without waiting for a reply. Every call that sends rejects
   * with `invalid_value` (nothing sent) for a value the wire cannot carry.
   */
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
export const DEFAULT_KEEPALIVE: Readonly<Required<KeepaliveOptions>>;

"""`hf-kvcache serve`: OpenAI-style completions and chat over transformers' continuous batching, its pages packed in a
preset's format (`hf_kvcache.paged`).

One manager (`model.init_continuous_batching`) runs the batches in its own thread; each HTTP request adds its prompt
and waits for its result, which one dispatcher thread takes from the manager's output queue and hands to the request
that asked. The standard library serves HTTP (`ThreadingHTTPServer`): no web framework to install. Endpoints:
`POST /v1/completions`, `POST /v1/chat/completions` (`"stream": true` answers in server-sent events), `GET /v1/models`,
`GET /health`. Sampling is the
server's (`--do-sample`, `--temperature`, `--top-p`); a request sets `max_tokens`.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import describe


class RequestError(ValueError):
    """A bad request body: answered with status 400 and the message."""


class Server:
    """A model, its tokenizer and a continuous-batching manager over packed pages, behind an HTTP server.

    `start()` starts the manager and the dispatcher, `serve_forever()` answers requests, `stop()` ends both."""

    def __init__(self, model, tokenizer, kv_cache: str, *, name: str, host: str = "127.0.0.1", port: int = 8000,
                 max_tokens: int = 256, do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                 timeout: float = 600.0, **cb_kwargs):
        from transformers import GenerationConfig

        from .paged import PackedBatchingConfig

        self.model, self.tokenizer, self.kv_cache, self.name = model, tokenizer, kv_cache, name
        self.max_tokens, self.timeout = max_tokens, timeout
        eos = tokenizer.eos_token_id
        self.generation_config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=do_sample, temperature=temperature if do_sample else None,
            top_p=top_p if do_sample else None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or eos)
        self.cb_config = PackedBatchingConfig(kv_cache, **cb_kwargs)
        self.manager = None
        self._waiting: dict[str, queue.Queue] = {}  # request id -> its outputs, as the dispatcher takes them
        self._lock = threading.Lock()
        self._running = self._serving = False
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    def start(self) -> Server:
        self.manager = self.model.init_continuous_batching(generation_config=self.generation_config,
                                                           continuous_batching_config=self.cb_config)
        self.manager.start()
        self._running = True
        self._dispatcher = threading.Thread(target=self._dispatch, name="hf-kvcache-dispatch", daemon=True)
        self._dispatcher.start()
        return self

    def serve_forever(self) -> None:
        self._serving = True
        try:
            self.httpd.serve_forever()
        finally:
            self._serving = False

    def stop(self) -> None:
        if self._serving:  # served from another thread (a Ctrl-C in the serving one has left its loop already)
            self.httpd.shutdown()
        self.httpd.server_close()
        self._running = False
        if self.manager is not None:
            self.manager.stop(block=True)
        with self._lock:
            for inbox in self._waiting.values():
                inbox.put(None)

    def _dispatch(self) -> None:
        while self._running:
            result = self.manager.get_result(timeout=0.1)
            if result is None:
                continue
            with self._lock:
                inbox = self._waiting.get(result.request_id)
            if inbox is not None:
                inbox.put(result)

    def results(self, prompt_ids: list[int], max_tokens: int, streaming: bool = False) -> Iterator:
        """Add one request and yield its outputs as they come (every token when `streaming`, else the last), ending
        with the finished one; a request left before its end (a client gone) is cancelled."""
        request_id = f"req-{uuid.uuid4().hex}"
        inbox: queue.Queue = queue.Queue()
        with self._lock:
            self._waiting[request_id] = inbox
        finished = False
        try:
            self.manager.add_request(prompt_ids, request_id=request_id, max_new_tokens=max_tokens, streaming=streaming)
            deadline = time.monotonic() + self.timeout
            while not finished:
                try:
                    result = inbox.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    raise TimeoutError(f"no result within {self.timeout:g} s") from None
                if result is None:
                    raise RuntimeError("the server is stopping")
                if result.error:
                    raise RuntimeError(str(result.error))
                finished = result.is_finished()
                yield result
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
            if not finished and self._running:
                self.manager.cancel_request(request_id)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        """One request to its end: `(generated token ids, finish reason)`."""
        *_, result = self.results(prompt_ids, max_tokens)
        tokens = list(result.generated_tokens)
        return tokens, self._reason(tokens, max_tokens)

    def _reason(self, tokens: list[int], max_tokens: int) -> str:
        eos = self.generation_config.eos_token_id
        stopped = bool(tokens) and tokens[-1] in (eos if isinstance(eos, list) else [eos])
        return "stop" if stopped or len(tokens) < max_tokens else "length"

    def _text(self, tokens: list[int]) -> str:
        eos = self.generation_config.eos_token_id
        return self.tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=True)

    # --- the API
    def _max_tokens(self, body: dict) -> int:
        n = body.get("max_tokens", body.get("max_completion_tokens", self.max_tokens))
        if not isinstance(n, int) or n < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {n!r}")
        return n

    def _checked(self, body: dict) -> int:
        """The request's max_tokens, after refusing what this server does not do."""
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1")
        return self._max_tokens(body)

    def _answer(self, prompt_ids: list[int], max_tokens: int) -> tuple[str, str, int, int]:
        tokens, reason = self.generate(prompt_ids, max_tokens)
        return self._text(tokens), reason, len(prompt_ids), len(tokens)

    def _stream(self, kind: str, prompt_ids: list[int], max_tokens: int) -> Iterator[dict]:
        """The chunks of a streamed answer: the text each new token adds (decoded whole, so that a character split
        over tokens comes out once), then the finish reason."""
        chat = kind == "chat.completion.chunk"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": kind,
                "created": int(time.time()), "model": self.name}
        sent, tokens = "", []
        for result in self.results(prompt_ids, max_tokens, streaming=True):
            tokens = list(result.generated_tokens)
            text = self._text(tokens)
            if len(text) > len(sent) and not text.endswith("\ufffd"):
                delta, sent = text[len(sent):], text
                yield head | {"choices": [{"index": 0, "finish_reason": None,
                                           **({"delta": {"content": delta}} if chat else {"text": delta})}]}
        yield head | {"choices": [{"index": 0, "finish_reason": self._reason(tokens, max_tokens),
                                   **({"delta": {}} if chat else {"text": ""})}]}

    def completions(self, body: dict) -> dict | Iterator[dict]:
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise RequestError("prompt must be a string or a list of strings")
        max_tokens = self._checked(body)
        if body.get("stream"):
            if len(prompts) != 1:
                raise RequestError("stream=true takes one prompt")
            return self._stream("text_completion", self.tokenizer(prompts[0])["input_ids"], max_tokens)
        choices, used, made = [], 0, 0
        with ThreadPoolExecutor(len(prompts)) as pool:  # every prompt of the list at once: they batch together
            answers = list(pool.map(lambda p: self._answer(self.tokenizer(p)["input_ids"], max_tokens), prompts))
        for i, (text, reason, n_in, n_out) in enumerate(answers):
            choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
            used, made = used + n_in, made + n_out
        return self._response("text_completion", choices, used, made)

    def chat(self, body: dict) -> dict | Iterator[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content}")
        max_tokens = self._checked(body)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if body.get("stream"):
            return self._stream("chat.completion.chunk", list(ids), max_tokens)
        text, reason, n_in, n_out = self._answer(list(ids), max_tokens)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        return self._response("chat.completion", [choice], n_in, n_out)

    def _response(self, kind: str, choices: list, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": kind, "created": int(time.time()), "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "hf-kvcache"}]}

    def health(self) -> dict:
        return {"status": "ok", "model": self.name, "kv_cache": self.kv_cache, "kv_cache_format": describe(self.kv_cache)}


def _chain(first: dict, rest: Iterator[dict]) -> Iterator[dict]:
    yield first
    yield from rest


def _handler(server: Server) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: a server's log is its caller's business
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _send_events(self, chunks: Iterator[dict]) -> None:
            """Server-sent events, one chunk each, then `[DONE]`; the connection closes after them."""
            first = next(chunks)  # an error before the first token is still answered with its status
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                for chunk in _chain(first, chunks):
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                chunks.close()  # the client left: its request is cancelled
            except Exception as error:  # the status is sent: the stream ends with the error as its last event
                message = {"error": {"message": f"{type(error).__name__}: {error}", "type": "server_error"}}
                self.wfile.write(b"data: " + json.dumps(message).encode() + b"\n\n")

        def _error(self, status: int, message: str, kind: str) -> None:
            self._send(status, {"error": {"message": message, "type": kind}})

        def do_GET(self) -> None:
            routes = {"/v1/models": server.models, "/health": server.health}
            route = routes.get(self.path.rstrip("/"))
            if route is None:
                self._error(404, f"no route {self.path}: try POST /v1/completions or /v1/chat/completions",
                            "not_found")
                return
            self._send(200, route())

        def do_POST(self) -> None:
            routes = {"/v1/completions": server.completions, "/v1/chat/completions": server.chat}
            route = routes.get(self.path.rstrip("/"))
            if route is None:
                self._error(404, f"no route {self.path}", "not_found")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                answer = route(body)
                if isinstance(answer, dict):
                    self._send(200, answer)
                else:
                    self._send_events(answer)
            except (RequestError, json.JSONDecodeError) as error:
                self._error(400, str(error), "invalid_request_error")
            except TimeoutError as error:
                self._error(504, str(error), "timeout")
            except Exception as error:  # the server keeps serving; the client learns what broke
                self._error(500, f"{type(error).__name__}: {error}", "server_error")

    return Handler


def add_parser(sub) -> None:
    """The `hf-kvcache serve` command's arguments."""
    serve = sub.add_parser(
        "serve",
        help="OpenAI-style completions and chat over transformers' continuous batching, its pages packed",
        description="Serves POST /v1/completions and /v1/chat/completions (\"stream\": true too), GET /v1/models and /health "
        "with transformers' continuous batching, every page holding the --kv-cache preset's packed bytes: the same "
        "memory holds more tokens and more requests at once. Needs transformers >= 5.25.",
    )
    serve.add_argument("model", nargs="?", default=None, help="a local model directory or hub id already cached "
                       "(default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--kv-cache", default="turboquant-4", help="a make_cache spec (default turboquant-4; "
                       "'none': transformers' own pages in the model dtype)")
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="default 8000 (0: any free port)")
    serve.add_argument("--max-tokens", type=int, default=256, help="new tokens when a request names none")
    serve.add_argument("--page-size", type=int, default=256, help="tokens per page (default 256)")
    serve.add_argument("--max-memory-percent", type=float, default=None,
                       help="share of free GPU memory for the pages (transformers' default when left out)")
    serve.add_argument("--num-blocks", type=int, default=None, help="pages per layer, instead of a memory share")
    serve.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per forward (default: inferred)")
    serve.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    serve.add_argument("--temperature", type=float, default=1.0)
    serve.add_argument("--top-p", type=float, default=1.0)
    serve.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                       help="model dtype (default: bf16 on CUDA, fp32 on the CPU)")
    serve.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def main(args: argparse.Namespace) -> int:
    """`hf-kvcache serve`: load the model, serve until Ctrl-C or SIGTERM; 0, or 2 with one line for a bad argument."""
    import signal

    import torch

    from . import load_model
    from .presets import parse_spec

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[args.dtype]
    cb = {k: v for k, v in (("page_size", args.page_size), ("max_memory_percent", args.max_memory_percent),
                            ("num_blocks", args.num_blocks), ("max_batch_tokens", args.max_batch_tokens))
          if v is not None}
    try:
        parse_spec(args.kv_cache)  # a bad spec is told before the model loads
        model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
        server = Server(model, tokenizer, args.kv_cache, name=args.model or "smollm2-135m-instruct", host=args.host,
                        port=args.port, max_tokens=args.max_tokens, do_sample=args.do_sample,
                        temperature=args.temperature, top_p=args.top_p, **cb)
    except (ValueError, ImportError, OSError) as error:
        print(f"hf-kvcache: error: {error}", file=sys.stderr)
        return 2
    def terminate(signum, frame):
        raise KeyboardInterrupt  # SIGTERM stops it as Ctrl-C does

    signal.signal(signal.SIGTERM, terminate)
    server.start()
    host, port = server.address
    print(f"serving {server.name} with a {args.kv_cache} cache on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0

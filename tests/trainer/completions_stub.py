"""A ``/v1/completions`` stand-in for the evaluation tests: a real HTTP server on 127.0.0.1 whose
answer to each request is ``answer(payload)``'s text, returned as the replica returns it (its
token ids under the model's tokenizer, and the text)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def completions_server(answer: Callable[[dict], str], tokenizer) -> Iterator[str]:
    """Serve ``POST /v1/completions`` on a free loopback port until the block ends; yields the
    base URL. ``answer`` gets each request's JSON body and returns the completion's text;
    ``tokenizer`` (a ``transformers`` tokenizer, or a zero-argument callable returning one, for
    a test that sets it later) encodes it into the ``token_ids`` field."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = answer(payload)
            tok = (
                tokenizer()
                if callable(tokenizer) and not hasattr(tokenizer, "encode")
                else tokenizer
            )
            ids = tok.encode(text, add_special_tokens=False)
            body = json.dumps({"choices": [{"token_ids": ids, "text": text}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # a quiet terminal
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()

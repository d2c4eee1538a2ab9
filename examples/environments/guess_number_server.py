"""A reference environment server: a number-guessing game over AstraFlow's task-server protocol.

Run it, and point an ``http`` environment at the URL it prints::

    python examples/environments/guess_number_server.py --port 0
    # -> http://127.0.0.1:43121

    POST /start  {"sample_id": "7"}                       -> {"episode_id", "observation"}
    POST /step   {"episode_id", "action": "I guess 50"}  -> {"observation", "reward", "done"}
    POST /cancel {"episode_id"}                           -> {"cancelled": true|false}
    GET  /health                                          -> {"ok": true, "episodes": N}

The secret number (1..100) follows from the ``sample_id``, so every sample of a group plays the same
game. An action's first integer is the guess; the observation is ``higher``, ``lower`` or
``correct``. ``correct`` ends the episode with reward 1; running out of guesses ends it with 0.

Failure switches, so tests (and you) can watch the adapter's failure handling: a ``sample_id``
starting with ``fail`` answers ``start`` with HTTP 500; ``--fail-after N`` answers every request
after the first N with 500 (a server that breaks mid-run); ``--unavailable N`` answers the first N
requests with 503 (a server still starting, which clients retry).

Standard library only (``http.server``), one thread per connection.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOW, HIGH = 1, 100


@dataclass
class Game:
    secret: int
    guesses_left: int


def secret_for(sample_id: object) -> int:
    """The game's number for ``sample_id``: a stable hash, the same in every process."""
    digest = hashlib.sha256(str(sample_id).encode()).digest()
    return LOW + int.from_bytes(digest[:8], "big") % (HIGH - LOW + 1)


class GuessNumberServer(ThreadingHTTPServer):
    """The HTTP server with the game state and the failure switches."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], *, max_guesses: int = 7, fail_after: int | None = None,
                 unavailable: int = 0) -> None:
        super().__init__(address, Handler)
        self.max_guesses = max_guesses
        self.fail_after = fail_after
        self.unavailable = unavailable
        self.requests_seen = 0
        self.games: dict[str, Game] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def handle_call(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) of one protocol request."""
        with self.lock:
            self.requests_seen += 1
            if self.requests_seen <= self.unavailable:
                return 503, {"error": "starting up, try again"}
            if self.fail_after is not None and self.requests_seen > self.fail_after:
                return 500, {"error": "the server broke (--fail-after)"}
            if path == "/start":
                return self.start(body)
            if path == "/step":
                return self.step(body)
            if path == "/cancel":
                return 200, {"cancelled": self.games.pop(str(body.get("episode_id")), None) is not None}
            return 404, {"error": f"no such endpoint {path}"}

    def start(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if "sample_id" not in body:
            return 400, {"error": "start needs a sample_id"}
        sample_id = body["sample_id"]
        if str(sample_id).startswith("fail"):
            return 500, {"error": f"cannot load game {sample_id!r}"}
        episode_id = uuid.uuid4().hex
        self.games[episode_id] = Game(secret_for(sample_id), self.max_guesses)
        return 200, {"episode_id": episode_id,
                     "observation": f"Guess my number between {LOW} and {HIGH}. "
                                    f"You have {self.max_guesses} guesses. Answer with a number."}

    def step(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        game = self.games.get(str(body.get("episode_id")))
        if game is None:
            return 404, {"error": f"no episode {body.get('episode_id')!r} (finished, cancelled or never started)"}
        game.guesses_left -= 1
        found = re.search(r"-?\d+", str(body.get("action", "")))
        if found is None:
            observation, reward = f"Please answer with a number between {LOW} and {HIGH}.", 0.0
        else:
            guess = int(found.group())
            observation = "correct" if guess == game.secret else "higher" if guess < game.secret else "lower"
            reward = 1.0 if observation == "correct" else 0.0
        done = reward > 0 or game.guesses_left <= 0
        if done:
            del self.games[str(body["episode_id"])]
        return 200, {"observation": observation, "reward": reward, "done": done}


class Handler(BaseHTTPRequestHandler):
    server: GuessNumberServer

    def do_GET(self) -> None:
        if self.path == "/health":
            with self.server.lock:
                self.reply(200, {"ok": True, "episodes": len(self.server.games)})
        else:
            self.reply(404, {"error": f"no such endpoint {self.path}"})

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
        except (ValueError, UnicodeDecodeError):
            self.reply(400, {"error": "body is not JSON"})
            return
        if not isinstance(body, dict):
            self.reply(400, {"error": "body must be a JSON object"})
            return
        self.reply(*self.server.handle_call(self.path, body))

    def reply(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per request would drown the URL line a caller waits for."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--max-guesses", type=int, default=7, help="guesses per episode")
    parser.add_argument("--fail-after", type=int, default=None, help="answer 500 after this many requests")
    parser.add_argument("--unavailable", type=int, default=0, help="answer 503 to the first N requests")
    args = parser.parse_args(argv)
    server = GuessNumberServer((args.host, args.port), max_guesses=args.max_guesses,
                               fail_after=args.fail_after, unavailable=args.unavailable)
    print(server.url, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()

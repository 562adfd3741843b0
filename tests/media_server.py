"""A local HTTP server of media for the media-URL tests, on a loopback address: a PNG at
``/image.png``, and ``/redirect?to=<url>``, a 302 to that URL. It notes each path asked for, so
that a test sees whether a refused URL was fetched at all."""

from __future__ import annotations

import io
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image


def png(color: tuple[int, int, int] = (255, 0, 0), size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


class MediaServer:
    """Serves on ``address`` (a loopback one) and ``port`` (any free one by default) until the
    ``with`` block ends."""

    def __init__(self, address: str = "127.0.0.1", port: int = 0) -> None:
        self.hits: list[str] = []
        self.image = png()
        self._server = ThreadingHTTPServer((address, port), self._handler())
        self.port = self._server.server_address[1]

    def url(self, path: str = "/image.png", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def redirect(self, to: str, host: str = "127.0.0.1") -> str:
        """A URL of this server's that redirects to ``to``."""
        return self.url("/redirect?" + urllib.parse.urlencode({"to": to}), host)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.hits.append(self.path)
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", urllib.parse.parse_qs(url.query)["to"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif url.path == "/image.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(server.image)))
                    self.end_headers()
                    self.wfile.write(server.image)
                else:
                    self.send_error(404)

            def log_message(self, *args) -> None:
                pass

        return Handler

    def __enter__(self) -> MediaServer:
        threading.Thread(target=self._server.serve_forever, name="media-server", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

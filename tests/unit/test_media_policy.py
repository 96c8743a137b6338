"""Where image URLs may point (vLLM's ``--allowed-local-media-path`` and ``--allowed-media-domains``): file URLs are
read only inside the allowed folder, symbolic links followed; http(s) URLs reach only the allowed hosts, redirects
included, checked against a real HTTP server on this machine."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path
from typing import Iterator

import pytest

from pagellm import images
from pagellm.mm_config import MultiModalConfig

BODY = b"\x89PNG not really, but bytes all the same"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """/cat.png answers BODY; /hop redirects to /cat.png on 127.0.0.1 (whichever host it was asked by)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's name)
            if self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(BODY)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


def test_file_urls_are_read_only_inside_the_allowed_folder(tmp_path: Path) -> None:
    folder, outside = tmp_path / "media", tmp_path / "secret.png"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a b.png").write_bytes(BODY)
    outside.write_bytes(b"secret")
    (tmp_path / "media2").mkdir()
    (tmp_path / "media2" / "b.png").write_bytes(BODY)  # a sibling whose name starts with the folder's
    (folder / "link.png").symlink_to(outside)
    media = MultiModalConfig(allowed_local_media_path=str(folder))
    inside = f"file://{folder}/sub/a%20b.png"
    assert images.fetch_sync([inside, f"file://localhost{folder}/sub/a%20b.png"], media) == {
        inside: BODY, f"file://localhost{folder}/sub/a%20b.png": BODY}
    for url, message in [(f"file://{outside}", "is outside --allowed-local-media-path"),
                         (f"file://{folder}/link.png", "is outside --allowed-local-media-path"),
                         (f"file://{folder}/../secret.png", "is outside --allowed-local-media-path"),
                         (f"file://{folder}2/b.png", "is outside --allowed-local-media-path"),
                         (f"file://{folder}/missing.png", "could not be read: No such file"),
                         (f"file://otherhost{folder}/sub/a%20b.png", "names an absolute local path")]:
        with pytest.raises(ValueError, match=message):
            images.fetch_sync([url], media)
    with pytest.raises(ValueError, match="file URLs are read only under the folder the server names with "
                                         "--allowed-local-media-path"):
        images.fetch_sync([inside])


def test_http_urls_reach_only_the_allowed_hosts_redirects_included(port: int) -> None:
    cat, by_name = f"http://127.0.0.1:{port}/cat.png", f"http://localhost:{port}/cat.png"
    assert images.fetch_sync([cat, by_name]) == {cat: BODY, by_name: BODY}  # no list: any host
    only_ip = MultiModalConfig(allowed_media_domains=("127.0.0.1",))
    assert images.fetch_sync([cat, f"http://127.0.0.1:{port}/hop"], only_ip) == {
        cat: BODY, f"http://127.0.0.1:{port}/hop": BODY}
    with pytest.raises(ValueError, match=r"names host 'localhost', not one of --allowed-media-domains \(127.0.0.1\)"):
        images.fetch_sync([by_name], only_ip)
    only_name = MultiModalConfig(allowed_media_domains=["LocalHost"])
    assert images.fetch_sync([by_name], only_name) == {by_name: BODY}
    with pytest.raises(ValueError, match=r"names host '127.0.0.1', not one of --allowed-media-domains \(localhost\)"):
        images.fetch_sync([f"http://localhost:{port}/hop"], only_name)  # the redirect leaves the allowed host


def test_media_settings_are_checked_when_the_engine_is_configured(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allowed_local_media_path='/no/such/folder' is not a folder"):
        MultiModalConfig(allowed_local_media_path="/no/such/folder")
    for bad in (["https://example.com"], ["example.com:443"], ["example.com/images"], [""], []):
        with pytest.raises(ValueError, match="allowed_media_domains takes host names"):
            MultiModalConfig(allowed_media_domains=bad)
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert MultiModalConfig(allowed_local_media_path=str(tmp_path / "alias")).allowed_local_media_path == \
        str(tmp_path / "real")

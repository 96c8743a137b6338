"""How the server and its engine cores log (vLLM's ``--logging-config`` and ``--log-config-file``): JSON lines from
both processes, a ``dictConfig`` file applied as written, logging left alone, and bad settings refused by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import pytest
from server_utils import ServerProcess

from pagellm import logging_config
from pagellm.logging_config import LoggingConfig


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_json_lines_come_from_the_server_and_its_engine_core(start_server: Callable[..., ServerProcess],
                                                            tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--logging-config", '{"formatter": "json"}')
    server.stop()
    lines = _json_lines(server.log())
    assert {"APIServer", "EngineCore"} <= {line["process"] for line in lines}
    assert all({"time", "level", "logger", "pid", "message"} <= set(line) for line in lines)
    assert any(line["process"] == "EngineCore" and line["level"] == "INFO" for line in lines)
    quiet = start_server(tiny_llama, "--served-model-name", "tiny", "--logging-config",
                         '{"formatter": "json", "log_level": "WARNING"}')
    quiet.stop()
    assert not [line for line in _json_lines(quiet.log()) if line["level"] == "INFO"]  # in both processes
    assert not [line for line in quiet.log().splitlines() if line.startswith("INFO")]


def test_a_dict_config_file_decides_the_format(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                                tmp_path: Path) -> None:
    config = {"version": 1, "formatters": {"tagged": {"format": "TAGGED %(levelname)s %(name)s %(message)s"}},
              "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "tagged"}},
              "root": {"level": "INFO", "handlers": ["out"]}}
    (tmp_path / "logging.json").write_text(json.dumps(config))
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--log-config-file",
                          str(tmp_path / "logging.json"))
    server.stop()
    tagged = [line for line in server.log().splitlines() if line.startswith("TAGGED ")]
    assert any("pagellm.worker" in line for line in tagged)  # an engine core's line, in the file's format


def test_configure_follows_the_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = []
    try:
        monkeypatch.setenv("PAGELLM_LOG_FORMAT", "json")
        logging_config.configure("EngineCore")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("pagellm.test").exception("it %s", "failed")
        (line,) = _json_lines(capsys.readouterr().err)
        assert (line["process"], line["level"], line["logger"], line["message"]) == \
            ("EngineCore", "ERROR", "pagellm.test", "it failed") and "RuntimeError: boom" in line["exc_info"]
        monkeypatch.setenv("PAGELLM_CONFIGURE_LOGGING", "0")
        root.handlers[:] = []
        logging_config.configure()
        assert root.handlers == []  # left alone
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


@pytest.mark.parametrize(("text", "message"), [
    ('{"formatter": "xml"}', "formatter must be text or json"),
    ('{"level": "INFO"}', r"unknown keys \['level'\]"),
    ('{"log_level": "LOUD"}', "log_level must be one of"),
    ('{"pylogging_config_file": "/no/such/file.json"}', "cannot be read"),
    ("[1]", "must be a JSON object"),
])
def test_bad_logging_settings_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoggingConfig.parse(text)

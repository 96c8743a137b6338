"""How pagellm's processes log (vLLM's ``--logging-config`` and ``--log-config-file``), the same in the server and in
every engine core it starts.

Contract:
- ``configure(process)`` sets up the root logger of this process from the environment, which the server's flags set
  and its engine-core processes inherit: ``PAGELLM_CONFIGURE_LOGGING=0`` leaves logging alone (an embedding
  application's own setup wins); ``PAGELLM_LOGGING_CONFIG_PATH`` names a JSON file in Python's ``dictConfig``
  schema, applied as it is (it decides loggers, handlers and formats); otherwise one stream handler at
  ``PAGELLM_LOG_LEVEL`` (default INFO) in ``PAGELLM_LOG_FORMAT``: ``text`` (``LEVEL [process] logger: message``)
  or ``json`` (one object per line: time, level, logger, process, message, and the traceback when there is one, for
  log collectors).
- ``LoggingConfig.parse(json_text)`` reads vLLM's ``--logging-config`` object (``log_level``, ``formatter``,
  ``configure_logging``, ``pylogging_config_file``); ``export()`` puts it in the environment (``--log-level`` and
  ``--log-config-file`` override their fields, as vLLM's do). A file that is missing or not valid JSON is a
  ValueError naming it, before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.config
import os
import time
from typing import Any

LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
FORMATTERS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, for log collectors."""

    def __init__(self, process: str = "") -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "process": self.process or "APIServer",
            "pid": record.process, "message": record.getMessage()}
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def _dict_config(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except OSError as exc:
        raise ValueError(f"the logging config file {path!r} cannot be read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the logging config file {path!r} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"the logging config file {path!r} must hold a JSON object in logging.config.dictConfig's "
                         "schema")
    return config


def configure(process: str = "") -> None:
    """Set up this process's logging from the environment (see the module doc); ``process`` names it in each line
    (e.g. "EngineCore")."""
    if os.environ.get("PAGELLM_CONFIGURE_LOGGING", "1") == "0":
        return
    path = os.environ.get("PAGELLM_LOGGING_CONFIG_PATH")
    if path:
        logging.config.dictConfig(_dict_config(path))
        return
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "pagellm", False)]
    if len(ours) < len(root.handlers):  # the embedding application's handlers are there: leave them be
        return
    handler = logging.StreamHandler()
    handler.pagellm = True  # type: ignore[attr-defined]
    if os.environ.get("PAGELLM_LOG_FORMAT", "text") == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(f"%(levelname)s {process + ' ' if process else ''}%(name)s: "
                                               "%(message)s"))
    for old in ours:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(os.environ.get("PAGELLM_LOG_LEVEL", "INFO").upper())


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """vLLM's ``--logging-config``."""

    log_level: str | None = None
    formatter: str = "text"
    configure_logging: bool = True
    pylogging_config_file: str | None = None

    @classmethod
    def parse(cls, text: str | None, log_level: str | None = None, config_file: str | None = None) -> LoggingConfig:
        """From ``--logging-config``'s JSON; ``--log-level`` and ``--log-config-file`` win over their fields."""
        try:
            spec = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"--logging-config is not valid JSON ({exc})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--logging-config must be a JSON object, got {spec!r}")
        unknown = sorted(set(spec) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"--logging-config: unknown keys {unknown}; valid ones: log_level, formatter, "
                             "configure_logging, pylogging_config_file")
        config = cls(**{**spec, **({"log_level": log_level} if log_level else {}),
                        **({"pylogging_config_file": config_file} if config_file else {})})
        config.check()
        return config

    def check(self) -> None:
        if self.log_level is not None and str(self.log_level).upper() not in LEVELS:
            raise ValueError(f"--logging-config: log_level must be one of {', '.join(LEVELS)}, got {self.log_level!r}")
        if self.formatter not in FORMATTERS:
            raise ValueError(f"--logging-config: formatter must be text or json, got {self.formatter!r}")
        if not isinstance(self.configure_logging, bool):
            raise ValueError("--logging-config: configure_logging must be true or false")
        if self.pylogging_config_file is not None:
            if not self.configure_logging:
                raise ValueError("--logging-config: pylogging_config_file needs configure_logging true")
            _dict_config(self.pylogging_config_file)  # refused now rather than in every process

    def export(self) -> None:
        """Into the environment, for this process and the engine cores it starts (then ``configure()`` again)."""
        os.environ["PAGELLM_CONFIGURE_LOGGING"] = "1" if self.configure_logging else "0"
        os.environ["PAGELLM_LOG_FORMAT"] = self.formatter
        if self.log_level is not None:
            os.environ["PAGELLM_LOG_LEVEL"] = str(self.log_level).upper()
        if self.pylogging_config_file is not None:
            os.environ["PAGELLM_LOGGING_CONFIG_PATH"] = os.path.abspath(self.pylogging_config_file)

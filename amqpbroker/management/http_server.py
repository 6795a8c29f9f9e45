"""uvicorn on the broker's own loop (the management listener of a live broker,
management/service.py, and of a backup, management/ha.py): the broker, not uvicorn,
handles the process's signals."""

from __future__ import annotations

import contextlib
from typing import Any


def embedded_server_class() -> type:
    import uvicorn

    class EmbeddedServer(uvicorn.Server):
        """uvicorn on a loop it does not own: the broker handles the signals."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

        def install_signal_handlers(self) -> None:  # older uvicorn releases
            pass

    return EmbeddedServer


def embedded_server(config: Any) -> Any:
    return embedded_server_class()(config)
